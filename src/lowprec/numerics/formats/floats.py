"""The float family: ``FloatFormat`` (sign, exponent bits, mantissa bits, a style of special
values) and its grammar, ``eXmY[fn|fnuz][-nosub][-sat|-ovnan|-ovinf]`` with an optional ``fpN_``
width prefix, plus the names of the standards (fp32, fp16, bf16, tf32, fp8/fp6/fp4).

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
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar

import numpy as np

from .base import F32_MAX, F32_MIN_NORMAL_EXP, check_int, parse_enum
from .registry import FormatFamily, bad_format, register_format_family

__all__ = ["Style", "Overflow", "FloatFormat", "FP32", "FP16", "BF16", "TF32", "E4M3FN", "E5M2",
           "FLOAT_FAMILY"]


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


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: sign, ``exp_bits`` exponent bits, ``man_bits`` stored
    mantissa bits.

    ``overflow`` defaults to what the style's standard does: Inf for ``ieee``, NaN for ``fn`` and
    ``fnuz`` formats that have a NaN, and saturation at ``±max`` for those without one.
    """

    #: a static grid (see DynamicFixedFormat.dynamic)
    dynamic: ClassVar[bool] = False

    exp_bits: int
    man_bits: int
    style: Style = Style.IEEE
    subnormals: bool = True
    overflow: Overflow | None = None

    def __post_init__(self) -> None:
        check_int("exp_bits", self.exp_bits, 1, 8, "values are carried in float32")
        check_int("man_bits", self.man_bits, 0, 23, "values are carried in float32")
        style = parse_enum(Style, self.style, "style")
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
            object.__setattr__(self, "overflow", parse_enum(Overflow, self.overflow, "overflow"))
        if self.overflow is Overflow.INF and not self.has_inf:
            raise ValueError(f"overflow='inf' is not possible: {self._base} has no infinity")
        if self.overflow is Overflow.NAN and not self.has_nan:
            raise ValueError(f"overflow='nan' is not possible: {self._base} has no NaN")
        if self.emin < F32_MIN_NORMAL_EXP:
            raise ValueError(
                f"{self._base}: smallest normal 2**{self.emin} is below float32's 2**-126"
            )
        if self.max > F32_MAX:
            raise ValueError(f"{self._base}: max {self.max:g} exceeds float32's {F32_MAX:g}")

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

    def represents(self, value: float) -> bool:
        """Whether the finite number ``value`` is one of the format's values (zero's sign
        aside), from the fields alone: no tensor, no table."""
        a = abs(value)
        if a == 0.0:
            return True
        if a > self.max:
            return False
        if a >= self.min_normal:  # man_bits fraction bits below the leading one
            return (a * 2.0 ** (self.man_bits - (math.frexp(a)[1] - 1))).is_integer()
        return self.subnormals and (a / self.min_subnormal).is_integer()

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


FP32 = FloatFormat(8, 23)
FP16 = FloatFormat(5, 10)
BF16 = FloatFormat(8, 7)
TF32 = FloatFormat(8, 10)
E4M3FN = FloatFormat(4, 3, Style.FN)
E5M2 = FloatFormat(5, 2)

_FLOAT_SHORT_NAMES = {"e8m23": "fp32", "e5m10": "fp16", "e8m7": "bf16", "e8m10": "tf32"}

_FLOAT_RE = re.compile(r"^(?:fp(\d+)_)?e(\d+)m(\d+)(fnuz|fn)?((?:-[a-z]+)*)$")


def _parse_float(m: re.Match, spec: str) -> FloatFormat:
    prefix, e, man = m.group(1), int(m.group(2)), int(m.group(3))
    style, mods = m.group(4) or "ieee", m.group(5)
    # an fpN_ prefix is a claim about the width: sign + exponent + mantissa bits must make N
    if prefix is not None and int(prefix) != 1 + e + man:
        raise bad_format(spec, f"fp{prefix}_ says {prefix} bits but e{e}m{man} has 1 + {e} + {man} = "
                         f"{1 + e + man}")
    kwargs: dict = {}
    seen: set[str] = set()
    for mod in filter(None, mods.split("-")):
        if mod in seen:
            raise bad_format(spec, f"modifier -{mod} given twice")
        seen.add(mod)
        if mod == "nosub":
            kwargs["subnormals"] = False
        elif mod in ("sat", "ovnan", "ovinf"):
            if "overflow" in kwargs:
                raise bad_format(spec, "-sat, -ovnan and -ovinf exclude each other: give one overflow "
                                 "rule")
            kwargs["overflow"] = {"sat": "saturate", "ovnan": "nan", "ovinf": "inf"}[mod]
        else:
            raise bad_format(spec, f"modifier {mod!r} is not one of nosub, sat, ovnan, ovinf")
    try:
        return FloatFormat(e, man, Style(style), **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"number format {spec!r}: {err}") from None


def _parse(s: str, spec: str) -> FloatFormat | None:
    m = _FLOAT_RE.match(s)
    return None if m is None else _parse_float(m, spec)


def _special(fmt: FloatFormat) -> str:
    return ("inf+nan" if fmt.has_inf else ("nan" if fmt.has_nan else "none")) + (
        "" if fmt.has_negative_zero else ", no -0")


FLOAT_FAMILY = register_format_family(FormatFamily(
    "float", (FloatFormat,), _parse,
    accepted="fp32 tf32 fp16 (half) bf16 fp8_e4m3 fp8_e5m2 fp8_e4m3fnuz fp8_e5m2fnuz fp6_e2m3 "
             "fp6_e3m2 fp4_e2m1; eXmY[fn|fnuz][-nosub][-sat|-ovnan] (e.g. e5m10, e4m3fn, "
             "e2m1fn)",
    names={
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
    },
    aliases={
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
    },
    special=_special))
