"""The training engine: policies, loss scaling, 16-bit optimizers, the memory ledger."""

import copy
import math

import pytest
import torch
from helpers import train_steps
from torch import nn

import lowprec
from lowprec import (POLICIES, DynamicLossScale, Precision, StaticLossScale, find_loss_scale,
                     parse_policy, quantize)
from lowprec.numerics.formats import FP16, FP32
from lowprec.training.optim import SGD, Adam, AdamW, FormatOptimizer


def small_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 10))


def small_mlp(seed=0, d_in=20, hidden=32, d_out=5):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def cnn_batch(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


# -- policies --------------------------------------------------------------------------------

def test_named_policies_and_specs():
    p = parse_policy("16-true")
    assert (p.params, p.compute, p.grads, p.optimizer_state, p.master) == (FP16, FP16, FP16, FP16,
                                                                           None)
    m = parse_policy("16-master")
    assert m.master == FP32 and m.optimizer_state == FP32 and m.loss_scale == "dynamic"
    assert parse_policy("16-mixed").scope == "matmul"
    spec = parse_policy("p=fp16,c=fp16,g=fp16,m=fp32")
    assert spec.master == FP32 and spec.optimizer_state == FP16
    q = parse_policy("p=bf16:kahan,c=fixed<16,14>,g=e5m2:sr,ls=static:512,b=emulated")
    assert q.update == "kahan" and str(q.compute) == "q2.14" and q.grad_rounding.is_stochastic
    for pol in list(POLICIES.values()) + [q]:
        assert parse_policy(pol.spec) == pol


@pytest.mark.parametrize("bad", ["17-true", "p=fp7", "p=fp16,z=1", "p=fp16,ls=sometimes",
                                 "p=fp16,u=wobble", "p=fp16,b=gpu"])
def test_unknown_policy_is_a_clear_error(bad):
    with pytest.raises(ValueError) as err:
        parse_policy(bad)
    msg = str(err.value)
    assert repr(bad) in msg or bad in msg
    if "unknown policy" in msg:
        assert "32-true" in msg and "16-mixed" in msg


def test_native_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="emulated"):
        Precision("p=e4m3fn,b=native").setup(small_mlp())


# -- loss scaling ----------------------------------------------------------------------------

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


def _train_mlp(prec, steps, inject_at=None, skip_at=None, seed=0):
    model = small_mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = prec.setup(model, opt)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 20, generator=g), torch.randint(0, 5, (64,), generator=g)
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


def test_injected_inf_is_skipped_and_matches_a_control_run():
    init, growth, backoff, interval, steps, k = 2.0**10, 2.0, 0.5, 3, 20, 7
    scaled, prec = _train_mlp(
        Precision("32-true", loss_scale=DynamicLossScale(init, growth, backoff, interval)),
        steps, inject_at=k)
    control, _ = _train_mlp(Precision("32-true"), steps, skip_at=k)
    skipped = [t["step"] for t in prec.trace if t["skipped"]]
    assert skipped == [k] and prec.skipped == 1
    # growth events: every `interval` clean steps, the count restarting after the skip
    n_growth = k // interval + (steps - k - 1) // interval
    assert prec.loss_scale.scale == init * growth**n_growth * backoff**1
    assert prec.trace[k]["scale"] == init * growth ** (k // interval)
    for a, b in zip(scaled.parameters(), control.parameters()):
        assert torch.equal(a, b)  # power-of-two scaling is exact in fp32


def test_find_loss_scale_measures_underflow():
    model = small_mlp(0)
    x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))

    def loss_fn(out, t):  # a loss whose gradients sit largely below fp16's subnormals
        return nn.functional.cross_entropy(out, t) * 1e-6

    capped = find_loss_scale(model, (x, y), loss_fn, "fp16", max_scale=2.0**20)
    assert capped.scale == 2.0**20
    choice = find_loss_scale(model, (x, y), loss_fn, "fp16", max_scale=2.0**40)
    assert math.log2(choice.scale).is_integer()
    assert choice.max_abs * choice.scale * choice.headroom <= FP16.max
    assert choice.max_abs * choice.scale * 2 * choice.headroom > FP16.max  # the largest such
    mags = lowprec.analysis.scaling.gradient_magnitudes(model, (x, y), loss_fn)
    nz = mags[mags > 0].double()
    direct_1 = (quantize(nz.float(), "fp16") == 0).double().mean().item()
    direct_s = (quantize((nz * choice.scale).float(), "fp16") == 0).double().mean().item()
    assert choice.underflow_at_1 == pytest.approx(direct_1, abs=1e-12)
    assert choice.underflow_at_scale == pytest.approx(direct_s, abs=1e-12)
    assert choice.underflow_at_1 > 0.5 > choice.underflow_at_scale
    assert "underflow" in str(choice)


# -- optimizers ------------------------------------------------------------------------------

