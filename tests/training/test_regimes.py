"""The regimes of the literature: fixed point with stochastic rounding, dynamic fixed point,
BinaryNet, MX block formats."""

import math
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode
from helpers import train_steps
from torch import nn

from lowprec import POLICIES, Precision, parse_format, parse_policy, quantize
from lowprec.training.regimes.binary import BinaryActivation, BinaryLinear, binarize, sign_ste
from lowprec.training.regimes import GroupKey, Role
from lowprec.training.regimes.dynamic_fixed import Controller, DynamicFixedRegime
from lowprec.numerics.formats import DynamicFixedFormat, FixedFormat
from lowprec.training.optim import SGD, Adam
from lowprec.experiments.config import PRESETS

REGIMES = ["fixed16-sr", "fixed16-rn", "q2.14-sr", "fixed<16,14>-rn", "dfxp-10-12",
           "fixed-10-12", "binary", "binary-stochastic", "mxfp8_e4m3", "mxfp8_e5m2",
           "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8"]


def small_cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32),
                         nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.parametrize("name", REGIMES)
def test_every_regime_trains_a_few_steps(name):
    model = small_cnn()
    opt = Adam(model.parameters(), lr=1e-3) if name.startswith("binary") else SGD(
        model.parameters(), lr=0.02, momentum=0.9)
    prec = Precision(name, seed=0)
    model, opt = prec.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)
    losses = train_steps(prec, model, opt, x, y, 5)
    assert all(math.isfinite(v) for v in losses), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    st = prec.state_dict()
    again = Precision(name, seed=0)
    again.setup(small_cnn(), SGD(small_cnn().parameters(), lr=0.1))
    again.load_state_dict(st)
    back = again.state_dict()
    assert back["regimes"] == st["regimes"] and "trace" not in st  # constant size
    assert torch.equal(back["generator"], st["generator"])
    if name.startswith("dfxp"):  # every role's ranges travel, not an empty dict
        assert len(st["regimes"]["dynamic_fixed"]["ranges"]) > 10


def test_fixed_point_policy_names():
    p = parse_policy("fixed<16,14>-sr")
    assert p.params == FixedFormat(2, 14) and p.compute == FixedFormat(2, 14)
    assert p.update == "stochastic" and p.rounding.is_stochastic and p.grad_rounding.is_stochastic
    q = parse_policy("q6.10-rn")
    assert q.compute == FixedFormat(6, 10) and q.update == "nearest"
    assert not q.rounding.is_stochastic
    assert parse_policy("fixed16-sr").params.bits == 16
    for preset in PRESETS.values():
        for name in preset.get("policies", ()):
            pol = parse_policy(name)
            assert parse_policy(pol.spec) == pol
            if m := re.match(r"^q(\d+)\.(\d+)-(sr|rn)$", name):
                fmt = FixedFormat(int(m.group(1)), int(m.group(2)))
                assert (pol.params, pol.compute, pol.grads) == (fmt, fmt, fmt)
                stochastic = m.group(3) == "sr"
                assert pol.rounding.is_stochastic == pol.grad_rounding.is_stochastic == stochastic
                assert pol.update == ("stochastic" if stochastic else "nearest")
            elif "=" in name:  # a compact spec (p=fp32,sc=mxfp4; p=fp32,acc=fp16)
                assert name not in POLICIES and pol.name is None
            else:
                assert pol is POLICIES[name]


def test_fixed_point_values_are_on_the_grid_and_saturate():
    model = small_cnn()
    prec = Precision("q2.14-sr", seed=0)
    model, _ = prec.setup(model)
    seen = {}
    model[6].register_forward_hook(lambda m, a, o: seen.update(out=o))
    model(torch.randn(4, 1, 16, 16) * 10)
    fmt = FixedFormat(2, 14)
    out = seen["out"]
    assert torch.equal(out, quantize(out, fmt))
    assert out.max() <= fmt.max and out.min() >= fmt.min
    for p in model.parameters():
        assert torch.equal(p, quantize(p, fmt))


