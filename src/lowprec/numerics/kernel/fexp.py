"""ATen's vectorised exp of the 16-bit CPU flash attention (csrc/fexp.c, ``lp_fexp_u20``)."""

from __future__ import annotations

import torch

from . import library

__all__ = ["fexp_available", "fexp_u20"]


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
