"""Optimizers for low-precision parameters: fp32 arithmetic per parameter, low-precision storage.

Parameters, optimizer state and optional master weights live in the formats a policy gives
(real fp16/bf16 tensors, or fp32 tensors holding values on another format's grid when
emulated). Each update is computed in fp32 with the same tensor operations as torch.optim (so
with fp32 formats the results equal torch's bit for bit) and written back with:

* ``nearest``: round to nearest even. Small updates are lost: w + Δw rounds back to w when
  |Δw| < ulp(w) / 2 (the thread's "updates that should be different become equal").
* ``stochastic``: round up with probability proportional to the distance, so E[w'] = w + Δw and
  small updates survive on average (Gupta et al. 2015; torchao's bf16 stochastic rounding, for
  any format here).
* ``kahan``: compensated summation (Kahan 1965; Zamirai et al. 2020): a buffer c in the parameter
  format keeps what rounding dropped and adds it back at the next step.

All state (moments, master weights, compensation buffers, step counts) is in ``state_dict``.
:class:`FormatOptimizer` gives any torch optimizer the same storage rules.
"""

from __future__ import annotations

from .adam import Adam, AdamW
from .base import LowPrecisionOptimizer
from .protocol import PolicyOptimizer
from .sgd import SGD
from .torch_adam import OptimizerPrecisionWarning
from .wrapper import FormatOptimizer
from .writeback import Storage

__all__ = ["SGD", "Adam", "AdamW", "FormatOptimizer", "LowPrecisionOptimizer", "PolicyOptimizer",
           "Storage", "OptimizerPrecisionWarning"]
