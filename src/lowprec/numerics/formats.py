"""Number formats: frozen dataclasses that validate themselves and derive their limits.

Every format answers the same questions (``max``, ``min_normal``, ``min_subnormal``, ``eps``,
``bits``) from its fields, never from a hand-kept table, and prints as the short string that
:func:`parse_format` reads back (``str(FloatFormat(5, 10)) == "fp16"``, ``parse_format("e5m10")``).

Values are always *carried* in float32 (or a wider torch dtype), so every format here must be
a subset of float32: at most 8 exponent bits, 23 mantissa bits, 24 significant bits of fixed point.

Float styles (the bit layouts of the standards):

* ``ieee``: IEEE 754 binary formats. The all-ones exponent holds Inf and NaN; fp32, fp16 (e5m10),
  bf16 (e8m7), tf32 (e8m10), fp8 e5m2.
* ``fn`` ("finite", the OCP 8-bit and MX names, as in ml_dtypes): no Inf. Formats of 8 bits or
  more keep a single NaN encoding, S.1111.111 (OCP FP8 E4M3: max 448); narrower ones (OCP FP6
  E2M3 and E3M2, FP4 E2M1) have no NaN at all and every encoding is a finite number.
* ``fnuz``: no Inf, no negative zero; the pattern of -0 is the only NaN and the bias is one
  larger (e4m3fnuz: max 240). Used by AMD and Graphcore hardware.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Union

import numpy as np

__all__ = [
    "Style",
    "Overflow",
    "FloatFormat",
    "FixedFormat",
    "BlockFormat",
    "BinaryFormat",
    "DynamicFixedFormat",
    "Format",
    "parse_format",
    "as_format",
    "describe",
    "NAMED_FORMATS",
    "FP32",
    "FP16",
    "BF16",
    "TF32",
    "E4M3FN",
    "E5M2",
]

_F32_MAX = float(np.finfo(np.float32).max)
_F32_MIN_SUBNORMAL_EXP = -149  # 2**-149 is the smallest float32 subnormal
_F32_MIN_NORMAL_EXP = -126


class Style(str, Enum):
    """Bit layout of the special values of a float format (see the module docstring)."""

    IEEE = "ieee"
    FN = "fn"
    FNUZ = "fnuz"


class Overflow(str, Enum):
    """What a finite value beyond ``max`` becomes after rounding away from zero."""

    INF = "inf"
    NAN = "nan"
    SATURATE = "saturate"


def _enum(cls, value, what: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        accepted = ", ".join(m.value for m in cls)
        raise ValueError(f"{what}={value!r} is not valid; accepted: {accepted}") from None


def _check_int(name: str, value, lo: int, hi: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        extra = f" ({why})" if why else ""
        raise ValueError(f"{name}={value} is out of range [{lo}, {hi}]{extra}")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign, ``exp_bits`` exponent bits, ``man_bits`` stored
    mantissa bits.

    ``overflow`` defaults to what the style's standard does: Inf for ``ieee``, NaN for ``fn`` and
    ``fnuz`` formats that have a NaN, and saturation at ``±max`` for those without one.
    """

    exp_bits: int
    man_bits: int
    style: Style = Style.IEEE
    subnormals: bool = True
    overflow: Overflow | None = None

    def __post_init__(self) -> None:
        _check_int("exp_bits", self.exp_bits, 1, 8, "values are carried in float32")
        _check_int("man_bits", self.man_bits, 0, 23, "values are carried in float32")
        style = _enum(Style, self.style, "style")
        object.__setattr__(self, "style", style)
        if not isinstance(self.subnormals, bool):
            raise TypeError(f"subnormals must be a bool, got {self.subnormals!r}")
        if style is Style.IEEE and self.exp_bits < 2:
            raise ValueError(
                f"exp_bits={self.exp_bits}: an IEEE-style format needs at least 2 exponent bits "
                "(the all-ones exponent is reserved for Inf/NaN)"
            )
        if style is Style.FN and self.bits >= 8 and self.man_bits < 1:
            raise ValueError(
                f"man_bits={self.man_bits}: an 8-bit or wider 'fn' format needs a mantissa bit "
                "(its NaN is the all-ones mantissa of the top binade)"
            )
        if self.overflow is None:
            default = (
                Overflow.INF
                if self.has_inf
                else (Overflow.NAN if self.has_nan else Overflow.SATURATE)
            )
            object.__setattr__(self, "overflow", default)
        else:
            object.__setattr__(self, "overflow", _enum(Overflow, self.overflow, "overflow"))
        if self.overflow is Overflow.INF and not self.has_inf:
            raise ValueError(f"overflow='inf' is not possible: {self._base} has no infinity")
        if self.overflow is Overflow.NAN and not self.has_nan:
            raise ValueError(f"overflow='nan' is not possible: {self._base} has no NaN")
        if self.emin < _F32_MIN_NORMAL_EXP:
            raise ValueError(
                f"{self._base}: smallest normal 2**{self.emin} is below float32's 2**-126"
            )
        if self.max > _F32_MAX:
            raise ValueError(f"{self._base}: max {self.max:g} exceeds float32's {_F32_MAX:g}")

    # -- derived fields --------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        b = 2 ** (self.exp_bits - 1) - 1
        return b + 1 if self.style is Style.FNUZ else b

    @property
    def has_inf(self) -> bool:
        return self.style is Style.IEEE

    @property
    def has_nan(self) -> bool:
        if self.style is Style.FN:
            return self.bits >= 8
        return True

    @property
    def has_negative_zero(self) -> bool:
        return self.style is not Style.FNUZ

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest binade that holds finite numbers."""
        top = 2**self.exp_bits - 1  # all-ones exponent field
        return (top - 1 if self.style is Style.IEEE else top) - self.bias

    @property
    def max(self) -> float:
        m = self.man_bits
        if self.style is Style.FN and self.has_nan:
            # S.1111.111 is NaN, so the top binade loses its last code (OCP FP8 E4M3: 448)
            return (2.0 - 2.0 ** (1 - m)) * 2.0**self.emax
        return (2.0 - 2.0**-m) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal when subnormals are off)."""
        return 2.0 ** (self.emin - self.man_bits) if self.subnormals else self.min_normal

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return 2.0**-self.man_bits

    def values(self) -> np.ndarray:
        """Every finite non-negative value of the format, ascending, as float64."""
        m = self.man_bits
        mant = np.arange(2**m, dtype=np.float64)
        parts = []
        if self.subnormals:
            parts.append(mant * 2.0 ** (self.emin - m))
        else:
            parts.append(np.zeros(1))
        for e in range(self.emin, self.emax + 1):
            parts.append((2.0**m + mant) * 2.0 ** (e - m))
        vals = np.concatenate(parts)
        return np.unique(vals[vals <= self.max])

    @property
    def _base(self) -> str:
        suffix = "" if self.style is Style.IEEE else self.style.value
        return f"e{self.exp_bits}m{self.man_bits}{suffix}"

    def __str__(self) -> str:
        base = self._base
        default = replace(self, overflow=None, subnormals=True)
        if base in _FLOAT_SHORT_NAMES and self == default:
            return _FLOAT_SHORT_NAMES[base]
        mods = []
        if not self.subnormals:
            mods.append("nosub")
        if self.overflow is not default.overflow:
            mods.append({Overflow.SATURATE: "sat", Overflow.NAN: "ovnan", Overflow.INF: "ovinf"}[
                self.overflow
            ])
        return "-".join([base, *mods])


