"""Emulated precision at the operator level: see :mod:`.engine` and docs/design.md."""

from .engine import Emulation, Rule, emulated, group_key, op_name
from .oplists import FP32_OPS, GRID_OPS, LOWP_OPS

__all__ = ["Emulation", "Rule", "emulated", "group_key", "op_name", "LOWP_OPS", "FP32_OPS",
           "GRID_OPS"]
