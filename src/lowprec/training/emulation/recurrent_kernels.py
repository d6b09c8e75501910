"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) as ATen's CPU implementation runs them.

For a 16-bit CPU tensor with gradients enabled (oneDNN takes fp16 only without gradients),
``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh`` and ``torch.rnn_relu`` run the composite of
aten/src/ATen/native/RNN.cpp, every op of it writing a 16-bit tensor:

* per layer and direction, the input projection of the whole sequence first (``FullLayer``,
  ``PackedLayer`` with ``pre_compute_input``): ``at::linear(input, w_ih, b_ih)``, one rounding
  for a contiguous or 2-D input (addmm), two for a non-contiguous 3-D one (``batch_first``:
  ``matmul`` rounded, then ``add_(bias)`` rounded: at::linear's own branch, Linear.cpp);
* per step the cell (``LSTMCell``, ``GRUCell``, ``SimpleCell``), ``linear_hh`` an addmm of the
  step's hidden state, each elementwise op rounded; with projections ``hy @ w_hr^T``;
* the reverse direction walks the same projected input backwards, the outputs concatenated on
  the last axis; a packed sequence shrinks (forwards) or grows (backwards) the hidden state as
  the batch sizes change, as ``PackedLayer``/``ReversedPackedLayer`` slice and concatenate it;
* between layers, in training, ``at::dropout``: a noise tensor drawn by ``bernoulli_(1 - p)``
  from torch's global generator, divided by ``1 - p`` in the 16-bit dtype, multiplied in.

The replay computes each op in fp32 and rounds its output with ``engine.round`` (forward to the
compute format, the gradient reaching it to the gradient format, as the engine rounds every op),
and for IEEE-style formats rounded to nearest (what a 16-bit kernel stands for) it rounds the
backward as the 16-bit run's autograd does:

* sigmoid and tanh are differentiated from their rounded output (the 16-bit result the forward
  saved); fp16's ``sigmoid_backward`` runs in c10::Half arithmetic, each operation rounded;
* a tensor used more than once (the hidden state: the output sequence and the next step; the
  cell state; the GRU's new gate; a bidirectional layer's input) gets each use's gradient
  rounded, then summed in 16 bits in the order autograd's 16-bit buffer adds them (for a GRU's
  hidden state: output, h - n, linear_hh); the engine alone would sum fp32 terms, round once;
* the weights every step uses (``w_hh``, ``b_hh``, ``w_hr``), when stored in the compute format
  (16-true), get each step's gradient rounded and the steps' sum kept in that format, the last
  step's first, as autograd accumulates a 16-bit weight's gradients; otherwise they reach the
  parameter unrounded and summed in fp32, as the engine treats parameters.

Where the compiled kernel is loaded, an LSTM step with such formats runs fused: one autograd
node (:class:`_LSTMCell`) whose forward rounds and combines in C what torch's own sigmoid and
tanh give (for float16 and bfloat16 in one pass, the activations looked up in tables of all
65,536 inputs that torch's kernels computed), and whose backward replays the op-by-op
backward's roundings in C, in the same order (the same bits, tested: tests/training/test_lstm_cell.py); a 16-bit sum of two
gradients is one kernel pass (:class:`_Rounder`): a faster emulated step on the benchmark
LSTM (benchmarks/RESULTS.md, figure F7). With gradients, a whole unidirectional unpacked layer
without projections is one node (:class:`_LSTMLayer`) whose backward walks the steps as the
chain of per-step nodes would (the same products, sums and roundings, in the same order):
the chain's six Python autograd nodes a step go (figure F34).

Dynamic fixed point, block formats and stochastic rounding run the same forward, differentiated
op by op as the engine differentiates any op. Where every rounding is of an elementwise format
(stochastic rounding, fp8, fixed point; not dynamic fixed point or blocks) and draws its keys
from the forward's stream, eagerly, a whole unidirectional unpacked LSTM layer without
projections is one node of such steps (:class:`_LSTMLayerOps`): each step's eleven roundings at
the sites the chain's would take, with their keys, and the float32 ops between them and of
their backward, in the C kernel (the chain's bits; the benchmark LSTM's q6.10-sr step 0.72-0.75x
the chain's time on an AMD EPYC with AVX512-BF16: figure F37). Measured against ``model.half()`` and
``model.bfloat16()`` on an AVX2 CPU: outputs and parameter gradients bit-exact for GRU, LSTM
(packed, bidirectional, projections, dropout) and RNN, except where fp16 linear sums in its own
order (wider layers after the first: one unit at times); tests/training/test_fidelity.py.
Mixed policies do not come here: the engine's mixed path follows CUDA's autocast, which runs the
whole layer as one cuDNN op in 16 bits (aten/src/ATen/cudnn/AutocastRNN.cpp), and rounds that
op's inputs, weights and outputs. (CPU autocast differs: a GRU runs this composite with 16-bit
linears and gates but an fp32 hidden state, an LSTM goes to oneDNN, which has no 16-bit LSTM
on AVX2 CPUs.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _disable_current_modes

from ...numerics import kernel as _kernel
from ...numerics.formats import BF16, FP16, FP32, FixedFormat, FloatFormat
from ...numerics.keys import derive_keys
from ...numerics.params import ROUNDING_CODES, element_params, random_mask
from ...numerics.quantize import emits_graph_ops, quantize
from ...numerics.rounding import parse_rounding
from .gradmarks import note_rounded
from .kernels import plain_formats

__all__ = ["RNN_OPS", "RecurrentCall", "parse", "replay"]

# the torch functions nn.LSTM, nn.GRU and nn.RNN call (torch._VF), by the name the mode sees
RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})