def _feed(ctrl, key, fmt, rate_r, rate_r1, n=10_000):
    """One observation whose fraction at or beyond 2**range is rate_r and at or beyond
    2**(range - 1) is rate_r1 (planted)."""
    r = ctrl.range_of(key)
    x = torch.full((n,), 2.0 ** (r - 3))
    k1, k = round(rate_r1 * n), round(rate_r * n)
    x[:k1] = 2.0 ** (r - 1) * 1.5  # overflows range - 1 only
    x[:k] = 2.0**r * 1.5  # overflows the current range (and range - 1)
    ctrl.format(key, fmt, x)


@pytest.mark.parametrize("rate_r,rate_r1,change", [
    (0.05, 0.2, +1),   # overflow at the current range above the maximum: grow
    (0.0, 0.05, 0),    # only range - 1 would overflow: keep
    (0.0, 0.0, -1),    # neither: shrink
    (0.009, 0.009, -1),  # below the maximum rate 0.01 at both: shrink
])
def test_dynamic_range_update_follows_the_rule(rate_r, rate_r1, change):
    fmt = DynamicFixedFormat(10, max_overflow=0.01, interval=3)
    ctrl = Controller()
    ctrl.start("g", fmt, range_=2)
    for _ in range(3):
        assert ctrl.range_of("g") == 2  # unchanged inside an interval
        _feed(ctrl, "g", fmt, rate_r, rate_r1)
    assert ctrl.range_of("g") == 2 + change


def test_dynamic_range_follows_a_growing_tensor_and_rounds_with_it():
    fmt = DynamicFixedFormat(10, max_overflow=1e-4, interval=1)
    ctrl = Controller()
    x = torch.randn(1000) * 0.01
    f = ctrl.format("w", fmt, x)
    assert x.abs().max() < 2.0 ** ctrl.range_of("w") <= 2 * x.abs().max()
    assert f == FixedFormat(ctrl.range_of("w") + 1, 10 - ctrl.range_of("w") - 1)
    r0 = ctrl.range_of("w")
    for _ in range(3):
        ctrl.format("w", fmt, x * 100)  # everything overflows: the range grows each time
    assert ctrl.range_of("w") == r0 + 3


def test_dynamic_fixed_point_policy_keeps_ranges_per_group():
    model = small_cnn()
    prec = Precision("dfxp-10-12", seed=0)
    model, opt = prec.setup(model, SGD(model.parameters(), lr=0.05, momentum=0.9))
    x, y = torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))
    for _ in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        prec.backward(loss)
        prec.step(opt)
    (regime,) = prec.regimes
    assert isinstance(regime, DynamicFixedRegime)
    groups = regime.controller.groups
    for key in (GroupKey(Role.PARAM, "0.weight"), GroupKey(Role.PARAM, "0.bias"),
                GroupKey(Role.ACTIVATION, "0"), GroupKey(Role.GRAD, "0"),
                GroupKey(Role.PARAM_GRAD, "0.weight"),
                GroupKey(Role.STATE, "0.weight", "momentum")):
        assert key in groups, sorted(map(str, groups))
    w = model[0].weight
    r = groups[GroupKey(Role.PARAM, "0.weight")]["range"]
    # 12-bit words written at the range of the last step (now's, give or take one): on the
    # grid of range r - 1 (integer part widened so that the check is about the grid only)
    assert torch.equal(w, quantize(w, FixedFormat(r + 3, 12 - r)))
    assert not torch.equal(w, quantize(w, FixedFormat(r + 3, 12 - r - 2)))


def test_binarized_weights_are_exactly_pm1_and_latent_weights_stay_clipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    prec = Precision("binary", seed=0)
    model, opt = prec.setup(model, Adam(model.parameters(), lr=0.5))  # big steps: clipping works
    seen = []
    layers = [m for m in model.modules() if isinstance(m, BinaryLinear)]
    assert len(layers) == 2 and any(isinstance(m, BinaryActivation) for m in model.modules())
    assert any(isinstance(m, nn.BatchNorm1d) for m in model.modules())
    for m in layers:
        m.register_forward_hook(lambda mod, a, o: seen.append(mod.binary_weight().detach()))
    x, y = torch.randn(32, 4, 4), torch.randint(0, 4, (32,))
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        prec.backward(loss)
        prec.step(opt)
        for m in layers:
            assert m.weight.min() >= -1 and m.weight.max() <= 1
    for wb in seen:
        assert set(torch.unique(wb).tolist()) <= {-1.0, 1.0}
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert {id(p) for p in model.parameters()} == in_opt  # BatchNorm's were added
    # BinaryNet's per-layer learning rate: the inverse Glorot coefficient of each latent weight
    scales = {id(g["params"][0]): g["lr_scale"] for g in opt.param_groups if "lr_scale" in g}
    assert scales == {id(layers[0].weight): ((16 + 32) / 1.5) ** 0.5,
                      id(layers[1].weight): ((32 + 4) / 1.5) ** 0.5}


