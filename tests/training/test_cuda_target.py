"""``target="cuda"``: the ops whose CUDA kernels round otherwise than torch's CPU ones, emulated
as CUDA computes them, against a float64 model of that computation.

Each reference below follows the CUDA source the engine cites (aten/src/ATen/native/cuda and
cuDNN's convolution): every input is a 16-bit value, the kernel's fp32 arithmetic is done in
float64, and each 16-bit result the kernel writes is rounded once with torch's own cast. The
emulation does that arithmetic in fp32 on the CPU, so a sum can differ from float64's in its
last fp32 place and, where that straddles a rounding boundary, the 16-bit result by one unit:
the bound is >= 99.9% of the elements equal and none more than one unit off. Each test also
checks that the CPU kernels' emulation (``target="cpu"``, the default everywhere else) misses
that model by far more, so the test fails where the CUDA emulation is not taken. (How close
this model is to an H200's own kernels is measured by ``benchmarks/gpu.py`` when a GPU is
lent: docs/design.md "On CUDA".)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import Precision
from lowprec.training.emulation import emulated
from lowprec.training.emulation.compiled import unsupported

DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}
# the same policies on the emulated backend whatever this CPU's native kernels
SPECS = {"16-true": "p=fp16,c=fp16,g=fp16,o=fp16,b=emulated",
         "bf16-true": "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated"}


def _ordered(t, dtype):
    i = t.to(dtype).view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def agreement(emu, ref, dtype):
    """(share of elements with ref's 16-bit bits, largest distance in units of the format)."""
    a, b = _ordered(emu, dtype), _ordered(ref, dtype)
    return float((a == b).double().mean()), int((a - b).abs().max())


def check(emu, ref, dtype, what, cancel=False):
    """The documented bound: fp32 against float64 arithmetic before one rounding. ``cancel``
    (a convolution's sum, then its bias added): where the terms or the bias cancel, one unit of
    the sum's rounding is several units of the small result; an element off by more than one
    unit must then be within one unit at the largest output's scale."""
    assert torch.equal(emu, emu.to(dtype).float()), f"{what}: off the 16-bit grid"
    same, far = agreement(emu, ref, dtype)
    if far > 1 and cancel:
        off = (_ordered(emu, dtype) - _ordered(ref, dtype)).abs() > 1
        mant = 10 if dtype == torch.float16 else 7
        unit = 2.0 ** (math.floor(math.log2(float(ref.abs().max()))) - mant)
        far = 1 if bool(((emu.double() - ref).abs()[off] <= unit).all()) else far
    assert same >= 0.999 and far <= 1, f"{what}: {same:.5f} equal, up to {far} units"


def differs(emu_cpu, ref, dtype, what):
    """The CPU kernels' emulation misses the CUDA model: the test can fail."""
    same, far = agreement(emu_cpu, ref, dtype)
    assert same < 0.99 or far > 1, f"{what}: target='cpu' already gives the CUDA model"


def r16(t, dtype):
    """float64 rounded once to the 16-bit format (torch's cast), back in float64."""
    return t.to(dtype).to(torch.float64)


def _rand(gen, *shape, scale=1.0, shift=0.0, dtype=torch.float16):
    """16-bit values, as fp32 carriers (the engine takes them as on the grid)."""
    return (scale * torch.randn(*shape, generator=gen) + shift).to(dtype).float()


@pytest.mark.parametrize("policy", list(DTYPES))
def test_conv2d_bias_is_added_after_the_rounded_convolution(policy):
    """cuDNN convolves without the bias (fp32 accumulation, a 16-bit output), then ATen adds the
    bias to that output (a 16-bit add: fp32, rounded): two roundings."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(0)
    x, w = _rand(g, 8, 16, 12, 12, dtype=dtype), _rand(g, 16, 16, 3, 3, scale=0.2, dtype=dtype)
    b = _rand(g, 16, dtype=dtype)
    ref = r16(r16(F.conv2d(x.double(), w.double(), padding=1), dtype)
              + b.double().view(1, -1, 1, 1), dtype)
    out = {}
    for target in ("cuda", "cpu", None):
        with emulated(policy, target=target):
            out[target] = F.conv2d(x, w, b, padding=1)
    check(out["cuda"], ref, dtype, f"conv2d {policy}", cancel=True)
    differs(out["cpu"], ref, dtype, f"conv2d {policy}")
    # no target on CPU tensors: the CPU's kernels, as before (bias in fp32, one rounding)
    assert torch.equal(out[None], out["cpu"])


@pytest.mark.parametrize("policy", list(DTYPES))
def test_conv_bias_under_a_mixed_policy_and_as_a_module(policy):
    """nn.Conv1d (unbatched input too) and 16-mixed/bf16-mixed: the same two roundings."""
    dtype = DTYPES[policy]
    mixed = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    conv = nn.Conv1d(6, 10, 5, padding=2)
    with torch.no_grad():
        for p in conv.parameters():
            p.copy_(p.to(dtype).float())
    for x in (_rand(g, 4, 6, 50, dtype=dtype), _rand(g, 6, 50, dtype=dtype)):
        bias = conv.bias.double().view(-1, 1)
        ref = r16(r16(F.conv1d(x.double(), conv.weight.double(), padding=2), dtype) + bias,
                  dtype)
        for pol in (policy, mixed):
            with emulated(pol, target="cuda") as em:
                em.active = True  # mixed rules round inside autocast(): this block is one
                y = conv(x)
            check(y.detach(), ref, dtype, f"conv1d {pol} {tuple(x.shape)}", cancel=True)


@pytest.mark.parametrize("policy", list(DTYPES))
def test_batch_norm_training_with_fp32_statistics(policy):
    """Forward, backward and the running statistics as ATen's CUDA kernels compute them:
    mean and 1/std in fp32, never rounded; y = ((x - mean) * invstd) * w + b rounded once;
    dx = (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean))) invstd w rounded once;
    dw and db fp32 sums rounded once; running statistics updated in fp32, stored in 16 bits."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(2)
    x = _rand(g, 16, 8, 10, 10, scale=3.0, shift=1.5, dtype=dtype)
    w, b = _rand(g, 8, scale=0.2, shift=1.0, dtype=dtype), _rand(g, 8, scale=0.5, dtype=dtype)
    dy = _rand(g, *x.shape, dtype=dtype)
    rm0, rv0 = _rand(g, 8, scale=0.1, dtype=dtype), _rand(g, 8, scale=0.1, dtype=dtype).abs() + 1
    m, eps = 0.1, 1e-5

    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    dims, n = (0, 2, 3), x.numel() // 8
    mean = x64.mean(dims, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dims, keepdim=True)
    inv = 1 / torch.sqrt(var + eps)
    v = lambda t: t.view(1, -1, 1, 1)  # noqa: E731
    y_ref = r16(((x64 - mean) * inv) * v(w64) + v(b64), dtype)
    xmu = x64 - mean
    mdy, mdyx = dy64.mean(dims, keepdim=True), (dy64 * xmu).mean(dims, keepdim=True)
    dx_ref = r16((dy64 - mdy - xmu * inv ** 2 * mdyx) * inv * v(w64), dtype)
    dw_ref = r16((dy64 * xmu).sum(dims) * inv.flatten(), dtype)
    db_ref = r16(dy64.sum(dims), dtype)
    rm_ref = r16((1 - m) * rm0.double() + m * mean.flatten(), dtype)
    rv_ref = r16((1 - m) * rv0.double() + m * var.flatten() * n / (n - 1), dtype)

    out = {}
    for target in ("cuda", "cpu"):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        rm, rv = rm0.clone(), rv0.clone()
        with emulated(policy, target=target):
            y = F.batch_norm(xs, rm, rv, ws, bs, training=True, momentum=m, eps=eps)
        y.backward(dy)
        out[target] = (y.detach(), xs.grad, ws.grad, bs.grad, rm, rv)
    names = ("y", "dx", "dweight", "dbias", "running_mean", "running_var")
    for name, e, r in zip(names, out["cuda"], (y_ref, dx_ref, dw_ref, db_ref, rm_ref, rv_ref)):
        check(e, r, dtype, f"batch_norm {name} {policy}")
    differs(out["cpu"][0], y_ref, dtype, f"batch_norm y {policy}")
    differs(out["cpu"][1], dx_ref, dtype, f"batch_norm dx {policy}")