@dataclass
class RecurrentCall:
    """One call of ``torch.lstm``/``gru``/``rnn_tanh``/``rnn_relu``, either overload:
    ``(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``
    or ``(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
    bidirectional)`` (a ``PackedSequence``'s fields)."""

    kind: str
    x: torch.Tensor
    batch_sizes: list[int] | None
    hx: tuple  # (h0,) or, for the LSTM, (h0, c0): (layers * directions, batch, size)
    params: list  # per layer and direction: (w_ih, w_hh, b_ih, b_hh, w_hr), None if absent
    num_layers: int
    dropout: float
    train: bool
    bidirectional: bool
    batch_first: bool


def parse(name: str, args, kwargs) -> RecurrentCall | None:
    """The call, or None for what the replay does not stand for (keyword arguments, an
    unexpected signature); the engine then runs torch's op and rounds its outputs."""
    if name not in RNN_OPS or kwargs or len(args) != 9:
        return None
    packed = torch.is_tensor(args[1]) and not args[1].is_floating_point()
    if packed:
        x, sizes, hx, flat, has_biases, layers, p, train, bidir = args
        batch_first = False
    else:
        x, hx, flat, has_biases, layers, p, train, bidir, batch_first = args
        sizes = None
    if (name == "lstm") != isinstance(hx, (tuple, list)):
        return None
    hx = tuple(hx) if name == "lstm" else (hx,)
    tensors = [x, *hx, *flat]
    if not all(torch.is_tensor(t) and t.is_floating_point() for t in tensors) or \
            x.dim() != (2 if packed else 3) or len(hx) != (2 if name == "lstm" else 1):
        return None
    dirs = 2 if bidir else 1
    proj = name == "lstm" and hx[0].shape[-1] != hx[1].shape[-1]
    per = (4 if has_biases else 2) + int(proj)
    if len(flat) != per * layers * dirs or hx[0].shape[0] != layers * dirs:
        return None
    params = []
    for i in range(0, len(flat), per):
        w = list(flat[i:i + per])
        w_hr = w.pop() if proj else None
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        params.append((w[0], w[1], b_ih, b_hh, w_hr))
    return RecurrentCall(name, x, sizes.tolist() if packed else None, hx, params, int(layers),
                         float(p), bool(train), bool(bidir), bool(batch_first))


def _sum_of_uses(grads, rnd):
    """The gradient of a tensor from its uses' (None: unused), in order: rnd(total + rnd(g)),
    the first one rounded on its own (:class:`_Split`, :class:`_LSTMLayer`)."""
    total, raw = None, False
    for g in grads:
        if g is not None:
            total, raw = (g, True) if total is None else (rnd.add2(total, g), False)
    return rnd(total) if raw else total


class _Split(torch.autograd.Function):
    """``n`` uses of one tensor (views of it). Backward: each use's gradient rounded (the 16-bit
    tensor that use's backward writes), then summed in order, each sum rounded: autograd adds
    the gradients of a 16-bit tensor's uses in its dtype, in the order their backward nodes
    run. Without it the engine sums the unrounded fp32 terms and rounds once (two uses: a third
    of an LSTM's cell-state gradients one unit off)."""

    @staticmethod
    def forward(ctx, t, n, rnd):
        ctx.rnd = rnd
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return _sum_of_uses(grads, ctx.rnd), None, None


