"""lowprec: reduced-precision neural-network training on PyTorch.

Four layers, data flowing one way: :mod:`lowprec.numerics` (formats, rounding, quantize) ->
:mod:`lowprec.training` (policies, Precision, emulation, optimizers, loss scaling) ->
:mod:`lowprec.analysis` (certificate, ranges, lost updates...) -> :mod:`lowprec.experiments`
(data, models, runner, report) -> :mod:`lowprec.cli`. This module re-exports the public API.
"""

__version__ = "0.1.0"  # first: lowprec.experiments records it with every run

import importlib

# The public API, resolved on first use (PEP 562): importing ``lowprec`` (and so starting the
# ``lowprec`` command) loads nothing heavy, so the command has its signal handlers in place
# before torch is imported, and ``lowprec --help`` answers at once.
_EXPORTS = {
    "Quantizer": "numerics.autograd", "quantize_ste": "numerics.autograd",
    "BinaryFormat": "numerics.formats", "BlockFormat": "numerics.formats",
    "FixedFormat": "numerics.formats", "FloatFormat": "numerics.formats",
    "Overflow": "numerics.formats", "Style": "numerics.formats",
    "parse_format": "numerics.formats",
    "DynamicLossScale": "training.loss_scale", "LossScale": "training.loss_scale",
    "NoLossScale": "training.loss_scale", "StaticLossScale": "training.loss_scale",
    "MemoryLedger": "training.memory",
    "POLICIES": "training.policy", "Policy": "training.policy",
    "parse_policy": "training.policy", "register_policy": "training.policy",
    "Precision": "training.precision",
    "quantize": "numerics.quantize", "quantize_": "numerics.quantize",
    "Rounding": "numerics.rounding", "RoundingSpec": "numerics.rounding",
    "parse_rounding": "numerics.rounding",
    "find_loss_scale": "analysis.scaling",
}
#: sub-modules exported as attributes
_MODULES = {"optim": "training.optim", "binary": "training.regimes.binary",
            "dynamic_fixed": "training.regimes.dynamic_fixed", "analysis": "analysis"}

__all__ = sorted([*_EXPORTS, *_MODULES, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{_MODULES[name]}", __name__)
    else:
        raise AttributeError(f"module 'lowprec' has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted({*globals(), *__all__})
