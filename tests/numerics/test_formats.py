"""Formats: derived limits against torch.finfo and ml_dtypes.finfo, parsing, validation."""

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec import BinaryFormat, BlockFormat, FixedFormat, FloatFormat, Style, parse_format
from lowprec.numerics.formats import NAMED_FORMATS

# (spec, torch dtype or None, ml_dtypes type or None)
FLOAT_REFS = [
    ("fp32", torch.float32, np.float32),
    ("fp16", torch.float16, np.float16),
    ("bf16", torch.bfloat16, ml_dtypes.bfloat16),
    ("e4m3fn", torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
    ("e5m2", torch.float8_e5m2, ml_dtypes.float8_e5m2),
    ("e4m3fnuz", torch.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
    ("e5m2fnuz", torch.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz),
    ("e4m3", None, ml_dtypes.float8_e4m3),
    ("e3m4", None, ml_dtypes.float8_e3m4),
    ("e2m3fn", None, ml_dtypes.float6_e2m3fn),
    ("e3m2fn", None, ml_dtypes.float6_e3m2fn),
    ("e2m1fn", None, ml_dtypes.float4_e2m1fn),
]


@pytest.mark.parametrize("spec,tdtype,mdtype", FLOAT_REFS, ids=[r[0] for r in FLOAT_REFS])
def test_float_limits_match_finfo(spec, tdtype, mdtype):
    f = parse_format(spec)
    if tdtype is not None:
        fi = torch.finfo(tdtype)
        assert f.max == fi.max
        assert f.min_normal == fi.smallest_normal
        if tdtype is torch.float8_e5m2fnuz:
            # torch 2.13's finfo reports eps 0.125 here, but its own cast shows the spacing
            # above 1.0 is 0.25 (1.125 rounds to 1.0); ml_dtypes agrees with 0.25.
            one_up = torch.tensor([1.0 + f.eps]).to(tdtype).float().item()
            assert one_up == 1.0 + f.eps == 1.25
        else:
            assert f.eps == fi.eps
        assert f.bits == fi.bits
    if mdtype is not None:
        mi = ml_dtypes.finfo(mdtype)
        assert f.max == float(mi.max)
        assert f.min_normal == float(mi.smallest_normal)
        assert f.min_subnormal == float(mi.smallest_subnormal)
        assert f.eps == float(mi.eps)
        assert f.bits == mi.bits


@pytest.mark.parametrize("spec,mdtype", [(r[0], r[2]) for r in FLOAT_REFS[1:]],
                         ids=[r[0] for r in FLOAT_REFS[1:]])
def test_value_table_matches_every_encoding(spec, mdtype):
    """values() equals the set of finite non-negative numbers over all bit patterns."""
    f = parse_format(spec)
    nbits = 16 if mdtype in (np.float16, ml_dtypes.bfloat16) else 8
    codes = np.arange(2**nbits, dtype=np.uint16 if nbits == 16 else np.uint8)
    all_vals = codes.view(mdtype).astype(np.float64)
    expected = np.unique(all_vals[np.isfinite(all_vals) & (all_vals >= 0)])
    np.testing.assert_array_equal(f.values(), expected)


def test_tf32_and_named_values():
    tf32 = parse_format("tf32")
    assert (tf32.exp_bits, tf32.man_bits, tf32.bits) == (8, 10, 19)
    assert tf32.max == (2 - 2**-10) * 2**127
    assert parse_format("fp8_e4m3").max == 448
    assert parse_format("fp8_e4m3fnuz").max == 240
    assert parse_format("fp4_e2m1").values().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert not parse_format("fp6_e2m3").has_nan and parse_format("e4m3fn").has_nan
    assert not parse_format("e4m3fnuz").has_negative_zero


def test_fixed_point_range():
    f = parse_format("fixed<16,14>")
    assert f == FixedFormat(2, 14) == parse_format("q2.14")
    assert f.bits == 16 and f.step == 2**-14
    assert f.max == 2 - 2**-14 and f.min == -2
    u = parse_format("ufixed<8,4>")
    assert (u.min, u.max, u.signed) == (0.0, 16 - 1 / 16, False)
    assert FixedFormat(2, 6, symmetric=True).min == -(2 - 1 / 64)
    assert parse_format("int8") == FixedFormat(8, 0)


def test_block_formats():
    mx = parse_format("mxfp8_e4m3")
    assert isinstance(mx, BlockFormat) and mx.block_size == 32
    assert mx.element.max == 448 and mx.element.emax == 8
    assert mx.element.overflow.value == "saturate"
    assert parse_format("mxfp4").element.emax == 2
    assert parse_format("mxint8").element.emax == 0  # OCP MX v1.0: MXINT8 emax 0
    assert parse_format("mxfp8_e5m2").element.emax == 15
    assert parse_format("mxfp6_e3m2").element.emax == 4 and parse_format("mxfp6_e2m3").element.emax == 2
    dfx = parse_format("dfx<10>")
    assert dfx.block_size is None and dfx.element == FixedFormat(10, 0)
    assert parse_format("dfx10") == dfx
    assert mx.bits == 8 + 8 / 32


SPECS = ("fp32 fp16 half bf16 tf32 e5m10 e4m3fn e5m2 fp8_e4m3 fp8_e5m2 fp6_e2m3 fp6_e3m2 fp4_e2m1 "
         "fixed<16,14> q2.14 mxfp8_e4m3 mxfp4 binary e3m4 e6m9 e2m1fn e4m3fnuz e5m10-nosub "
         "e4m3fn-sat e5m2-ovnan uq4.4 q2.6-sym int<12> dfx<12> block<e3m2fn,16> "
         "block<bf16,tensor> block<q4.4,8,axis=0> mxint8 mxfp6_e3m2").split()


@pytest.mark.parametrize("spec", SPECS)
def test_parse_str_round_trip(spec):
    f = parse_format(spec)
    assert parse_format(str(f)) == f
    assert str(parse_format(str(f))) == str(f)
    assert parse_format(spec.upper()) == f


@pytest.mark.parametrize("name", list(NAMED_FORMATS))
def test_named_formats_round_trip(name):
    f = NAMED_FORMATS[name]
    assert parse_format(name) == f
    assert parse_format(str(f)) == f


def test_canonical_names():
    assert str(FloatFormat(5, 10)) == "fp16"
    assert str(FloatFormat(4, 3, Style.FN)) == "e4m3fn"
    assert str(FloatFormat(4, 3, Style.FN, overflow="saturate")) == "e4m3fn-sat"
    assert str(FloatFormat(5, 10, subnormals=False)) == "e5m10-nosub"
    assert str(parse_format("fixed<16,14>")) == "q2.14"
    assert str(BinaryFormat()) == "binary"
    assert str(parse_format("mxfp4_e2m1")) == "mxfp4"


@pytest.mark.parametrize("bad", ["fp17", "e9m3", "e5m30", "q40.10", "fixed<30,9>", "block<binary,4>",
                                 "e4m3fn-wobble", "", "mx", "e1m3"])
def test_bad_spec_names_value_and_accepted_forms(bad):
    with pytest.raises(ValueError) as err:
        parse_format(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    if "unknown number format" in msg:
        assert "accepted" in msg and "eXmY" in msg


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="exp_bits"):
        FloatFormat(9, 3)
    with pytest.raises(ValueError, match="man_bits"):
        FloatFormat(5, 24)
    with pytest.raises(TypeError, match="exp_bits"):
        FloatFormat(5.0, 10)
    with pytest.raises(ValueError, match="overflow"):
        FloatFormat(4, 3, Style.FN, overflow="inf")
    with pytest.raises(ValueError, match="overflow"):
        FloatFormat(2, 1, Style.FN, overflow="nan")  # fp4 has no NaN
    with pytest.raises(ValueError, match="style"):
        FloatFormat(4, 3, "fnord")
    with pytest.raises(ValueError, match="word length"):
        FixedFormat(20, 10)
    with pytest.raises(ValueError, match="block_size"):
        BlockFormat(FixedFormat(8, 0), 0)
    with pytest.raises(TypeError, match="element"):
        BlockFormat(BinaryFormat())
    with pytest.raises(ValueError, match="max"):
        FloatFormat(8, 3, Style.FN)  # beyond float32's range


def test_formats_are_frozen_and_hashable():
    f = parse_format("fp16")
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.exp_bits = 4
    assert len({parse_format(s) for s in ["fp16", "half", "e5m10", "float16"]}) == 1


@pytest.mark.parametrize("bad,why", [
    ("fp8_e5m10", "fp8_ says 8 bits but e5m10 has 1 + 5 + 10 = 16"),
    ("fp99_e5m2", "fp99_ says 99 bits but e5m2 has 1 + 5 + 2 = 8"),
    ("e5 m2", "no spaces"),
    ("fixed<16, 14>", "no spaces"),
    ("fp 16", "no spaces"),
    ("e4m3-sat-ovnan", "exclude each other"),
    ("e5m2-ovinf-sat", "exclude each other"),
    ("e5m10-nosub-nosub", "-nosub given twice"),
    ("e4m3fn-sat-sat", "-sat given twice"),
])
def test_strict_spec_errors_are_one_line_with_spec_and_accepted_forms(bad, why):
    with pytest.raises(ValueError) as err:
        parse_format(bad)
    msg = str(err.value)
    assert repr(bad) in msg and why in msg and "accepted" in msg and "eXmY" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("spec,expected", [
    ("fp16_e5m10", FloatFormat(5, 10)),
    ("fp8_e4m3fn", FloatFormat(4, 3, Style.FN)),
    ("fp8_e5m2-sat", FloatFormat(5, 2, overflow="saturate")),
    ("  e5m2  ", FloatFormat(5, 2)),  # surrounding spaces are not inside the spec
    ("e4m3fn-nosub-sat", FloatFormat(4, 3, Style.FN, subnormals=False, overflow="saturate")),
])
def test_prefix_agreeing_with_the_bit_count_is_accepted(spec, expected):
    assert parse_format(spec) == expected


@pytest.mark.parametrize("bad,why", [
    ("dfxp<10,overflow=0.01,overflow=0.02>", "dfxp option overflow given twice"),
    ("dfxp<10,interval=2,interval=3>", "dfxp option interval given twice"),
    ("dfxp<10,interval=1_0>", "'1_0' is not an integer"),
    ("block<e4m3,32,axis=0,axis=1>", "block option axis given twice"),
    ("block<e4m3,32,scale=-2..2,scale=-3..3>", "block option scale given twice"),
    ("block<e4m3,32,axis=1_0>", "'1_0' is not an integer"),
])
def test_format_options_given_twice_or_not_decimal_are_refused(bad, why):
    """dfxp<10,interval=2,interval=3> used to take the last value silently."""
    with pytest.raises(ValueError) as err:
        parse_format(bad)
    msg = str(err.value)
    assert repr(bad) in msg and why in msg and "\n" not in msg


@pytest.mark.parametrize("spec", ["e4m3fn", "e5m2", "e2m1", "e3m2", "e4m3fnuz", "e3m2-nosub",
                                  "fp16", "q6.10", "q2.6", "q4.4-sym", "uq3.5"])
def test_represents_holds_exactly_the_enumerated_values(spec):
    """``represents`` (from the fields alone) is true on every value ``values()`` lists, with
    either sign where the format is signed, and false halfway between neighbours and beyond."""
    import numpy as np

    fmt = parse_format(spec)
    vals = fmt.values()
    assert all(fmt.represents(float(v)) for v in vals)
    mids = (vals[1:] + vals[:-1]) / 2
    assert not any(fmt.represents(float(m)) for m in mids)
    assert not fmt.represents(float(vals[-1]) * 2 + 1)
    signed = getattr(fmt, "signed", True)
    if signed:
        neg = [-float(v) for v in vals if v and -float(v) >= getattr(fmt, "min", -np.inf)]
        assert all(fmt.represents(v) for v in neg)