class _Rounder:
    """Rounding to nearest ``fmt`` (a plain format): ``rnd(t)``, and ``add2(a, b)`` =
    rnd(rnd(a) + rnd(b)), one step of a 16-bit sum, in one kernel pass where it can."""

    __slots__ = ("fmt", "prm")

    def __init__(self, fmt) -> None:
        self.fmt = fmt
        self.prm = _cell_params(fmt) if _kernel.lstm_available() else None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return quantize(t, self.fmt)

    def add2(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        fused = self.prm is not None and not emits_graph_ops()  # (traced: graph ops)
        out = _kernel.round_add2(a, b, self.prm) if fused else None
        return out if out is not None else self(self(a) + self(b))


class _Uses:
    """The uses of a weight, one per step: each step's gradient rounded to the parameter
    format, summed in it, the last step's first (what the backward of a 16-bit run gives a
    16-bit weight used at every step); ``rnd`` None: plain uses."""

    def __init__(self, w: torch.Tensor | None, rnd) -> None:
        self.rest = w
        self.rnd = rnd if w is not None and w.requires_grad and torch.is_grad_enabled() else None

    def next(self) -> torch.Tensor | None:
        if self.rnd is None:
            return self.rest
        use, self.rest = _Split.apply(self.rest, 2, self.rnd)
        return use


class _Activation(torch.autograd.Function):
    """sigmoid or tanh rounded to the compute format, differentiated from that rounded output,
    as the 16-bit backward kernels read the 16-bit output the forward saved (autograd's fp32
    derivative uses the unrounded one: 47% (sigmoid), 62% (tanh) of fp16 input gradients off).
    ``tanh_backward``: dy * (1 - y * y) in fp32, rounded once (BinaryOpsKernel.cpp, the
    reduced-float branch). ``sigmoid_backward`` for float16 runs in c10::Half arithmetic, each
    operation rounded: ((dy * (1 - y)) * y); for other formats in fp32, rounded once."""

    @staticmethod
    def forward(ctx, x, sigmoid, fwd, grad, half_arith):
        y = fwd(torch.sigmoid(x) if sigmoid else torch.tanh(x))
        ctx.save_for_backward(y)
        ctx.spec = (sigmoid, grad, half_arith)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        sigmoid, grad, half_arith = ctx.spec
        dy = grad(dy)  # the gradient reaching the op's output, in the gradient format
        if not sigmoid:
            return grad(dy * (1 - y * y)), None, None, None, None
        if half_arith:
            return grad(grad(dy * grad(1 - y)) * y), None, None, None, None
        return grad(dy * (1 - y) * y), None, None, None, None


def _cell_params(fmt):
    """The kernel's parameters of rounding to nearest ``fmt``, or None where the fused cell
    does not stand for the replay (formats with no element parameters, fp32 itself)."""
    if not isinstance(fmt, (FloatFormat, FixedFormat)) or fmt == FP32 or fmt.dynamic:
        return None
    try:
        return _kernel.prepare(element_params(fmt), 0, 0)  # code 0: nearest even
    except (TypeError, ValueError):
        return None


# The activations of float16 and bfloat16 cells by table (lp_lstm_step_tab): a 16-bit sigmoid
# or tanh has 65,536 inputs, so the kernel looks their results up, computed once by torch's own
# float32 kernels and rounded once: what the op-by-op replay computes, and on every input what
# torch's native float16 / bfloat16 kernels give (tests/training/test_lstm_cell.py). (Computing
# them in the kernel instead, as Sleef does in ATen, was no faster: a step 266 us against 254 on
# an Intel Xeon, one thread.)
_TABLES: dict = {}


def _activation_tables(fmt):
    """(sigmoid's table, tanh's, the kernel's kind: 1 float16, 2 bfloat16) for those formats
    rounded to nearest, else None."""
    kind = 1 if fmt == FP16 else 2 if fmt == BF16 else 0
    if not kind or not _kernel.lstm_step_available():
        return None
    if fmt not in _TABLES:
        dtype = torch.float16 if kind == 1 else torch.bfloat16
        # every 16-bit pattern, in the order of its unsigned bits; on the CPU and by torch's own
        # kernels whatever default device or mode is active at the first use (a table built
        # under a user's mode or on the meta device would be kept for good)
        with torch.no_grad(), _disable_current_modes(), torch._C.DisableTorchFunction():
            x = torch.arange(65536, dtype=torch.int32, device="cpu").to(torch.int16)
            x = x.view(dtype).float()
            _TABLES[fmt] = (quantize(torch.sigmoid(x), fmt).contiguous(),
                            quantize(torch.tanh(x), fmt).contiguous(), kind)
    return _TABLES[fmt]


@dataclass(frozen=True)
class _CellRounding:
    """The fused cell's forward rounding: the kernel's parameters, and for float16 and bfloat16
    the activations' tables (a step in one kernel pass)."""
    prm: object
    tables: tuple | None


def _cell_forward(lin, xw, c, pc: _CellRounding, h=None):
    """One fused LSTM step's forward (:class:`_LSTMCell`): (h, written into ``h`` if given
    (contiguous), the new cell state, what its backward reads)."""
    lin = lin.contiguous()
    xw = xw if xw.stride(-1) == 1 else xw.contiguous()
    c = c if c.stride(-1) == 1 else c.contiguous()
    acts, cn = torch.empty_like(lin), c.new_empty(c.shape)
    h = torch.empty_like(cn) if h is None else h
    if pc.tables is not None:
        tc = torch.empty_like(cn)
        _kernel.lstm_step(lin, xw, c, *pc.tables, acts, cn, tc, h, pc.prm)
        return h, cn, (acts, tc, c)
    gates = torch.empty_like(lin)
    _kernel.lstm_gates(lin, xw, gates, pc.prm)
    i, f, g, o = gates.chunk(4, 1)
    # (tanh of a contiguous copy: the same values, and faster than over the strided chunk,
    # figure F32 of benchmarks/RESULTS.md)
    _kernel.lstm_forward(torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g.contiguous()),
                         torch.sigmoid(o), c, acts, cn, pc.prm)
    tc = torch.tanh(cn)
    _kernel.lstm_forward2(tc, acts, h, pc.prm)
    return h, cn, (acts, tc, c)


def _cell_backward(dh, dcn, saved, pg, half, d_gates=None, dc=None):
    """One fused step's backward: (the gates' gradient, written into ``d_gates`` if given, the
    cell state's, into ``dc`` if given: contiguous, not ``dcn``)."""
    acts, tc, c = saved
    if dh is None:  # as the op-by-op cell's rounding node gets it: zeros
        dh = torch.zeros_like(tc)
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    if dcn is not None and dcn.stride(-1) != 1:
        dcn = dcn.contiguous()
    d_gates = torch.empty_like(acts) if d_gates is None else d_gates
    dc = torch.empty_like(tc) if dc is None else dc
    _kernel.lstm_backward(dh, dcn, acts, tc, c, d_gates, dc, pg, half)
    return d_gates, dc


