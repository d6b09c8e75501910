"""Finding, opening and declaring the compiled kernel ``_qkernel`` (built by setup.py from
``numerics/csrc/``), and the C structs every call passes.

Every entry point's C signature is set here, one section per C file in the order of
``lp_common.h``'s list; the modules beside this one call the functions. ``lib()`` opens the
installed library once, on first use; ``LOWPREC_KERNEL=0`` in the environment disables it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import lru_cache

from ..params import ElementParams

__all__ = ["ABI_VERSION", "LPParams", "LPOpt", "LPAccFmt", "LPAccGemm", "available", "lib",
           "open_kernel", "params", "prepare", "with_keys"]

ABI_VERSION = 6  # lp_abi_version() in csrc/module.c


class LPParams(ctypes.Structure):
    """A format and a rounding (lp_params in csrc/lp_common.h)."""

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


class LPOpt(ctypes.Structure):
    """The fused step's settings (lp_opt in csrc/optimizer.c). The float fields are the float32
    constants of the per-element definition (lowprec/training/optim/sgd.py, adam.py): Python
    computes them in float64 and ctypes rounds them to float32 to nearest, as torch does with a
    Python scalar given to a float32 tensor op."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "kind", "p_dtype", "g_dtype", "s_dtype", "nesterov", "first", "decoupled",
        "sqrt_storage", "has_momentum")] + [(name, ctypes.c_float) for name in (
        "neg_lr", "momentum", "damp_c", "wd", "decay", "lerp_w", "beta2", "beta2_c", "eps",
        "neg_step", "bc2_sqrt", "grad_scale")] + [(name, ctypes.c_int32) for name in (
        "p_is_bf16", "s_is_bf16", "raw_state", "tiles_only")]


class LPAccFmt(ctypes.Structure):
    """An accumulator format and its rounding (lp_acc_fmt in csrc/accumulate.c)."""

    _fields_ = [(n, ctypes.c_int32) for n in ("man", "emin", "qsub", "overflow", "signed_zero",
                                              "rounding")] + [
        ("maxpos", ctypes.c_float), ("maxneg", ctypes.c_float), ("rmask", ctypes.c_uint32),
        ("k0", ctypes.c_uint32), ("k1", ctypes.c_uint32)]


class LPAccGemm(ctypes.Structure):
    """A GEMM's shape, strides and order of summation (lp_acc_gemm in csrc/accumulate.c)."""

    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "M", "N", "K", "sa_b", "sa_m", "sa_k",
                                              "sb_b", "sb_k", "sb_n")] + [
        ("order", ctypes.c_int32), ("chunk", ctypes.c_int32)]


@lru_cache(maxsize=1)
def lib():
    """The installed kernel, opened once; None when it is missing, does not load, or is
    disabled by ``LOWPREC_KERNEL=0``."""
    if os.environ.get("LOWPREC_KERNEL", "1") == "0":
        return None
    spec = importlib.util.find_spec("lowprec.numerics._qkernel")
    if spec is None or not spec.origin:
        return None
    return open_kernel(spec.origin)


def available() -> bool:
    """True when the compiled kernel is loaded (and not disabled by LOWPREC_KERNEL=0)."""
    return lib() is not None


