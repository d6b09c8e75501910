"""ATen's vectorised exp of the 16-bit CPU flash attention (csrc/fexp.c, ``lp_fexp_u20``) and
the emulated attention's fused passes over rows of scores (``lp_attn_*``)."""

from __future__ import annotations

import torch

from . import library

__all__ = ["fexp_available", "fexp_u20", "attention_rows_available", "attn_fwd_rows",
           "attn_bwd_p", "attn_bwd_ds"]


def fexp_available() -> bool:
    """True when the loaded kernel has ``lp_fexp_u20`` (builds since this function)."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_fexp_u20")


def fexp_u20(x: torch.Tensor, out: torch.Tensor) -> None:
    """ATen's vectorised ``fexp_u20`` (lp_fexp_u20) of a contiguous float32 CPU tensor into
    ``out`` (same shape)."""
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"fexp_u20: {name} must be a contiguous float32 CPU tensor, got "
                             f"{t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    if out.shape != x.shape:
        raise ValueError(f"fexp_u20: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    library.lib().lp_fexp_u20(x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())


def attention_rows_available() -> bool:
    """True when the loaded kernel has the ``lp_attn_*`` row passes."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_attn_bwd_ds")


def _rows(name: str, s: torch.Tensor, *per_row: torch.Tensor) -> tuple[int, int, int]:
    """(rows, keys, queries) of contiguous float32 CPU scores [..., L, n], checked, and the
    per-row tensors (one value a row) with them."""
    if s.dtype != torch.float32 or not s.is_contiguous() or s.device.type != "cpu" or \
            s.dim() < 2:
        raise ValueError(f"{name}: scores must be a contiguous float32 CPU tensor [..., L, n], "
                         f"got {s.dtype} {tuple(s.shape)} on {s.device}")
    n, L = s.shape[-1], s.shape[-2]
    rows = s.numel() // n if n else 0
    for t in per_row:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" or \
                t.numel() != rows:
            raise ValueError(f"{name}: a per-row tensor must be contiguous float32 on the CPU "
                             f"with {rows} values, got {t.dtype} {tuple(t.shape)}")
    return rows, n, L


def attn_fwd_rows(s: torch.Tensor, scale: float, causal: bool, nvec: int) -> torch.Tensor:
    """In place on the raw scores q @ k^T: s * scale, masked -inf (causal), each row's max m
    (NaN if it has one, 0 if infinite), fexp_u20(s - m) on each row's first ``nvec`` keys and
    s - m on the rest. Returns m, [..., L, 1]."""
    rows, n, L = _rows("attn_fwd_rows", s)
    m = torch.empty(s.shape[:-1] + (1,), dtype=torch.float32)
    library.lib().lp_attn_fwd_rows(s.data_ptr(), m.data_ptr(), rows, n, max(0, nvec), L, scale,
                                   int(causal), torch.get_num_threads())
    return m


def attn_bwd_p(s: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool) -> None:
    """In place on the raw scores: s * scale - lse where kept; where masked, 0 (NaN where
    -inf - lse is): torch's exp of the result, then :func:`attn_bwd_ds`, give P."""
    rows, n, L = _rows("attn_bwd_p", s, lse)
    library.lib().lp_attn_bwd_p(s.data_ptr(), lse.data_ptr(), rows, n, L, scale, int(causal),
                                torch.get_num_threads())


def attn_bwd_ds(dp: torch.Tensor, p: torch.Tensor, dsum: torch.Tensor, causal: bool) -> None:
    """In place: p zero where masked (NaN kept); dp = (dp - dsum) * p, a row's dsum each."""
    rows, n, L = _rows("attn_bwd_ds", p, dsum)
    if dp.shape != p.shape or not dp.is_contiguous() or dp.dtype != torch.float32:
        raise ValueError(f"attn_bwd_ds: dp must be contiguous float32 of p's shape "
                         f"{tuple(p.shape)}, got {dp.dtype} {tuple(dp.shape)}")
    library.lib().lp_attn_bwd_ds(dp.data_ptr(), p.data_ptr(), dsum.data_ptr(), rows, n, L,
                                 int(causal), torch.get_num_threads())
