"""Experiments on real data: configuration and presets, data sets that ship offline, models,
the runner (every policy x seed, resumable), the results database and the report."""

from .config import DEFAULT_POLICIES, PRESETS, CompareConfig, RunError
from .compare import run_compare

__all__ = ["CompareConfig", "DEFAULT_POLICIES", "PRESETS", "RunError", "run_compare"]