class _LSTMCell(torch.autograd.Function):
    """One LSTM step of the replay, fused: from the step's ``linear_hh`` output ``lin`` (not
    rounded), its input projection ``xw`` and the cell state ``c`` to (h, the new cell state),
    with every rounding of the op-by-op cell (:meth:`_Replay.cell`) and of its backward, in the
    same order, by the C kernel (lp_lstm_* in csrc/recurrent.c): four kernel calls and four torch
    activations a step (float16 and bfloat16: one call, :func:`_activation_tables`) instead of
    some forty ops and roundings, each with its autograd node. sigmoid and tanh are torch's own
    float32 kernels on the same tensors as the op-by-op cell, or their results on every 16-bit
    input, so the bits are that cell's (tested against it). The new cell state's gradient is the sum
    of its two uses' (this step's tanh, the next step's ``forgetgate * cx``) as :class:`_Split`
    adds them; ``h``'s gradient comes rounded or not (its uses' :class:`_Split` rounds)."""

    @staticmethod
    def forward(ctx, lin, xw, c, pc, pg, half):
        ctx.set_materialize_grads(False)
        h, cn, saved = _cell_forward(lin, xw, c, pc)
        ctx.save_for_backward(*saved)
        ctx.spec = (pg, half)
        return h, cn

    @staticmethod
    @once_differentiable
    def backward(ctx, dh, dcn):
        d_gates, dc = _cell_backward(dh, dcn, ctx.saved_tensors, *ctx.spec)
        return d_gates, d_gates, dc, None, None, None


def _column_major(t: torch.Tensor) -> bool:
    """The layout test of autograd's mm backward (``mm_mat1_backward``/``mm_mat2_backward``,
    FunctionsManual.cpp): a column-major operand gets its gradient computed transposed."""
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _same(t):
    return t


def _h_grad(d: torch.Tensor, w: torch.Tensor, h_prev: torch.Tensor, out=None) -> torch.Tensor:
    """linear_hh's input gradient from its output's ``d``, as autograd's addmm backward computes
    it (the same product, chosen by its layout test on the input ``h_prev``), into ``out`` if
    given where that product is ``d @ w``."""
    if _column_major(h_prev):
        return w.t().mm(d.t()).t()
    return d.mm(w) if out is None else torch.mm(d, w, out=out)


def _weight_grads(d_lin, h_prevs, w, need_w: bool, need_b: bool, first, add):
    """linear_hh's weight and bias gradients over the steps (``d_lin`` its output's gradient
    by step, ``h_prevs`` its inputs), each step's as autograd's addmm backward computes it,
    summed the last step first: ``first(g)`` the last step's, ``add(g, sum)`` each next."""
    wt = w.t()
    dw = db = None
    for d, h_prev in zip(reversed(d_lin), reversed(h_prevs)):
        if need_w:
            gw = d.t().mm(h_prev) if _column_major(wt) else h_prev.t().mm(d).t()
            dw = first(gw) if dw is None else add(gw, dw)
        if need_b:
            gb = d.sum(0)
            db = first(gb) if db is None else add(gb, db)
    return dw, db


class _LSTMLayer(torch.autograd.Function):
    """A whole unidirectional, unpacked LSTM layer of fused steps (:class:`_LSTMCell`) as one
    autograd node: the same forward, and a backward that replays, step by step from the last,
    what the chain of per-step nodes computes: each step's hidden-state gradient summed from
    its two uses (the output, the next step's ``linear_hh``) as :class:`_Split` sums them, the
    cell's backward by the kernel, ``linear_hh``'s backward as autograd's ``addmm`` backward
    computes it (the same matrix products, chosen by the same layout test), and the weights'
    gradients rounded step by step and summed in the parameter format, the last step's first
    (:class:`_Uses`). One node instead of about six a step: the per-step Python and autograd
    overhead of the chain goes, the bits stay (tests/training/test_lstm_cell.py).

    ``xw`` is the input projection of the whole sequence (time, batch, 4 hidden); returns
    (the output sequence, the last hidden state, the last cell state)."""

    @staticmethod
    def forward(ctx, xw, h0, c0, w, b, reverse, pc, pg, half, rnd_g, rnd_w):
        ctx.set_materialize_grads(False)
        steps = xw.shape[0]
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        h, c = h0, c0
        out, saved = c0.new_empty((steps,) + c0.shape), []  # each step's h written in place
        # linear_hh's output in one buffer for every step, warm in cache (F.linear's addmm /
        # mm, with out=: the same op)
        lin, wt = xw.new_empty(xw.shape[1:]), w.t()
        for t in order:
            if b is None:
                torch.mm(h, wt, out=lin)
            else:
                torch.addmm(b, h, wt, out=lin)
            h, c, s = _cell_forward(lin, xw[t], c, pc, out[t])
            saved += s
        # (the steps' inputs h from ``out`` itself, saved as an output: a view of it saved
        # would hold it, its node and so the view in a cycle, never freed)
        ctx.save_for_backward(w, b, h0, out, *saved)
        ctx.spec = (reverse, steps, pg, half, rnd_g, rnd_w)
        return out, h.clone(), c

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out, g_h, g_c):
        w, b, h0, out, *saved = ctx.saved_tensors
        reverse, steps, pg, half, rnd_g, rnd_w = ctx.spec
        need = ctx.needs_input_grad
        order = list(range(steps - 1, -1, -1) if reverse else range(steps))
        h_prevs = [h0] + [out[t] for t in order[:-1]]  # each step's input, in the forward's order
        # (one copy of a strided output gradient, not one per step in the 16-bit sums)
        outs = g_out.contiguous().unbind(0) if g_out is not None else (None,) * steps
        d_lin = [None] * steps  # by the step's place in the forward's order
        # the input projection's gradient: each step's gates' gradient written in place (no
        # stack of them after)
        dxw = saved[0].new_empty((steps,) + saved[0].shape) if need[0] else None
        # (the hidden and cell states' gradients step to step in two buffers each, warm in
        # cache: the hidden state's read by the next step's sum before the product rewrites it)
        dcs = [torch.empty_like(saved[1]) for _ in range(min(steps, 2))]
        dhs = [torch.empty_like(saved[1]) for _ in range(min(steps, 2))]
        for k in range(steps - 1, -1, -1):  # the steps in backward order
            t = order[k]
            h_prev, s = h_prevs[k], saved[3 * k:3 * k + 3]
            dh = _sum_of_uses((outs[t], g_h), rnd_g)
            d, g_c = _cell_backward(dh, g_c, s, pg, half, None if dxw is None else dxw[t],
                                    dcs[k % len(dcs)])
            d_lin[k] = d
            g_h = None
            if k or need[1]:  # linear_hh's input gradient: the previous hidden state's
                g_h = _h_grad(d, w, h_prev, dhs[k % len(dhs)])
        if dxw is not None:
            note_rounded(dxw, rnd_g.fmt)  # (the kernel rounded each: the projection's
            # rounding nodes skip it)
        # each step's weight gradient rounded, summed in the parameter format (:class:`_Uses`)
        dw, db = _weight_grads(d_lin, h_prevs, w, need[3], need[4], rnd_w, rnd_w.add2)
        return dxw, g_h, g_c, dw, db, None, None, None, None, None, None


