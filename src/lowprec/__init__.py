"""lowprec: reduced-precision neural-network training on PyTorch.

Number formats (:mod:`lowprec.formats`), rounding modes (:class:`Rounding`), one exact quantization
function (:func:`quantize`) and its autograd wrappers (:class:`Quantizer`, :func:`quantize_ste`).
"""

from .autograd import Quantizer, quantize_ste
from .formats import (
    BinaryFormat,
    BlockFormat,
    FixedFormat,
    FloatFormat,
    Overflow,
    Style,
    parse_format,
)
from .loss_scale import (
    DynamicLossScale,
    LossScale,
    NoLossScale,
    StaticLossScale,
    find_loss_scale,
)
from .memory import MemoryLedger
from .policy import POLICIES, Policy, parse_policy, register_policy
from .precision import Precision
from .quantize import quantize, quantize_
from .rounding import Rounding, parse_rounding
from . import optim

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "MemoryLedger",
    "NoLossScale",
    "POLICIES",
    "Policy",
    "Precision",
    "StaticLossScale",
    "find_loss_scale",
    "optim",
    "parse_policy",
    "register_policy",
    "BinaryFormat",
    "BlockFormat",
    "FixedFormat",
    "FloatFormat",
    "Overflow",
    "Quantizer",
    "Rounding",
    "Style",
    "parse_format",
    "parse_rounding",
    "quantize",
    "quantize_",
    "quantize_ste",
    "__version__",
]