def open_kernel(path: str):
    """The kernel library at ``path`` with its functions' signatures set, or None when it does
    not load or has another ABI version. The installed one is opened once, on first use; the
    tests also open builds of ``csrc/*.c`` for one instruction set each (``-DLP_NO_CLONES
    -march=...``), to check every path the clones dispatch to, not only this CPU's. A function
    that older builds lack is declared only where present (the ``*_available`` checks)."""
    try:
        handle = ctypes.CDLL(path)
    except OSError:
        return None
    if handle.lp_abi_version() != ABI_VERSION:
        return None
    p, i32, i64, ci = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int
    lpp = ctypes.POINTER(LPParams)
    signatures = {
        # quantize.c
        "lp_quantize_f32": [p, p, i64, lpp, ci],
        "lp_quantize_f32_bt": [p, p, i64, i64, i64, lpp, ci],
        "lp_quantize_f32_nonfinite": [p, p, i64, lpp, ci],
        # block.c
        "lp_quantize_blocks_f32": [p, p, i64, i64, i64, p, lpp, ci],
        "lp_block_shifts_f32": [p, p, i64, i64, i64, i32, i32, i32, ci],
        "lp_count_abs_ge": [p, i64, ctypes.c_float, ctypes.c_float, ctypes.POINTER(i64), ci],
        # accumulate.c
        "lp_gemm_acc": [p, p, p, ctypes.POINTER(LPAccGemm), ctypes.POINTER(LPAccFmt),
                        ctypes.POINTER(LPAccFmt), ci],
        "lp_dot4": [p, p, p] + [i64] * 5 + [ci],
        "lp_channel_sums": [p, i64, i64, p, i64, p, p, ci],
        "lp_plane_sums": [p, i64, i64, i64, ci, p, p, ci],
        # optimizer.c
        "lp_opt_step": [p, p, p, p, i64, ctypes.POINTER(LPOpt), lpp, lpp, ci],
        # recurrent.c
        "lp_round_add2": [p, p, p, i64, lpp, ci],
        "lp_round_sum_delta": [p, p, p, p, i64, lpp, ci],
        "lp_index_add_rounded": [p, p, p, i64, i64, lpp, ci],
        "lp_affine_round": [p, p, p, p, i64, i64, i64, lpp, ci],
        "lp_affine_round_bt": [p, p, p, p, i64, i64, i64, lpp, ci],
        "lp_lstm_gates": [p, p, i64, p, i64, i64, lpp, ci],
        "lp_lstm_fwd": [p, p, p, p, i64, p, i64, p, p, i64, i64, lpp, ci],
        "lp_lstm_fwd2": [p, p, p, i64, i64, lpp, ci],
        "lp_lstm_step_tab": [p, p, i64, p, i64, p, p, ci, p, p, p, p, i64, i64, lpp, ci],
        "lp_lstm_bwd": [p, i64, p, i64, p, p, p, i64, p, p, i64, i64, lpp, ci, ci],
        # (the op-by-op step: an array of lp_params a site, passed as an address)
        "lp_lstm_op_gates": [p, p, i64, p, i64, i64, p, ci],
        "lp_lstm_op_cell": [p, p, p, p, p, i64, p, p, i64, i64, p, ci],
        "lp_lstm_op_out": [p, p, p, p, i64, i64, p, ci],
        "lp_lstm_op_bwd": [p, p, p, p, p, p, p, p, p, p, p, p, i64, p, p, i64, i64, p, ci],
        # fexp.c
        "lp_fexp_u20": [p, p, i64, ci],
        "lp_attn_fwd_rows": [p, p, i64, i64, i64, i64, ctypes.c_float, ci, ci],
        "lp_attn_bwd_p": [p, p, i64, i64, i64, ctypes.c_float, ci, ci],
        "lp_attn_bwd_ds": [p, p, p, i64, i64, i64, ci, ci],
    }
    for name, argtypes in signatures.items():
        if hasattr(handle, name):
            fn = getattr(handle, name)
            fn.argtypes = argtypes
            fn.restype = {"lp_gemm_acc": ctypes.c_int, "lp_affine_round_bt": ctypes.c_int,
                          "lp_quantize_f32_nonfinite": ctypes.c_int64}.get(name)
    return handle


def params(ep: ElementParams, rounding: int, rmask: int, seed: tuple[int, int]) -> LPParams:
    """The kernel's parameters of format ``ep`` rounded by mode ``rounding`` (R_* codes)."""
    return LPParams(ep.man, ep.bemin, ep.qsub, ep.overflow, ep.signed_zero, rounding, ep.maxpos,
                    ep.maxneg, rmask, seed[0], seed[1])


def prepare(ep: ElementParams, rounding: int, rmask: int) -> LPParams:
    """The kernel's parameters of a deterministic rounding, built once (quantize's fast path)."""
    return params(ep, rounding, rmask, (0, 0))


def with_keys(prm: LPParams, k0: int, k1: int) -> LPParams:
    """A copy of prepared parameters (:func:`prepare`) with stochastic rounding's keys."""
    q = LPParams.from_buffer_copy(prm)
    q.k0, q.k1 = k0, k1
    return q
