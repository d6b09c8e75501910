"""quantize against references nobody here wrote: torch's casts, ml_dtypes, gfloat, float64."""

import gfloat
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_same_bits, assert_same_values
from gfloat.formats import (
    format_info_binary16,
    format_info_ocp_e2m1,
    format_info_ocp_e2m3,
    format_info_ocp_e3m2,
    format_info_ocp_e4m3,
    format_info_ocp_e5m2,
)
from reference import interesting_values, random_f32_patterns, round_reference

from lowprec import FixedFormat, parse_format, quantize
from lowprec.numerics.formats import FloatFormat


def _sixteen_bit_probe(dtype) -> np.ndarray:
    """Every value of a 16-bit format, every midpoint between neighbours, the float32 values
    just either side of each midpoint, and 2**21 random float32 bit patterns."""
    codes = np.arange(2**16, dtype=np.uint16)
    if dtype is torch.float16:
        vals = codes.view(np.float16).astype(np.float32)
    else:
        vals = (codes.astype(np.uint32) << 16).view(np.float32)
    finite = np.unique(vals[np.isfinite(vals)].astype(np.float64))
    mids = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32
    beyond = np.array([65504 + 8, 65504 + 16, 65520, 65519.996, 65536, 1e5, 3.4e38],
                      dtype=np.float32)
    probe = np.concatenate([vals, mids, np.nextafter(mids, np.float32(np.inf)),
                            np.nextafter(mids, np.float32(-np.inf)), beyond, -beyond,
                            random_f32_patterns(2**21, seed=1)])
    return probe


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_16bit_nearest_is_bit_identical_to_torch_cast(spec, dtype, impl):
    x = torch.from_numpy(_sixteen_bit_probe(dtype))
    expected = x.to(dtype).float()
    got = quantize(x, spec, impl=impl)
    finite = ~torch.isnan(x)
    assert_same_bits(got[finite], expected[finite], spec)
    assert torch.isnan(got[~finite]).all()
    # the named corner cases
    corner = torch.tensor([65504.0, 65519.99, 65520.0, -65520.0, 2.0**-24, 2.0**-25,
                           2.0**-25 * 1.5, -0.0, 0.0, float("inf"), float("-inf")])
    assert_same_bits(quantize(corner, spec, impl=impl), corner.to(dtype).float(), "corners")


