"""The LSTM cell of ATen's CPU composite in a 16-bit dtype (csrc/recurrent.c, ``lp_lstm_*``),
16-bit sums of gradients (``lp_round_add2``, ``lp_round_sum_delta``, an embedding's
``lp_index_add_rounded``) and a batch norm's output rounded as it is computed
(``lp_affine_round``)."""

from __future__ import annotations

import ctypes

import torch

from . import library
from .library import LPParams

__all__ = ["lstm_available", "lstm_backward", "lstm_forward", "lstm_forward2", "lstm_gates",
           "lstm_step_available", "lstm_step",
           "round_add2", "round_sum_delta", "index_add_rounded", "affine_round",
           "lstm_op_available",
           "site_params", "lstm_op_gates", "lstm_op_cell", "lstm_op_out", "lstm_op_backward"]


def lstm_available() -> bool:
    """True when the loaded kernel has the fused LSTM cell (builds since these functions)."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_lstm_bwd")

def round_add2(a: torch.Tensor, b: torch.Tensor, prm: LPParams) -> torch.Tensor | None:
    """rnd(rnd(a) + rnd(b)) in one pass (lp_round_add2), ``prm`` a deterministic rounding from
    :func:`~.library.prepare`; None where ``a`` and ``b`` are not contiguous float32 CPU tensors
    of one shape (the caller then rounds with torch ops: the same bits)."""
    if not (a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu" and
            a.shape == b.shape and a.is_contiguous() and b.is_contiguous()):
        return None
    out = torch.empty_like(a)
    library.lib().lp_round_add2(a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(),
                                ctypes.byref(prm), torch.get_num_threads())
    return out


def round_sum_delta(g: torch.Tensor, v: torch.Tensor, prm: LPParams, keep: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One arrival at a 16-bit sum of gradients in one pass (lp_round_sum_delta): with ``s =
    rnd(v + rnd(g))`` (``v`` the running sum, on the grid), returns ``(s - v, s if keep else
    None)``; ``prm`` a deterministic rounding from :func:`~.library.prepare`. None where the
    build lacks the function, or ``g`` and ``v`` are not float32 CPU tensors of one shape laid
    out alike in dense memory (contiguous or channels-last): the caller then uses torch ops,
    which give the same bits."""
    lib = library.lib()
    if lib is None or not hasattr(lib, "lp_round_sum_delta") or not (
            g.dtype == v.dtype == torch.float32 and g.device.type == v.device.type == "cpu" and
            g.shape == v.shape and g.stride() == v.stride() and _dense(g)):
        return None
    delta = torch.empty_like(g)
    s = torch.empty_like(g) if keep else None
    lib.lp_round_sum_delta(g.data_ptr(), v.data_ptr(), delta.data_ptr(),
                           s.data_ptr() if keep else None, g.numel(), ctypes.byref(prm),
                           torch.get_num_threads())
    return delta, s


def index_add_rounded(acc: torch.Tensor, ids: torch.Tensor, g: torch.Tensor,
                      prm: LPParams) -> bool:
    """``acc[ids[i]] = rnd(acc[ids[i]] + g[i])`` for each i in turn, in place
    (lp_index_add_rounded), ``prm`` a deterministic rounding from :func:`~.library.prepare`;
    False (nothing done) where the build lacks the function or the tensors are not contiguous
    CPU ones (``acc`` float32 (rows, D), ``ids`` int64 (n,) within the rows, ``g`` float32
    (n, D)): the caller then uses torch ops."""
    lib = library.lib()
    if lib is None or not hasattr(lib, "lp_index_add_rounded") or not (
            acc.dtype == g.dtype == torch.float32 and ids.dtype == torch.int64 and
            acc.device.type == g.device.type == ids.device.type == "cpu" and
            acc.dim() == g.dim() == 2 and ids.dim() == 1 and acc.shape[1] == g.shape[1] and
            g.shape[0] == ids.shape[0] and acc.is_contiguous() and g.is_contiguous() and
            ids.is_contiguous()):
        return False
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < acc.shape[0]):
        raise IndexError(f"index_add_rounded: indices must lie in [0, {acc.shape[0]}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    lib.lp_index_add_rounded(acc.data_ptr(), ids.data_ptr(), g.data_ptr(), ids.numel(),
                             g.shape[1], ctypes.byref(prm), torch.get_num_threads())
    return True


