"""Storage sizes and dtypes of formats: how a tensor in a format is held and what it costs.

Real fp32/fp16/bf16 tensors hold values of those formats; any other format is held on a float32
carrier (its values lie on the format's grid). ``format_bytes`` is what the format itself would
take in memory (block formats include their shared scales), used by the memory ledger.
"""

from __future__ import annotations

import math

import torch

from .formats import BF16, FP16, FP32, BlockFormat, Format

__all__ = ["storage_dtype", "format_of_dtype", "format_bytes", "NATIVE_DTYPES"]

NATIVE_DTYPES = {FP32: torch.float32, FP16: torch.float16, BF16: torch.bfloat16}


def storage_dtype(fmt: Format) -> torch.dtype:
    """The torch dtype a tensor in ``fmt`` is stored in (float32 carrier for other formats)."""
    return NATIVE_DTYPES.get(fmt, torch.float32)


def format_of_dtype(dtype: torch.dtype) -> Format:
    for fmt, dt in NATIVE_DTYPES.items():
        if dt == dtype:
            return fmt
    raise TypeError(f"no lowprec format for dtype {dtype}")


def format_bytes(fmt: Format, numel: int) -> int:
    """Bytes that ``numel`` values take in ``fmt`` (block formats include their scales)."""
    if isinstance(fmt, BlockFormat):
        elem_bits = numel * fmt.element.bits
        blocks = 1 if fmt.block_size is None else math.ceil(numel / fmt.block_size)
        return math.ceil(elem_bits / 8) + blocks
    return math.ceil(numel * fmt.bits / 8)
