"""Scaled casts (lowprec.numerics.scaling) against references nobody here wrote: torchao's
MXTensor and NVFP4Tensor, and float64 re-computations of the OCP MX rule and of amax scaling
(element rounding by ml_dtypes). Where torchao departs from the OCP MX specification the tests
show the difference and that lowprec follows the specification."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec.numerics.scaling import (AmaxHistory, ScaleKind, ScaledCast, parse_cast,
                                      scaled_cast)
from lowprec import quantize

torchao = pytest.importorskip(
    "torchao", reason="torchao==0.18.0 (test extra, pinned in constraints.txt) is the reference "
                      "of the MX and NVFP4 casts: pip install -c constraints.txt torchao==0.18.0")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor,  # noqa: E402
                                                       per_tensor_amax_to_scale)

ELEMENTS = {  # lowprec element -> torchao element dtype, ml_dtypes dtype
    "e4m3fn": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    "e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2),
    "e3m2fn": ("fp6_e3m2", ml_dtypes.float6_e3m2fn),
    "e2m3fn": ("fp6_e2m3", ml_dtypes.float6_e2m3fn),
    "e2m1fn": (torch.float4_e2m1fn_x2, ml_dtypes.float4_e2m1fn),
}
MODES = ["floor", "ceil", "even", "rceil"]


def same(a, b):
    """Equal values, NaN where the other is NaN."""
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def wide_data(seed=0, rows=64, cols=256):
    """Magnitudes over 12 decades, so that blocks cover many scales and roundings."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.logspace(-6, 6, cols)[torch.randperm(cols, generator=g)]


def torchao_mx(x, el, mode):
    return MXTensor.to_mx(x, ELEMENTS[el][0], 32, ScaleCalculationMode(mode)).dequantize(
        torch.float32)


# -- the grammar -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["hp", "e4m3fn@tensor", "e4m3fn@axis:pow2", "e5m2@delayed16",
                                  "e4m3fn@1x128", "e4m3fn@128x128:pow2", "e4m3fn@mx",
                                  "e2m1fn@mx:rceil", "e4m3fn@mx16:even", "e2m1fn@nvfp4",
                                  "e4m3fn@none", "e5m2@tensor:pow2"])
def test_a_cast_prints_as_it_parses(spec):
    c = parse_cast(spec)
    assert str(c) == spec and parse_cast(str(c)) == c


@pytest.mark.parametrize("spec,needle", [
    ("e4m3fn", "ELEMENT@RULE"), ("e4m3fn@rows", "rule 'rows'"),
    ("e4m3fn@axis:rceil", "exact or pow2"),
    ("e4m3fn@mx:pow2", "floor, ceil, even or rceil"), ("fp16x@tensor", "unknown number format"),
    ("e4m3fn@delayed0", "history=0"), ("q8.8@tensor", "float element"),
    ("e4m3fn@tensor:up", "rounding 'up'"), ("e4m3fn@0x128", "two integers >= 1"),
    ("fp16@mx", "at most 8 bits")])