def affine_round(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, prm: LPParams,
                 stochastic: bool = False) -> torch.Tensor | None:
    """``addcmul(b, x, a)`` over the channels (dimension 1) of ``x``, rounded by ``prm`` (from
    :func:`~.library.prepare`; ``stochastic``: its keys set, :func:`~.library.with_keys`), in
    one pass: a new tensor in ``x``'s layout, each value with the random counter of its
    row-major index as :func:`~lowprec.numerics.quantize` draws it (lp_affine_round in memory
    order; a channels-last ``x`` rounded stochastically by lp_affine_round_bt, counters of the
    logical order). None where the build lacks the function or the arguments do not fit it
    (``x`` a float32 CPU tensor of 2 or more dimensions, contiguous or channels-last, below
    2**32 values when channels-last and stochastic; ``a`` and ``b`` contiguous float32 vectors
    of its channels): the caller then uses torch."""
    lib = library.lib()
    if lib is None or not hasattr(lib, "lp_affine_round") or not (
            x.dtype == a.dtype == b.dtype == torch.float32 and x.dim() >= 2 and
            x.device.type == a.device.type == b.device.type == "cpu" and _dense(x) and
            a.shape == b.shape == (x.shape[1],) and a.is_contiguous() and b.is_contiguous()
            and x.numel()):
        return None
    if stochastic and not x.is_contiguous():  # channels-last: memory order is not logical
        if not hasattr(lib, "lp_affine_round_bt") or x.numel() >= 2**32:
            return None
        out = torch.empty_like(x)
        n, c, h, w = x.shape
        if lib.lp_affine_round_bt(x.data_ptr(), a.data_ptr(), b.data_ptr(), out.data_ptr(), n,
                                  h * w, c, ctypes.byref(prm), torch.get_num_threads()) != 0:
            return None
        return out
    out = torch.empty_like(x)  # (x's dense layout)
    inner = x.stride(1) if x.shape[1] > 1 else 1  # (a size-1 dimension's stride is free)
    lib.lp_affine_round(x.data_ptr(), a.data_ptr(), b.data_ptr(), out.data_ptr(), x.numel(),
                        x.shape[1], inner, ctypes.byref(prm), torch.get_num_threads())
    return out


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory with no gap or overlap, in an order the flat
    loop may take (contiguous, or channels-last for 4-D)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(
        memory_format=torch.channels_last))


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
    library.lib().lp_lstm_gates(lin.data_ptr(), xw.data_ptr(), _rows(xw, "xw", n),
                                out.data_ptr(), b, n, ctypes.byref(prm), torch.get_num_threads())


def lstm_forward(si, sf, tg, so, c, acts, cn, prm: LPParams) -> None:
    """acts = the rounded activations (i, f, g, o), cn the new cell state (lp_lstm_fwd)."""
    b, h = cn.shape
    rs = _rows(si, "si", h)
    if any(_rows(t, "activation", h) != rs for t in (sf, tg, so)):
        raise ValueError("lstm cell: the four activations must share one row stride")
    if not (acts.is_contiguous() and cn.is_contiguous()) or acts.shape != (b, 4 * h):
        raise ValueError("lstm cell: acts (B, 4H) and cn (B, H) must be contiguous")
    library.lib().lp_lstm_fwd(si.data_ptr(), sf.data_ptr(), tg.data_ptr(), so.data_ptr(), rs,
                              c.data_ptr(), _rows(c, "c", h), acts.data_ptr(), cn.data_ptr(), b,
                              h, ctypes.byref(prm), torch.get_num_threads())


def lstm_forward2(tc, acts, h_out, prm: LPParams) -> None:
    """tc rounded in place (torch's tanh of the cell state), h = rc(o * tc) (lp_lstm_fwd2)."""
    b, h = tc.shape
    if not all(t.is_contiguous() for t in (tc, acts, h_out)):
        raise ValueError("lstm cell: tc, acts and h must be contiguous")
    library.lib().lp_lstm_fwd2(tc.data_ptr(), acts.data_ptr(), h_out.data_ptr(), b, h,
                               ctypes.byref(prm), torch.get_num_threads())


