"""ctypes binding of the compiled kernel ``_qkernel`` (built by setup.py at install time).

``available()`` says whether it loaded; ``LOWPREC_KERNEL=0`` in the environment disables it, and
lowprec then uses the plain-torch path, which gives the same bits.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import lru_cache

import torch

from ._params import ElementParams

__all__ = ["available", "quantize_f32", "quantize_blocks_f32", "LPParams"]


class LPParams(ctypes.Structure):
    _fields_ = [
        ("man", ctypes.c_int32),
        ("bemin", ctypes.c_int32),
        ("qsub", ctypes.c_int32),
        ("overflow", ctypes.c_int32),
        ("signed_zero", ctypes.c_int32),
        ("rounding", ctypes.c_int32),
        ("maxpos", ctypes.c_uint32),
        ("maxneg", ctypes.c_uint32),
        ("rmask", ctypes.c_uint32),
        ("k0", ctypes.c_uint32),
        ("k1", ctypes.c_uint32),
    ]


@lru_cache(maxsize=1)
def _lib():
    if os.environ.get("LOWPREC_KERNEL", "1") == "0":
        return None
    spec = importlib.util.find_spec("lowprec._qkernel")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError:
        return None
    if lib.lp_abi_version() != 1:
        return None
    p = ctypes.c_void_p
    lib.lp_quantize_f32.argtypes = [p, p, ctypes.c_int64, ctypes.POINTER(LPParams), ctypes.c_int]
    lib.lp_quantize_f32.restype = None
    lib.lp_quantize_blocks_f32.argtypes = [
        p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, ctypes.POINTER(LPParams),
        ctypes.c_int,
    ]
    lib.lp_quantize_blocks_f32.restype = None
    return lib


def available() -> bool:
    """True when the compiled kernel is loaded (and not disabled by LOWPREC_KERNEL=0)."""
    return _lib() is not None


def _params(ep: ElementParams, rounding: int, rmask: int, seed: tuple[int, int]) -> LPParams:
    return LPParams(ep.man, ep.bemin, ep.qsub, ep.overflow, ep.signed_zero, rounding, ep.maxpos,
                    ep.maxneg, rmask, seed[0], seed[1])


def quantize_f32(x: torch.Tensor, out: torch.Tensor, ep: ElementParams, rounding: int,
                 rmask: int, seed: tuple[int, int]) -> None:
    """Quantize the contiguous float32 CPU tensor ``x`` into ``out`` (which may be ``x``)."""
    prm = _params(ep, rounding, rmask, seed)
    _lib().lp_quantize_f32(x.data_ptr(), out.data_ptr(), x.numel(), ctypes.byref(prm),
                           torch.get_num_threads())


def quantize_blocks_f32(x: torch.Tensor, out: torch.Tensor, row_len: int, block: int,
                        shifts: torch.Tensor, ep: ElementParams, rounding: int, rmask: int,
                        seed: tuple[int, int]) -> None:
    """Blocked variant: ``shifts`` (int32, contiguous) holds one scale exponent per block."""
    prm = _params(ep, rounding, rmask, seed)
    rows = x.numel() // row_len
    _lib().lp_quantize_blocks_f32(x.data_ptr(), out.data_ptr(), rows, row_len, block,
                                  shifts.data_ptr(), ctypes.byref(prm), torch.get_num_threads())
