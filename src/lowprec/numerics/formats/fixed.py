"""The fixed-point family: ``FixedFormat`` <IL, FL> and its grammar, ``qIL.FL[-sym]``,
``uqIL.FL``, ``fixed<WL,FL>``, ``ufixed<WL,FL>`` and ``int<N>``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import F32_MAX, check_int
from .registry import FormatFamily, register_format_family

__all__ = ["FixedFormat", "FIXED_FAMILY"]


@dataclass(frozen=True)
class FixedFormat:
    """Two's complement fixed point <IL, FL> of Gupta et al. (2015): word length IL + FL bits,
    the sign included in IL; values k * 2**-FL in [-2**(IL-1), 2**(IL-1) - 2**-FL]; rounding
    saturates at both ends. ``signed=False`` gives [0, 2**IL - 2**-FL]; ``symmetric=True`` drops
    the most negative code (the OCP MXINT8 element range is symmetric).
    """

    #: a static grid (see DynamicFixedFormat.dynamic)
    dynamic: ClassVar[bool] = False

    int_bits: int
    frac_bits: int
    signed: bool = True
    symmetric: bool = False

    def __post_init__(self) -> None:
        check_int("frac_bits", self.frac_bits, 0, 149, "the step 2**-FL must be a float32")
        # IL may be zero or negative: <-5, 15> holds k * 2**-15 in [-2**-6, 2**-6), the small
        # ranges dynamic fixed point gives to weights and gradients
        check_int("int_bits", self.int_bits, -126, 128)
        word = self.int_bits + self.frac_bits
        top = 25 if self.signed else 24
        if not (2 if self.signed else 1) <= word <= top:
            raise ValueError(
                f"word length {word} = int_bits {self.int_bits} + frac_bits {self.frac_bits} "
                f"must be in [{2 if self.signed else 1}, {top}]: float32 carries 24 significant bits"
            )
        if self.max > F32_MAX:
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

    def represents(self, value: float) -> bool:
        """Whether the finite number ``value`` is one of the format's values, from the fields
        alone: a multiple of the step within [min, max]."""
        return self.min <= value <= self.max and (value / self.step).is_integer()

    def values(self) -> np.ndarray:
        """Every non-negative value, ascending, as float64."""
        n = round(self.max / self.step)
        return np.arange(n + 1, dtype=np.float64) * self.step

    def __str__(self) -> str:
        s = f"{'' if self.signed else 'u'}q{self.int_bits}.{self.frac_bits}"
        return s + "-sym" if self.symmetric else s


_Q_RE = re.compile(r"^(u?)q(-?\d+)\.(\d+)(-sym)?$")
_FIXED_RE = re.compile(r"^(u?)fixed<(\d+),(\d+)>$")
_INT_RE = re.compile(r"^int<?(\d+)>?$")


def _parse(s: str, spec: str) -> FixedFormat | None:
    if m := _Q_RE.match(s):
        return FixedFormat(int(m.group(2)), int(m.group(3)), not m.group(1), bool(m.group(4)))
    if m := _FIXED_RE.match(s):
        word, frac = int(m.group(2)), int(m.group(3))
        return FixedFormat(word - frac, frac, signed=not m.group(1))
    if m := _INT_RE.match(s):
        return FixedFormat(int(m.group(1)), 0)
    return None


FIXED_FAMILY = register_format_family(FormatFamily(
    "fixed", (FixedFormat,), _parse,
    accepted="qIL.FL, uqIL.FL, fixed<WL,FL>, ufixed<WL,FL>, int<N>",
    names={"q2.14": FixedFormat(2, 14), "q8.8": FixedFormat(8, 8)},
    special=lambda fmt: "saturates"))
