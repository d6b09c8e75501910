"""Sums of products in a given order and rounding (csrc/accumulate.c): the GEMM with a rounded
accumulator (``lp_gemm_acc``), the reference-order dot products (``lp_dot4``) and per-channel
sums in the order of ATen's batch-norm statistics (``lp_channel_sums``: channels-last,
``lp_plane_sums``: contiguous)."""

from __future__ import annotations

import ctypes

import torch

from . import library
from .library import LPAccFmt, LPAccGemm

__all__ = ["channel_sums", "dot4", "gemm_acc", "gemm_acc_available", "plane_sums", "sums",
           "sums_take"]


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


def _sums_fit(x: torch.Tensor, dims: int, mean: torch.Tensor | None) -> bool:
    """Whether ``x`` (``dims``-d, contiguous float32 on the CPU) and ``mean`` (None, or one
    float32 value a channel, dimension 1 of ``x``) are what the per-channel sums take."""
    ok = x.dim() == dims and x.dtype == torch.float32 and x.device.type == "cpu" and \
        x.is_contiguous()
    return ok and (mean is None or (mean.dtype == torch.float32 and mean.is_contiguous() and
                                    mean.device.type == "cpu" and mean.shape == (x.shape[1],)))


def sums_take(kind: str, x: torch.Tensor, arg: int, mean: torch.Tensor | None = None) -> bool:
    """Whether :func:`channel_sums` (``kind`` "channel", ``arg`` parts) or :func:`plane_sums`
    ("plane", ``arg`` lanes) takes ``x`` and ``mean``, decided from their dtype, device, shape
    and layout only (so that a trace decides it on fake tensors)."""
    lib = library.lib()
    name, dims, ok = ("lp_channel_sums", 2, arg >= 1) if kind == "channel" else \
        ("lp_plane_sums", 3, 1 <= arg <= 32)
    return ok and lib is not None and hasattr(lib, name) and _sums_fit(x, dims, mean)


def channel_sums(x: torch.Tensor, parts: int, mean: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
    """Per-channel float32 sums of ``x`` (rows, C), contiguous float32 on the CPU, in the order
    of ATen's channels-last batch-norm statistics for a 16-bit input: ``parts`` chunks of
    ceil(rows / parts) rows (its threads), each summed row by row from zero, the partials then
    added in chunk order; with ``mean`` (C,), the squared deviations ``(x - mean)**2`` as
    fused multiply-adds. None where the loaded kernel lacks ``lp_channel_sums`` or the tensors
    do not fit (the caller then uses torch ops)."""
    if not sums_take("channel", x, parts, mean):
        return None
    rows, c = x.shape
    out = torch.empty(c, dtype=torch.float32)
    buf = torch.empty(parts * c, dtype=torch.float32)
    library.lib().lp_channel_sums(x.data_ptr(), rows, c,
                                  None if mean is None else mean.data_ptr(), parts,
                                  buf.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def plane_sums(x: torch.Tensor, lanes: int, mean: torch.Tensor | None = None
               ) -> torch.Tensor | None:
    """Per-channel float32 sums of ``x`` (batch, C, HW), contiguous float32 on the CPU, in the
    order of ATen's contiguous batch-norm statistics for a 16-bit input: per channel, runs of
    2 * ``lanes`` values into ``lanes`` partials, each plane's remainder into a scalar sum, the
    partials folded in lane order into it; with ``mean`` (C,), the squared deviations (each a
    product, then a sum). None where the loaded kernel lacks ``lp_plane_sums`` or the tensors
    do not fit (the caller then uses torch ops)."""
    if not sums_take("plane", x, lanes, mean):
        return None
    batch, c, hw = x.shape
    out = torch.empty(c, dtype=torch.float32)
    library.lib().lp_plane_sums(x.data_ptr(), batch, c, hw, lanes,
                                None if mean is None else mean.data_ptr(), out.data_ptr(),
                                torch.get_num_threads())
    return out


def sums(kind: str, x: torch.Tensor, arg: int, mean: torch.Tensor | None = None
         ) -> torch.Tensor | None:
    """:func:`channel_sums` (``kind`` "channel", ``arg`` parts) or :func:`plane_sums` ("plane",
    ``arg`` lanes)."""
    return (channel_sums if kind == "channel" else plane_sums)(x, arg, mean)