class _LSTMLayerOps(torch.autograd.Function):
    """A whole unidirectional, unpacked LSTM layer without projections of the op-by-op cell
    (:meth:`_Replay.cell`) for formats that are not a 16-bit kernel's (stochastic rounding, fixed
    point, formats of no torch dtype), as one autograd node: each step's eleven roundings (the
    engine's sites, each with its own stochastic keys: ``pf``/``pb`` hold the forward's and the
    backward's per step, :meth:`_OpSites.params`) and the float32 ops between them by the C
    kernel (lp_lstm_op_* in csrc/recurrent.c), sigmoid and tanh by torch on the same tensors;
    backward as autograd runs the chain of per-step nodes (each op's float32 backward, each
    site's gradient rounding, a tensor's uses summed in float32, the weights' per-step
    gradients summed in float32, the last step's first). One node instead of some forty a
    step, the same bits (tests/training/test_lstm_cell.py)."""

    @staticmethod
    def forward(ctx, xw, h0, c0, w, b, reverse, pf, pb, gfmt):
        ctx.set_materialize_grads(False)
        steps, rows, hidden = xw.shape[0], c0.shape[0], c0.shape[1]
        order = range(steps - 1, -1, -1) if reverse else range(steps)
        h, c = h0, c0
        outs, saved = [None] * steps, []
        for k, t in enumerate(order):
            h_prev = h
            lin = F.linear(h_prev, w, b)
            gates = xw.new_empty((rows, 4 * hidden))
            _kernel.lstm_op_gates(lin, xw[t], gates, pf[k])
            i, f, g, o = gates.chunk(4, 1)
            si, sf, tg, so = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
            acts, cn = torch.empty_like(gates), xw.new_empty((rows, hidden))
            _kernel.lstm_op_cell(si, sf, tg, so, c, acts, cn, pf[k])
            tcu = torch.tanh(cn)
            tr, h = torch.empty_like(cn), torch.empty_like(cn)
            _kernel.lstm_op_out(tcu, acts, tr, h, pf[k])
            outs[t] = h
            saved += [h_prev, c, acts, si, sf, tg, so, tcu, tr]
            c = cn
        ctx.save_for_backward(w, b, *saved)
        ctx.spec = (reverse, steps, pb, gfmt)
        return torch.stack(outs), h, c

    @staticmethod
    @once_differentiable
    def backward(ctx, g_out, g_h, g_c):
        w, b, *saved = ctx.saved_tensors
        reverse, steps, pb, gfmt = ctx.spec
        need = ctx.needs_input_grad
        order = list(range(steps - 1, -1, -1) if reverse else range(steps))
        outs = g_out.contiguous().unbind(0) if g_out is not None else (None,) * steps
        d_lin = [None] * steps  # by the step's place in the forward's order
        # the input projection's gradient: each step's gates' gradient written in place
        dxw = saved[2].new_empty((steps,) + saved[2].shape) if need[0] else None
        dh, dc = g_h, g_c  # what reaches the last step's h and cell state besides its output
        for k in range(steps - 1, -1, -1):
            h_prev, c, acts, si, sf, tg, so, tcu, tr = saved[9 * k:9 * k + 9]
            d = torch.empty_like(acts) if dxw is None else dxw[order[k]]
            dcp = torch.empty_like(tcu)
            _kernel.lstm_op_backward(outs[order[k]], dh, dc, None, acts, si, sf, tg, so, tcu, tr,
                                     c, d, dcp, pb[k])
            d_lin[k], dc, dh = d, dcp, None
            if k or need[1]:  # linear_hh's input gradient: the previous hidden state's
                dh = _h_grad(d, w, h_prev)
        if dxw is not None:
            note_rounded(dxw, gfmt)  # (rounded at the gates' site: the projection's rounding
            # node leaves it as it is)
        # each step's weight gradient summed in float32, as autograd's buffer sums a weight's
        dw, db = _weight_grads(d_lin, saved[0::9], w, need[3], need[4], _same,
                               lambda g, acc: acc + g)
        return dxw, dh, dc if need[2] else None, dw, db, None, None, None, None


