"""Quantizer / quantize_ste: forward rounds values, backward rounds gradients, STE otherwise."""

import torch

from lowprec import Quantizer, quantize, quantize_ste


def test_forward_and_backward_use_their_own_formats():
    x = (torch.randn(1000) * 10).requires_grad_()
    q = Quantizer(forward="fp16", backward="e5m2")
    y = q(x)
    assert torch.equal(y.detach(), x.detach().half().float())
    g = torch.randn(1000) * 1e-3
    y.backward(g)
    assert torch.equal(x.grad, g.to(torch.float8_e5m2).float())
    assert "forward=fp16" in repr(q) and "backward=e5m2" in repr(q)


def test_straight_through_when_no_backward_format():
    x = torch.randn(100, requires_grad=True)
    y = quantize_ste(x, "e4m3fn")
    g = torch.randn(100)
    y.backward(g)
    assert torch.equal(x.grad, g)
    assert torch.equal(y.detach(), quantize(x.detach(), "e4m3fn"))


def test_backward_only_leaves_values_alone():
    x = torch.randn(100, requires_grad=True)
    y = quantize_ste(x, None, "bf16", backward_rounding="toward_zero")
    assert torch.equal(y.detach(), x.detach())
    g = torch.randn(100)
    (y * g).sum().backward()
    assert torch.equal(x.grad, quantize(g, "bf16", "toward_zero"))


def test_stochastic_backward_reproducible_with_generator():
    def run():
        x = torch.full((10_000,), 1.0, requires_grad=True)
        q = Quantizer(backward="e4m3fn", rounding="stochastic",
                      generator=torch.Generator().manual_seed(8))
        (q(x) * 0.3).sum().backward()
        return x.grad

    a, b = run(), run()
    assert torch.equal(a, b)
    assert set(torch.unique(a).tolist()) == {0.28125, 0.3125}  # the e4m3fn neighbours of 0.3


def test_inside_a_model_and_half_inputs():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), Quantizer("bf16", "bf16"), torch.nn.ReLU())
    out = model(torch.randn(3, 8))
    out.sum().backward()
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
    h = torch.randn(5, dtype=torch.float16, requires_grad=True)
    quantize_ste(h, "e5m2", "e5m2").sum().backward()
    assert h.grad.dtype == torch.float16
