"""The fused optimizer step on low-precision storage (csrc/optimizer.c, ``lp_opt_step``)."""

from __future__ import annotations

import ctypes

import torch

from ..params import R_STOCHASTIC, ElementParams, random_mask
from . import library
from .library import LPOpt

__all__ = ["opt_dtype_code", "opt_step"]

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # DT_* in optimizer.c


def opt_dtype_code(dtype: torch.dtype) -> int | None:
    """The kernel's code of a storage dtype, None for one it does not read."""
    return _DT.get(dtype)


_PREPARED: dict = {}  # (element parameters, deterministic rounding) -> the kernel's parameters

#: whether SGD steps whole vectors in one loop where the kernel can (float32 carriers of float16
#: or bfloat16 values, a CPU with AVX2, FMA and F16C: ``sgd_f32_fast``); False: its tiles, the
#: same bits (the tests compare the two in one build)
ONE_LOOP = True


def _prepared(ep: ElementParams, rounding: int):
    """A deterministic rounding's kernel parameters, built once (the kernel only reads them)."""
    prm = _PREPARED.get((ep, rounding))
    if prm is None:
        prm = _PREPARED[(ep, rounding)] = library.prepare(ep, rounding, 0)
    return prm


def opt_step(p, g, s1, s2, opt: LPOpt, pq: ElementParams, p_rounding: int, seed,
             sq: ElementParams) -> None:
    """Fused optimizer step on CPU tensors laid out alike over dense memory, read in memory
    order (see lp_opt_step in csrc/optimizer.c)."""
    if p_rounding == R_STOCHASTIC:
        pp = library.params(pq, p_rounding, random_mask(32), seed)
    else:
        pp = _prepared(pq, p_rounding)
    sp = _prepared(sq, 0)
    opt.tiles_only = 0 if ONE_LOOP else 1
    dummy = p.data_ptr()
    library.lib().lp_opt_step(p.data_ptr(), g.data_ptr(),
                              s1.data_ptr() if s1 is not None else dummy,
                              s2.data_ptr() if s2 is not None else dummy, p.numel(),
                              ctypes.byref(opt), ctypes.byref(pp), ctypes.byref(sp),
                              torch.get_num_threads())