class _OpSites:
    """The kernel's parameters of the op-by-op LSTM step's roundings under a rule (compute and
    gradient formats with element parameters: floats, fixed point; any mode), and each step's
    eleven sites' stochastic keys: :meth:`params`."""

    SITES = 11  # linear_hh, gates, sigmoid i, f, tanh g, sigmoid o, f * c, i * g, c, tanh c, h

    def __init__(self, rule) -> None:
        self.fwd = self._prm(rule.compute, rule.rounding)
        self.bwd = self._prm(rule.grads, rule.grad_rounding)
        # a site's keys are drawn in turn (:class:`Site`), the forward's only where its
        # rounding is stochastic: the backward's are then the site's second, else its first
        self.bwd_draw = 1 if parse_rounding(rule.rounding, None)[0].is_stochastic else 0

    @staticmethod
    def _prm(fmt, rounding):
        if not isinstance(fmt, (FloatFormat, FixedFormat)) or fmt == FP32 or fmt.dynamic:
            raise ValueError(f"no element parameters for {fmt}")
        mode, rbits = parse_rounding(rounding, None)
        return _kernel.prepare(element_params(fmt), ROUNDING_CODES[mode], random_mask(rbits))

    def params(self, base, n0: int, steps: int):
        """(forward, backward) lp_params rows (steps, 11, 11) for the sites n0, n0 + 1, ...
        (11 a step, in the op-by-op order): the engine's :class:`Site` keys, the forward's
        rounding its first draw (counter n), the backward's its next (2**31 + n after a
        stochastic forward rounding, n after a deterministic one, which draws none)."""
        sites = range(n0, n0 + self.SITES * steps)
        j = self.bwd_draw * 2**31
        keys = torch.tensor([[derive_keys(base, n), derive_keys(base, j + n)]
                             for n in sites], dtype=torch.int64)  # (sites, 2, 2)
        shape = (steps, self.SITES, 2)
        return (_kernel.site_params(self.fwd, keys[:, 0].reshape(shape)),
                _kernel.site_params(self.bwd, keys[:, 1].reshape(shape)))


