"""The integer description of an element format that both quantization paths consume.

See ``csrc/lp_common.h`` for the meaning of each field; this module is the only place that turns a
format object into those numbers, so the compiled kernel and the plain-torch reference path
cannot disagree about a format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

from .formats import FixedFormat, FloatFormat, Overflow
from .rounding import RULES, Rounding

__all__ = ["ElementParams", "element_params", "ROUNDING_CODES", "OVERFLOW_CODES", "f32_bits",
           "NAN_SHIFT", "FIXED_BEMIN", "R_NEAREST_EVEN", "R_NEAREST_AWAY", "R_TOWARD_ZERO",
           "R_UP", "R_DOWN", "R_STOCHASTIC"]

# the rounding codes every quantization path takes (rounding.RULES; R_* in csrc/lp_common.h)
ROUNDING_CODES = {mode: rule.code for mode, rule in RULES.items()}
R_NEAREST_EVEN, R_NEAREST_AWAY, R_TOWARD_ZERO, R_UP, R_DOWN, R_STOCHASTIC = (
    ROUNDING_CODES[m] for m in (Rounding.NEAREST_EVEN, Rounding.NEAREST_AWAY, Rounding.TOWARD_ZERO,
                                Rounding.UP, Rounding.DOWN, Rounding.STOCHASTIC))
OVERFLOW_CODES = {Overflow.INF: 0, Overflow.NAN: 1, Overflow.SATURATE: 2}
NAN_SHIFT = 1000  # per-block shift marking a NaN scale (LP_NAN_SHIFT in the kernel)
FIXED_BEMIN = 1 << 20  # fixed point has no normal range: every value uses the fixed quantum


def f32_bits(value: float) -> int:
    """The float32 bit pattern of ``value`` (which must be exactly representable)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        raise ValueError(f"{value!r} is not a float32 value")
    return bits


@dataclass(frozen=True)
class ElementParams:
    man: int
    bemin: int
    qsub: int
    overflow: int
    signed_zero: int
    maxpos: int
    maxneg: int


@lru_cache(maxsize=None)
def element_params(fmt: FloatFormat | FixedFormat) -> ElementParams:
    if isinstance(fmt, FloatFormat):
        return ElementParams(
            man=fmt.man_bits,
            bemin=fmt.emin + 127,
            qsub=(fmt.emin - fmt.man_bits) if fmt.subnormals else fmt.emin,
            overflow=OVERFLOW_CODES[fmt.overflow],
            signed_zero=int(fmt.has_negative_zero),
            maxpos=f32_bits(fmt.max),
            maxneg=f32_bits(fmt.max),
        )
    if isinstance(fmt, FixedFormat):
        return ElementParams(
            man=0,
            bemin=FIXED_BEMIN,
            qsub=-fmt.frac_bits,
            overflow=OVERFLOW_CODES[Overflow.SATURATE],
            signed_zero=0,
            maxpos=f32_bits(fmt.max),
            maxneg=f32_bits(abs(fmt.min)),
        )
    raise TypeError(f"no element parameters for {fmt!r}")


def random_mask(random_bits: int) -> int:
    """Mask of the top ``random_bits`` bits of a 32-bit word (0 for deterministic modes)."""
    if random_bits <= 0:
        return 0
    return (0xFFFFFFFF << (32 - random_bits)) & 0xFFFFFFFF