# (spec, ml_dtypes type, torch dtype with its own overflow rule or None)
SMALL = [
    ("e4m3fn", ml_dtypes.float8_e4m3fn, None),
    ("e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2),
    ("e4m3fnuz", ml_dtypes.float8_e4m3fnuz, None),
    ("e5m2fnuz", ml_dtypes.float8_e5m2fnuz, None),
    ("e4m3", ml_dtypes.float8_e4m3, None),
    ("e3m4", ml_dtypes.float8_e3m4, None),
    ("fp6_e2m3", ml_dtypes.float6_e2m3fn, None),
    ("fp6_e3m2", ml_dtypes.float6_e3m2fn, None),
    ("fp4_e2m1", ml_dtypes.float4_e2m1fn, None),
]


@pytest.mark.parametrize("spec,mdtype,_t", SMALL, ids=[s[0] for s in SMALL])
def test_small_floats_match_ml_dtypes(spec, mdtype, _t, impl):
    fmt = parse_format(spec)
    x = np.concatenate([interesting_values(fmt), random_f32_patterns(50_000, seed=2)])
    if not fmt.has_nan:  # ml_dtypes turns NaN into -0 where the format has no NaN
        x = x[~np.isnan(x)]
    expected = x.astype(mdtype).astype(np.float64)
    got = quantize(torch.from_numpy(x), fmt, impl=impl)
    assert_same_values(got, expected, spec)


@pytest.mark.parametrize("spec,tdtype", [
    ("e4m3fn-sat", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2),
    ("e4m3fnuz", torch.float8_e4m3fnuz), ("e5m2fnuz", torch.float8_e5m2fnuz)])
def test_fp8_matches_torch_cast_in_its_overflow_mode(spec, tdtype, impl):
    fmt = parse_format(spec)
    x = np.concatenate([interesting_values(fmt), random_f32_patterns(50_000, seed=3)])
    xt = torch.from_numpy(x)
    expected = xt.to(tdtype).float()
    got = quantize(xt, fmt, impl=impl)
    assert_same_values(got, expected, spec)


def test_e4m3fn_overflow_modes_follow_each_reference():
    x = torch.tensor([464.0, 464.01, 480.0, 1e4, float("inf"), -1e4])
    assert quantize(x, "e4m3fn-sat").tolist() == [448, 448, 448, 448, 448, -448]  # torch's rule
    got = quantize(x, "e4m3fn")  # ml_dtypes / OCP non-saturating: NaN
    assert got[0] == 448 and torch.isnan(got[1:]).all()


DIRECTED_FORMATS = ["fp16", "bf16", "e4m3fn", "e5m2", "e4m3fnuz", "fp6_e3m2", "fp4_e2m1",
                    "e5m10-nosub", "e3m2fn-nosub", "e4m3fn-sat", "q2.14", "uq4.4", "q8.8",
                    "q2.6-sym"]
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", DIRECTED_FORMATS)
def test_every_mode_matches_float64_table_reference(spec, mode, impl):
    fmt = parse_format(spec)
    x = np.concatenate([interesting_values(fmt), random_f32_patterns(20_000, seed=4)])
    with np.errstate(all="ignore"):
        expected = round_reference(x, fmt, mode)
    got = quantize(torch.from_numpy(x), fmt, mode, impl=impl)
    assert_same_values(got, expected, f"{spec} {mode}")


GFLOAT = [("fp16", format_info_binary16, False), ("e4m3fn", format_info_ocp_e4m3, False),
          ("e5m2", format_info_ocp_e5m2, False), ("fp6_e2m3", format_info_ocp_e2m3, True),
          ("fp6_e3m2", format_info_ocp_e3m2, True), ("fp4_e2m1", format_info_ocp_e2m1, True)]
GMODES = {"nearest": gfloat.RoundMode.TiesToEven, "nearest_away": gfloat.RoundMode.TiesToAway,
          "toward_zero": gfloat.RoundMode.TowardZero, "up": gfloat.RoundMode.TowardPositive,
          "down": gfloat.RoundMode.TowardNegative}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec,fi,sat", GFLOAT, ids=[g[0] for g in GFLOAT])
def test_every_mode_matches_gfloat(spec, fi, sat, mode):
    fmt = parse_format(spec)
    x = interesting_values(fmt, neighbours=False)
    if spec == "fp16":  # keep gfloat's pure-Python loop short
        x = np.concatenate([x[::7], x[-12:]])
    if not fmt.has_nan:
        x = x[~np.isnan(x)]
    expected = np.array([gfloat.round_float(fi, float(v), GMODES[mode], sat=sat) for v in x])
    got = quantize(torch.from_numpy(x), fmt, mode)
    assert_same_values(got, expected, f"{spec} {mode}")


@pytest.mark.parametrize("il,fl", [(2, 14), (8, 8), (1, 7), (4, 0), (12, 12)])
def test_fixed_point_matches_integer_arithmetic(il, fl, impl):
    fmt = FixedFormat(il, fl)
    rng = np.random.default_rng(5)
    span = 2.0 ** (il - 1)
    x = np.concatenate([rng.uniform(-1.5 * span, 1.5 * span, 100_000),
                        (rng.integers(-(2 ** (il + fl)), 2 ** (il + fl), 1000) + 0.5) * 2.0**-fl,
                        [span, -span, span * 10, -span * 10, 0.0]]).astype(np.float32)
    k = np.rint(x.astype(np.float64) * 2.0**fl)  # numpy rint: ties to even
    k = np.clip(k, -(2 ** (il + fl - 1)), 2 ** (il + fl - 1) - 1)
    expected = k * 2.0**-fl
    got = quantize(torch.from_numpy(x), fmt, impl=impl).double().numpy()
    np.testing.assert_array_equal(got, expected + 0.0)  # fixed point has no -0
    assert not np.signbit(got[got == 0]).any()
    # toward zero is truncation of the integer
    kz = np.clip(np.trunc(x.astype(np.float64) * 2.0**fl), -(2 ** (il + fl - 1)),
                 2 ** (il + fl - 1) - 1)
    np.testing.assert_array_equal(quantize(torch.from_numpy(x), fmt, "toward_zero",
                                           impl=impl).double().numpy(), kz * 2.0**-fl)


def _mx_reference(x: np.ndarray, fmt) -> np.ndarray:
    """Per-block float64 reference of OCP MX v1.0 section 6.3 (last axis, nearest-even)."""
    elem = fmt.element
    B = fmt.block_size
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.empty_like(rows)
    for j, row in enumerate(rows):
        for b0 in range(0, row.size, B):
            blk = row[b0:b0 + B]
            amax = np.max(np.abs(blk))
            if not np.isfinite(amax):
                out[j, b0:b0 + B] = np.nan
                continue
            s = -127 if amax == 0 else int(np.clip(np.floor(np.log2(amax)) - elem.emax, -127, 127))
            scaled = blk / 2.0**s
            q = round_reference(scaled.astype(np.float32), elem, "nearest") if np.all(
                scaled.astype(np.float32) == scaled) else None
            assert q is not None, "scaled block must be exact in float32 for this reference"
            out[j, b0:b0 + B] = q * 2.0**s
    return out.reshape(x.shape)


@pytest.mark.parametrize("spec", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4",
                                  "mxint8", "block<q4.4,8>"])
