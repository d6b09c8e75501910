"""``lowprec.optim``: the optimizers, importable as ``from lowprec.optim import Adam``.

A thin public facade over :mod:`lowprec.training.optim`, where the optimizers live (the training
layer); the names here are the same objects. See that package for the storage rules
(``nearest``, ``stochastic``, ``kahan`` write-back) and :class:`FormatOptimizer` for wrapping
any torch optimizer.
"""

from __future__ import annotations

from .training.optim import (
    SGD,
    Adam,
    AdamW,
    FormatOptimizer,
    LowPrecisionOptimizer,
    OptimizerPrecisionWarning,
    PolicyOptimizer,
    Storage,
)

__all__ = ["SGD", "Adam", "AdamW", "FormatOptimizer", "LowPrecisionOptimizer", "PolicyOptimizer",
           "Storage", "OptimizerPrecisionWarning"]