@pytest.mark.parametrize("ours,theirs,kw", [
    (SGD, torch.optim.SGD, dict(lr=0.1)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, dampening=0.0)),
    (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
])
def test_fp32_optimizers_equal_torch_bit_for_bit(ours, theirs, kw):
    a, b = small_mlp(0), small_mlp(0)
    oa, ob = ours(a.parameters(), **kw), theirs(b.parameters(), **kw)
    x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))
    for _ in range(5):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _mlp_small_grads(seed=0):
    model = small_mlp(seed, d_in=8, hidden=16, d_out=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g)
    y = torch.randn(64, 1, generator=g) * 0.01
    return model, x, y


def test_torch_adam_fails_in_pure_fp16_and_lowprec_adam_does_not():
    """eps=1e-8 is 0 in fp16 and g**2 underflows: torch's Adam on fp16 parameters divides by 0."""
    results = {}
    for name, make in [("torch", lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-8)),
                       ("lowprec", lambda ps: Adam(ps, lr=1e-3, eps=1e-8))]:
        model, x, y = _mlp_small_grads()
        prec = Precision("p=fp16,c=fp16,g=fp16,o=fp16,b=native")
        model, opt = prec.setup(model, make(model.parameters()))
        assert next(model.parameters()).dtype == torch.float16
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y) * 1e-3  # small gradients
            prec.backward(loss)
            prec.step(opt)
            losses.append(nn.functional.mse_loss(model(x).float(), y).item())
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        results[name] = (finite, losses)
    assert not results["torch"][0], "torch.optim.Adam in fp16 should have produced Inf/NaN"
    ok, losses = results["lowprec"]
    assert ok and losses[-1] < losses[0]