def test_mx_matches_per_block_float64_reference(spec, impl):
    fmt = parse_format(spec)
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((6, 70)) * np.exp(rng.uniform(-8, 8, (6, 1)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 3] = 1e-30  # a tiny element beside normal ones
    x[2, 40] = np.nan  # poisons its block only
    x[3, 5] = np.inf
    got = quantize(torch.from_numpy(x), fmt, impl=impl).double().numpy()
    expected = _mx_reference(x, fmt)
    assert_same_values(got, expected, spec)
    B = fmt.block_size
    b0 = 40 // B * B
    assert np.isnan(got[2, b0:b0 + B]).all() and not np.isnan(got[2, :b0]).any()


def test_mx_e4m3_matches_gfloat_block():
    from gfloat import compute_scale_amax, quantize_block
    from gfloat.formats import format_info_mxfp8_e4m3
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(32) * 3).astype(np.float32)
    expected = quantize_block(format_info_mxfp8_e4m3, x.astype(np.float64), compute_scale_amax)
    got = quantize(torch.from_numpy(x), "mxfp8_e4m3")
    assert_same_values(got, expected, "mxfp8_e4m3 vs gfloat")


def test_dynamic_fixed_point_shares_one_exponent():
    x = torch.tensor([[3.0, -0.001, 100.0], [0.5, 7.25, -64.0]])
    got = quantize(x, "dfx<8>")
    # amax 100 -> floor(log2) = 6; int8 emax = 6 -> scale 2**0: integers in [-128, 127]
    assert got.tolist() == [[3.0, -0.0 + 0, 100.0], [0.0, 7.0, -64.0]]
    got10 = quantize(x * 1e-3, "dfx<10>")
    s = 2.0 ** (np.floor(np.log2(0.1)) - 8)
    np.testing.assert_allclose(got10.numpy(), np.clip(np.rint((x * 1e-3).double().numpy() / s),
                                                      -512, 511) * s, rtol=0, atol=0)


def test_dynamic_fixed_point_range_counts_the_negative_end_and_is_idempotent():
    """A most negative value of exactly -2**k fits in two's complement at the smaller range
    (int4 holds -8): dfx<4> of [-8, 3.3] keeps the grid of 1, and rounding again changes nothing,
    in every mode (it once moved the scale up, and stochastic rounding then moved small values)."""
    x = torch.tensor([-8.0, 3.3, 0.5])
    assert quantize(x, "dfx<4>").tolist() == [-8.0, 3.0, 0.0]
    g = torch.Generator().manual_seed(0)
    for mode in ("nearest", "stochastic", "up", "down", "toward_zero"):
        for scale in (1.0, 1e-11, 3e5):
            q = quantize(x * scale, "dfx<2>", mode, generator=g)
            assert_same_values(quantize(q, "dfx<2>", mode, generator=g), q, f"{mode} {scale}")


def test_block_axis_and_scalar():
    x = torch.randn(64, 3)
    along0 = quantize(x, parse_format("block<e2m1fn,32,axis=0>"))
    ref = quantize(x.t().contiguous(), "block<e2m1fn,32>").t()
    assert torch.equal(along0, ref)
    assert quantize(torch.tensor(3.3), "mxfp4").shape == ()