def test_ste_gradient_is_zero_exactly_where_abs_x_exceeds_one():
    x = torch.tensor([-3.0, -1.0001, -1.0, -0.5, 0.0, 0.5, 1.0, 1.0001, 3.0], requires_grad=True)
    y = sign_ste(x)
    assert y.tolist() == [-1, -1, -1, -1, 1, 1, 1, 1, 1]  # sign, 0 -> +1
    y.backward(torch.full_like(x, 2.0))
    assert x.grad.tolist() == [0, 0, 2, 2, 2, 2, 2, 0, 0]


def test_stochastic_binarization_is_unbiased():
    w = torch.tensor([-1.0, -0.6, -0.2, 0.0, 0.3, 0.8, 1.0])
    n = 200_000
    draws = sign_ste(w.repeat(n, 1), stochastic=True, generator=torch.Generator().manual_seed(0))
    assert set(torch.unique(draws).tolist()) == {-1.0, 1.0}
    mean = draws.mean(dim=0)
    p = ((w + 1) / 2).clamp(0, 1)
    bound = 5 * 2 * torch.sqrt(p * (1 - p) / n) + 1e-12
    assert ((mean - w).abs() <= bound).all(), (mean, w)


def test_binarize_keeps_the_parameters_the_optimizer_holds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    ids = [id(p) for p in model.parameters()]
    added = binarize(model)
    assert [id(p) for p in model.parameters() if id(p) in ids] == ids
    assert len(added) == 4  # two BatchNorm layers, weight and bias each


