"""Sums of products in a given order and rounding (csrc/accumulate.c): the GEMM with a rounded
accumulator (``lp_gemm_acc``) and the reference-order dot products (``lp_dot4``)."""

from __future__ import annotations

import ctypes

import torch

from . import library
from .library import LPAccFmt, LPAccGemm

__all__ = ["dot4", "gemm_acc", "gemm_acc_available"]


def gemm_acc_available() -> bool:
    """True when the loaded kernel has the accumulation GEMM."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_gemm_acc")


def _acc_fmt(lim, rounding: int, rmask: int, seed) -> LPAccFmt:
    return LPAccFmt(lim.man, lim.emin, lim.qsub, lim.overflow, int(lim.signed_zero), rounding,
                    lim.maxpos, lim.maxneg, rmask, seed[0], seed[1])


def gemm_acc(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, order: int, chunk: int,
             lim, wide, rounding: int, rmask: int, seed: tuple[int, int]) -> None:
    """``out`` (batch, M, N) contiguous = a (batch, M, K) any strides @ b (batch, K, N)
    contiguous, float32 CPU tensors, accumulated as lp_gemm_acc does."""
    bt, m, k = a.shape
    n = b.shape[2]
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"gemm_acc: {name} must be a float32 CPU tensor, got {t.dtype} on "
                             f"{t.device}")
    if not (b.is_contiguous() and out.is_contiguous()):
        raise ValueError("gemm_acc: b and out must be contiguous")
    g = LPAccGemm(bt, m, n, k, a.stride(0), a.stride(1), a.stride(2), k * n, n, 1, order, chunk)
    fp, fw = _acc_fmt(lim, rounding, rmask, seed), _acc_fmt(wide, 0, 0, (0, 0))
    rc = library.lib().lp_gemm_acc(a.data_ptr(), b.data_ptr(), out.data_ptr(), ctypes.byref(g),
                                   ctypes.byref(fp), ctypes.byref(fw), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"gemm_acc: no memory for the pairwise buffer (K={k})")


def dot4(cols: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: int) -> None:
    """Reference-order dot products (lp_dot4) of contiguous float32 CPU tensors: ``cols``
    N x (groups*K) x L, ``w`` (groups*Cog) x K, into ``out`` N x (groups*Cog) x L."""
    for name, t in (("cols", cols), ("w", w), ("out", out)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"dot4: {name} must be a contiguous float32 CPU tensor, got "
                             f"{t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    n, gk, length = cols.shape
    k = gk // groups
    library.lib().lp_dot4(cols.data_ptr(), w.data_ptr(), out.data_ptr(), n, groups, k, length,
                          w.shape[0] // groups, torch.get_num_threads())