class _Replay:
    """One call replayed; ``act`` rounds an op's output (and the gradient reaching it)."""

    def __init__(self, engine, rule, key: str, kind: str) -> None:
        self.engine, self.rule, self.key, self.kind = engine, rule, key, kind
        # IEEE-style formats rounded to nearest stand for a 16-bit kernel: its backward's
        # roundings are replayed too; other formats (dynamic fixed point, blocks, stochastic
        # rounding) are differentiated op by op, as the engine differentiates any op
        self.plain = plain_formats(rule)
        self.uses_of_h = 2 if kind == "gru" else 1  # (h - n and) linear_hh

        grad, param = _Rounder(rule.grads), _Rounder(rule.params)
        self.grad_rounding = grad if self.plain else None
        self.weight_rounding = param if self.plain and rule.params == rule.compute else None
        # the fused LSTM cell (:class:`_LSTMCell`): plain formats the kernel rounds, eagerly
        self.fused = None
        if kind == "lstm" and self.plain and grad.prm is not None and not emits_graph_ops():
            pc = _cell_params(rule.compute)
            if pc is not None:
                cell = _CellRounding(pc, _activation_tables(rule.compute))
                self.fused = (cell, grad.prm, rule.grads == FP16)
        # other formats: the op-by-op step in the kernel (:class:`_LSTMLayerOps`), eagerly
        self.ops = None
        if kind == "lstm" and not self.plain and not rule.block and \
                _kernel.lstm_op_available() and not emits_graph_ops():
            try:
                self.ops = _OpSites(rule)
            except (TypeError, ValueError):  # a format with no element parameters
                pass

    def act(self, t: torch.Tensor) -> torch.Tensor:
        """An op's output on the compute grid; the gradient reaching it on the gradient grid."""
        return self.engine.round(t, self.rule, self.key)

    def split(self, t: torch.Tensor, n: int) -> tuple:
        """``n`` uses of ``t``, their gradients rounded and summed as a 16-bit run sums them,
        in this order (:class:`_Split`)."""
        if n == 1 or self.grad_rounding is None or not (t.requires_grad and
                                                         torch.is_grad_enabled()):
            return (t,) * n
        return _Split.apply(t, n, self.grad_rounding)

    def activation(self, x, sigmoid: bool):
        """sigmoid(x) or tanh(x) on the compute grid; plain formats: differentiated as the
        16-bit kernels are (:class:`_Activation`)."""
        if not self.plain or not (x.requires_grad and torch.is_grad_enabled()):
            return self.act(x.sigmoid() if sigmoid else x.tanh())
        rule = self.rule

        def fwd(t):
            return quantize(t, rule.compute)

        return _Activation.apply(x, sigmoid, fwd, self.grad_rounding, rule.grads == FP16)

    def linear(self, x, w, b):
        """at::linear (Linear.cpp): addmm for 2-D and contiguous 3-D inputs, one rounding;
        a non-contiguous 3-D input with a bias: matmul, then add_(bias), each rounded."""
        if b is not None and x.dim() == 3 and not x.is_contiguous():
            m = torch.matmul(x, w.t())
            if m._is_view():
                return self.act(self.act(m) + b)
            # the same roundings and sum in place: no new (time x batch x 4 hidden) buffers
            # (figure F33 of benchmarks/RESULTS.md)
            self.engine.round_(m, self.rule, self.key)
            m.add_(b)
            self.engine.round_(m, self.rule, self.key)
            return m
        return self.act(F.linear(x, w, b))

    # -- cells (RNN.cpp's LSTMCell, GRUCell, SimpleCell with pre_compute_input) ----------------
    def cell(self, xw, h_uses, c, uses):
        """One step: ``xw`` the step's input projection, ``h_uses`` the cell's uses of the
        hidden state (GRU: h - n, linear_hh; others: linear_hh), ``c`` the LSTM's cell state.
        Returns the new (h, c); c is the use left for the next step or the final state."""
        act, sig = self.act, self.activation
        w_hh, b_hh = uses[0].next(), uses[1].next()
        if self.kind == "lstm" and self.fused is not None and xw.dtype == torch.float32 and \
                xw.device.type == "cpu" and c.dtype == torch.float32 and c.dim() == 2:
            lin = F.linear(h_uses[0], w_hh, b_hh)
            stream = self.engine._stream
            if stream is not None:  # the sites the op-by-op cell's roundings would take
                stream.n += self._cell_sites(lin, xw, c)
            h, c = _LSTMCell.apply(lin, xw, c, *self.fused)
            w_hr = uses[2].next()
            if w_hr is not None:  # projections: matmul_hr
                h = act(torch.matmul(h, w_hr.t()))
            return h, c
        if self.kind == "lstm":
            gates = act(act(F.linear(h_uses[0], w_hh, b_hh)) + xw)  # linear_hh(hx).add_(input)
            i, f, g, o = gates.chunk(4, 1)
            i, f, g, o = sig(i, True), sig(f, True), sig(g, False), sig(o, True)
            c = act(act(f * c) + act(i * g))  # (forgetgate * cx).add_(ingate * cellgate)
            c_here, c = self.split(c, 2)  # cy.tanh(), and the next step's forgetgate * cx
            h = act(o * sig(c_here, False))
            w_hr = uses[2].next()
            if w_hr is not None:  # projections: matmul_hr
                h = act(torch.matmul(h, w_hr.t()))
            return h, c
        if self.kind == "gru":
            h_sub, h_lin = h_uses
            ir, iz, in_ = xw.chunk(3, 1)
            hr, hz, hn = act(F.linear(h_lin, w_hh, b_hh)).chunk(3, 1)
            r = sig(act(hr + ir), True)
            z = sig(act(hz + iz), True)
            n_sub, n_add = self.split(sig(act(in_ + act(hn * r)), False), 2)
            return act(act(act(h_sub - n_sub) * z) + n_add), None  # (h - n).mul_(z).add_(n)
        pre = act(act(F.linear(h_uses[0], w_hh, b_hh)) + xw)
        return (sig(pre, False) if self.kind == "rnn_tanh" else act(pre.relu())), None

    @staticmethod
    def _cell_sites(lin, xw, c) -> int:
        """The rounding sites of one op-by-op LSTM cell: six ``act`` roundings (linear_hh, the
        gates, f * c, i * g, the cell state, h), and one more per activation whose input needs
        no gradient (rounded by ``act``, not :class:`_Activation`): the four gates' when
        neither ``lin`` nor ``xw`` does, the cell state's tanh when ``c`` does not either."""
        on = torch.is_grad_enabled()
        gates = on and (lin.requires_grad or xw.requires_grad)
        state = gates or (on and c.requires_grad)
        return 6 + (0 if gates else 4) + (0 if state else 1)

    def uses(self, p):
        _, w_hh, _, b_hh, w_hr = p
        return [_Uses(w, self.weight_rounding) for w in (w_hh, b_hh, w_hr)]

    def after_step(self, h, whole_next: bool):
        """The uses of a step's new hidden state: (output, the next step's uses) when the next
        step takes the whole state (its uses and the output's sum in one buffer, in that
        order: output, h - n, linear_hh); else (output, the rest), the rest to be sliced."""
        if whole_next:
            out, *h_uses = self.split(h, 1 + self.uses_of_h)
            return out, None, h_uses
        out, rest = self.split(h, 2)
        return out, rest, None

    # -- layers ---------------------------------------------------------------------------------
    def full(self, x, state, p, reverse: bool):
        """FullLayer over a (time, batch, features) input; ``reverse``: the backward direction
        of FullBidirectionalLayer (same projection, steps walked backwards)."""
        xw = self.linear(x, p[0], p[2])
        layer = self._layer(xw, state, p, reverse)
        if layer is not None:
            return layer
        steps = xw.unbind(0)
        uses = self.uses(p)
        h, c = state
        h_uses = self.split(h, self.uses_of_h)
        outs = [None] * len(steps)
        order = list(range(len(steps)))[::-1 if reverse else 1]
        for k, t in enumerate(order):
            h, c = self.cell(steps[t], h_uses, c, uses)
            outs[t], h, h_uses = self.after_step(h, k + 1 < len(order))
        return torch.stack(outs), (h, c)

    def _layer(self, xw, state, p, reverse: bool):
        """The whole layer as one node (:class:`_LSTMLayer`) where the per-step chain would be
        fused cells with gradients: an LSTM without projections whose weights, if they take
        gradients, sum them in the parameter format; else None."""
        _, w_hh, _, b_hh, w_hr = p
        h0, c0 = state
        tensors = [t for t in (xw, h0, w_hh, b_hh) if t is not None]
        if self.kind != "lstm" or w_hr is not None or \
                not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors) or \
                xw.dtype != torch.float32 or xw.device.type != "cpu" or c0 is None or \
                c0.dtype != torch.float32 or c0.dim() != 2 or xw.shape[0] == 0:
            return None
        if self.fused is None:
            return self._op_layer(xw, h0, c0, w_hh, b_hh, reverse)
        if self.weight_rounding is None and \
                any(t is not None and t.requires_grad for t in (w_hh, b_hh)):
            return None
        stream = self.engine._stream
        if stream is not None:  # each step's gates take gradients: six sites a step
            stream.n += 6 * xw.shape[0]
        out, h, c = _LSTMLayer.apply(xw, h0, c0, w_hh, b_hh, reverse, *self.fused,
                                     self.grad_rounding, self.weight_rounding)
        return out, (h, c)

    def _op_layer(self, xw, h0, c0, w, b, reverse: bool):
        """The layer as one node of op-by-op steps in the kernel (:class:`_LSTMLayerOps`), for
        formats the fused cell does not take, where the roundings draw their keys from the
        forward's stream as pairs of ints (eagerly); else None (the chain of per-step ops)."""
        stream = self.engine._stream
        if self.ops is None or stream is None or type(stream.base) is not tuple or \
                xw.stride(-1) != 1 or emits_graph_ops():
            return None
        steps = xw.shape[0]
        pf, pb = self.ops.params(stream.base, stream.n, steps)
        stream.n += _OpSites.SITES * steps  # the sites the chain's roundings would take
        c0 = c0 if c0.stride(-1) == 1 or c0.shape[-1] == 1 else c0.contiguous()
        out, h, c = _LSTMLayerOps.apply(xw, h0, c0, w, b, reverse, pf, pb, self.rule.grads)
        return out, (h, c)

    def packed(self, data, sizes, state, p, reverse: bool):
        """PackedLayer (the hidden state shrinks as sequences end, the finished rows kept for
        the final state) or ReversedPackedLayer (it grows from the initial state's rows)."""
        steps = torch.split(self.linear(data, p[0], p[2]), sizes)
        uses = self.uses(p)
        h0, c0 = state
        order = list(range(len(sizes)))[::-1 if reverse else 1]
        finals, outs = [], [None] * len(sizes)
        last = sizes[order[0]]
        h, c = h0[:last], (c0[:last] if c0 is not None else None)
        h_uses = None
        for k, i in enumerate(order):
            b = sizes[i]
            if h_uses is None:
                if b < last:  # PackedLayer: rows b..last are finished
                    finals.append((h[b:last], c[b:last] if c is not None else None))
                    h, c = h[:b], (c[:b] if c is not None else None)
                elif b > last:  # ReversedPackedLayer: rows last..b join
                    h = torch.cat([h, h0[last:b]])
                    c = torch.cat([c, c0[last:b]]) if c is not None else None
                h_uses = self.split(h, self.uses_of_h)
            last = b
            h, c = self.cell(steps[i], h_uses, c, uses)
            whole = k + 1 < len(order) and sizes[order[k + 1]] == b
            outs[i], h, h_uses = self.after_step(h, whole)
        if reverse:
            return torch.cat(outs, 0), (h, c)
        finals.append((h, c))
        finals.reverse()
        hs = torch.cat([f[0] for f in finals], 0)
        return torch.cat(outs, 0), (hs, torch.cat([f[1] for f in finals], 0) if c0 is not None
                                     else None)

    def dropout(self, x, p: float):
        """at::dropout(input, p, train=true) on CPU (Dropout.cpp, ``_dropout_impl``): noise =
        empty_like(input).bernoulli_(1 - p) (the same draws from torch's generator whatever the
        dtype), noise.div_(1 - p) in the 16-bit dtype, input * noise."""
        if p == 1:
            return self.act(x * 0)
        with torch.no_grad():
            noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
        noise = self.engine.round(noise, self.rule, self.key, grads=False)
        return self.act(x * noise)


