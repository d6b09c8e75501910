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

from .params import R_STOCHASTIC, ElementParams

__all__ = ["available", "open_kernel", "quantize_f32", "quantize_blocks_f32", "LPParams",
           "gemm_acc", "gemm_acc_available", "quantize_transposed", "transposed_available",
           "block_shifts", "block_shifts_available"]


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


class LPOpt(ctypes.Structure):
    """The fused step's settings (lp_opt in _qkernel.c). The float fields are the float32
    constants of the per-element definition (lowprec/training/optim/sgd.py, adam.py): Python
    computes them in float64 and ctypes rounds them to float32 to nearest, as torch does with a
    Python scalar given to a float32 tensor op."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "kind", "p_dtype", "g_dtype", "s_dtype", "nesterov", "first", "decoupled",
        "sqrt_storage", "has_momentum")] + [(name, ctypes.c_float) for name in (
        "neg_lr", "momentum", "damp_c", "wd", "decay", "lerp_w", "beta2", "beta2_c", "eps",
        "neg_step", "bc2_sqrt", "grad_scale")] + [("p_is_bf16", ctypes.c_int32),
                                                   ("s_is_bf16", ctypes.c_int32)]


_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def opt_dtype_code(dtype: torch.dtype) -> int | None:
    return _DT.get(dtype)


def opt_step(p, g, s1, s2, opt: LPOpt, pq: ElementParams, p_rounding: int, seed,
             sq: ElementParams) -> None:
    """Fused optimizer step on contiguous CPU tensors (see lp_opt_step in _qkernel.c)."""
    from .params import random_mask

    pp = _params(pq, p_rounding, random_mask(32) if p_rounding == R_STOCHASTIC else 0, seed)
    sp = _params(sq, 0, 0, (0, 0))
    dummy = p.data_ptr()
    _lib().lp_opt_step(p.data_ptr(), g.data_ptr(), s1.data_ptr() if s1 is not None else dummy,
                       s2.data_ptr() if s2 is not None else dummy, p.numel(), ctypes.byref(opt),
                       ctypes.byref(pp), ctypes.byref(sp), torch.get_num_threads())


@lru_cache(maxsize=1)
def _lib():
    if os.environ.get("LOWPREC_KERNEL", "1") == "0":
        return None
    spec = importlib.util.find_spec("lowprec.numerics._qkernel")
    if spec is None or not spec.origin:
        return None
    return open_kernel(spec.origin)


def open_kernel(path: str):
    """The kernel library at ``path`` with its functions' signatures set, or None when it does
    not load or has another ABI version. The installed one is opened once, on first use; the
    tests also open builds of ``_qkernel.c`` for one instruction set each (``-DLP_NO_CLONES
    -march=...``), to check every path the clones dispatch to, not only this CPU's."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if lib.lp_abi_version() != 5:
        return None
    p = ctypes.c_void_p
    lib.lp_quantize_f32.argtypes = [p, p, ctypes.c_int64, ctypes.POINTER(LPParams), ctypes.c_int]
    lib.lp_quantize_f32.restype = None
    lib.lp_quantize_blocks_f32.argtypes = [
        p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, ctypes.POINTER(LPParams),
        ctypes.c_int,
    ]
    lib.lp_quantize_blocks_f32.restype = None
    lib.lp_opt_step.argtypes = [p, p, p, p, ctypes.c_int64, ctypes.POINTER(LPOpt),
                                ctypes.POINTER(LPParams), ctypes.POINTER(LPParams), ctypes.c_int]
    lib.lp_opt_step.restype = None
    lib.lp_count_abs_ge.argtypes = [p, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                                    ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    lib.lp_count_abs_ge.restype = None
    lib.lp_dot4.argtypes = [p, p, p] + [ctypes.c_int64] * 5 + [ctypes.c_int]
    lib.lp_dot4.restype = None
    if hasattr(lib, "lp_fexp_u20"):
        lib.lp_fexp_u20.argtypes = [p, p, ctypes.c_int64, ctypes.c_int]
        lib.lp_fexp_u20.restype = None
    if hasattr(lib, "lp_lstm_bwd"):
        i64, lpp, ci = ctypes.c_int64, ctypes.POINTER(LPParams), ctypes.c_int
        lib.lp_lstm_gates.argtypes = [p, p, i64, p, i64, i64, lpp, ci]
        lib.lp_lstm_fwd.argtypes = [p, p, p, p, i64, p, i64, p, p, i64, i64, lpp, ci]
        lib.lp_lstm_fwd2.argtypes = [p, p, p, i64, i64, lpp, ci]
        lib.lp_lstm_bwd.argtypes = [p, i64, p, i64, p, p, p, i64, p, p, i64, i64, lpp, ci, ci]
        lib.lp_round_add2.argtypes = [p, p, p, i64, lpp, ci]
        for f in (lib.lp_lstm_gates, lib.lp_lstm_fwd, lib.lp_lstm_fwd2, lib.lp_lstm_bwd,
                  lib.lp_round_add2):
            f.restype = None
    if hasattr(lib, "lp_block_shifts_f32"):
        i32 = ctypes.c_int32
        lib.lp_block_shifts_f32.argtypes = [p, p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_int64, i32, i32, i32, ctypes.c_int]
        lib.lp_block_shifts_f32.restype = None
    if hasattr(lib, "lp_quantize_f32_bt"):
        lib.lp_quantize_f32_bt.argtypes = [p, p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.POINTER(LPParams), ctypes.c_int]
        lib.lp_quantize_f32_bt.restype = None
    if hasattr(lib, "lp_gemm_acc"):
        lib.lp_gemm_acc.argtypes = [p, p, p, ctypes.POINTER(LPAccGemm), ctypes.POINTER(LPAccFmt),
                                    ctypes.POINTER(LPAccFmt), ctypes.c_int]
        lib.lp_gemm_acc.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the compiled kernel is loaded (and not disabled by LOWPREC_KERNEL=0)."""
    return _lib() is not None


def _params(ep: ElementParams, rounding: int, rmask: int, seed: tuple[int, int]) -> LPParams:
    return LPParams(ep.man, ep.bemin, ep.qsub, ep.overflow, ep.signed_zero, rounding, ep.maxpos,
                    ep.maxneg, rmask, seed[0], seed[1])


def prepare(ep: ElementParams, rounding: int, rmask: int) -> LPParams:
    """The kernel's parameters of a deterministic rounding, built once (quantize's fast path)."""
    return _params(ep, rounding, rmask, (0, 0))


def with_keys(prm: LPParams, k0: int, k1: int) -> LPParams:
    """A copy of prepared parameters (:func:`prepare`) with stochastic rounding's keys."""
    q = LPParams.from_buffer_copy(prm)
    q.k0, q.k1 = k0, k1
    return q