def test_binary():
    x = torch.tensor([0.3, -0.0, 0.0, -2.0, float("nan"), float("inf"), -1e-30])
    got = quantize(x, "binary")
    assert got[:4].tolist() == [1.0, 1.0, 1.0, -1.0]
    assert torch.isnan(got[4]) and got[5] == 1 and got[6] == -1


def test_dtypes_shapes_and_layouts(impl):
    base = torch.randn(6, 8, 5) * 100
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = base.to(dtype)
        got = quantize(x, "e4m3fn", impl=impl)
        assert got.dtype == dtype and got.shape == x.shape and got.device == x.device
        assert_same_values(got, quantize(x.float(), "e4m3fn", impl=impl).to(dtype), str(dtype))
    nc = base.transpose(0, 2)
    assert not nc.is_contiguous()
    assert torch.equal(quantize(nc, "fp16", impl=impl), nc.half().float())
    assert torch.equal(quantize(base[:, ::2], "bf16", impl=impl), base[:, ::2].bfloat16().float())
    empty = torch.empty(0, 3)
    assert quantize(empty, "fp16", impl=impl).shape == (0, 3)
    assert quantize(torch.tensor(1.1), "fp16").shape == ()


def test_kernel_and_torch_paths_give_identical_bits():
    from lowprec.numerics import kernel as _kernel
    if not _kernel.available():
        pytest.skip("kernel not built")
    x = torch.from_numpy(random_f32_patterns(300_000, seed=8))
    for spec in ["fp16", "bf16", "e4m3fn", "e2m1fn", "q2.14", "e5m10-nosub", "mxfp6_e3m2"]:
        for mode in MODES + ["stochastic", "sr4"]:
            g = torch.Generator().manual_seed(11)
            a = quantize(x, spec, mode, generator=g, impl="kernel")
            g = torch.Generator().manual_seed(11)
            b = quantize(x, spec, mode, generator=g, impl="torch")
            assert_same_bits(a, b, f"{spec} {mode}")


def test_input_errors():
    with pytest.raises(TypeError, match="int64"):
        quantize(torch.arange(3), "fp16")
    with pytest.raises(TypeError, match="Tensor"):
        quantize([1.0], "fp16")
    with pytest.raises(ValueError, match="unknown rounding mode 'sideways'"):
        quantize(torch.ones(2), "fp16", "sideways")
    with pytest.raises(ValueError, match="unknown number format 'fp7'"):
        quantize(torch.ones(2), "fp7")
    with pytest.raises(ValueError, match="random_bits"):
        quantize(torch.ones(2), "fp16", "nearest", random_bits=4)


def test_quantize_in_place():
    from lowprec import quantize_
    x = torch.randn(1000) * 1000
    expected = x.half().float()
    y = quantize_(x, "fp16")
    assert y is x and torch.equal(x, expected)
    h = torch.randn(50).half()
    assert torch.equal(quantize_(h, "e5m2"), h.float().to(torch.float8_e5m2).half())


def test_rounding_enum_and_strings_agree():
    from lowprec import Rounding
    x = torch.randn(1000)
    for name, member in [("nearest", Rounding.NEAREST_EVEN), ("rz", Rounding.TOWARD_ZERO),
                         ("up", Rounding.UP), ("down", Rounding.DOWN),
                         ("nearest_away", Rounding.NEAREST_AWAY)]:
        assert torch.equal(quantize(x, "bf16", name), quantize(x, "bf16", member))


def test_values_are_representable_in_format():
    """Whatever the input, every output is in the format's value table (or a special)."""
    x = torch.from_numpy(random_f32_patterns(100_000, seed=9))
    for spec in ["e3m2fn", "e4m3fn", "q4.4", "e5m10-nosub"]:
        fmt = parse_format(spec)
        got = quantize(x, fmt, "stochastic").double().numpy()
        finite = got[np.isfinite(got)]
        pos = np.abs(finite)
        table = fmt.values() if isinstance(fmt, FloatFormat) else np.arange(
            int(-fmt.min / fmt.step) + 1) * fmt.step
        assert np.isin(pos, table).all(), spec
