"""Loss scaling: the dynamic rule, and a skipped step against a control run."""

import dataclasses

import pytest
import torch
from helpers import small_mlp
from torch import nn

from lowprec import DynamicLossScale, Precision, StaticLossScale, quantize
from lowprec.training.policy import parse_policy


def test_dynamic_loss_scale_rule():
    ls = DynamicLossScale(init=8.0, growth=2.0, backoff=0.5, interval=2, min=1.0, max=64.0)
    for found in [False, False, True, False, False, False, False, True, True, True, True]:
        ls.update(found)
    # 8 -> 16 (2 good) -> 8 (inf) -> 16 -> 32 (4 good) -> 16 -> 8 -> 4 -> 2
    assert ls.scale == 2.0
    st = ls.state_dict()
    ls2 = DynamicLossScale()
    ls2.load_state_dict(st)
    assert ls2.scale == 2.0 and ls2.good_steps == 0
    with pytest.raises(ValueError, match="backoff"):
        DynamicLossScale(backoff=2.0)
    with pytest.raises(ValueError, match="scale"):
        StaticLossScale(0)


def _train_mlp(prec, steps, inject_at=None, skip_at=None, seed=0, device="cpu"):
    model = small_mlp(seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = prec.setup(model, opt)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 20, generator=g), torch.randint(0, 5, (64,), generator=g)
    x, y = x.to(device), y.to(device)
    for step in range(steps):
        opt.zero_grad()
        with prec.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        prec.backward(loss)
        if step == inject_at:
            model[0].weight.grad[0, 0] = float("inf")
        if step == skip_at:
            prec.trace.append({"step": step, "skipped": True})
            continue
        prec.step(opt)
    return model, prec


def test_injected_inf_is_skipped_and_matches_a_control_run(device):
    init, growth, backoff, interval, steps, k = 2.0**10, 2.0, 0.5, 3, 20, 7
    scaled, prec = _train_mlp(
        Precision("32-true", loss_scale=DynamicLossScale(init, growth, backoff, interval)),
        steps, inject_at=k, device=device)
    control, _ = _train_mlp(Precision("32-true"), steps, skip_at=k, device=device)
    skipped = [t["step"] for t in prec.trace if t["skipped"]]
    assert skipped == [k] and prec.skipped == 1
    # growth events: every `interval` clean steps, the count restarting after the skip
    n_growth = k // interval + (steps - k - 1) // interval
    assert prec.loss_scale.scale == init * growth**n_growth * backoff**1
    assert prec.trace[k]["scale"] == init * growth ** (k // interval)
    for a, b in zip(scaled.parameters(), control.parameters()):
        assert torch.equal(a, b)  # power-of-two scaling is exact in fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inv_scale", [1.0, 2.0**-10, 1 / 3, 65536.0])
def test_the_unfused_check_is_torchs_fused_one(dtype, inv_scale):
    # CUDA has no bfloat16 kernel of torch's fused check: Precision checks those gradients in
    # plain ops, which must give torch's flag and torch's unscaled bits (its CPU kernel here)
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=g).mul(2.0 ** torch.randint(-24, 12, (n,), generator=g))
             .to(dtype) for n in (1, 7, 300)]  # fp16 subnormals too, no overflow
    for case in ("finite", "inf", "nan"):
        gs = [t.clone() for t in grads]
        if case != "finite":
            gs[1][3] = float(case)
        ref, ref_found = [t.clone() for t in gs], torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found,
                                                         torch.full((1,), inv_scale))
        found = torch.zeros(1)
        Precision._check_unfused(gs, found, inv_scale)
        assert bool(found.item() > 0) == bool(ref_found.item() > 0) == (case != "finite")
        bits = torch.int16 if dtype != torch.float32 else torch.int32
        for a, b in zip(gs, ref):  # NaN payloads aside (a step with a NaN is skipped)
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a[~a.isnan()].view(bits), b[~b.isnan()].view(bits))



@pytest.mark.parametrize("policy", ["16-true", "bf16-true", "e5m2", "fixed16-rn"])
@pytest.mark.parametrize("case", ["finite", "overflow", "inf", "nan"])
def test_an_emulated_steps_check_sees_what_rounding_leaves(policy, case, monkeypatch):
    """The emulated step rounds each gradient to its storage format and checks it for Inf/NaN,
    in one pass where the kernel can (lp_quantize_f32_nonfinite): the flag is torch's fused
    check of the gradients rounded by quantize (a gradient of 70000 overflows fp16 and e5m2
    only on rounding; bf16 keeps it; 16-bit fixed point saturates it, and an Inf or NaN there is
    seen before rounding); the gradients are left as quantize rounds them; a flagged step is
    skipped. Three steps: the first prepares the rounding the later ones count in one pass."""
    from lowprec.numerics import kernel

    counted = []
    if kernel.nonfinite_available():
        real = kernel.quantize_prepared_nonfinite
        monkeypatch.setattr(kernel, "quantize_prepared_nonfinite",
                            lambda *a: counted.append(1) or real(*a))
    pol = dataclasses.replace(parse_policy(policy), backend="emulated")
    prec = Precision(pol, loss_scale=StaticLossScale(1.0))
    net = small_mlp(0)
    model, opt = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    value = {"finite": 1.0, "overflow": 70000.0, "inf": float("inf"), "nan": float("nan")}[case]
    flags = []
    for _ in range(3):
        opt.zero_grad()
        with prec.autocast():
            loss = model(x).square().mean()
        prec.backward(loss)
        model[0].weight.grad[0, 0] = value
        params = list(model.parameters())
        fmts = prec._backend.grad_formats(params)
        want = [quantize(p.grad, f) for p, f in zip(params, fmts)]
        ref = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([w.clone() for w in want], ref,
                                                         torch.ones(1))
        if not all(getattr(f, "has_inf", False) for f in fmts):  # saturating: as they came
            torch._amp_foreach_non_finite_check_and_unscale_([p.grad.clone() for p in params],
                                                             ref, torch.ones(1))
        before = [p.detach().clone() for p in params]
        stepped = prec.step(opt)
        flags.append(prec.trace[-1]["found_inf"])
        assert prec.trace[-1]["found_inf"] == (ref.item() > 0) and stepped == (ref.item() == 0)
        for p, w, b in zip(params, want, before):
            assert torch.equal(p.grad.isnan(), w.isnan())
            assert torch.equal(p.grad.masked_fill(p.grad.isnan(), 0), w.masked_fill(w.isnan(), 0))
            assert stepped or torch.equal(p.detach(), b)
    overflows = {"16-true": True, "bf16-true": False, "e5m2": True, "fixed16-rn": False}[policy]
    assert flags == [case in ("inf", "nan") or (case == "overflow" and overflows)] * 3
    assert counted or not kernel.nonfinite_available(), "the counting pass did not run"
