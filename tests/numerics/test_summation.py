"""Reference-order convolution against torch's own CPU 16-bit convolution (the reference nobody
here wrote) and against fp32 autograd, with the compiled kernel and with its plain-torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowprec.numerics import kernel, summation
from lowprec.training.emulation import emulated

CASES = {  # in channels, out channels, kernel, stride, padding, dilation, groups, bias
    "3x3": (3, 16, 3, 1, 1, 1, 1, False),
    "stride2_bias": (16, 16, 3, 2, 1, 1, 1, True),
    "1x1_stride2": (16, 32, 1, 2, 0, 1, 1, False),
    "depthwise": (16, 16, 3, 1, 1, 1, 16, False),
    "grouped_dilated": (8, 12, 3, 1, 2, 2, 4, True),
    "5x5_lenet": (6, 16, 5, 1, 0, 1, 1, True),
    "same_even": (6, 16, 4, 1, "same", 1, 1, True),
}


def _case(name, seed=0):
    cin, cout, k, stride, padding, dilation, groups, bias = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, cin, 15, 15, generator=g).half()
    w = (torch.randn(cout, cin // groups, k, k, generator=g) * 0.3).half()
    b = (torch.randn(cout, generator=g) * 0.1).half() if bias else None
    return x, w, b, (stride, padding, dilation, groups)


def _f32(*ts):
    return [t.float() if t is not None else None for t in ts]


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel" and not kernel.available():
        pytest.skip("the compiled kernel is not built")
    if request.param == "torch":
        monkeypatch.setattr(kernel, "available", lambda: False)
    return request.param


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("name", list(CASES))
def test_bit_exact_with_the_native_16_bit_convolution(reference_conv, name, path):
    """fp16 (CPUs with AVX512-BF16 run oneDNN's bf16 convolution, not this kernel)."""
    x, w, b, conf = _case(name)
    native = F.conv2d(x, w, b, *conf).float()
    ours = summation.conv2d(*_f32(x, w, b), *conf)
    assert torch.equal(ours.half().float(), native)


def test_fp32_then_round_is_not_the_native_order(reference_conv):
    """The fact the module exists for: oneDNN's fp32 convolution rounded once differs from
    the native 16-bit convolution on some outputs (measured 3-14 per case of ~10^4)."""
    diffs = 0
    for name in CASES:
        if name == "same_even":
            continue
        x, w, b, conf = _case(name)
        native = F.conv2d(x, w, b, *conf).float()
        diffs += int((F.conv2d(*_f32(x, w, b), *conf).half().float() != native).sum())
    assert diffs > 0


def test_kernel_and_torch_paths_give_the_same_bits(monkeypatch):
    if not kernel.available():
        pytest.skip("the compiled kernel is not built")
    g = torch.Generator().manual_seed(3)
    for k in (1, 3, 4, 7, 150):  # remainders 1, 3, 0, 3, 2 after the groups of four
        cols = torch.randn(2, 2 * k, 37, generator=g).half().float()
        w = torch.randn(6, k, generator=g).half().float()
        ours = summation.dot4(cols, w, groups=2)
        with monkeypatch.context() as m:
            m.setattr(kernel, "available", lambda: False)
            ref = summation.dot4(cols, w, groups=2)
        assert torch.equal(ours, ref)


def test_the_order_is_four_partial_sums():
    """The documented order, against float64 arithmetic rounded to fp32 step by step."""
    g = torch.Generator().manual_seed(4)
    cols = torch.randn(1, 11, 5, generator=g).half().float()
    w = torch.randn(1, 11, generator=g).half().float()
    got = summation.dot4(cols, w)[0, 0]
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    for j in range(5):
        s = [0.0] * 4
        for i in range(11):
            p = 0 if i >= 8 else i % 4
            s[p] = f32(s[p] + w[0, i].item() * cols[0, i, j].item())
        assert got[j].item() == f32(f32(f32(s[0] + s[1]) + s[2]) + s[3])


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_are_the_fp32_convolution_gradients(name):
    x, w, b, conf = _case(name)
    x, w, b = (t.float().requires_grad_() if t is not None else None for t in (x, w, b))
    gy = torch.randn(F.conv2d(x, w, b, *conf).shape, generator=torch.Generator().manual_seed(1))
    inputs = [t for t in (x, w, b) if t is not None]
    ref = torch.autograd.grad(F.conv2d(x, w, b, *conf), inputs, gy)
    ours = torch.autograd.grad(summation.conv2d(x, w, b, *conf), inputs, gy)
    for a, r in zip(ours, ref):
        assert torch.equal(a, r)


def test_unbatched_input_and_other_dtypes():
    x, w, b, conf = _case("3x3")
    x, w = x.float(), w.float()
    assert torch.equal(summation.conv2d(x[0], w, None, *conf), summation.conv2d(x, w, None, *conf)[0])
    xd, wd = x.double(), w.double()  # not a 16-bit carrier: F.conv2d as it is
    assert torch.equal(summation.conv2d(xd, wd, None, *conf), F.conv2d(xd, wd, None, *conf))


def test_bad_groups_and_padding_are_named():
    with pytest.raises(ValueError, match="groups=4"):
        summation.dot4(torch.zeros(1, 6, 3), torch.zeros(2, 3), groups=4)
    with pytest.raises(ValueError, match="'full'.*'same', 'valid'"):
        summation.conv2d(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 3, 3), padding="full")
    with pytest.raises(ValueError, match="'same' needs stride 1, got stride \\(2, 2\\)"):
        summation.conv2d(torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 3, 3), stride=2,
                         padding="same")
    if kernel.available():
        with pytest.raises(ValueError, match="cols must be a contiguous float32 CPU tensor"):
            kernel.dot4(torch.zeros(1, 3, 4).transpose(1, 2), torch.zeros(2, 4),
                        torch.zeros(1, 2, 3), 1)