@pytest.mark.parametrize("opt_cls", [SGD, torch.optim.SGD], ids=["lowprec", "torch"])
@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_bf16_small_lr_nearest_loses_every_update(backend, opt_cls):
    """At a learning rate where |lr * g| < ulp(w) / 2 everywhere, nearest rounding changes
    nothing; stochastic and Kahan write-back still lower the loss."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 20), torch.randn(256, 1)
    base = nn.Sequential(nn.Linear(20, 1))
    with torch.no_grad():
        base[0].weight.fill_(1.0)  # ulp(1) in bf16 is 2**-7
        base[0].bias.fill_(1.0)
    finals = {}
    for update in ["nearest", "stochastic", "kahan"]:
        model = copy.deepcopy(base)
        prec = Precision(f"p=bf16:{update},b={backend}", seed=0)
        model, opt = prec.setup(model, opt_cls(model.parameters(), lr=1e-4))
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(200):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), y)
            prec.backward(loss)
            prec.step(opt)
        finals[update] = nn.functional.mse_loss(model(x).float(), y).item()
        if update == "nearest":
            for p, s in zip(model.parameters(), start):
                assert torch.equal(p, s), "nearest should lose every update"
            first = finals["nearest"]
    assert finals["stochastic"] < first - 1e-3
    assert finals["kahan"] < first - 1e-3


def test_optimizer_state_dict_round_trip_with_master_and_compensation():
    for update, master in [("kahan", None), ("nearest", "fp32")]:
        model = small_mlp(0)
        opt = Adam(model.parameters(), lr=1e-2, param_format="bf16", state_format="bf16",
                   master_format=master, update=update)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(quantize(p, "bf16"))
        x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        key = "master" if master else "compensation"
        st = opt.state_dict()
        assert all(key in s for s in st["state"].values())
        opt2 = Adam(model.parameters(), lr=1e-2, param_format="bf16", state_format="bf16",
                    master_format=master, update=update)
        opt2.load_state_dict(copy.deepcopy(st))
        for p in model.parameters():
            for k, v in opt.state[p].items():
                v2 = opt2.state[p][k]
                assert (torch.equal(v, v2) if torch.is_tensor(v) else v == v2), k
                if torch.is_tensor(v):
                    assert v2.dtype == v.dtype  # fp32 master weights stay fp32
    # the wrapper of a torch optimizer
    model = small_mlp(0)
    fo = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         param_format="fp16", master_format="fp32")
    nn.functional.cross_entropy(model(torch.randn(4, 20)), torch.tensor([0, 1, 2, 3])).backward()
    fo.step()
    st = fo.state_dict()
    fo2 = FormatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                          param_format="fp16", master_format="fp32")
    fo2.load_state_dict(st)
    for a, b in zip(fo.masters, fo2.masters):
        assert torch.equal(a, b)


def test_adam_stores_sqrt_of_second_moment_in_narrow_formats():
    model = small_mlp(0)
    opt = Adam(model.parameters(), lr=1e-3, param_format="fp16", state_format="fp16")
    nn.functional.cross_entropy(model(torch.randn(4, 20)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    st = opt.state[next(model.parameters())]
    assert "exp_avg_sq_sqrt" in st and st["exp_avg"].dtype == torch.float16
    opt_bf = Adam(small_mlp(0).parameters(), state_format="bf16")
    assert "exp_avg_sq" in opt_bf.state_layout(next(iter(opt_bf.param_groups[0]["params"])))


# -- the memory ledger -----------------------------------------------------------------------

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


# -- every policy through the same loop --------------------------------------------------------

DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float32,
          "16-mixed": torch.float32, "bf16-mixed": torch.float32, "16-master": torch.float32}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("opt_kind", ["torch", "lowprec"])
def test_policy_contract(name, opt_kind):
    model = small_cnn()
    if opt_kind == "torch":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = SGD(model.parameters(), lr=0.05, momentum=0.9)
    prec = Precision(name, seed=0)
    model, opt = prec.setup(model, opt)
    x, y = cnn_batch()
    losses = train_steps(prec, model, opt, x, y, 4)
    assert all(math.isfinite(v) for v in losses)
    pol = prec.policy
    expected_dtype = DTYPES.get(name)
    if expected_dtype is not None:
        assert next(model.parameters()).dtype == expected_dtype
    if pol.params != FP32:  # parameters lie on the parameter format's grid
        from lowprec.numerics.formats import DynamicFixedFormat
        for pname, p in model.named_parameters():
            fmt = pol.params
            if isinstance(fmt, DynamicFixedFormat):
                # written at the range its group had then (now's, give or take one): on the
                # grid of now's range - 1, whose integer part is widened to hold them all
                r = prec.controller.range_of(f"param:{pname}")
                fmt = lowprec.FixedFormat(r + 3, fmt.bits - r)
            assert torch.equal(p.float(), quantize(p.float(), fmt))
    if pol.master is not None:
        assert isinstance(opt, (FormatOptimizer, SGD))
    st = prec.state_dict()
    prec2 = Precision(name, seed=0)
    prec2.load_state_dict(st)
    assert prec2.state_dict()["trace"] == st["trace"] and prec2.loss_scale.scale == \
        prec.loss_scale.scale
    ost = opt.state_dict()
    opt.load_state_dict(copy.deepcopy(ost))
    led = prec.memory(model, (x, y), nn.functional.cross_entropy)
    assert led.total > 0


def test_emulated_activations_are_on_the_grid():
    model = small_cnn()
    prec = Precision("p=fp32,c=e4m3fn,g=e5m2,s=all,b=emulated")
    model, _ = prec.setup(model)
    outs = {}
    model[4].register_forward_hook(lambda m, a, o: outs.update(conv2=o))
    model[4].register_forward_pre_hook(lambda m, a: outs.update(w=m.weight))
    model(cnn_batch()[0])
    assert torch.equal(outs["conv2"], quantize(outs["conv2"], "e4m3fn"))
    assert torch.equal(outs["w"], quantize(outs["w"], "e4m3fn"))  # weights rounded when used
    assert isinstance(model[4].weight, nn.Parameter)  # and restored afterwards


@pytest.mark.parametrize("cls,kw", [
    (SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (SGD, dict(lr=0.1)),
    (Adam, dict(lr=1e-2, weight_decay=1e-3)),
    (AdamW, dict(lr=1e-2, weight_decay=1e-2)),
])
@pytest.mark.parametrize("dtype,pf,sf", [(torch.bfloat16, None, None), (torch.float16, None, None),
                                         (torch.float32, "fp16", "fp16"),
                                         (torch.float32, "e4m3fn", "bf16")])
def test_fused_cpu_kernel_agrees_with_the_torch_path(cls, kw, dtype, pf, sf):
    """The fused step and the torch-op path implement one per-element definition (see the SGD
    and Adam docstrings; more cases in test_optim_arith.py): the same bits."""
    from lowprec.numerics import kernel as _kernel
    if not _kernel.available():
        pytest.skip("kernel not built")
    w0 = torch.randn(200, 300).to(dtype)
    if pf:
        w0 = quantize(w0, pf)
    res = []
    for fuse in (True, False):
        w = w0.clone()
        opt = cls([w], param_format=pf, state_format=sf, **kw)
        if not fuse:
            opt._can_fuse = lambda p, s: False
        for i in range(4):
            w.grad = (torch.randn(200, 300, generator=torch.Generator().manual_seed(i)) * 0.1
                      ).to(dtype)
            opt.step(grad_scale=0.5)
        res.append(w.float().clone())
        if fuse:
            assert opt._can_fuse(w, opt.state[w])
    assert torch.equal(res[0].view(torch.int32), res[1].view(torch.int32))


def test_ledger_counts_a_slice_of_a_large_input_as_the_slice():
    model = small_mlp(0)
    prec = Precision("32-true")
    model, _ = prec.setup(model)
    big = torch.randn(10_000, 20)
    y = torch.randint(0, 5, (8,))
    a = prec.memory(model, (big[:8], y), nn.functional.cross_entropy).activations
    b = prec.memory(model, (big[:8].clone(), y), nn.functional.cross_entropy).activations
    assert a == b