def lstm_step_available() -> bool:
    """True when the loaded kernel has the one-pass step of tabulated activations."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_lstm_step_tab")


def lstm_step(lin, xw, c, tsig, ttanh, kind: int, acts, cn, tc, h_out, prm: LPParams) -> None:
    """One forward step in one pass (lp_lstm_step_tab): acts = the rounded activations of
    rc(rc(lin) + xw) by the tables ``tsig``/``ttanh`` (65,536 float32 values each, indexed by
    the input's float16 bits, ``kind`` 1, or bfloat16 bits, ``kind`` 2), the new cell state
    ``cn``, its tanh ``tc`` and ``h_out``."""
    b, h = cn.shape
    if lin.shape != (b, 4 * h) or acts.shape != (b, 4 * h) or tc.shape != (b, h) or \
            h_out.shape != (b, h) or not all(
                t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                for t in (lin, acts, cn, tc, h_out)):
        raise ValueError("lstm step: lin and acts (B, 4H), cn, tc and h (B, H) must be "
                         "contiguous float32 CPU tensors")
    if kind not in (1, 2) or any(t.dtype != torch.float32 or t.numel() != 65536 or
                                 not t.is_contiguous() or t.device.type != "cpu"
                                 for t in (tsig, ttanh)):
        raise ValueError(f"lstm step: kind must be 1 or 2 (got {kind}) and the tables "
                         f"contiguous float32 CPU tensors of 65536 values")
    library.lib().lp_lstm_step_tab(lin.data_ptr(), xw.data_ptr(), _rows(xw, "xw", 4 * h),
                                   c.data_ptr(), _rows(c, "c", h), tsig.data_ptr(),
                                   ttanh.data_ptr(), kind, acts.data_ptr(), cn.data_ptr(),
                                   tc.data_ptr(), h_out.data_ptr(), b, h, ctypes.byref(prm),
                                   torch.get_num_threads())


def lstm_backward(dh, dcn, acts, tc, c, dG, dcp, prm: LPParams, half: bool) -> None:
    """The cell's backward (lp_lstm_bwd): dG the gates' gradient, dcp the cell state's."""
    b, h = tc.shape
    library.lib().lp_lstm_bwd(dh.data_ptr(), _rows(dh, "dh", h),
                              dcn.data_ptr() if dcn is not None else None,
                              _rows(dcn, "dcn", h) if dcn is not None else 0, acts.data_ptr(),
                              tc.data_ptr(), c.data_ptr(), _rows(c, "c", h), dG.data_ptr(),
                              dcp.data_ptr(), b, h, ctypes.byref(prm), int(half),
                              torch.get_num_threads())


# -- the op-by-op LSTM step of any elementwise format and mode (lp_lstm_op_*) ------------------
def lstm_op_available() -> bool:
    """True when the loaded kernel has the op-by-op LSTM step (lp_lstm_op_*)."""
    lib = library.lib()
    return lib is not None and hasattr(lib, "lp_lstm_op_bwd")


def site_params(prm: LPParams, keys: torch.Tensor) -> torch.Tensor:
    """lp_params rows (int32, (*keys.shape[:-1], 11)): ``prm``'s fields, each row with the
    stochastic keys of ``keys`` (int64 pairs in [0, 2**32), last axis (k0, k1)); a row's address
    is what the lp_lstm_op_* functions take for an lp_params."""
    base = torch.frombuffer(bytearray(bytes(prm)), dtype=torch.int32)
    rows = base.repeat(*keys.shape[:-1], 1)
    k = keys.to(torch.int64)
    rows[..., 9:11] = torch.where(k >= 2**31, k - 2**32, k).to(torch.int32)
    return rows


def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def lstm_op_gates(lin: torch.Tensor, xw: torch.Tensor, out: torch.Tensor,
                  pf: torch.Tensor) -> None:
    """``out`` = r1(r0(lin) + xw) at the step's sites ``pf`` (:func:`site_params`, 11 rows)."""
    b, n = out.shape
    lin = _c(lin)  # (held through the call)
    library.lib().lp_lstm_op_gates(lin.data_ptr(), xw.data_ptr(), _rows(xw, "xw", n),
                                   out.data_ptr(), b, n, pf.data_ptr(), torch.get_num_threads())


def lstm_op_cell(si, sf, tg, so, c, acts, cn, pf: torch.Tensor) -> None:
    """acts = the four activations rounded at their sites, cn = r8(r6(f * c) + r7(i * g))."""
    b, h = cn.shape
    si, sf, tg, so = (_c(t) for t in (si, sf, tg, so))
    library.lib().lp_lstm_op_cell(si.data_ptr(), sf.data_ptr(), tg.data_ptr(), so.data_ptr(),
                                  c.data_ptr(), _rows(c, "c", h), acts.data_ptr(), cn.data_ptr(),
                                  b, h, pf.data_ptr(), torch.get_num_threads())


def lstm_op_out(tcu, acts, t_out, h_out, pf: torch.Tensor) -> None:
    """T = r9(tcu) (torch's tanh of the cell state), h = r10(o * T)."""
    b, h = h_out.shape
    tcu = _c(tcu)  # (held: its memory must outlive the call)
    library.lib().lp_lstm_op_out(tcu.data_ptr(), acts.data_ptr(), t_out.data_ptr(),
                                 h_out.data_ptr(), b, h, pf.data_ptr(), torch.get_num_threads())


def lstm_op_backward(dh_a, dh_b, dc_a, dc_b, acts, si, sf, tg, so, tcu, t_r, c, d_gates, dc_prev,
                     pb: torch.Tensor) -> None:
    """The step's backward (lp_lstm_op_bwd): the gates' gradient rounded at their site into
    ``d_gates``, the previous cell state's raw gradient into ``dc_prev``; None for a use
    that sent no gradient."""
    b, h = dc_prev.shape
    held = [_c(t) for t in (dh_a, dh_b, dc_a, dc_b, si, sf, tg, so, tcu, t_r)]  # (outlive the
    # call: a contiguous copy's memory must not be freed before it)
    ptrs = [None if t is None else t.data_ptr() for t in held]
    library.lib().lp_lstm_op_bwd(*ptrs[:4], acts.data_ptr(), *ptrs[4:], c.data_ptr(),
                                 _rows(c, "c", h), d_gates.data_ptr(), dc_prev.data_ptr(), b, h,
                                 pb.data_ptr(), torch.get_num_threads())
