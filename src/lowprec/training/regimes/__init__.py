"""Regimes of the literature that need more than formats: BinaryNet (a model transformation) and
dynamic fixed point (ranges that move with overflow rates)."""

from . import binary, dynamic_fixed

__all__ = ["binary", "dynamic_fixed"]
