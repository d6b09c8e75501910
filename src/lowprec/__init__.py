"""lowprec: reduced-precision neural-network training on PyTorch.

Four layers, data flowing one way: :mod:`lowprec.numerics` (formats, rounding, quantize) ->
:mod:`lowprec.training` (policies, Precision, emulation, optimizers, loss scaling) ->
:mod:`lowprec.analysis` (certificate, ranges, lost updates...) -> :mod:`lowprec.experiments`
(data, models, runner, report) -> :mod:`lowprec.cli`. This module re-exports the public API.
"""

from typing import Any

__version__ = "0.1.0"  # first: lowprec.experiments records it with every run

from .numerics.autograd import Quantizer, quantize_ste
from .numerics.formats import (
    BinaryFormat,
    BlockFormat,
    FixedFormat,
    FloatFormat,
    Overflow,
    Style,
    parse_format,
)
from .training.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale
from .training.memory import MemoryLedger
from .training.policy import POLICIES, Policy, parse_policy, register_policy
from .training.precision import Precision
from .training.plan import Plan
from .numerics.quantize import quantize, quantize_
from .numerics.rounding import Rounding, RoundingSpec, parse_rounding
from . import optim  # lowprec/optim.py: the optimizers' public module
from .training.regimes import binary, dynamic_fixed
from . import analysis
from .analysis.scaling import find_loss_scale

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "MemoryLedger",
    "NoLossScale",
    "POLICIES",
    "Policy",
    "Precision",
    "Plan",
    "plan",
    "results",
    "StaticLossScale",
    "find_loss_scale",
    "optim",
    "analysis",
    "binary",
    "dynamic_fixed",
    "parse_policy",
    "register_policy",
    "BinaryFormat",
    "BlockFormat",
    "FixedFormat",
    "FloatFormat",
    "Overflow",
    "Quantizer",
    "Rounding",
    "RoundingSpec",
    "Style",
    "parse_format",
    "parse_rounding",
    "quantize",
    "quantize_",
    "quantize_ste",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """``lowprec.plan``: :func:`lowprec.experiments.planner.plan`, and ``lowprec.results``: the
    results API, imported on first use (the experiments layer is not loaded by ``import
    lowprec``)."""
    if name == "plan":
        from .experiments.planner import plan

        return plan
    if name == "results":
        import importlib

        return importlib.import_module(".results", __name__)
    raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
