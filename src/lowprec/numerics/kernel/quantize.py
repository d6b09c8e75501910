"""Elementwise rounding of float32 tensors (csrc/quantize.c): ``lp_quantize_f32``, the
batched transpose ``lp_quantize_f32_bt`` and the rounding that counts the non-finite values it
writes ``lp_quantize_f32_nonfinite``."""

from __future__ import annotations

import ctypes

import torch

from ..params import ElementParams
from . import library
from .library import LPParams

__all__ = ["quantize_f32", "quantize_prepared", "quantize_transposed", "transposed_available",
           "nonfinite_available", "quantize_prepared_nonfinite"]


def quantize_prepared(x: torch.Tensor, out: torch.Tensor, prm: LPParams) -> None:
    """:func:`quantize_f32` with parameters from :func:`~.library.prepare`: contiguous float32
    CPU ``x`` and ``out`` of its size (unchecked: the caller checked)."""
    library.lib().lp_quantize_f32(x.data_ptr(), out.data_ptr(), x.numel(), ctypes.byref(prm),
                                  torch.get_num_threads())


def quantize_f32(x: torch.Tensor, out: torch.Tensor, ep: ElementParams, rounding: int,
                 rmask: int, seed: tuple[int, int]) -> None:
    """Quantize the contiguous float32 CPU tensor ``x`` into ``out`` (which may be ``x``)."""
    quantize_prepared(x, out, library.params(ep, rounding, rmask, seed))


def transposed_available() -> bool:
    """True when the loaded kernel rounds a batched transpose in logical order."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_quantize_f32_bt")


def quantize_transposed(x: torch.Tensor, out: torch.Tensor, batch: int, rows: int, cols: int,
                        prm: LPParams) -> None:
    """Round ``x``, contiguous float32 (batch, rows, cols) in memory, whose logical tensor is
    (batch, cols, rows), into ``out`` of the same layout: each element with the random bits of
    its logical row-major index (lp_quantize_f32_bt; a channels-last activation: rows = H*W,
    cols = C). Below 2**32 elements (unchecked: the caller checked)."""
    library.lib().lp_quantize_f32_bt(x.data_ptr(), out.data_ptr(), batch, rows, cols,
                                     ctypes.byref(prm), torch.get_num_threads())


def nonfinite_available() -> bool:
    """True when the loaded kernel has the rounding that counts non-finite values."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_quantize_f32_nonfinite")


def quantize_prepared_nonfinite(x: torch.Tensor, out: torch.Tensor, prm: LPParams) -> int:
    """:func:`quantize_prepared`, returning how many of the values it wrote are Inf or NaN
    (one pass: each chunk counted while it is in cache)."""
    return library.lib().lp_quantize_f32_nonfinite(x.data_ptr(), out.data_ptr(), x.numel(),
                                                   ctypes.byref(prm), torch.get_num_threads())
