"""Storage sizes and dtypes of formats: how a tensor in a format is held and what it costs.

Real fp32/fp16/bf16 tensors hold values of those formats; any other format is held on a float32
carrier (its values lie on the format's grid). ``format_bytes`` is what the format itself would
take in memory (block formats include their shared scales), used by the memory ledger.

Files are another matter: a checkpoint holds what a native run would store. ``file_dtype`` is the
narrowest torch dtype whose values include every value of a format (fp16 for fp16, the float8
dtypes for fp8, float8_e4m3fn for fp6 and fp4 too), and ``compact`` converts a carrier to it
when every bit survives the round trip (NaN as NaN); formats torch has no dtype for (fixed
point, tf32, MX blocks) stay float32.
"""

from __future__ import annotations

import math

import torch

from .formats import BF16, FP16, FP32, BlockFormat, FloatFormat, Format, Style, as_format

__all__ = ["storage_dtype", "format_of_dtype", "format_bytes", "file_dtype", "compact",
           "NATIVE_DTYPES"]

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


# torch's floating dtypes as formats, narrowest first: file_dtype takes the first that holds a
# format. The float8 dtypes are the OCP / AMD layouts (torch.float8_e4m3fn: no Inf, one NaN, max
# 448; *_fnuz: no -0, bias one larger), as numerics/formats.py defines the same names.
_FILE_DTYPES = (
    (FloatFormat(4, 3, Style.FN), torch.float8_e4m3fn),
    (FloatFormat(5, 2), torch.float8_e5m2),
    (FloatFormat(4, 3, Style.FNUZ), torch.float8_e4m3fnuz),
    (FloatFormat(5, 2, Style.FNUZ), torch.float8_e5m2fnuz),
    (FP16, torch.float16),
    (BF16, torch.bfloat16),
    (FP32, torch.float32),
)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _holds(big: FloatFormat, small: FloatFormat) -> bool:
    """Whether every value of ``small`` (specials included) is a value of ``big``: no more
    mantissa bits, no larger max, and a smallest quantum (2**(emin - man), the spacing of the
    lowest binade and of the subnormals) that is a multiple of ``big``'s."""
    return (small.man_bits <= big.man_bits and small.max <= big.max
            and small.emin - small.man_bits >= big.emin - big.man_bits
            and (big.has_inf or not small.has_inf) and (big.has_nan or not small.has_nan)
            and (big.has_negative_zero or not small.has_negative_zero))


def file_dtype(fmt: str | Format) -> torch.dtype | None:
    """The narrowest torch dtype holding every value of ``fmt`` exactly (``torch.float16`` for
    fp16 and its -nosub/-sat variants, ``torch.float8_e5m2`` for e5m2, ``torch.float8_e4m3fn``
    for e4m3fn and the fp6/fp4 formats); None for formats that are not a float format of at
    most 32 bits (fixed point, blocks, dynamic fixed point, binary)."""
    fmt = as_format(fmt)
    if not isinstance(fmt, FloatFormat):
        return None
    for big, dtype in _FILE_DTYPES:
        if _holds(big, fmt):
            return dtype
    return None


def compact(t: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """``t`` in :func:`file_dtype` of ``fmt`` when that dtype is narrower than ``t``'s and the
    conversion keeps every value bit for bit (-0 and Inf included, NaN as NaN); ``t`` itself
    otherwise (a value off the format's grid, an Inf the dtype has no code for). Converting the
    result back to ``t.dtype`` gives ``t`` exactly."""
    dtype = file_dtype(fmt)
    if (dtype is None or not torch.is_tensor(t) or not t.is_floating_point()
            or t.element_size() <= dtype.itemsize or t.element_size() not in _INT_OF_SIZE):
        return t
    small = t.detach().to(dtype)
    back = small.to(t.dtype)
    ints = _INT_OF_SIZE[t.element_size()]
    nan = torch.isnan(t)
    if not torch.equal(nan, torch.isnan(back)):
        return t
    same = (back.view(ints) == t.detach().view(ints)) | nan
    return small if bool(same.all()) else t
