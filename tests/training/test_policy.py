"""Policies: named policies, compact specs and their round trip, typed fields, clear errors."""

import copy

import pytest
import torch
from helpers import assert_same_bits
from torch import nn

from lowprec import POLICIES, Policy, Precision, Rounding, parse_policy, quantize
from lowprec.numerics.rounding import RoundingSpec
from lowprec.training.policy import UPDATE_MODES, Backend, Scope, WriteBack
from lowprec.numerics.formats import FP16, FP32


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


# -- typed fields: rounding keeps its random bits, enums parse once -----------------------------

def test_sr4_keeps_its_bits_through_policy_and_spec():
    p = parse_policy("p=fp32,c=fp16,g=e5m2:sr4,s=matmul")
    assert p.grad_rounding == RoundingSpec(Rounding.STOCHASTIC_LIMITED, 4)
    assert "g=e5m2:sr4" in p.spec
    assert parse_policy(p.spec) == p
    # the default of stochastic_limited (8 bits) is spelled out, and sr (32 bits) stays "sr"
    assert "c=fp16:sr8" in parse_policy("p=fp32,c=fp16:stochastic_limited").spec
    assert parse_policy("p=fp32,g=e5m2:sr").grad_rounding.bits == 32


def test_training_draws_the_policys_random_bits(monkeypatch):
    """The gradient of the input of one emulated linear layer, rounded by the policy's backward
    hooks, equals the same arithmetic written with ``quantize(..., "sr4")`` and the keys the
    engine used, each derived from one draw of the Precision's generator for the forward
    (lowprec.numerics.keys); with 8 bits it differs (so the bits do reach the kernel)."""
    from lowprec.numerics.keys import derive_keys
    from lowprec.numerics.quantize import draw_seed
    from lowprec.training.emulation import autograd_fns

    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    x0 = torch.randn(16, 64)
    c = torch.randn(16, 32)
    used = {}  # shape -> the keys its stochastic rounding used
    real = autograd_fns.quantize

    def recording(x, fmt, mode, **kw):
        if kw.get("seed") is not None:
            used[tuple(x.shape)] = kw["seed"]
        return real(x, fmt, mode, **kw)

    monkeypatch.setattr(autograd_fns, "quantize", recording)

    def input_grad(spec):
        model = copy.deepcopy(layer)
        prec = Precision(spec, generator=torch.Generator().manual_seed(7))
        model, _ = prec.setup(model)
        x = x0.clone().requires_grad_(True)
        with prec.autocast():
            (model(x) * c).sum().backward()
        return x.grad

    got = input_grad("p=fp32,c=fp16,g=e5m2:sr4,s=matmul,b=emulated")
    base = draw_seed(torch.Generator().manual_seed(7))  # the forward's one draw
    derived = {derive_keys(base, j * 2**31 + n) for n in range(64) for j in range(4)}
    assert set(used) == {(16, 32), (16, 64)} and all(k in derived for k in used.values())
    assert used[(16, 32)] != used[(16, 64)]
    dy = quantize(c, "e5m2", "sr4", seed=used[(16, 32)])          # the output's gradient
    dx = dy @ quantize(layer.weight.detach(), "fp16")              # through the fp16 weight
    expected = quantize(dx, "e5m2", "sr4", seed=used[(16, 64)])    # the input's gradient
    assert_same_bits(got, expected, "sr4 input gradient")
    got8 = input_grad("p=fp32,c=fp16,g=e5m2:sr8,s=matmul,b=emulated")
    assert not torch.equal(got, got8)


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_named_policy_round_trips_its_spec(name):
    p = POLICIES[name]
    q = parse_policy(p.spec)
    assert q == p
    assert (q.rounding, q.grad_rounding, q.update, q.backend, q.scope) == (
        p.rounding, p.grad_rounding, p.update, p.backend, p.scope)
    assert q.spec == p.spec


def test_enum_fields_are_typed_and_compare_with_their_names():
    p = parse_policy("p=bf16:kahan,b=emulated,s=all")
    assert p.update is WriteBack.KAHAN and p.update == "kahan"
    assert p.backend is Backend.EMULATED and p.scope is Scope.ALL
    assert f"{p.update}" == "kahan" and str(p.backend) == "emulated"
    assert UPDATE_MODES == ("nearest", "stochastic", "kahan")
    assert Policy(update="stochastic").update is WriteBack.STOCHASTIC


@pytest.mark.parametrize("field,value,accepted", [
    ("update", "wobble", "nearest, stochastic, kahan"),
    ("backend", "gpu", "auto, native, emulated"),
    ("scope", "conv", "all, matmul"),
])
def test_enum_errors_name_the_accepted_values(field, value, accepted):
    with pytest.raises(ValueError) as err:
        Policy(**{field: value})
    msg = str(err.value)
    assert f"{field}={value!r}" in msg and accepted in msg and "\n" not in msg


def test_a_write_back_with_limited_random_bits_is_refused_not_truncated():
    with pytest.raises(ValueError, match="write-back takes nearest, stochastic .* or kahan"):
        parse_policy("p=bf16:sr4")
    assert parse_policy("p=bf16:sr").update is WriteBack.STOCHASTIC


# -- a key or a setting given twice (hostile-tester findings) -----------------------------------

@pytest.mark.parametrize("spec", ["p=fp16,p=bf16", "p=fp16,params=bf16", "c=fp16,compute=bf16",
                                  "p=fp16,g=fp16,g=bf16", "o=fp16,opt=fp32", "m=fp32,m=none",
                                  "p=fp16,ls=none,ls=dynamic", "b=native,backend=emulated",
                                  "s=all,s=matmul", "p=fp16,u=kahan,u=nearest",
                                  "r=nearest,rounding=sr"])
def test_a_key_given_twice_is_refused(spec):
    """``p=fp16,p=bf16`` used to run bf16 (the last one won)."""
    with pytest.raises(ValueError) as err:
        parse_policy(spec)
    msg = str(err.value)
    assert "given twice" in msg and "\n" not in msg and repr(spec) in msg


@pytest.mark.parametrize("spec", ["p=fp16:kahan,u=nearest", "p=fp16:sr,u=kahan",
                                  "c=fp16:sr,r=nearest", "g=e5m2:sr,r=nearest"])
def test_a_setting_given_two_ways_is_refused(spec):
    with pytest.raises(ValueError, match="given twice"):
        parse_policy(spec)


def test_one_way_each_still_parses():
    assert parse_policy("p=fp16,u=kahan").update == "kahan"
    assert parse_policy("p=fp16,r=sr").grad_rounding.is_stochastic
    assert parse_policy("p=fp16,c=fp16:sr").rounding.is_stochastic