@dataclass(frozen=True)
class FixedFormat:
    """Two's complement fixed point <IL, FL> of Gupta et al. (2015): word length IL + FL bits,
    the sign included in IL; values k * 2**-FL in [-2**(IL-1), 2**(IL-1) - 2**-FL]; rounding
    saturates at both ends. ``signed=False`` gives [0, 2**IL - 2**-FL]; ``symmetric=True`` drops
    the most negative code (the OCP MXINT8 element range is symmetric).
    """

    int_bits: int
    frac_bits: int
    signed: bool = True
    symmetric: bool = False

    def __post_init__(self) -> None:
        _check_int("frac_bits", self.frac_bits, 0, 149, "the step 2**-FL must be a float32")
        # IL may be zero or negative: <-5, 15> holds k * 2**-15 in [-2**-6, 2**-6), the small
        # ranges dynamic fixed point gives to weights and gradients
        _check_int("int_bits", self.int_bits, -126, 128)
        word = self.int_bits + self.frac_bits
        top = 25 if self.signed else 24
        if not (2 if self.signed else 1) <= word <= top:
            raise ValueError(
                f"word length {word} = int_bits {self.int_bits} + frac_bits {self.frac_bits} "
                f"must be in [{2 if self.signed else 1}, {top}]: float32 carries 24 significant bits"
            )
        if self.max > _F32_MAX:
            raise ValueError(f"{self!s}: max exceeds float32's range")
        if self.symmetric and not self.signed:
            raise ValueError("symmetric=True needs signed=True")

    @property
    def bits(self) -> int:
        return self.int_bits + self.frac_bits

    @property
    def step(self) -> float:
        return 2.0**-self.frac_bits

    @property
    def max(self) -> float:
        il = self.int_bits - 1 if self.signed else self.int_bits
        return 2.0**il - self.step

    @property
    def min(self) -> float:
        """Most negative value (0 when unsigned)."""
        if not self.signed:
            return 0.0
        return -self.max if self.symmetric else -(2.0 ** (self.int_bits - 1))

    @property
    def min_normal(self) -> float:
        return self.step

    @property
    def min_subnormal(self) -> float:
        return self.step

    @property
    def eps(self) -> float:
        return self.step

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (used for block scales)."""
        return math.floor(math.log2(self.max))

    def values(self) -> np.ndarray:
        """Every non-negative value, ascending, as float64."""
        n = round(self.max / self.step)
        return np.arange(n + 1, dtype=np.float64) * self.step

    def __str__(self) -> str:
        s = f"{'' if self.signed else 'u'}q{self.int_bits}.{self.frac_bits}"
        return s + "-sym" if self.symmetric else s


@dataclass(frozen=True)
class BlockFormat:
    """Elements in ``element`` sharing one power-of-two scale per block.

    ``block_size`` consecutive elements along ``axis`` share the scale 2**s with
    s = floor(log2(amax)) - element.emax, clamped to the E8M0 range [-127, 127]
    (OCP Microscaling Formats v1.0, section 6.3). Elements saturate at the element's max; a block
    holding a NaN or an Inf becomes all NaN (its E8M0 scale is NaN). ``block_size=None`` shares
    one exponent across the whole tensor: the dynamic fixed point of Courbariaux et al. (2014)
    with an integer element.
    """

    element: FloatFormat | FixedFormat
    block_size: int | None = 32
    axis: int = -1
    scale_min_exp: int = -127
    scale_max_exp: int = 127

    def __post_init__(self) -> None:
        if not isinstance(self.element, (FloatFormat, FixedFormat)):
            raise TypeError(f"element must be a FloatFormat or FixedFormat, got {self.element!r}")
        if isinstance(self.element, FloatFormat) and self.element.overflow is not Overflow.SATURATE:
            object.__setattr__(self, "element", replace(self.element, overflow=Overflow.SATURATE))
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1, 2**31)
        _check_int("axis", self.axis, -64, 63)
        _check_int("scale_min_exp", self.scale_min_exp, -127, 127)
        _check_int("scale_max_exp", self.scale_max_exp, self.scale_min_exp, 127)

    @property
    def bits(self) -> float:
        """Storage bits per element, the shared 8-bit scale included."""
        if self.block_size is None:
            return float(self.element.bits)
        return self.element.bits + 8 / self.block_size

    @property
    def max(self) -> float:
        return self.element.max * 2.0**self.scale_max_exp

    @property
    def min_normal(self) -> float:
        return self.element.min_normal * 2.0**self.scale_min_exp

    @property
    def min_subnormal(self) -> float:
        return self.element.min_subnormal * 2.0**self.scale_min_exp

    @property
    def eps(self) -> float:
        return self.element.eps

    def __str__(self) -> str:
        for name, fmt in _BLOCK_NAMES.items():
            if fmt == self:
                return name
        if (
            self.block_size is None
            and isinstance(self.element, FixedFormat)
            and self.element.frac_bits == 0
            and self.element.signed
            and not self.element.symmetric
            and (self.axis, self.scale_min_exp, self.scale_max_exp) == (-1, -127, 127)
        ):
            return f"dfx<{self.element.int_bits}>"
        size = "tensor" if self.block_size is None else str(self.block_size)
        extra = "" if self.axis == -1 else f",axis={self.axis}"
        if (self.scale_min_exp, self.scale_max_exp) != (-127, 127):
            extra += f",scale={self.scale_min_exp}..{self.scale_max_exp}"
        return f"block<{self.element},{size}{extra}>"


@dataclass(frozen=True)
class DynamicFixedFormat:
    """Dynamic fixed point as trained by Courbariaux, Bengio and David (2014): ``bits``-bit
    two's complement words (sign included) whose radix point, the *range* r (values in
    [-2**r, 2**r)), is shared by a group of tensors and moves during training.

    The range update of their code: every ``interval`` observations of a group, with r the
    fraction of values overflowing the current range and r1 the fraction that would overflow
    range - 1: if r > ``max_overflow`` the range grows by one; else if r1 > ``max_overflow`` it
    stays; else it shrinks by one. The state lives in :class:`lowprec.training.regimes.dynamic_fixed.Controller`
    (Precision keeps one per run); each observation rounds with the range it starts with.
    """

    bits: int
    max_overflow: float = 1e-4
    interval: int = 1

    def __post_init__(self) -> None:
        _check_int("bits", self.bits, 2, 25, "float32 carries 24 significant bits")
        _check_int("interval", self.interval, 1, 10**9)
        if not 0 < self.max_overflow < 1:
            raise ValueError(f"max_overflow={self.max_overflow!r} must be in (0, 1)")

    def at_range(self, r: int) -> "FixedFormat":
        """The static fixed-point format of range r: <r + 1, bits - r - 1>."""
        return FixedFormat(r + 1, self.bits - r - 1)

    @property
    def max(self) -> float:
        return float("nan")  # depends on the range

    min_normal = min_subnormal = eps = max

    def __str__(self) -> str:
        opts = ""
        if self.max_overflow != 1e-4:
            opts += f",overflow={self.max_overflow:g}"
        if self.interval != 1:
            opts += f",interval={self.interval}"
        return f"dfxp<{self.bits}{opts}>"


@dataclass(frozen=True)
class BinaryFormat:
    """Sign only: +1 or -1, with 0 mapped to +1 (BinaryNet, Courbariaux, Hubara et al. 2016)."""

    bits: int = field(default=1, init=False)

    @property
    def max(self) -> float:
        return 1.0

    @property
    def min_normal(self) -> float:
        return 1.0

    @property
    def min_subnormal(self) -> float:
        return 1.0

    @property
    def eps(self) -> float:
        return 2.0

    def __str__(self) -> str:
        return "binary"


Format = Union[FloatFormat, FixedFormat, BlockFormat, BinaryFormat, DynamicFixedFormat]

FP32 = FloatFormat(8, 23)
FP16 = FloatFormat(5, 10)
BF16 = FloatFormat(8, 7)
TF32 = FloatFormat(8, 10)
E4M3FN = FloatFormat(4, 3, Style.FN)
E5M2 = FloatFormat(5, 2)

_FLOAT_SHORT_NAMES = {"e8m23": "fp32", "e5m10": "fp16", "e8m7": "bf16", "e8m10": "tf32"}

_MX_ELEMENTS = {
    "mxfp8_e4m3": FloatFormat(4, 3, Style.FN),
    "mxfp8_e5m2": FloatFormat(5, 2),
    "mxfp6_e2m3": FloatFormat(2, 3, Style.FN),
    "mxfp6_e3m2": FloatFormat(3, 2, Style.FN),
    "mxfp4": FloatFormat(2, 1, Style.FN),
    # MXINT8: 8-bit two's complement with an implicit 2**-6, range kept symmetric as in the
    # reference implementation (microsoft/microxcaling: max_norm 127/64 for int8, emax 0)
    "mxint8": FixedFormat(2, 6, symmetric=True),
}
_BLOCK_NAMES = {name: BlockFormat(elem, 32) for name, elem in _MX_ELEMENTS.items()}

#: The formats with a name of their own, in table order (``lowprec formats`` prints these).
NAMED_FORMATS: dict[str, Format] = {
    "fp32": FP32,
    "tf32": TF32,
    "fp16": FP16,
    "bf16": BF16,
    "fp8_e5m2": E5M2,
    "fp8_e4m3": E4M3FN,
    "fp8_e4m3fnuz": FloatFormat(4, 3, Style.FNUZ),
    "fp8_e5m2fnuz": FloatFormat(5, 2, Style.FNUZ),
    "fp6_e3m2": FloatFormat(3, 2, Style.FN),
    "fp6_e2m3": FloatFormat(2, 3, Style.FN),
    "fp4_e2m1": FloatFormat(2, 1, Style.FN),
    "q2.14": FixedFormat(2, 14),
    "q8.8": FixedFormat(8, 8),
    **_BLOCK_NAMES,
    "dfx<10>": BlockFormat(FixedFormat(10, 0), None),
    "binary": BinaryFormat(),
}

_ALIASES: dict[str, Format] = {
    **NAMED_FORMATS,
    "float32": FP32,
    "single": FP32,
    "float16": FP16,
    "half": FP16,
    "bfloat16": BF16,
    "fp8_e4m3fn": E4M3FN,
    "fp6_e2m3fn": FloatFormat(2, 3, Style.FN),
    "fp6_e3m2fn": FloatFormat(3, 2, Style.FN),
    "fp4": FloatFormat(2, 1, Style.FN),
    "fp4_e2m1fn": FloatFormat(2, 1, Style.FN),
    "mxfp4_e2m1": _BLOCK_NAMES["mxfp4"],
    "bin": BinaryFormat(),
    "sign": BinaryFormat(),
}

_ACCEPTED = (
    "fp32 tf32 fp16 (half) bf16 fp8_e4m3 fp8_e5m2 fp8_e4m3fnuz fp8_e5m2fnuz fp6_e2m3 fp6_e3m2 "
    "fp4_e2m1; eXmY[fn|fnuz][-nosub][-sat|-ovnan] (e.g. e5m10, e4m3fn, e2m1fn); "
    "qIL.FL, uqIL.FL, fixed<WL,FL>, ufixed<WL,FL>, int<N>; mxfp8_e4m3 mxfp8_e5m2 mxfp6_e2m3 "
    "mxfp6_e3m2 mxfp4 mxint8; block<ELEMENT,N|tensor>; dfx<N> (one exponent per tensor); "
    "dfxp<N[,overflow=R,interval=K]> (dynamic fixed point with the range-update rule); binary"
)

_FLOAT_RE = re.compile(r"^(?:fp(\d+)_)?e(\d+)m(\d+)(fnuz|fn)?((?:-[a-z]+)*)$")
_Q_RE = re.compile(r"^(u?)q(-?\d+)\.(\d+)(-sym)?$")
_FIXED_RE = re.compile(r"^(u?)fixed<(\d+),(\d+)>$")
_INT_RE = re.compile(r"^int<?(\d+)>?$")
_DFX_RE = re.compile(r"^dfx<?(\d+)>?$")
_DFXP_RE = re.compile(r"^dfxp<(\d+)((?:,[a-z_]+=[^,>]+)*)>$")
_BLOCK_RE = re.compile(r"^block<(.+),(\d+|tensor)((?:,[a-z_]+=[^,]+)*)>$")


_INT_TEXT = re.compile(r"^[+-]?\d+$", re.ASCII)
_FLOAT_TEXT = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?$", re.ASCII)


def _decimal(val: str, spec: str, integer: bool = False) -> str:
    """``val`` if it is a plain ASCII decimal (int() and float() also take "1_0" and
    non-ASCII digits, which a format spec refuses)."""
    if not (_INT_TEXT if integer else _FLOAT_TEXT).match(val.strip()):
        raise _bad(spec, f"{val!r} is not {'an integer' if integer else 'a number'}")
    return val


def _bad(spec: object, why: str = "") -> ValueError:
    reason = f" ({why})" if why else ""
    return ValueError(f"unknown number format {spec!r}{reason}; accepted: {_ACCEPTED}")


def _parse_float(m: re.Match, spec: str) -> FloatFormat:
    prefix, e, man = m.group(1), int(m.group(2)), int(m.group(3))
    style, mods = m.group(4) or "ieee", m.group(5)
    # an fpN_ prefix is a claim about the width: sign + exponent + mantissa bits must make N
    if prefix is not None and int(prefix) != 1 + e + man:
        raise _bad(spec, f"fp{prefix}_ says {prefix} bits but e{e}m{man} has 1 + {e} + {man} = "
                         f"{1 + e + man}")
    kwargs: dict = {}
    seen: set[str] = set()
    for mod in filter(None, mods.split("-")):
        if mod in seen:
            raise _bad(spec, f"modifier -{mod} given twice")
        seen.add(mod)
        if mod == "nosub":
            kwargs["subnormals"] = False
        elif mod in ("sat", "ovnan", "ovinf"):
            if "overflow" in kwargs:
                raise _bad(spec, "-sat, -ovnan and -ovinf exclude each other: give one overflow "
                                 "rule")
            kwargs["overflow"] = {"sat": "saturate", "ovnan": "nan", "ovinf": "inf"}[mod]
        else:
            raise _bad(spec, f"modifier {mod!r} is not one of nosub, sat, ovnan, ovinf")
    try:
        return FloatFormat(e, man, Style(style), **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"number format {spec!r}: {err}") from None


def parse_format(spec: str | Format) -> Format:
    """Read a format from its short string (case-insensitive); formats pass through.

    >>> parse_format("e5m10") == parse_format("half")
    True
    >>> str(parse_format("fixed<16,14>"))
    'q2.14'
    """
    if isinstance(spec, (FloatFormat, FixedFormat, BlockFormat, BinaryFormat, DynamicFixedFormat)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a format spec must be a str or a format object, got {spec!r}")
    s = spec.strip().lower()
    if any(ch.isspace() for ch in s):
        raise _bad(spec, "no spaces inside a format spec")
    if s in _ALIASES:
        return _ALIASES[s]
    try:
        if m := _FLOAT_RE.match(s):
            return _parse_float(m, spec)
        if m := _Q_RE.match(s):
            return FixedFormat(int(m.group(2)), int(m.group(3)), not m.group(1), bool(m.group(4)))
        if m := _FIXED_RE.match(s):
            word, frac = int(m.group(2)), int(m.group(3))
            return FixedFormat(word - frac, frac, signed=not m.group(1))
        if m := _INT_RE.match(s):
            return FixedFormat(int(m.group(1)), 0)
        if m := _DFXP_RE.match(s):
            kwargs = {}
            for item in filter(None, m.group(2).split(",")):
                key, val = item.split("=", 1)
                if key in ("overflow", "interval") and ("max_overflow" if key == "overflow"
                                                       else key) in kwargs:
                    raise _bad(spec, f"dfxp option {key} given twice")
                if key == "overflow":
                    kwargs["max_overflow"] = float(_decimal(val, spec))
                elif key == "interval":
                    kwargs["interval"] = int(_decimal(val, spec, integer=True))
                else:
                    raise _bad(spec, f"dfxp option {item!r} is not overflow=R or interval=N")
            return DynamicFixedFormat(int(m.group(1)), **kwargs)
        if m := _DFX_RE.match(s):
            return BlockFormat(FixedFormat(int(m.group(1)), 0), None)
        if m := _BLOCK_RE.match(s):
            elem = parse_format(m.group(1))
            if not isinstance(elem, (FloatFormat, FixedFormat)):
                raise _bad(spec, "a block element must be a float or fixed-point format")
            size = None if m.group(2) == "tensor" else int(m.group(2))
            kwargs: dict = {}
            seen: set[str] = set()
            for item in filter(None, m.group(3).split(",")):
                key, val = item.split("=", 1)
                if key in ("axis", "scale") and key in seen:
                    raise _bad(spec, f"block option {key} given twice")
                seen.add(key)
                if key == "axis":
                    kwargs["axis"] = int(_decimal(val, spec, integer=True))
                elif key == "scale" and ".." in val:
                    lo, hi = val.split("..")
                    kwargs["scale_min_exp"], kwargs["scale_max_exp"] = (
                        int(_decimal(lo, spec, integer=True)), int(_decimal(hi, spec, integer=True)))
                else:
                    raise _bad(spec, f"block option {item!r} is not axis=N or scale=LO..HI")
            return BlockFormat(elem, size, **kwargs)
    except (TypeError, ValueError) as err:
        if str(err).startswith("unknown number format") or str(err).startswith("number format"):
            raise
        raise ValueError(f"number format {spec!r}: {err}") from None
    raise _bad(spec)


def as_format(spec: str | Format) -> Format:
    """Alias of :func:`parse_format`, for call sites that accept either form."""
    return parse_format(spec)


def describe(fmt: Format) -> dict:
    """One row of the formats table: bits and limits, as numbers (``lowprec formats`` prints it)."""
    kind = type(fmt).__name__.replace("Format", "").lower()
    row = {"format": str(fmt), "kind": kind, "bits": fmt.bits, "max": fmt.max,
           "min_normal": fmt.min_normal, "min_subnormal": fmt.min_subnormal, "eps": fmt.eps}
    if isinstance(fmt, FloatFormat):
        row["special"] = ("inf+nan" if fmt.has_inf else ("nan" if fmt.has_nan else "none")) + (
            "" if fmt.has_negative_zero else ", no -0")
    elif isinstance(fmt, BlockFormat):
        size = "tensor" if fmt.block_size is None else fmt.block_size
        row["special"] = f"{fmt.element} x {size}, E8M0 scale"
    else:
        row["special"] = "saturates" if isinstance(fmt, FixedFormat) else "±1"
    return row