def test_keyword_arguments_as_f_conv2d():
    x, w, b, (stride, padding, dilation, groups) = _case("stride2_bias")
    x, w, b = _f32(x, w, b)
    assert torch.equal(summation.conv2d(input=x, weight=w, bias=b, stride=stride, padding=padding),
                       summation.conv2d(x, w, b, stride, padding))


def test_native_backend_warns_that_it_does_not_apply():
    from torch import nn

    from helpers import native
    from lowprec import Precision

    with pytest.warns(UserWarning, match="match_cpu_kernels=True has no effect"):
        Precision(native("bf16-true"), match_cpu_kernels=True).setup(nn.Conv2d(1, 1, 3))


def test_the_engine_uses_it_when_asked(reference_conv):
    x, w, b, conf = _case("stride2_bias")
    native = F.conv2d(x, w, b, *conf).float()
    args = _f32(x, w, b)  # fp32 carriers made outside: inside, .float() is an fp32 island
    with emulated("16-true", match_cpu_kernels=True):
        ours = F.conv2d(*args, *conf)
    with emulated("16-true"):
        default = F.conv2d(*args, *conf)
    assert torch.equal(ours, native)
    assert torch.equal(default, F.conv2d(*args, *conf).half().float())


def test_precision_trains_with_it_and_stays_bit_exact_with_native(reference_conv):
    """Through Precision with an optimizer: after two SGD steps, the model's forward equals
    native fp16's (``model.half()`` with the same weights and statistics) bit for bit."""
    from torch import nn

    from lowprec import Precision

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                             nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, stride=2, groups=2),
                             nn.ReLU())

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 12, 12, generator=g).half().float()
    prec = Precision("16-true", match_cpu_kernels=True)
    model = make()
    start = [p.detach().clone() for p in model.parameters()]
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        opt.zero_grad()
        prec.backward(model(x).square().mean())
        prec.step(opt)
    assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
    native = make()
    native.load_state_dict(model.state_dict())
    native.half()
    with torch.no_grad():
        assert torch.equal(model(x), native(x.half()).float())