@pytest.mark.parametrize("policy", list(DTYPES))
def test_layer_norm_backward_in_fp32_rounded_once(policy):
    """layer_norm_kernel.cu: mean and rstd in fp32; dX in fp32 from the 16-bit dY, X and gamma,
    rounded once; dgamma = sum(dY * xhat) and dbeta = sum(dY) over the rows in fp32, rounded
    once (GammaBetaBackward). The forward is the CPU's too (fp32, one rounding)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(3)
    x = _rand(g, 96, 64, scale=2.0, shift=0.7, dtype=dtype)
    w, b = _rand(g, 64, scale=0.2, shift=1.0, dtype=dtype), _rand(g, 64, scale=0.1, dtype=dtype)
    dy = _rand(g, 96, 64, dtype=dtype)

    x64, w64, b64, dy64 = (t.double() for t in (x, w, b, dy))
    mean = x64.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((x64 - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    xh = (x64 - mean) * rstd
    y_ref = r16(xh * w64 + b64, dtype)
    gw = dy64 * w64
    dx_ref = r16(rstd * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True)),
                 dtype)
    dw_ref, db_ref = r16((dy64 * xh).sum(0), dtype), r16(dy64.sum(0), dtype)

    out = {}
    for target in ("cuda", "cpu"):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        with emulated(policy, target=target):
            y = F.layer_norm(xs, (64,), ws, bs)
        y.backward(dy)
        out[target] = (y.detach(), xs.grad, ws.grad, bs.grad)
    for name, e, r in zip(("y", "dx", "dweight", "dbias"), out["cuda"],
                          (y_ref, dx_ref, dw_ref, db_ref)):
        check(e, r, dtype, f"layer_norm {name} {policy}")
    # the CPU kernel keeps mean and rstd in 16 bits (and dgamma/dbeta in 16-bit buffers)
    differs(out["cpu"][1], dx_ref, dtype, f"layer_norm dx {policy}")


@pytest.mark.parametrize("policy", list(DTYPES))
@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax_backward_from_the_rounded_product(policy, dim):
    """softmax_backward_cuda_out: tmp = grad * output as a 16-bit tensor (rounded), then
    tmp - output * sum(tmp) in fp32, rounded once; the forward fp32, rounded once (along a
    middle dimension too: no 16-bit scalar tail as the CPU's)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(4)
    x = _rand(g, 8, 40, 24, scale=2.0, dtype=dtype)
    dy = _rand(g, 8, 40, 24, dtype=dtype)
    y_ref = r16(torch.softmax(x.double(), dim), dtype)
    t = r16(dy.double() * y_ref, dtype)
    dx_ref = r16(t - y_ref * t.sum(dim, keepdim=True), dtype)
    out = {}
    for target in ("cuda", "cpu"):
        xs = x.clone().requires_grad_()
        with emulated(policy, target=target):
            y = torch.softmax(xs, dim)
        y.backward(dy)
        out[target] = (y.detach(), xs.grad)
    check(out["cuda"][0], y_ref, dtype, f"softmax y {policy} dim {dim}")
    check(out["cuda"][1], dx_ref, dtype, f"softmax dx {policy} dim {dim}")
    differs(out["cpu"][1], dx_ref, dtype, f"softmax dx {policy} dim {dim}")


@pytest.mark.parametrize("policy", list(DTYPES))
def test_log_softmax_forward_rounded_once_and_its_backward(policy):
    """CUDA's log_softmax: x - max - log(sum(exp(x - max))) in fp32, rounded once (the CPU's
    keeps the row's sum and its log in 16 bits); backward dy - exp(y) sum(dy) in fp32 from the
    16-bit output, rounded once (the same formula as the CPU's)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(5)
    x = _rand(g, 64, 100, scale=3.0, dtype=dtype)
    dy = _rand(g, 64, 100, dtype=dtype)
    y_ref = r16(torch.log_softmax(x.double(), -1), dtype)
    dx_ref = r16(dy.double() - torch.exp(y_ref) * dy.double().sum(-1, keepdim=True), dtype)
    out = {}
    for target in ("cuda", "cpu"):
        xs = x.clone().requires_grad_()
        with emulated(policy, target=target):
            y = F.log_softmax(xs, -1)
        y.backward(dy)
        out[target] = (y.detach(), xs.grad)
    check(out["cuda"][0], y_ref, dtype, f"log_softmax y {policy}")
    check(out["cuda"][1], dx_ref, dtype, f"log_softmax dx {policy}")
    differs(out["cpu"][0], y_ref, dtype, f"log_softmax y {policy}")


@pytest.mark.parametrize("policy", list(DTYPES))
def test_embedding_backward_sums_each_row_in_fp32(policy):
    """embedding_dense_backward_cuda: each row's uses summed in fp32, written once (the CPU's
    index_add_ into a 16-bit gradient rounds each addition)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(6)
    weight = _rand(g, 20, 16, dtype=dtype)
    ids = torch.randint(0, 20, (32, 40), generator=g)
    dy = _rand(g, 32, 40, 16, dtype=dtype)
    ref = r16(torch.zeros(20, 16, dtype=torch.float64).index_add_(
        0, ids.flatten(), dy.double().reshape(-1, 16)), dtype)
    out = {}
    for target in ("cuda", "cpu"):
        ws = weight.clone().requires_grad_()
        with emulated(policy, target=target):
            y = F.embedding(ids, ws)
        y.backward(dy)
        out[target] = ws.grad
    check(out["cuda"], ref, dtype, f"embedding dweight {policy}")
    differs(out["cpu"], ref, dtype, f"embedding dweight {policy}")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.ln = nn.LayerNorm(8 * 6 * 6)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = self.ln(F.max_pool2d(h, 2).flatten(1))
        return torch.softmax(self.fc(h), -1)


