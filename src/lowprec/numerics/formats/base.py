"""What every format family shares: float32's limits (values are carried in float32, so every
format is a subset of it) and the checks a frozen format dataclass runs in ``__post_init__``."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["F32_MAX", "F32_MIN_SUBNORMAL_EXP", "F32_MIN_NORMAL_EXP", "check_int", "parse_enum",
           "is_decimal"]

F32_MAX = float(np.finfo(np.float32).max)
F32_MIN_SUBNORMAL_EXP = -149  # 2**-149 is the smallest float32 subnormal
F32_MIN_NORMAL_EXP = -126


def parse_enum(cls, value, what: str):
    """``value`` as a member of the str Enum ``cls``; ValueError naming the accepted values."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        accepted = ", ".join(m.value for m in cls)
        raise ValueError(f"{what}={value!r} is not valid; accepted: {accepted}") from None


def check_int(name: str, value, lo: int, hi: int, why: str = "") -> None:
    """TypeError unless ``value`` is an int, ValueError unless lo <= value <= hi."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        extra = f" ({why})" if why else ""
        raise ValueError(f"{name}={value} is out of range [{lo}, {hi}]{extra}")


_INT_TEXT = re.compile(r"^[+-]?\d+$", re.ASCII)
_FLOAT_TEXT = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?$", re.ASCII)


def is_decimal(val: str, integer: bool = False) -> bool:
    """Whether ``val`` is a plain ASCII decimal (int() and float() also take "1_0" and
    non-ASCII digits, which a format spec refuses)."""
    return bool((_INT_TEXT if integer else _FLOAT_TEXT).match(val.strip()))
