"""Scaled casts (csrc/block.c): MX blocks' scale exponents and blocked rounding, and dynamic
fixed point's overflow counts."""

from __future__ import annotations

import ctypes

import torch

from ..params import ElementParams
from . import library

__all__ = ["block_shifts", "block_shifts_available", "count_abs_ge", "quantize_blocks_f32"]


def block_shifts_available() -> bool:
    """True when the loaded kernel computes MX block scale exponents (lp_block_shifts_f32)."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_block_shifts_f32")


def block_shifts(x: torch.Tensor, block: int, emax: int, smin: int, smax: int) -> torch.Tensor:
    """The scale exponent of every block of the contiguous float32 CPU matrix ``x`` (rows,
    row_len), blocks of ``block`` along each row: int32 (rows, ceil(row_len / block))."""
    rows, row_len = x.shape
    out = torch.empty(rows, -(-row_len // block), dtype=torch.int32)
    library.lib().lp_block_shifts_f32(x.data_ptr(), out.data_ptr(), rows, row_len, block, emax,
                                      smin, smax, torch.get_num_threads())
    return out


def quantize_blocks_f32(x: torch.Tensor, out: torch.Tensor, row_len: int, block: int,
                        shifts: torch.Tensor, ep: ElementParams, rounding: int, rmask: int,
                        seed: tuple[int, int]) -> None:
    """Blocked variant: ``shifts`` (int32, contiguous) holds one scale exponent per block."""
    prm = library.params(ep, rounding, rmask, seed)
    rows = x.numel() // row_len
    library.lib().lp_quantize_blocks_f32(x.data_ptr(), out.data_ptr(), rows, row_len, block,
                                         shifts.data_ptr(), ctypes.byref(prm),
                                         torch.get_num_threads())


def count_abs_ge(x: torch.Tensor, t1: float, t2: float) -> tuple[int, int]:
    """(#|x| >= t1, #|x| >= t2) of a contiguous float32 CPU tensor, in one pass."""
    out = (ctypes.c_int64 * 2)()
    library.lib().lp_count_abs_ge(x.data_ptr(), x.numel(), t1, t2, out, torch.get_num_threads())
    return int(out[0]), int(out[1])