def replay(engine, rule, key: str, call: RecurrentCall):
    """The outputs torch's op returns ((output, hy) or (output, hy, cy); ``output`` is the
    packed data for a packed call), computed op by op as ATen's CPU composite does, each op's
    output rounded by ``engine.round``; the caller rounds the outputs (already on the grid)."""
    rp = _Replay(engine, rule, key, call.kind)
    dirs = 2 if call.bidirectional else 1
    hx = call.hx
    states = [(hx[0][i], hx[1][i] if len(hx) > 1 else None) for i in range(hx[0].shape[0])]
    x = call.x.transpose(0, 1) if call.batch_first else call.x
    finals = []
    for layer in range(call.num_layers):
        results = []
        for d, xd in enumerate(rp.split(x, dirs)):  # both directions project the same input
            i = layer * dirs + d
            if call.batch_sizes is None:
                results.append(rp.full(xd, states[i], call.params[i], reverse=d == 1))
            else:
                results.append(rp.packed(xd, call.batch_sizes, states[i], call.params[i],
                                         reverse=d == 1))
        x = results[0][0] if dirs == 1 else torch.cat([r[0] for r in results], -1)
        finals += [r[1] for r in results]
        if call.dropout and call.train and layer < call.num_layers - 1:
            x = rp.dropout(x, call.dropout)
    if call.batch_first:
        x = x.transpose(0, 1)
    hy = torch.stack([f[0] for f in finals])
    if call.kind != "lstm":
        return x, hy
    return x, hy, torch.stack([f[1] for f in finals])