def test_mx_policy_rounds_matmul_weights_and_inputs_in_blocks_along_the_reduction_axis():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(40, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    prec = Precision("mxfp4")
    model, _ = prec.setup(model)
    seen = {}

    class Seen(TorchFunctionMode):  # below the engine's mode: sees the ops as they run
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("conv2d", "linear"):
                seen[0 if func.__name__ == "conv2d" else 3] = (args[0], args[1])
            return func(*args, **(kwargs or {}))

    with prec.autocast(), Seen():  # matmul-scope policies round inside autocast, as torch's
        out = model(torch.randn(2, 40, 6, 6))
    mx = parse_format("mxfp4")
    from dataclasses import replace

    x_lin, w_lin = seen[3]
    assert torch.equal(w_lin, quantize(w_lin.detach(), mx))  # blocks along in_features
    assert torch.equal(x_lin, quantize(x_lin.detach(), mx))
    x_conv, w_conv = seen[0]
    conv_mx = replace(mx, axis=1)  # blocks along the input channels
    assert torch.equal(w_conv, quantize(w_conv.detach(), conv_mx))
    assert torch.equal(x_conv, quantize(x_conv.detach(), conv_mx))
    assert not torch.equal(w_conv, quantize(w_conv.detach(), mx))  # not the last axis
    assert torch.isfinite(out).all()


def test_a_new_regime_plugs_in_without_touching_precision():
    """A regime defined here, registered, is chosen by the registry from the policy and sees
    every hook at its point of the lifecycle; its state travels in Precision's state_dict."""
    from lowprec.training.regimes import REGIMES, Regime, register_regime

    calls = []

    class CountingRegime(Regime):
        name = "counting-test"

        @classmethod
        def applies(cls, policy):
            return policy.compute == parse_format("e3m4")

        def prepare(self, model):
            calls.append("prepare")
            self.steps = 0
            return []

        def configure_optimizer(self, optimizer, added):
            calls.append(("configure", type(optimizer).__name__))

        def resolve(self, fmt, key, x):
            calls.append(("resolve", key.role))
            return fmt

        def after_step(self, model):
            self.steps += 1

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    register_regime(CountingRegime)
    try:
        assert Precision("p=fp32,c=fp16").regimes == []
        prec = Precision("p=e3m4,c=e3m4,g=e3m4,o=fp32", seed=0)
        (regime,) = prec.regimes
        model = nn.Sequential(nn.Linear(4, 3))
        model, opt = prec.setup(model, SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        train_steps(prec, model, opt, x, y, 3)
        # prepare, set-up's rounding of both parameters, the optimizer, then each step's grads
        assert calls[:4] == ["prepare", ("resolve", Role.PARAM), ("resolve", Role.PARAM),
                             ("configure", "SGD")]
        assert calls[4:] == [("resolve", Role.PARAM_GRAD)] * 6
        assert regime.steps == 3 and prec.state_dict()["regimes"] == {"counting-test": {"steps": 3}}
        again = Precision("p=e3m4,c=e3m4,g=e3m4,o=fp32")
        again.load_state_dict(prec.state_dict())
        assert again.regimes[0].steps == 3
        with pytest.raises(ValueError, match="already registered"):
            register_regime(type("Other", (Regime,), {"name": "counting-test"}))
    finally:
        REGIMES.remove(CountingRegime)


def test_group_keys_are_typed():
    assert GroupKey.of("param", "0.weight") == GroupKey(Role.PARAM, "0.weight")
    assert GroupKey.of("momentum", "0.weight") == GroupKey(Role.STATE, "0.weight", "momentum")
    assert str(GroupKey(Role.STATE, "0.weight", "exp_avg")) == "state.exp_avg:0.weight"
    with pytest.raises(ValueError, match="role='weights'; accepted: param, pgrad"):
        GroupKey("weights", "0")


def test_a_group_that_only_sees_zeros_stays_at_a_valid_range():
    """An all-zero tensor (an LSTM's initial state) shrinks its group's range every interval;
    the range stops where the integer bits reach FixedFormat's floor (-126) instead of failing."""
    from lowprec.numerics.formats import parse_format

    ctrl, fmt = Controller(), parse_format("dfxp<10>")
    for _ in range(300):
        got = ctrl.format("zeros", fmt, torch.zeros(8))
    assert ctrl.range_of("zeros") == -127 and got.int_bits == -126
    assert float(quantize(torch.zeros(4), got).abs().max()) == 0.0


# -- a batch of one example under BinaryNet (hostile-tester finding) ----------------------------

@pytest.mark.parametrize("kind", ["linear", "conv-1x1-map"])
def test_inserted_batch_norm_normalises_one_example_with_running_statistics(kind):
    """torch's batch norm refuses a training batch with one value per channel ("Expected more
    than 1 value per channel when training"); the one binarize() inserts normalises it with its
    running statistics, as in evaluation, and leaves them unchanged."""
    torch.manual_seed(0)
    if kind == "linear":
        model, x = nn.Sequential(nn.Linear(6, 4)), torch.randn(1, 6)
    else:
        model, x = nn.Sequential(nn.Conv2d(2, 4, 3)), torch.randn(1, 2, 3, 3)  # 1x1 output map
    binarize(model)
    bn = model[0].bn
    with torch.no_grad():  # statistics of earlier batches, then one example
        model.train()
        model(torch.randn(8, *x.shape[1:]))
    stats = [t.clone() for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    y = model(x)
    y.sum().backward()
    for before, after in zip(stats, (bn.running_mean, bn.running_var, bn.num_batches_tracked)):
        assert torch.equal(before, after)
    model.eval()
    assert torch.equal(y.detach(), model(x).detach())  # what evaluation gives
    assert bn.weight.grad is not None and bn.bias.grad is not None
    model.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(4).train()(torch.randn(1, 4))  # torch's own, for contrast


def test_binary_compare_with_a_last_batch_of_one_trains(tmp_path):
    """lowprec compare --data digits --model mlp --train-subset 33 --batch-size 32
    --policies binary used to fail its run at the last batch (one example)."""
    from lowprec.experiments import CompareConfig, run_compare
    from lowprec.experiments.results import ResultsDB

    out = run_compare(CompareConfig(data="digits", model="mlp", policies=("binary",),
                                    seeds=(0,), epochs=1, batch_size=32, train_subset=33,
                                    out=str(tmp_path / "b"), quiet=True))
    runs = ResultsDB(out / "results.db", create=False).runs()
    assert [r["status"] for r in runs] == ["finished"], runs
