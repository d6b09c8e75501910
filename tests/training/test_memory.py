"""The memory ledger: exact bytes by role against hand counts."""

import torch
from helpers import cnn_batch, small_cnn, small_mlp
from torch import nn

from lowprec import Precision
from lowprec.training.optim import SGD


def test_ledger_equals_hand_count_mlp():
    model = small_mlp(0, d_in=20, hidden=32, d_out=5)
    prec = Precision("32-true")
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    B = 8
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    led = prec.memory(model, (x, y), nn.functional.cross_entropy)
    n_params = 20 * 32 + 32 + 32 * 5 + 5
    assert led.params == led.grads == 4 * n_params
    assert led.optimizer_state == 4 * n_params  # one momentum buffer, before the first step
    assert led.master == 0
    # saved for backward (derivatives.yaml): addmm saves its input (x, then the ReLU output,
    # which ReLU itself saves: one storage), log_softmax its result, nll_loss the target and
    # the 0-dim total weight; weights are parameters and not counted
    hand = 4 * B * 20 + 4 * B * 32 + 4 * B * 5 + 8 * B + 4
    assert led.activations == hand
    # pure fp16 (emulated): everything in the model on the fp16 grid counts 2 bytes
    prec16 = Precision("16-true")
    m16 = small_mlp(0)
    m16, o16 = prec16.setup(m16, SGD(m16.parameters(), lr=0.1, momentum=0.9))
    led16 = prec16.memory(m16, (x, y), nn.functional.cross_entropy)
    assert led16.params == 2 * n_params and led16.optimizer_state == 2 * n_params
    # x and the ReLU output are rounded to fp16; log_softmax of fp16 logits is not on the grid;
    # the total weight (8.0) is
    assert led16.activations == 2 * B * 20 + 2 * B * 32 + 4 * B * 5 + 8 * B + 2


def test_ledger_equals_hand_count_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(4 * 4 * 4, 10))
    prec = Precision("32-true")
    model, opt = prec.setup(model, torch.optim.Adam(model.parameters()))
    B = 4
    x, y = torch.randn(B, 1, 8, 8), torch.randint(0, 10, (B,))
    led = prec.memory(model, (x, y), nn.functional.cross_entropy)
    n_params = 4 * 9 + 4 + 64 * 10 + 10
    assert led.params == 4 * n_params
    assert led.optimizer_state == 2 * 4 * n_params + 4 * 4  # exp_avg, exp_avg_sq, 0-dim steps
    # conv saves its input; ReLU its output (which max-pool saves too: one storage) and
    # max-pool its int64 indices; linear its (flattened, same storage) input; loss as above
    hand = (4 * B * 64) + (4 * B * 4 * 64) + (8 * B * 4 * 16) + (4 * B * 64) + (4 * B * 10) \
        + 8 * B + 4
    assert led.activations == hand


def test_ledger_does_not_move_batchnorm_statistics():
    model = small_cnn()
    prec = Precision("32-true")
    model, _ = prec.setup(model)
    before = model[1].running_mean.clone()
    prec.memory(model, cnn_batch(), nn.functional.cross_entropy)
    assert torch.equal(model[1].running_mean, before)


def test_ledger_counts_a_slice_of_a_large_input_as_the_slice():
    model = small_mlp(0)
    prec = Precision("32-true")
    model, _ = prec.setup(model)
    big = torch.randn(10_000, 20)
    y = torch.randint(0, 5, (8,))
    a = prec.memory(model, (big[:8], y), nn.functional.cross_entropy).activations
    b = prec.memory(model, (big[:8].clone(), y), nn.functional.cross_entropy).activations
    assert a == b


def test_ledger_counts_overridden_modules_in_their_own_format():
    """Per-module overrides (and plans, which are overrides): a layer kept in fp32 under a
    16-true policy costs 4 bytes per parameter and gradient element, the rest 2, as the
    tensors of model.half() with that layer left in fp32 would (torch's element sizes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 3))
    prec = Precision("16-true", overrides={"0": "32-true"})
    model, _ = prec.setup(model)
    ledger = prec.memory(batch=(torch.randn(4, 10), torch.tensor([0, 1, 2, 0])),
                         loss_fn=nn.functional.cross_entropy)
    ref = nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 3).half())
    want = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert want == 132 * 4 + 39 * 2
    assert ledger.params == want and ledger.grads == want


def test_an_mx_quantized_tensor_counts_at_the_formats_width_along_any_axis():
    """Emulated MX ops quantize a tensor in blocks along the axis they reduce (a convolution's
    input along its channels, axis 1), so the copy autograd saves lies on the format's grid
    along that axis, not the last: it counts at the format's width, one byte an element and a
    scale byte a block of the rows along an axis it lies on the grid along (the fewest: at
    most those of the axis it was quantized along, at least one per 32 values; a row shorter
    than a block takes one); a tensor off the grid counts 4 bytes a value."""
    from dataclasses import replace

    from lowprec.numerics.formats import parse_format
    from lowprec.training.memory import saved_activation_bytes

    mx = parse_format("mxfp8_e4m3")
    g = torch.Generator().manual_seed(0)
    for shape, axis, scales in (((4, 32, 3, 5), 1, 4 * 3 * 5), ((4, 32, 3, 5), -1, 4 * 32 * 3),
                                ((4, 3, 8, 8), 1, 4 * 8 * 8), ((2, 70), -1, 2 * 3)):
        raw = torch.randn(*shape, generator=g).requires_grad_()
        x = quantize_along(raw.detach(), replace(mx, axis=axis))
        assert not torch.equal(x, raw)
        got = saved_activation_bytes(lambda: torch.sin(x).sum(), exclude=[], compute=mx)
        assert x.numel() - (-x.numel() // 32) <= got <= x.numel() + scales, (shape, axis, got)
        # off the grid along every axis: fp32's 4 bytes
        assert saved_activation_bytes(lambda: torch.sin(raw).sum(), exclude=[], compute=mx) \
            == 4 * raw.numel()
    # quantized along its 32 channels, one block a row: no layout has fewer scales
    x = quantize_along(torch.randn(4, 32, 3, 5, generator=g), replace(mx, axis=1))
    assert saved_activation_bytes(lambda: torch.sin(x).sum(), exclude=[], compute=mx) == \
        x.numel() + 4 * 3 * 5


def quantize_along(t, fmt):
    from lowprec import quantize

    return quantize(t, fmt).requires_grad_()
