"""The binary family: ``BinaryFormat``, sign only (BinaryNet), named ``binary``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .registry import FormatFamily, register_format_family

__all__ = ["BinaryFormat", "BINARY_FAMILY"]


@dataclass(frozen=True)
class BinaryFormat:
    """Sign only: +1 or -1, with 0 mapped to +1 (BinaryNet, Courbariaux, Hubara et al. 2016)."""

    #: a static grid (see DynamicFixedFormat.dynamic)
    dynamic: ClassVar[bool] = False

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


BINARY_FAMILY = register_format_family(FormatFamily(
    "binary", (BinaryFormat,), lambda s, spec: None, accepted="binary",
    names={"binary": BinaryFormat()}, aliases={"bin": BinaryFormat(), "sign": BinaryFormat()},
    special=lambda fmt: "±1"))