def _one_step(policy, target):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prec = Precision(SPECS[policy], target=target)
    model, opt = prec.setup(model, opt)
    g = torch.Generator().manual_seed(7)
    x, labels = torch.randn(16, 3, 12, 12, generator=g), torch.randint(0, 10, (16,), generator=g)
    with prec.autocast():
        loss = F.nll_loss(torch.log(model(x) + 1e-3), labels)
    prec.backward(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    prec.step(opt)
    return prec, loss, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["16-true", "bf16-true"])
def test_a_conv_bn_layernorm_softmax_network_trains_a_step_under_cuda_kernels(policy):
    prec, loss, grads, params = _one_step(policy, "cuda")
    assert prec.kernel_target == "cuda" and prec.emulation.target == "cuda"
    assert torch.isfinite(loss) and all(torch.isfinite(t).all() for t in grads + params)
    _, loss_cpu, grads_cpu, _ = _one_step(policy, "cpu")
    # the same network under the CPU kernels: other roundings, other gradients
    assert any(not torch.equal(a, b) for a, b in zip(grads, grads_cpu))


def test_the_target_defaults_to_the_device_of_the_model():
    prec = Precision(SPECS["16-true"])
    assert prec.target is None
    prec.setup(nn.Linear(4, 4))
    assert prec.kernel_target == "cpu" and prec.emulation.target == "cpu"


def test_a_bad_target_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"target='gpu'.*accepted: 'cpu', 'cuda' or None"):
        Precision("16-true", target="gpu")
    with pytest.raises(ValueError, match="match_cpu_kernels"):
        Precision("16-true", target="cuda", match_cpu_kernels=True)
    with pytest.raises(ValueError, match="target="):
        with emulated("16-true", target="CUDA"):
            pass


def test_compiled_emulation_falls_back_to_eager_under_cuda_kernels():
    """The compiled graph holds the CPU kernels' roundings: under target='cuda' the model
    runs eagerly, and says why."""
    for target, why in (("cuda", "target='cuda'"), ("cpu", None)):
        prec = Precision(SPECS["16-true"], target=target)
        prec.setup(_Net())
        reason = unsupported(prec.emulation)
        assert (reason is None) if why is None else why in reason