def quantize_prepared(x: torch.Tensor, out: torch.Tensor, prm: LPParams) -> None:
    """:func:`quantize_f32` with parameters from :func:`prepare`: contiguous float32 CPU
    ``x`` and ``out`` of its size (unchecked: the caller checked)."""
    _lib().lp_quantize_f32(x.data_ptr(), out.data_ptr(), x.numel(), ctypes.byref(prm),
                           torch.get_num_threads())


def block_shifts_available() -> bool:
    """True when the loaded kernel computes MX block scale exponents (lp_block_shifts_f32)."""
    lib = _lib()
    return lib is not None and hasattr(lib, "lp_block_shifts_f32")


def block_shifts(x: torch.Tensor, block: int, emax: int, smin: int, smax: int) -> torch.Tensor:
    """The scale exponent of every block of the contiguous float32 CPU matrix ``x`` (rows,
    row_len), blocks of ``block`` along each row: int32 (rows, ceil(row_len / block))."""
    rows, row_len = x.shape
    out = torch.empty(rows, -(-row_len // block), dtype=torch.int32)
    _lib().lp_block_shifts_f32(x.data_ptr(), out.data_ptr(), rows, row_len, block, emax, smin,
                               smax, torch.get_num_threads())
    return out


def transposed_available() -> bool:
    """True when the loaded kernel rounds a batched transpose in logical order."""
    lib = _lib()
    return lib is not None and hasattr(lib, "lp_quantize_f32_bt")


def quantize_transposed(x: torch.Tensor, out: torch.Tensor, batch: int, rows: int, cols: int,
                        prm: LPParams) -> None:
    """Round ``x``, contiguous float32 (batch, rows, cols) in memory, whose logical tensor is
    (batch, cols, rows), into ``out`` of the same layout: each element with the random bits of
    its logical row-major index (lp_quantize_f32_bt; a channels-last activation: rows = H*W,
    cols = C). Below 2**32 elements (unchecked: the caller checked)."""
    _lib().lp_quantize_f32_bt(x.data_ptr(), out.data_ptr(), batch, rows, cols,
                              ctypes.byref(prm), torch.get_num_threads())


def quantize_f32(x: torch.Tensor, out: torch.Tensor, ep: ElementParams, rounding: int,
                 rmask: int, seed: tuple[int, int]) -> None:
    """Quantize the contiguous float32 CPU tensor ``x`` into ``out`` (which may be ``x``)."""
    quantize_prepared(x, out, _params(ep, rounding, rmask, seed))


def quantize_blocks_f32(x: torch.Tensor, out: torch.Tensor, row_len: int, block: int,
                        shifts: torch.Tensor, ep: ElementParams, rounding: int, rmask: int,
                        seed: tuple[int, int]) -> None:
    """Blocked variant: ``shifts`` (int32, contiguous) holds one scale exponent per block."""
    prm = _params(ep, rounding, rmask, seed)
    rows = x.numel() // row_len
    _lib().lp_quantize_blocks_f32(x.data_ptr(), out.data_ptr(), rows, row_len, block,
                                  shifts.data_ptr(), ctypes.byref(prm), torch.get_num_threads())


def count_abs_ge(x: torch.Tensor, t1: float, t2: float) -> tuple[int, int]:
    """(#|x| >= t1, #|x| >= t2) of a contiguous float32 CPU tensor, in one pass."""
    out = (ctypes.c_int64 * 2)()
    _lib().lp_count_abs_ge(x.data_ptr(), x.numel(), t1, t2, out, torch.get_num_threads())
    return int(out[0]), int(out[1])


def dot4(cols: torch.Tensor, w: torch.Tensor, out: torch.Tensor, groups: int) -> None:
    """Reference-order dot products (lp_dot4 in _qkernel.c) of contiguous float32 CPU tensors:
    ``cols`` N x (groups*K) x L, ``w`` (groups*Cog) x K, into ``out`` N x (groups*Cog) x L."""
    for name, t in (("cols", cols), ("w", w), ("out", out)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"dot4: {name} must be a contiguous float32 CPU tensor, got "
                             f"{t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    n, gk, length = cols.shape
    k = gk // groups
    _lib().lp_dot4(cols.data_ptr(), w.data_ptr(), out.data_ptr(), n, groups, k, length,
                   w.shape[0] // groups, torch.get_num_threads())


def fexp_available() -> bool:
    """True when the loaded kernel has ``lp_fexp_u20`` (builds since this function)."""
    return _lib() is not None and hasattr(_lib(), "lp_fexp_u20")


def fexp_u20(x: torch.Tensor, out: torch.Tensor) -> None:
    """ATen's vectorised ``fexp_u20`` (lp_fexp_u20 in _qkernel.c) of a contiguous float32 CPU
    tensor into ``out`` (same shape)."""
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"fexp_u20: {name} must be a contiguous float32 CPU tensor, got "
                             f"{t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    if out.shape != x.shape:
        raise ValueError(f"fexp_u20: out has shape {tuple(out.shape)}, x {tuple(x.shape)}")
    _lib().lp_fexp_u20(x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())


# -- the LSTM cell of ATen's CPU composite in a 16-bit dtype (lp_lstm_* in _qkernel.c) -----------
def lstm_available() -> bool:
    """True when the loaded kernel has the fused LSTM cell (builds since these functions)."""
    return _lib() is not None and hasattr(_lib(), "lp_lstm_bwd")


def round_add2(a: torch.Tensor, b: torch.Tensor, prm: LPParams) -> torch.Tensor | None:
    """rnd(rnd(a) + rnd(b)) in one pass (lp_round_add2), ``prm`` a deterministic rounding from
    :func:`prepare`; None where ``a`` and ``b`` are not contiguous float32 CPU tensors of one
    shape (the caller then rounds with torch ops: the same bits)."""
    if not (a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu" and
            a.shape == b.shape and a.is_contiguous() and b.is_contiguous()):
        return None
    out = torch.empty_like(a)
    _lib().lp_round_add2(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(),
                         ctypes.byref(prm), torch.get_num_threads())
    return out


def _rows(t: torch.Tensor, name: str, cols: int) -> int:
    """The row stride of a 2-D float32 CPU tensor of ``cols`` columns with unit column stride
    (a single row's stride is never read: a size-1 dimension may have any, even 0)."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2 or \
            t.shape[1] != cols or (t.stride(1) != 1 and t.shape[1] > 1) or \
            (t.stride(0) < cols and t.shape[0] > 1):
        raise ValueError(f"lstm cell: {name} must be a 2-D float32 CPU tensor of {cols} columns "
                         f"with rows of unit stride, got {t.dtype} {tuple(t.shape)} strides "
                         f"{t.stride()} on {t.device}")
    return t.stride(0) if t.shape[0] > 1 else cols


def lstm_gates(lin, xw, out, prm: LPParams) -> None:
    """``out`` = rc(rc(lin) + xw) (lp_lstm_gates); ``lin`` and ``out`` contiguous."""
    b, n = out.shape
    for t, name in ((lin, "lin"), (out, "out")):
        _rows(t, name, n)
    if not (lin.is_contiguous() and out.is_contiguous()):
        raise ValueError("lstm cell: lin and out must be contiguous")
    _lib().lp_lstm_gates(lin.data_ptr(), xw.data_ptr(), _rows(xw, "xw", n), out.data_ptr(), b,
                         n, ctypes.byref(prm), torch.get_num_threads())


def lstm_forward(si, sf, tg, so, c, acts, cn, prm: LPParams) -> None:
    """acts = the rounded activations (i, f, g, o), cn the new cell state (lp_lstm_fwd)."""
    b, h = cn.shape
    rs = _rows(si, "si", h)
    if any(_rows(t, "activation", h) != rs for t in (sf, tg, so)):
        raise ValueError("lstm cell: the four activations must share one row stride")
    if not (acts.is_contiguous() and cn.is_contiguous()) or acts.shape != (b, 4 * h):
        raise ValueError("lstm cell: acts (B, 4H) and cn (B, H) must be contiguous")
    _lib().lp_lstm_fwd(si.data_ptr(), sf.data_ptr(), tg.data_ptr(), so.data_ptr(), rs,
                       c.data_ptr(), _rows(c, "c", h), acts.data_ptr(), cn.data_ptr(), b, h,
                       ctypes.byref(prm), torch.get_num_threads())


def lstm_forward2(tc, acts, h_out, prm: LPParams) -> None:
    """tc rounded in place (torch's tanh of the cell state), h = rc(o * tc) (lp_lstm_fwd2)."""
    b, h = tc.shape
    if not all(t.is_contiguous() for t in (tc, acts, h_out)):
        raise ValueError("lstm cell: tc, acts and h must be contiguous")
    _lib().lp_lstm_fwd2(tc.data_ptr(), acts.data_ptr(), h_out.data_ptr(), b, h,
                        ctypes.byref(prm), torch.get_num_threads())


def lstm_backward(dh, dcn, acts, tc, c, dG, dcp, prm: LPParams, half: bool) -> None:
    """The cell's backward (lp_lstm_bwd): dG the gates' gradient, dcp the cell state's."""
    b, h = tc.shape
    _lib().lp_lstm_bwd(dh.data_ptr(), _rows(dh, "dh", h),
                       dcn.data_ptr() if dcn is not None else None,
                       _rows(dcn, "dcn", h) if dcn is not None else 0, acts.data_ptr(),
                       tc.data_ptr(), c.data_ptr(), _rows(c, "c", h), dG.data_ptr(),
                       dcp.data_ptr(), b, h, ctypes.byref(prm), int(half),
                       torch.get_num_threads())


# -- the GEMM with a rounded accumulator (lp_gemm_acc in _qkernel_acc.c) -------------------------
class LPAccFmt(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("man", "emin", "qsub", "overflow", "signed_zero",
                                              "rounding")] + [
        ("maxpos", ctypes.c_float), ("maxneg", ctypes.c_float), ("rmask", ctypes.c_uint32),
        ("k0", ctypes.c_uint32), ("k1", ctypes.c_uint32)]


class LPAccGemm(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "M", "N", "K", "sa_b", "sa_m", "sa_k",
                                              "sb_b", "sb_k", "sb_n")] + [
        ("order", ctypes.c_int32), ("chunk", ctypes.c_int32)]


def gemm_acc_available() -> bool:
    """True when the loaded kernel has the accumulation GEMM."""
    return _lib() is not None and hasattr(_lib(), "lp_gemm_acc")


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
    rc = _lib().lp_gemm_acc(a.data_ptr(), b.data_ptr(), out.data_ptr(), ctypes.byref(g),
                            ctypes.byref(fp), ctypes.byref(fw), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"gemm_acc: no memory for the pairwise buffer (K={k})")