def test_bad_casts_are_one_line_errors(spec, needle):
    with pytest.raises(ValueError) as err:
        parse_cast(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_elements_saturate():
    c = parse_cast("e4m3fn@none")
    assert c.element.overflow.value == "saturate"
    assert scaled_cast(torch.tensor([1000.0, -1e30]), c).tolist() == [448.0, -448.0]


# -- MX: torchao's MXTensor, every scale mode, every element ------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("el", list(ELEMENTS))
def test_mx_casts_equal_torchao_to_mx_dequantized(el, mode):
    x = wide_data()
    assert same(scaled_cast(x, f"{el}@mx:{mode}"), torchao_mx(x, el, mode))
    # along the other axis of a GEMM operand: blocks down the columns
    got = scaled_cast(x.t(), f"{el}@mx:{mode}", axis=-2)
    assert same(got, torchao_mx(x, el, mode).t())


def _ocp_mx_reference(x: np.ndarray, el: str, mode: str) -> np.ndarray:
    """Blocks of 32 along the last axis in float64: the E8M0 exponent by the mode's rule,
    clamped to [-127, 127], elements = saturate(V / X) rounded to nearest-even by ml_dtypes."""
    from lowprec import parse_format

    fmt = parse_format(el)
    out = np.empty_like(x, dtype=np.float64)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], 32):
            v = x[i, j:j + 32].astype(np.float64)
            amax = np.abs(v).max()
            if not np.isfinite(amax):
                out[i, j:j + 32] = np.nan  # the E8M0 NaN scale
                continue
            if amax == 0:
                s = -127
            elif mode == "floor":
                s = math.floor(math.log2(amax)) - fmt.emax
            elif mode == "ceil":
                s = math.ceil(math.log2(amax)) - fmt.emax
            elif mode == "rceil":
                s = math.ceil(math.log2(float(np.float32(amax) / np.float32(fmt.max))))
            else:  # even: amax rounded half-up at the element's mantissa width, then floor
                e0 = math.floor(math.log2(amax))
                s = math.floor(math.log2(amax + 2.0 ** (e0 - fmt.man_bits - 1))) - fmt.emax
            s = min(max(s, -127), 127)
            p = np.clip(v / 2.0 ** s, -fmt.max, fmt.max).astype(ELEMENTS[el][1])
            out[i, j:j + 32] = p.astype(np.float64) * 2.0 ** s
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("el", ["e4m3fn", "e2m1fn"])
def test_mx_casts_follow_the_ocp_rule_where_torchao_departs_from_it(el, mode):
    """Blocks whose scale is E8M0's smallest, 2**-127 (amax below 2**(emax - 126)): torchao
    divides by 2**-126 (it clamps the float32 scale to the smallest normal) but multiplies
    back by 2**-127, halving the block (floor, ceil, even); under rceil it multiplies by 1
    instead of 2**127 and flushes the block to zero. A block holding Inf: torchao saturates the
    Inf (max times a scale of 2**(128 - emax) overflows) and flushes the rest to zero; lowprec
    gives the block the E8M0 NaN scale, as its MX formats do.
    lowprec equals the float64 re-computation of the rule; torchao does not."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g)
    x[0, :32] *= 1e-37                      # block amax ~ 2**-121: scale 2**-127 (e4m3)
    x[1, :32] = torch.randn(32, generator=g) * 2.0 ** -130   # fp32 subnormals among them
    x[2, :32] *= 2.0 ** -124
    x[3, 5] = float("inf")
    x[4, 7] = float("nan")
    ref = torch.from_numpy(_ocp_mx_reference(x.numpy(), el, mode)).float()
    got = scaled_cast(x, f"{el}@mx:{mode}")
    assert same(got, ref)
    ao = torchao_mx(x, el, mode)
    assert same(got[5], ao[5]) and same(got[:, 32:], ao[:, 32:])  # ordinary blocks: equal
    others = torch.arange(32) != 5
    assert torch.isnan(got[3, :32]).all()  # the Inf block: NaN here; torchao keeps the Inf
    assert torch.isinf(ao[3, 5]) and (ao[3, :32][others] == 0).all()  # and flushes the rest
    assert torch.isnan(ao[4, :32]).all()  # a NaN: both NaN
    tiny = got[0, :32] != 0
    if el == "e4m3fn" and mode == "rceil":  # amax / 448 below 2**-127
        assert (ao[0, :32] == 0).all() and tiny.any()
    elif el == "e4m3fn":
        assert torch.equal(ao[0, :32][tiny] * 2, got[0, :32][tiny])  # torchao: half


def test_mx_floor_equals_lowprecs_ocp_block_format_on_ordinary_blocks():
    x = wide_data(seed=2)
    for el, fmt in (("e4m3fn", "mxfp8_e4m3"), ("e5m2", "mxfp8_e5m2"), ("e2m1fn", "mxfp4")):
        assert same(scaled_cast(x, f"{el}@mx"), quantize(x, fmt))


# -- NVFP4: torchao's NVFP4Tensor ---------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_equals_torchao_two_level_conversion(seed):
    x = wide_data(seed, rows=32, cols=128)
    x = x / x.abs().amax() * 10.0 ** (3 * seed - 3)  # tensor amax 1e-3, 1, 1e3
    ts = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    ref = NVFP4Tensor.to_nvfp4(x, 16, ts).dequantize(torch.float32)
    assert torch.equal(scaled_cast(x, "e2m1fn@nvfp4"), ref)
    assert torch.equal(scaled_cast(x.t(), "e2m1fn@nvfp4", axis=-2), ref.t())


def test_nvfp4_of_an_all_zero_tensor_is_zero_where_torchao_gives_nan():
    x = torch.zeros(4, 32)
    ref = NVFP4Tensor.to_nvfp4(x, 16, per_tensor_amax_to_scale(torch.max(torch.abs(x))))
    assert torch.isnan(ref.dequantize(torch.float32)).all()  # 0 / 0 in the block scale
    assert torch.equal(scaled_cast(x, "e2m1fn@nvfp4"), x)


# -- amax scaling: float64 re-computation -------------------------------------------------------
def _amax_reference(x: np.ndarray, tile, el: str, pow2: bool) -> np.ndarray:
    """scale = fp32(max / max(amax, 1e-12)) per tile of the last two axes (tile cols along the
    last), x * scale in float32, saturated, rounded by ml_dtypes, divided by scale in float32."""
    from lowprec import parse_format

    fmt = parse_format(el)
    out = np.empty_like(x)
    tr, tc = tile
    for i in range(0, x.shape[0], tr):
        for j in range(0, x.shape[1], tc):
            v = x[i:i + tr, j:j + tc]
            scale = np.float32(fmt.max / max(float(np.abs(v).max()), 1e-12))
            if pow2:
                scale = np.float32(2.0 ** math.floor(math.log2(scale)))
            q = np.clip(v * scale, -fmt.max, fmt.max).astype(ELEMENTS[el][1]).astype(np.float32)
            out[i:i + tr, j:j + tc] = q / scale
    return out


@pytest.mark.parametrize("rule,tile", [("tensor", None), ("axis", (1, None)), ("1x128", (1, 128)),
                                       ("128x128", (128, 128)), ("1x96", (1, 96)),
                                       ("64x48", (64, 48))])
@pytest.mark.parametrize("el", ["e4m3fn", "e5m2"])
def test_amax_scaled_casts_equal_a_float64_recomputation(rule, tile, el):
    x = wide_data(seed=3, rows=200, cols=300)  # 300 and 200 leave partial tiles at the edges
    x = x / x.abs().amax(dim=1, keepdim=True) * torch.logspace(-3, 3, 200).unsqueeze(1)
    xn = x.numpy()
    tile = (x.shape[0], x.shape[1]) if tile is None else (tile[0], tile[1] or x.shape[1])
    for pow2 in (False, True):
        spec = f"{el}@{rule}" + (":pow2" if pow2 else "")
        ref = torch.from_numpy(_amax_reference(xn, tile, el, pow2))
        assert torch.equal(scaled_cast(x, spec), ref), spec
        # the same tiles on the transposed operand, reduction axis -2
        assert torch.equal(scaled_cast(x.t(), spec, axis=-2), ref.t()), spec


def test_pow2_scales_make_scaling_exact():
    x = wide_data(seed=4)
    q = scaled_cast(x, "e4m3fn@axis:pow2")
    # elements times a power of two: q * scale is an e4m3 value for every row
    scale = 2.0 ** torch.floor(torch.log2(448.0 / x.abs().amax(dim=1, keepdim=True)))
    assert torch.equal(quantize(q * scale, "e4m3fn"), q * scale)


def test_layout_is_kept():
    x = torch.randn(64, 32).t()
    for spec in ("e4m3fn@tensor", "e4m3fn@axis", "e4m3fn@mx", "e2m1fn@nvfp4", "e4m3fn@none"):
        assert scaled_cast(x, spec).stride() == x.stride()


def test_delayed_scaling_uses_the_history_of_previous_casts():
    hist = AmaxHistory()
    c = parse_cast("e4m3fn@delayed3")
    assert c.kind is ScaleKind.DELAYED and c.history == 3
    xs = [torch.full((4, 4), v) for v in (1.0, 4.0, 2.0, 0.5, 0.25, 0.125)]
    outs = [scaled_cast(x, c, history=hist, key="k") for x in xs]
    # first cast: its own amax; then the largest of the (up to 3) previous ones
    used = [1.0, 1.0, 4.0, 4.0, 4.0, 2.0]
    for x, out, amax in zip(xs, outs, used):
        scale = torch.tensor(448.0 / amax, dtype=torch.float32)
        expected = quantize(torch.clamp(x * scale, -448, 448), "e4m3fn") / scale
        assert torch.equal(out, expected)
    assert outs[1].max() == 1.0  # 4 cast with the scale of amax 1: saturates at 1
    assert hist.state_dict() == {"k": [0.5, 0.25, 0.125]}
    other = AmaxHistory()
    other.load_state_dict(hist.state_dict())
    assert torch.equal(scaled_cast(xs[0], c, history=other, key="k"),
                       scaled_cast(xs[0], c, history=hist, key="k"))
    with pytest.raises(ValueError, match="AmaxHistory"):
        scaled_cast(xs[0], c)


def test_hp_is_the_operand_itself_and_stats_are_counted():
    x = torch.tensor([[1.0, 1e-6, 0.0, 300.0]])
    assert scaled_cast(x, "hp") is x
    st: dict = {}
    scaled_cast(x, "e4m3fn@none", stats=st)
    assert st["nonzero"] == 3 and st["flushed"] == pytest.approx(1 / 3)
    assert st["amax"] == 300.0 and st["saturated"] == 0.0
    assert ScaledCast(ScaleKind.HP).is_hp


# -- stochastic element rounding (NVFP4's gradients) --------------------------------------------

def test_stochastic_cast_parses_prints_and_refuses_other_roundings():
    c = parse_cast("e2m1fn:sr@nvfp4")
    assert c.stochastic and str(c) == "e2m1fn:sr@nvfp4" and parse_cast(str(c)) == c
    assert str(parse_cast("e4m3fn:stochastic@axis:pow2")) == "e4m3fn:sr@axis:pow2"
    with pytest.raises(ValueError, match="element rounding 'up'; accepted: sr"):
        parse_cast("e2m1fn:up@nvfp4")


@pytest.mark.parametrize("spec", ["e2m1fn:sr@nvfp4", "e4m3fn:sr@tensor", "e2m1fn:sr@mx"])
def test_stochastic_cast_rounds_to_a_neighbour_and_is_unbiased(spec):
    """Each draw is one of the two grid points around x (the nearest cast's value or the one
    on the other side of x; the scale is the nearest cast's), reproducible from the
    generator's seed, and the mean of n draws is x up to the sampling error:
    |mean - x| <= 5 * gap / (2 sqrt(n)) wherever both neighbours were drawn (an element whose
    other neighbour has probability < 0.5% may show only one in n = 2000 draws)."""
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    rn = scaled_cast(x, parse_cast(spec.replace(":sr", "")))
    g = torch.Generator().manual_seed(5)
    n = 2000
    draws = torch.stack([scaled_cast(x, spec, generator=g) for _ in range(n)])
    g.manual_seed(5)
    assert torch.equal(scaled_cast(x, spec, generator=g), draws[0])
    lo, hi = draws.min(0).values, draws.max(0).values
    assert bool(((draws == lo) | (draws == hi)).all())  # two values at most
    assert bool(((rn == lo) | (rn == hi)).all())  # the nearest is one of them
    both = lo != hi
    assert int(both.sum()) > 0.9 * x.numel()
    tol = 1e-6 * x.abs()  # bringing the elements back to scale rounds in fp32
    assert bool(((lo <= x + tol) & (x <= hi + tol))[both].all())  # they bracket x
    err = (draws.mean(0) - x).abs()
    assert bool((err <= 5 * (hi - lo) / (2 * n ** 0.5) + tol)[both].all())
    # and the nearest cast's error, which stochastic rounding removes, is much larger
    assert float(err.mean()) < 0.2 * float((rn - x).abs().mean())
