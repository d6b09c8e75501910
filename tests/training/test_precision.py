"""Precision: backends, emulated grids, every named policy through one loop."""

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode
from helpers import cnn_batch, small_cnn, small_mlp, train_steps
from torch import nn

import lowprec
from lowprec import POLICIES, Precision, quantize
from lowprec.numerics.formats import FP32
from lowprec.numerics.storage import format_bytes
from lowprec.training.regimes import GroupKey, Role
from lowprec.training.optim import SGD, FormatOptimizer


def test_the_repr_shows_a_plans_overrides():
    """A plan's Precision read as its base policy alone looked like that policy everywhere (a
    new user's report): the repr lists the per-module overrides."""
    plan = lowprec.Plan("16-true", overrides={"head": "32-true"})
    assert repr(Precision(plan)).startswith("Precision(16-true, overrides={'head': '32-true'}")
    assert "overrides" not in repr(Precision("16-true"))


def test_native_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="emulated"):
        Precision("p=e4m3fn,b=native").setup(small_mlp())


DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float32,
          "16-mixed": torch.float32, "bf16-mixed": torch.float32, "16-master": torch.float32}
NATIVE_DTYPES = {"16-true": torch.float16, "16-master": torch.float16}  # fp16 run natively


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
    # the parameters' dtype on the backend auto chose for this device (fp32 carriers emulated)
    expected_dtype = (NATIVE_DTYPES.get(name, DTYPES.get(name)) if prec.backend == "native"
                      else torch.float32 if name in DTYPES else None)
    if expected_dtype is not None:
        assert next(model.parameters()).dtype == expected_dtype
    if pol.params != FP32:  # parameters lie on the parameter format's grid
        from lowprec.numerics.formats import DynamicFixedFormat
        for pname, p in model.named_parameters():
            fmt = pol.params
            if isinstance(fmt, DynamicFixedFormat):
                # written at the range its group had then (now's, give or take one): on the
                # grid of now's range - 1, whose integer part is widened to hold them all
                r = prec.regimes[0].controller.range_of(GroupKey(Role.PARAM, pname))
                fmt = lowprec.FixedFormat(r + 3, fmt.bits - r)
            assert torch.equal(p.float(), quantize(p.float(), fmt))
    if pol.master is not None:
        assert isinstance(opt, (FormatOptimizer, SGD))
    # state round trips with equal next steps: tests/test_contracts.py
    led = prec.memory(model, (x, y), nn.functional.cross_entropy)
    params = list(model.parameters())
    if prec.backend == "native":  # real tensors: their own storage is the reference
        assert led.params == sum(p.numel() * p.element_size() for p in params)
    else:  # fp32 carriers of the parameter format's values
        assert led.params == format_bytes(pol.params, sum(p.numel() for p in params))
    assert led.grads == led.params  # every parameter trains; gradients in the parameter format


def test_emulated_activations_are_on_the_grid():
    model = small_cnn()
    prec = Precision("p=fp32,c=e4m3fn,g=e5m2,s=all,b=emulated")
    model, _ = prec.setup(model)
    outs = {}
    model[4].register_forward_hook(lambda m, a, o: outs.update(conv2=o))

    class Seen(TorchFunctionMode):  # below the engine's mode: sees the weight each op gets
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "conv2d" and args[1].shape[0] == 8:
                outs["w"] = args[1]
            return func(*args, **(kwargs or {}))

    with Seen():
        model(cnn_batch()[0])
    assert torch.equal(outs["conv2"], quantize(outs["conv2"], "e4m3fn"))
    assert torch.equal(outs["w"], quantize(outs["w"], "e4m3fn"))  # weights rounded when used
    assert not torch.equal(model[4].weight, outs["w"])  # the stored fp32 weight unchanged


# -- states and generators (hostile-tester findings) ---------------------------------------------

_BAD_PRECISION_STATES = [
    ("loss_scale", {"scale": float("nan")}), ("loss_scale", {"scale": float("inf")}),
    ("loss_scale", {"scale": -8.0}), ("loss_scale", {"scale": 0.0}),
    ("loss_scale", {"scale": 2.0**30}), ("loss_scale", {"scale": 8.0, "good_steps": -2}),
    ("steps", -1), ("steps", float("nan")), ("skipped", 5), ("nonfinite", 1.5),
    ("trace", "not a list"), ("generator", "not a state"), ("regimes", [1]),
]


@pytest.mark.parametrize("key,value", _BAD_PRECISION_STATES,
                         ids=[f"{k}={v!r}"[:40] for k, v in _BAD_PRECISION_STATES])
def test_load_state_dict_refuses_a_bad_field_and_changes_nothing(key, value):
    """A NaN (or inf, zero, negative) loss scale used to load and skip every later step."""
    prec = Precision("16-mixed", seed=0)
    prec.loss_scale.update(False)
    before = prec.state_dict()
    state = prec.state_dict()
    state[key] = value
    with pytest.raises(ValueError) as err:
        prec.load_state_dict(state)
    assert "\n" not in str(err.value)
    after = prec.state_dict()
    assert after["loss_scale"] == before["loss_scale"] and after["steps"] == before["steps"]
    assert torch.equal(after["generator"], before["generator"])


def test_dynamic_fixed_point_ranges_are_checked_on_load():
    prec = Precision("dfxp-10-12")
    state = prec.state_dict()
    state["regimes"] = {"dynamic_fixed": {"ranges": {"w": {"range": float("nan"), "over": 0,
                                                            "over1": 0, "n": 0, "calls": 0}}}}
    with pytest.raises(ValueError, match="range=nan must be an integer"):
        prec.load_state_dict(state)
    assert prec.state_dict()["regimes"] == Precision("dfxp-10-12").state_dict()["regimes"]


@pytest.mark.parametrize("kwargs", [dict(generator="0"), dict(generator=0), dict(seed="0"),
                                    dict(seed=1.5), dict(seed=True)])
def test_a_generator_or_seed_of_the_wrong_type_is_a_type_error(kwargs):
    with pytest.raises(TypeError) as err:
        Precision("16-true", **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and repr(next(iter(kwargs.values()))) in msg


def test_generator_and_seed_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        Precision("16-true", seed=0, generator=torch.Generator())


def _set_up_mixed():
    prec = Precision("16-mixed")
    model = nn.Linear(2, 2)
    prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return prec


@pytest.mark.parametrize("call,what", [
    (lambda: Precision("16-mixed").setup("model"), "setup() takes a torch.nn.Module, got str"),
    (lambda: _set_up_mixed().step("opt"), "step() takes an optimizer"),
    (lambda: _set_up_mixed().unscale_("opt"), "unscale_() takes an optimizer"),
    (lambda: _set_up_mixed().setup_optimizer("opt"), "setup_optimizer() takes an optimizer"),
    (lambda: Precision("16-mixed").backward("loss"), "backward() takes the loss tensor"),
    (lambda: Precision("16-true", overrides="x"), "overrides='x' (str) must be a dict"),
])
def test_wrong_types_are_type_errors_not_attribute_errors(call, what):
    with pytest.raises(TypeError) as err:
        call()
    assert what in str(err.value)
