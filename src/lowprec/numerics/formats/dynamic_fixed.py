"""The dynamic fixed-point family: ``DynamicFixedFormat`` (Courbariaux, Bengio and David
2014), fixed-point words whose radix point moves during training, and its grammar,
``dfxp<N[,overflow=R,interval=K]>``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from .base import check_int
from .fixed import FixedFormat
from .registry import FormatFamily, bad_format, decimal, register_format_family

__all__ = ["DynamicFixedFormat", "DYNAMIC_FIXED_FAMILY"]


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

    #: True: the grid of a tensor is chosen while training, per group of tensors, by whoever
    #: resolves the format (the dynamic_fixed regime of lowprec.training); every format class
    #: has this flag, False for a static grid
    dynamic: ClassVar[bool] = True

    bits: int
    max_overflow: float = 1e-4
    interval: int = 1

    def __post_init__(self) -> None:
        check_int("bits", self.bits, 2, 25, "float32 carries 24 significant bits")
        check_int("interval", self.interval, 1, 10**9)
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


_DFXP_RE = re.compile(r"^dfxp<(\d+)((?:,[a-z_]+=[^,>]+)*)>$")


def _parse(s: str, spec: str) -> DynamicFixedFormat | None:
    if m := _DFXP_RE.match(s):
        kwargs = {}
        for item in filter(None, m.group(2).split(",")):
            key, val = item.split("=", 1)
            if key in ("overflow", "interval") and ("max_overflow" if key == "overflow"
                                                   else key) in kwargs:
                raise bad_format(spec, f"dfxp option {key} given twice")
            if key == "overflow":
                kwargs["max_overflow"] = float(decimal(val, spec))
            elif key == "interval":
                kwargs["interval"] = int(decimal(val, spec, integer=True))
            else:
                raise bad_format(spec, f"dfxp option {item!r} is not overflow=R or interval=N")
        return DynamicFixedFormat(int(m.group(1)), **kwargs)
    return None


DYNAMIC_FIXED_FAMILY = register_format_family(FormatFamily(
    "dynamic_fixed", (DynamicFixedFormat,), _parse,
    accepted="dfxp<N[,overflow=R,interval=K]> (dynamic fixed point with the range-update rule)"))
