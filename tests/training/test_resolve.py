"""Dynamic formats are resolved through one callable: every format says whether its grid is
dynamic (``fmt.dynamic``), the engine and the optimizers' storage take a ``resolve`` and know
no regime by name. Grids checked in float64."""

import math

import pytest
import torch

from lowprec.numerics.formats import NAMED_FORMATS, families, parse_format
from lowprec.training.emulation.engine import emulated
from lowprec.training.optim import SGD
from lowprec.training.regimes.base import GroupKey, Role, static_resolve


def on_fixed_grid(t: torch.Tensor, bits: int) -> bool:
    """Every value k * 2**-F with |k| < 2**(bits-1) for one range r (F = bits - r - 1), in
    float64: the grid of dynamic fixed point at some range."""
    v = t.detach().double().flatten()
    amax = float(v.abs().max())
    if amax == 0:
        return True
    for r in range(math.floor(math.log2(amax)), math.floor(math.log2(amax)) + 3):
        scaled = v * 2.0 ** (bits - r - 1)
        if torch.equal(scaled, scaled.round()) and float(scaled.abs().max()) <= 2 ** (bits - 1):
            return True
    return False


def test_only_dynamic_fixed_point_is_dynamic_in_every_family():
    fmts = list(NAMED_FORMATS.values()) + [parse_format("dfxp<10>"), parse_format("int<8>")]
    assert {type(f) for f in fmts} == {t for fam in families() for t in fam.types}
    assert [str(f) for f in fmts if f.dynamic] == ["dfxp<10>"]


def test_a_dynamic_format_without_a_regime_is_refused_with_one_line():
    with pytest.raises(ValueError, match="needs a dynamic fixed-point Controller"):
        static_resolve(parse_format("dfxp<8>"), GroupKey(Role.PARAM, "x"), torch.ones(2))
    assert static_resolve(parse_format("q2.6"), GroupKey(Role.PARAM, "x"), None) == \
        parse_format("q2.6")


def test_emulated_resolves_through_the_regimes_the_policy_needs():
    torch.manual_seed(0)
    x = torch.randn(64) * 3
    with emulated("p=fp32,c=dfxp<8>,g=fp32"):
        y = torch.nn.functional.gelu(x)
    assert on_fixed_grid(y, 8) and not on_fixed_grid(torch.nn.functional.gelu(x), 8)


def test_an_optimizer_on_its_own_keeps_dynamic_fixed_point_parameters_on_a_grid():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32))
    opt = SGD([w], lr=0.1, param_format="dfxp<12>")
    for _ in range(3):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    assert on_fixed_grid(w, 12)
