"""The numeric core: number formats, rounding modes, one exact ``quantize`` (a compiled C kernel
and a plain-torch path that give the same bits), its autograd wrappers and storage sizes.
Nothing here knows about models or training."""

from . import ops  # registers the lowprec::quantize custom op (torch.compile)
from .autograd import Quantizer, quantize_ste
from .formats import (
    BF16,
    FP16,
    FP32,
    BinaryFormat,
    BlockFormat,
    DynamicFixedFormat,
    FixedFormat,
    FloatFormat,
    Format,
    Overflow,
    Style,
    parse_format,
)
from .quantize import quantize, quantize_
from .rounding import Rounding, RoundingSpec, parse_rounding
from .storage import format_bytes, format_of_dtype, storage_dtype

__all__ = [
    "BF16", "FP16", "FP32",
    "BinaryFormat", "BlockFormat", "DynamicFixedFormat", "FixedFormat", "FloatFormat", "Format",
    "Overflow", "Style", "parse_format",
    "Quantizer", "quantize_ste", "quantize", "quantize_",
    "Rounding", "RoundingSpec", "parse_rounding",
    "format_bytes", "format_of_dtype", "storage_dtype",
]
