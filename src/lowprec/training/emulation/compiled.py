"""Compiled emulation: a model's forward and backward compiled by Inductor with every rounding
of the eager engine in the graph.

Stochastic rounding: each forward draws one base pair of keys from the engine's generator (as
the eager engine's root forward does) and passes it to the compiled function as a tensor, a graph
input; every rounding's keys are derived from it inside the graph as the eager engine derives
them from the same pair in Python (:class:`.autograd_fns.Site`, :func:`lowprec.numerics.keys
.derive_keys`), so the random bits are the eager ones.

Two traces, one after the other:

1. Dynamo traces the model's plain fp32 forward into one graph (``fullgraph=True``): the
   engine's module hooks do nothing while Dynamo traces (``_eager_only`` in :mod:`.engine`),
   so no lowprec code enters this graph and none breaks it.
2. lowprec's Dynamo backend (:func:`backend`) hands that graph to AOTAutograd with a function
   that runs the graph node by node (``torch.fx.Interpreter``) under the eager engine
   (:meth:`Emulation.call_root`, as the root module's hooks run a forward). AOTAutograd traces
   the forward and, through ``torch.autograd``, the backward at the ATen level; the engine's
   Python -- the rule lookups, the tensor marks, its autograd Functions and their backwards,
   the 16-bit sums of an activation's consumers -- runs once, at trace time, and every rounding
   it makes is recorded as one ``lowprec::quantize`` node (:mod:`lowprec.numerics.ops`).
   Inductor (``compile_fx_inner``) then compiles the forward and backward graphs.

The compiled step makes the eager engine's roundings, in its order; what Inductor may change is
the fp32 arithmetic between them (a fused reduction may sum in another order than ATen's
kernel). The parameters' graph inputs stand in for the parameters (``PARAM``: their id), and
carry their marks, so that the engine rounds, names and sums them as it does the parameters.

What cannot be traced runs eagerly, with one warning line naming why (:func:`unsupported`):
state the engine reads per call that a graph would freeze at its trace (dynamic fixed point's
ranges, observers), per-module overrides (the flat graph has no
module boundaries the engine's rules follow here), C kernels that take real data (accumulators,
``match_cpu_kernels``), scaled GEMMs and CUDA's kernels (``target="cuda"``, or a model on
a CUDA device with no target: the compiled graph holds the CPU kernels' roundings); and any
failure to compile (a graph break under
``fullgraph``, a recompilation limit reached).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import threading
import types

import torch
from torch import nn

from ..caller import warn
from ...numerics import fused as _fused
from ...numerics.formats import BlockFormat
from ...numerics.ops import define_op, quantize_op
from ...numerics.quantize import seed_tensor, tracing_graph
from ..tree import tensors_in
from .dtypes import LOGICAL, format_dtype
from .engine import MARK, PARAM, Emulation

__all__ = ["CompiledForward", "backend", "roundings_in", "unsupported", "compile_model", "COMPILERS"]


def _rules(engine: Emulation) -> list:
    return [engine.root_rule, *engine.rules.values(), *engine.overrides.values()]


def unsupported(engine: Emulation) -> str | None:
    """Why ``engine``'s model cannot run compiled (None: it can)."""
    rules = _rules(engine)
    if engine.overrides:
        return "per-module overrides"
    for r in rules:
        fmts = (r.compute, r.grads, r.params)
        if any(getattr(f, "dynamic", False) for f in fmts):
            return "dynamic fixed point keeps its ranges per call"
        if any(isinstance(f, BlockFormat) for f in fmts):
            return "block formats are emulated eagerly"
        if r.accumulator is not None:
            return "accumulator emulation runs a C kernel on real data"
        if r.scaled is not None:
            return "scaled GEMMs are emulated eagerly"
    if engine.match_cpu_kernels:
        return "match_cpu_kernels runs kernels on real data"
    model = engine.model
    if engine.target == "cuda" or engine.target is None and model is not None and any(
            t.is_cuda for t in (*model.parameters(), *model.buffers())):
        return "CUDA's kernels (target='cuda') are emulated eagerly"
    return None


_OPAQUE: dict = {}  # ATen op -> (its lowprec_compiled op, how to pass its arguments)
# Inductor's vector loops take ATen's vectorised exp (Sleef) on whole vectors but std::exp on
# a row's tail, where ATen's kernel runs the vector code on a partial vector: the tail's values
# differ by an ulp now and then (attention's exp over 8 keys)
_TRANSCENDENTAL = ("exp", "expm1", "log", "log1p", "tanh", "erf", "sigmoid", "sin", "cos")



_LIB = None  # the lowprec_compiled library, defined on first use (:func:`_opaque_op`)


class _OpaqueOp:
    """What :func:`_opaque_op` gives: ``register_fake``, as a ``torch.library.custom_op``'s."""

    def __init__(self, qualname: str) -> None:
        self.qualname = qualname

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn


def _opaque_op(name: str):
    """``lowprec_compiled::<name>``, a functional op running ``fn`` (its schema inferred from
    its annotations, as ``torch.library.custom_op`` infers it) on every device. Defined with
    ``torch.library.Library`` rather than ``custom_op``: one Python call a use, where
    ``custom_op``'s Python dispatch wrappers cost 6.5 us more a call (a 4 x 4 ``mm``: 9.7 us
    against 3.2, ATen's own 1.9, on an Intel Xeon), and a compiled step calls these ops often
    (the MLP's: eleven times; benchmarks/RESULTS.md, "Issue 37, thirteenth session"). No
    autograd: they run inside compiled graphs, whose forward and backward are
    traced already."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("lowprec_compiled", "FRAGMENT")

    def define(fn):
        return _OpaqueOp(define_op(_LIB, name, fn))

    return define


def _opaque_ops() -> dict:
    """Opaque custom ops running ATen's kernels, registered on first use, for the ops whose
    Inductor code differs from ATen's in its last bits (and then, now and then, in a rounding
    to 16 bits): its own loops for a sum, a mean or a variance add in another order than ATen's
    CPU kernels (a cascade of partial sums); a GEMM on an operand Inductor laid out otherwise
    sums in another order (opaque ops get the traced strides); transcendental functions
    (``_TRANSCENDENTAL``). Inductor fuses around them, not through them."""
    if _OPAQUE:
        return _OPAQUE
    _register_gemms_and_reductions()
    _register_pointwise()
    _register_norms()
    _register_pooling_and_embedding()
    _OPAQUE.update(_pointwise_rewrites())
    _OPAQUE.update(_kernel_rewrites())
    return _OPAQUE


def _register_gemms_and_reductions() -> None:
    """lowprec_compiled::sum, mean, var_mean, mm, bmm, addmm (:func:`_opaque_ops`)."""
    aten = torch.ops.aten

    @_opaque_op("sum")
    def sum_(x: torch.Tensor, dim: list[int] | None, keepdim: bool) -> torch.Tensor:
        return aten.sum.dim_IntList(x, dim, keepdim)

    @_opaque_op("mean")
    def mean_(x: torch.Tensor, dim: list[int] | None, keepdim: bool) -> torch.Tensor:
        return aten.mean.dim(x, dim, keepdim)

    @_opaque_op("var_mean")
    def var_mean_(x: torch.Tensor, dim: list[int] | None, correction: float | None,
                  keepdim: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return aten.var_mean.correction(x, dim, correction=correction, keepdim=keepdim)

    @_opaque_op("mm")
    def mm_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return aten.mm.default(a, b)

    @_opaque_op("bmm")
    def bmm_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return aten.bmm.default(a, b)

    @_opaque_op("addmm")
    def addmm_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return aten.addmm.default(c, a, b)

    mm_.register_fake(lambda a, b: aten.mm.default(a, b))
    bmm_.register_fake(lambda a, b: aten.bmm.default(a, b))
    addmm_.register_fake(lambda c, a, b: aten.addmm.default(c, a, b))
    sum_.register_fake(lambda x, dim, keepdim: aten.sum.dim_IntList(x, dim, keepdim))
    mean_.register_fake(lambda x, dim, keepdim: aten.mean.dim(x, dim, keepdim))
    var_mean_.register_fake(lambda x, dim, correction, keepdim: aten.var_mean.correction(
        x, dim, correction=correction, keepdim=keepdim))


def _register_pointwise() -> None:
    """lowprec_compiled::unary, activation(_backward), addcmul, softmax(_backward); and
    adaptive_avg_pool2d and dropout(_backward), which are not pointwise but are registered
    here too (:func:`_opaque_ops`)."""
    aten = torch.ops.aten

    @_opaque_op("unary")
    def unary_(x: torch.Tensor, name: str) -> torch.Tensor:
        return getattr(aten, name).default(x)

    unary_.register_fake(lambda x, name: getattr(aten, name).default(x))

    # activations whose decompositions compute another formula than ATen's kernels (silu:
    # x * sigmoid(x) for x / (1 + exp(-x))) or another erf: 1-ulp fp32 differences that now
    # and then move a 16-bit rounding (the zoo's dict-input, GELU, under 16-true)
    @_opaque_op("activation")
    def activation_(x: torch.Tensor, name: str, approximate: str) -> torch.Tensor:
        return _activation(name, x, approximate)

    @_opaque_op("activation_backward")
    def activation_bw_(g: torch.Tensor, x: torch.Tensor, name: str,
                       approximate: str) -> torch.Tensor:
        return _activation(name + "_backward", g, x, approximate)

    activation_.register_fake(lambda x, name, approximate: torch.empty_like(x))
    activation_bw_.register_fake(lambda g, x, name, approximate: torch.empty_like(g))

    # ATen's CPU addcmul is compiled with its multiply and add contracted to one fused
    # multiply-add (one rounding); Inductor's CPU code, built with -ffp-contract=off, rounds the
    # product first: 18% of a batch-norm output's fp32 values (the engine's y = x * a + b')
    # differ by an ulp, and now and then a rounding to the format with them (ResNet-20 under
    # stochastic gradients: the outputs of its second step)
    @_opaque_op("addcmul")
    def addcmul_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return aten.addcmul.default(c, a, b)

    addcmul_.register_fake(lambda c, a, b: aten.addcmul.default(c, a, b))

    # adaptive average pooling to more than 1 x 1 (1 x 1 is ATen's mean, opaque already):
    # Inductor lowers it with its own window sums, in another order than ATen's kernel (5,162
    # of 23,040 outputs differed, 8 x 16 x 7 x 7 to 3 x 3, twenty draws); Inductor runs its
    # backward on ATen's kernel already
    @_opaque_op("adaptive_avg_pool2d")
    def adaptive_avg_pool_(x: torch.Tensor, size: list[int]) -> torch.Tensor:
        return aten._adaptive_avg_pool2d.default(x, size)

    adaptive_avg_pool_.register_fake(lambda x, size: aten._adaptive_avg_pool2d.default(x, size))

    # dropout as eager torch.dropout computes it on a CPU (ATen's _dropout_impl: the noise
    # bernoulli_(1 - p) from torch's generator, divided by 1 - p in float32, times the input),
    # where the trace holds native_dropout (x * mask * (1 / (1 - p)) in double): the same
    # masks, but the scale an ulp apart for some p (15 of p = 0.01 ... 0.99)
    @_opaque_op("dropout")
    def dropout_(x: torch.Tensor, p: float, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not train or p == 0 or x.numel() == 0:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        if p == 1:
            return x * torch.zeros((), dtype=x.dtype), torch.zeros_like(x, dtype=torch.bool)
        noise = torch.empty_like(x).bernoulli_(1 - p)
        mask = noise.bool()
        return x * noise.div_(1 - p), mask

    @_opaque_op("dropout_backward")
    def dropout_bw_(g: torch.Tensor, mask: torch.Tensor, keep: float) -> torch.Tensor:
        # keep = 1 - p (from native_dropout_backward's scale 1 / (1 - p), which gives back
        # 1 - p in float32 for every p of 0.01 ... 0.99): the gradient times eager's noise
        if keep == 0:
            return g * torch.zeros((), dtype=g.dtype)
        return g * mask.to(g.dtype).div_(keep)

    dropout_.register_fake(lambda x, p, train: (torch.empty_like(x),
                                                torch.empty_like(x, dtype=torch.bool)))
    dropout_bw_.register_fake(lambda g, mask, keep: torch.empty_like(g))

    @_opaque_op("softmax")
    def softmax_(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        return (aten._log_softmax if log else aten._softmax).default(x, dim, False)

    @_opaque_op("softmax_backward")
    def softmax_bw_(g: torch.Tensor, out: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
        op = aten._log_softmax_backward_data if log else aten._softmax_backward_data
        return op.default(g, out, dim, torch.float32)

    softmax_.register_fake(lambda x, dim, log: torch.empty_like(x))
    softmax_bw_.register_fake(lambda g, out, dim, log: torch.empty_like(g))


def _register_norms() -> None:
    """lowprec_compiled::layer_norm(_backward), batch_norm(_no_stats, _eval, _backward)
    (:func:`_opaque_ops`)."""
    aten = torch.ops.aten

    @_opaque_op("layer_norm")
    def layer_norm_(x: torch.Tensor, shape: list[int], w: torch.Tensor | None,
                    b: torch.Tensor | None, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.clone() if t is x else t
                     for t in aten.native_layer_norm.default(x, shape, w, b, eps))

    @_opaque_op("layer_norm_backward")
    def layer_norm_bw_(g: torch.Tensor, x: torch.Tensor, shape: list[int], mean: torch.Tensor,
                       rstd: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                       mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # an output not asked for (None in the traced graph, which has no user of it) is an
        # empty tensor: a custom op returns tensors only
        out = aten.native_layer_norm_backward.default(g, x, shape, mean, rstd, w, b, mask)
        return tuple(x.new_empty(0) if t is None else t for t in out)

    # batch norm: the engine's 16-bit replay takes its statistics and backward from these fp32
    # kernels (kernels.batch_norm), and fp32 islands run them; Inductor's decompositions sum in
    # another order
    @_opaque_op("batch_norm")
    def batch_norm_(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                    rm: torch.Tensor, rv: torch.Tensor, training: bool, momentum: float,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
        return aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, training,
                                                                momentum, eps)

    @_opaque_op("batch_norm_no_stats")
    def batch_norm_ns_(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                       training: bool, momentum: float, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return aten._native_batch_norm_legit.no_stats(x, w, b, training, momentum, eps)

    @_opaque_op("batch_norm_eval")
    def batch_norm_ev_(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None,
                       rm: torch.Tensor, rv: torch.Tensor, momentum: float, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return aten._native_batch_norm_legit_no_training.default(x, w, b, rm, rv, momentum,
                                                                 eps)

    @_opaque_op("batch_norm_backward")
    def batch_norm_bw_(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None,
                       rm: torch.Tensor | None, rv: torch.Tensor | None,
                       save_mean: torch.Tensor | None, save_invstd: torch.Tensor | None,
                       train: bool, eps: float, mask: list[bool]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = aten.native_batch_norm_backward.default(g, x, w, rm, rv, save_mean, save_invstd,
                                                      train, eps, mask)
        return tuple(x.new_empty(0) if t is None else t for t in out)  # as layer_norm_bw_

    batch_norm_.register_fake(
        lambda x, w, b, rm, rv, training, momentum, eps:
        aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, training, momentum,
                                                         eps))
    batch_norm_ns_.register_fake(
        lambda x, w, b, training, momentum, eps:
        aten._native_batch_norm_legit.no_stats(x, w, b, training, momentum, eps))
    batch_norm_ev_.register_fake(
        lambda x, w, b, rm, rv, momentum, eps:
        aten._native_batch_norm_legit_no_training.default(x, w, b, rm, rv, momentum, eps))
    batch_norm_bw_.register_fake(
        lambda g, x, w, rm, rv, save_mean, save_invstd, train, eps, mask: (
            torch.empty_like(x) if mask[0] else x.new_empty(0),
            *(x.new_empty(x.shape[1]) if want else x.new_empty(0) for want in mask[1:])))
    layer_norm_.register_fake(lambda x, shape, w, b, eps: aten.native_layer_norm.default(
        x, shape, w, b, eps))
    layer_norm_bw_.register_fake(lambda g, x, shape, mean, rstd, w, b, mask: (
        x.new_empty(x.shape) if mask[0] else x.new_empty(0),  # dX contiguous, as the kernel's
        *(torch.empty_like(t) if want else x.new_empty(0) for t, want in zip((w, b), mask[1:]))))


def _register_pooling_and_embedding() -> None:
    """lowprec_compiled::max_pool2d(_backward), embedding_backward (:func:`_opaque_ops`)."""
    aten = torch.ops.aten

    # an embedding's weight gradient adds the rows of each index in the order they come; the
    # decomposition (index_put with accumulate) adds them in another (zoo encoder, 16-mixed)
    # max pooling: Inductor's loop over windows with indices is scalar code, and a bf16 cast
    # round trip fused into it is c10's scalar conversion (benchmarks/RESULTS.md, "Issue 37,
    # second session"); ATen's kernel is vectorised and exact (kept undecomposed for it)
    @_opaque_op("max_pool2d")
    def max_pool_(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                  dilation: list[int], ceil: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return aten.max_pool2d_with_indices.default(x, kernel, stride, padding, dilation, ceil)

    @_opaque_op("max_pool2d_backward")
    def max_pool_bw_(g: torch.Tensor, x: torch.Tensor, kernel: list[int], stride: list[int],
                     padding: list[int], dilation: list[int], ceil: bool,
                     idx: torch.Tensor) -> torch.Tensor:
        return aten.max_pool2d_with_indices_backward.default(g, x, kernel, stride, padding,
                                                             dilation, ceil, idx)

    max_pool_.register_fake(lambda x, k, s, p, d, c: aten.max_pool2d_with_indices.default(
        x, k, s, p, d, c))
    max_pool_bw_.register_fake(lambda g, x, k, s, p, d, c, i:
                               aten.max_pool2d_with_indices_backward.default(g, x, k, s, p, d,
                                                                             c, i))

    @_opaque_op("embedding_backward")
    def embedding_bw_(g: torch.Tensor, idx: torch.Tensor, n: int, pad: int,
                      by_freq: bool) -> torch.Tensor:
        return aten.embedding_dense_backward.default(g, idx, n, pad, by_freq)

    embedding_bw_.register_fake(
        lambda g, idx, n, pad, by_freq: g.new_empty((n, g.shape[-1])))


def _pointwise_rewrites() -> dict:
    """ATen op -> (its opaque op, its arguments spelled for it; None: the call stays as it
    is) for the transcendental functions and activations."""
    aten = torch.ops.aten
    lc = torch.ops.lowprec_compiled
    out: dict = {}
    for name in _TRANSCENDENTAL:
        out[getattr(aten, name).default] = (lc.unary.default,
                                            lambda a, kw, name=name: (a[0], name))

    out.update({
        aten.addcmul.default: (lc.addcmul.default, lambda a, kw: None if kw or len(a) != 3
                               else tuple(a)),
        aten._adaptive_avg_pool2d.default: (lc.adaptive_avg_pool2d.default,
                                            lambda a, kw: None if kw else (a[0], list(a[1]))),
        aten.native_dropout.default: (lc.dropout.default, lambda a, kw: None if kw or len(a) != 3
                                      or a[2] is None else (a[0], float(a[1]), bool(a[2]))),
        aten.native_dropout_backward.default: (
            lc.dropout_backward.default, lambda a, kw: None if kw or len(a) != 3
            else (a[0], a[1], 0.0 if math.isinf(float(a[2])) else 1.0 / float(a[2]))),
        aten.gelu.default: (lc.activation.default, lambda a, kw: None if kw else (
            a[0], "gelu", a[1] if len(a) > 1 else "none")),
        aten.silu.default: (lc.activation.default, lambda a, kw: None if kw else (
            a[0], "silu", "")),
        aten.gelu_backward.default: (lc.activation_backward.default, lambda a, kw: None if kw
                                     else (a[0], a[1], "gelu", a[2] if len(a) > 2 else "none")),
        aten.silu_backward.default: (lc.activation_backward.default, lambda a, kw: None if kw
                                     else (a[0], a[1], "silu", "")),
    })
    return out


def _kernel_rewrites() -> dict:
    """ATen op -> (its opaque op, its arguments spelled for it; None: the call stays as it
    is) for softmax, the norms, max pooling, an embedding's backward, GEMMs and reductions."""
    aten = torch.ops.aten
    lc = torch.ops.lowprec_compiled

    def dims(args):
        return args[1] if len(args) > 1 else None

    def keep(args, kw):
        return args[2] if len(args) > 2 else kw.get("keepdim", False)

    def fp32(a, kw, i):
        return len(a) > i and a[i] in (False, torch.float32) and not kw

    return {
        aten._softmax.default: (lc.softmax.default, lambda a, kw: (a[0], a[1], False)
                                if fp32(a, kw, 2) else None),
        aten._log_softmax.default: (lc.softmax.default, lambda a, kw: (a[0], a[1], True)
                                    if fp32(a, kw, 2) else None),
        aten._softmax_backward_data.default: (
            lc.softmax_backward.default,
            lambda a, kw: (a[0], a[1], a[2], False) if fp32(a, kw, 3) else None),
        aten._log_softmax_backward_data.default: (
            lc.softmax_backward.default,
            lambda a, kw: (a[0], a[1], a[2], True) if fp32(a, kw, 3) else None),
        aten.native_layer_norm.default: (lc.layer_norm.default,
                                         lambda a, kw: None if kw else tuple(a)),
        aten.native_layer_norm_backward.default: (
            lc.layer_norm_backward.default,
            lambda a, kw: (*a[:7], [bool(m) for m in a[7]]) if not kw and len(a) == 8
            and (a[5] is not None or not a[7][1]) and (a[6] is not None or not a[7][2])
            else None),
        aten._native_batch_norm_legit_functional.default: (
            lc.batch_norm.default, lambda a, kw: None if kw else tuple(a)),
        aten._native_batch_norm_legit.no_stats: (
            lc.batch_norm_no_stats.default, lambda a, kw: None if kw else tuple(a)),
        aten._native_batch_norm_legit_no_training.default: (
            lc.batch_norm_eval.default, lambda a, kw: None if kw else tuple(a)),
        aten.native_batch_norm_backward.default: (
            lc.batch_norm_backward.default,
            lambda a, kw: (*a[:9], [bool(m) for m in a[9]]) if not kw and len(a) == 10
            and (a[2] is not None or not a[9][1]) else None),
        aten.max_pool2d_with_indices.default: (lc.max_pool2d.default, _pool_args),
        aten.max_pool2d_with_indices_backward.default: (
            lc.max_pool2d_backward.default,
            lambda a, kw: None if kw or len(a) != 8 or (p := _pool_args(a[1:7], {})) is None
            else (a[0], *p, a[7])),
        aten.embedding_dense_backward.default: (lc.embedding_backward.default,
                                                lambda a, kw: None if kw else tuple(a)),
        aten.mm.default: (torch.ops.lowprec_compiled.mm.default, lambda a, kw: tuple(a)),
        aten.bmm.default: (torch.ops.lowprec_compiled.bmm.default, lambda a, kw: tuple(a)),
        aten.addmm.default: (torch.ops.lowprec_compiled.addmm.default,
                             lambda a, kw: None if kw or len(a) > 3 else tuple(a)),
        aten.sum.dim_IntList: (torch.ops.lowprec_compiled.sum.default,
                               lambda a, kw: (a[0], dims(a), keep(a, kw))),
        aten.mean.dim: (torch.ops.lowprec_compiled.mean.default,
                        lambda a, kw: (a[0], dims(a), keep(a, kw))),
        aten.var_mean.correction: (torch.ops.lowprec_compiled.var_mean.default,
                                   lambda a, kw: (a[0], dims(a), None if kw.get("correction")
                                                  is None else float(kw["correction"]),
                                                  kw.get("keepdim", False))),
    }


def _pool_args(a, kw):
    """max_pool2d_with_indices' arguments with its defaults filled in (None: keyword ones)."""
    if kw:
        return None

    def pair(v, d):  # ATen reads an int or a one-element list as both sides
        if isinstance(v, (list, tuple)) and len(v) in (1, 2) and \
                all(isinstance(e, int) for e in v):
            return list(v) * (3 - len(v))
        return [int(v)] * 2 if isinstance(v, int) else d

    x, k = a[0], pair(a[1], None)
    if k is None:
        return None
    s = pair(a[2], None) if len(a) > 2 and a[2] not in ([], ()) else k
    p = pair(a[3], None) if len(a) > 3 else [0, 0]
    d = pair(a[4], None) if len(a) > 4 else [1, 1]
    if s is None or p is None or d is None:
        return None
    return (x, k, s, p, d, bool(a[5]) if len(a) > 5 else False)


def _activation(name: str, *args):
    """ATen's kernel of an activation of :func:`_opaque_ops` (approximate: GELU's, "" else)."""
    *tensors, approximate = args
    op = getattr(torch.ops.aten, name).default
    return op(*tensors, approximate=approximate) if name.startswith("gelu") else op(*tensors)


def _partition(split):
    """``split`` (AOTAutograd's partition function), then every boolean tensor the forward
    saves for the backward (a ReLU's mask, ``threshold_backward``'s ``self <= 0``) saved as
    float32 (0 or 1) and made boolean again where the backward reads it. Inductor's CPU code
    stores a boolean vector mask element by element (``VecMask::store(bool*)``, torch 2.13;
    measured in benchmarks/RESULTS.md, "Issue 37, second session"). Same values: a
    comparison's 0/1 in float32 and back."""

    def partition(joint, inputs, **kwargs):
        fw, bw = split(joint, inputs, **kwargs)
        _widen_saved_masks(fw, bw)
        return fw, bw

    return partition


def _widen_saved_masks(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
    saved = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    out = fw.graph.output_node()
    values = list(out.args[0])
    done = False
    for i in range(len(values) - 1, -1, -1):  # the saved values follow the forward's outputs
        n = values[i]
        place = saved.pop(getattr(n, "name", None), None)
        val = place.meta.get("val") if place is not None else None
        if not (torch.is_tensor(val) and val.dtype == torch.bool):
            continue
        with fw.graph.inserting_before(out):
            wide = fw.graph.call_function(torch.ops.prims.convert_element_type.default,
                                          (n, torch.float32))
        wide.meta["val"] = n.meta["val"].to(torch.float32)
        values[i] = wide
        with bw.graph.inserting_after(place):
            back = bw.graph.call_function(torch.ops.aten.ne.Scalar, (place, 0))
        back.meta["val"] = val
        place.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        place.meta["val"] = val.to(torch.float32)
        done = True
    if done:
        out.args = (tuple(values),) + tuple(out.args[1:])
        fw.recompile()
        bw.recompile()


def _decompositions() -> dict:
    """Inductor's decompositions but for the ops run on ATen's kernels whole (softmax, layer
    norm, batch norm, an embedding's backward: their decompositions sum in another order than
    the fused kernels)."""
    from torch._inductor.decomposition import select_decomp_table

    aten = torch.ops.aten
    keep = (aten._softmax, aten._log_softmax, aten._softmax_backward_data,
            aten._log_softmax_backward_data, aten.native_layer_norm,
            aten.native_layer_norm_backward, aten.native_batch_norm,
            aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
            aten._native_batch_norm_legit_no_training, aten.native_batch_norm_backward,
            aten.embedding_dense_backward, aten.gelu, aten.gelu_backward, aten.silu,
            aten.silu_backward, aten.max_pool2d_with_indices,
            aten.max_pool2d_with_indices_backward, aten.native_dropout)
    table = dict(select_decomp_table())
    for packet in keep:
        for name in packet.overloads():
            table.pop(getattr(packet, name), None)
    return table


def _aten_kernels(gm: torch.fx.GraphModule) -> None:
    """The ops of :func:`_opaque_ops` in ``gm`` run by ATen's kernels."""
    table = _opaque_ops()
    for n in gm.graph.nodes:
        hit = table.get(n.target) if n.op == "call_function" else None
        if hit is None or n.kwargs.get("dtype") is not None:
            continue
        op, spell = hit
        args = spell(n.args, n.kwargs)
        if args is None:
            continue
        n.args, n.kwargs, n.target = args, {}, op
        # Inductor hands a custom op its inputs with the strides they had when traced (those
        # of the eager run): a GEMM on an operand laid out otherwise sums in another order
        n.meta["eager_input_vals"] = (tuple(a.meta["val"] if isinstance(a, torch.fx.Node)
                                            else a for a in args), {})
    gm.recompile()


def _inner(gm, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner

    _aten_kernels(gm)
    # the engine's fp16/bf16 roundings to nearest are cast round trips (fused.native_casts),
    # which must be kept, not simplified away; so is a cast the model makes itself
    # (x.half().float()). No layout optimisation:
    # a convolution's backward in channels-last sums in another order than eager's. Random ops
    # (dropout's native_dropout, kept whole by _decompositions) on ATen's kernels, drawing from
    # torch's generator as the eager run draws (Inductor's own would give other masks)
    with torch._inductor.config.patch(emulate_precision_casts=True, layout_optimization=False,
                                      fallback_random=True):
        return compile_fx_inner(gm, example_inputs, **kwargs)


def _aten(gm, example_inputs, **kwargs):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


COMPILERS = ("inductor", "aten")


def roundings_in(graph: torch.fx.Graph) -> int:
    """The roundings of a traced ATen graph: its opaque ``lowprec::quantize`` nodes plus the
    fused ones, which AOTAutograd has expanded into the int32 ops of
    :mod:`lowprec.numerics.fused` (``lowprec::quantize_fused`` is CompositeImplicitAutograd),
    each ending in one bitcast of int32 bits back to float32 (no model op bitcasts); for
    fp16/bf16 to nearest (:func:`lowprec.numerics.fused.native_casts`), into a cast to the
    16-bit dtype and back to float32; for fixed point, into float ops ending in
    ``where(isnan(x), x, where(_, neg(v), v))`` with ``v`` a ``minimum`` (the saturation)."""
    opaque = len(graph.find_nodes(op="call_function", target=quantize_op()))
    fused = sum(1 for n in graph.find_nodes(op="call_function",
                                            target=torch.ops.aten.view.dtype)
                if n.args[1] == torch.float32 and _dtype_of(n.args[0]) == torch.int32)
    fixed = sum(1 for n in graph.find_nodes(op="call_function", target=torch.ops.aten.where.self)
                if _is_fixed_rounding(n))
    return opaque + fused + fixed + sum(
        1 for n in graph.nodes
        if _cast_to(n) == torch.float32 and _cast_to(n.args[0]) in (torch.float16,
                                                                    torch.bfloat16))


def _is_fixed_rounding(n) -> bool:
    """Whether ``n`` is the last node of :func:`lowprec.numerics.fused._fixed`."""
    cond, x, inner = n.args
    if not (_called(cond, torch.ops.aten.isnan.default) and cond.args[0] is x
            and _called(inner, torch.ops.aten.where.self)):
        return False
    v = inner.args[2]
    return _called(v, torch.ops.aten.minimum.default) and _called(
        inner.args[1], torch.ops.aten.neg.default) and inner.args[1].args[0] is v


def _called(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and \
        node.target == target


def _dtype_of(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if torch.is_tensor(val) else None


def _cast_to(node) -> torch.dtype | None:
    """The dtype a cast node (prims.convert_element_type, aten._to_copy) casts to."""
    if not (_called(node, torch.ops.prims.convert_element_type.default) or
            _called(node, torch.ops.aten._to_copy.default)):
        return None
    return _dtype_of(node)


# Model code that reads a tensor's dtype (``h.dtype``, ``torch.finfo(h.dtype)``) gets its
# logical dtype from the eager engine (float16 under 16-true) but the physical one, float32, from
# Dynamo's trace of the plain forward, which then freezes it into the graph (``.to(h.dtype)``
# becomes an upcast to an fp32 island: the zoo encoder's masked mean; ``h.dtype ==
# torch.float16`` a branch not taken). Each read by code outside torch is recorded while Dynamo
# traces (the tensor's graph node, the dtype it answered, and where the read is:
# :func:`_read_key`) and checked when the engine runs the graph (:func:`_checked_interpreter`):
# any answer other than the engine's fails the compilation with the engine's answers, and
# :class:`CompiledForward` traces the model again with those answers given to the reads
# (``.to(h.dtype)`` then casts to float16 in the graph, which the engine runs as the eager cast),
# up to :data:`_RETRACES` times; where that does not settle, it falls back. torch's own modules
# are not checked: they read dtypes to choose fast paths (``query.dtype != in_proj_bias.dtype``,
# the same answer either way) and mask types (0 and -inf, exact in every float format);
# nn.MultiheadAttention with a padding mask compiles bit-identical.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_RETRACES = 3  # traces with the engine's answers after the first, at most
# per thread, while a CompiledForward traces: .reads [(fx node, dtype answered, _read_key)] and
# .answers {_read_key: the dtype the eager engine answers there}
_DTYPE_READS = threading.local()
_HOOK_LOCK = threading.Lock()
_HOOKED: list = []  # [the plain TensorVariable.method_attr_dtype] once the hook is installed


def _read_key(node: torch.fx.Node, tx) -> tuple:
    """A dtype read's place, the same in a trace and its re-trace: the tensor's graph node
    (its name) and the instruction reading it (code object and offset). An answer that renames
    later nodes gives their reads new keys: the next trace learns those."""
    code = tx.f_code
    return (node.name, code.co_filename, code.co_firstlineno, code.co_name,
            tx.current_instruction.offset)


def _install_dtype_hook() -> None:
    """Dynamo's answer to ``tensor.dtype`` recorded (and replaced) in the thread that traces
    inside :func:`_recording_dtype_reads`, and torch's own elsewhere; installed once."""
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable

    with _HOOK_LOCK:
        if _HOOKED:
            return
        plain = TensorVariable.method_attr_dtype

        def read(self, tx):
            reads = getattr(_DTYPE_READS, "reads", None)
            if (reads is not None and self.dtype is not None and self.dtype.is_floating_point
                    and not tx.f_code.co_filename.startswith(_TORCH_DIR)):
                key = _read_key(self.proxy.node, tx)
                answer = _DTYPE_READS.answers.get(key)
                reads.append((self.proxy.node, self.dtype if answer is None else answer, key))
                if answer is not None:
                    return VariableTracker.build(tx, answer)
            return plain(self, tx)

        TensorVariable.method_attr_dtype = read
        _HOOKED.append(plain)


@contextlib.contextmanager
def _recording_dtype_reads(into: list, answers: dict | None = None):
    """Record the floating dtype reads of model code while Dynamo traces in this thread (into
    ``into``); ``answers`` (:func:`_read_key` -> dtype): reads answered with that dtype."""
    _install_dtype_hook()
    outer = getattr(_DTYPE_READS, "reads", None), getattr(_DTYPE_READS, "answers", {})
    _DTYPE_READS.reads, _DTYPE_READS.answers = into, dict(answers or {})
    try:
        yield
    finally:
        _DTYPE_READS.reads, _DTYPE_READS.answers = outer


class DtypeReadError(RuntimeError):
    """Model code read a tensor's dtype that the compiled graph would fix otherwise than eager
    emulation answers it. ``answers``: :func:`_read_key` -> the engine's answer, for each
    read answered otherwise (a re-trace gives them; empty where none would help)."""

    def __init__(self, message: str, answers: dict | None = None) -> None:
        super().__init__(message)
        self.answers = dict(answers or {})


def _where(node: torch.fx.Node) -> str:
    """Where model code made ``node`` (" made at file.py:123"), from its stack trace."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    files = [ln.strip() for ln in trace if ln.strip().startswith("File ")]
    if not files:
        return f" ({node.name})"
    try:
        path, line = files[-1].split('"')[1], files[-1].split("line ")[1].split(",")[0]
    except IndexError:
        return f" ({node.name})"
    return f" made at {os.path.basename(path)}:{line}"


def _checked_interpreter(engine: Emulation, reads: dict):
    """A ``torch.fx.Interpreter`` class checking the dtypes read in ``reads`` (node ->
    [(Dynamo's answer, :func:`_read_key`)], a pair per read of that node's tensor) against what
    ``engine`` answers: any that differ raise :class:`DtypeReadError` with the engine's answers.
    (A difference can look harmless and not be: ViT's ``pixel_values.dtype != weight.dtype``
    compares two answers alike, but ``h.dtype == torch.float16`` is a branch Dynamo took on
    float32; so every one is traced again.)"""
    class Checked(torch.fx.Interpreter):
        def run(self, *args, **kwargs):
            self.answers = []  # (node, Dynamo's answer, the engine's)
            out = super().run(*args, **kwargs)
            wrong = [(n, want, got, key) for n, want, got, key in self.answers if want != got]
            if wrong:
                n, want, got, _ = wrong[0]
                raise DtypeReadError(
                    f"the model reads the dtype of a tensor{_where(n)}: {got} under this "
                    f"policy, {want} in a compiled graph, which would fix it there",
                    {key: got for _, _, got, key in wrong})
            return out

        def run_node(self, n):
            out = super().run_node(n)
            if n in reads and torch.is_tensor(out):
                got = engine.reported_dtype(out)
                self.answers.extend((n, want, got, key) for want, key in reads[n])
            return out
    return Checked


def backend(engine: Emulation, compiler: str = "inductor", stats: dict | None = None,
            reads: list | None = None, keys: list | None = None):
    """The Dynamo backend compiling ``engine``'s model's graphs with its roundings in them:
    ``compiler="inductor"`` generates fused code; ``"aten"`` runs the traced ATen graphs op by
    op, undecomposed (every op on ATen's own kernel, as eager emulation runs it: a reference,
    and the floor of what tracing alone costs). ``stats`` (a dict) gets the number of
    roundings (:func:`roundings_in`) of each compiled graph kind added to it ("forward",
    "backward", "inference"). ``reads``: the list :func:`_recording_dtype_reads` fills while
    Dynamo traces, checked (and emptied) as each graph compiles. ``keys``: a one-item list
    holding the base keys tensor of the call being traced (stochastic rounding), which the
    traced forward hands the engine as its ``keys_input``."""
    if compiler not in COMPILERS:
        raise ValueError(f"compiler={compiler!r}; accepted: {', '.join(COMPILERS)}")
    import torch._inductor.compile_fx  # noqa: F401 - Inductor's decompositions need its lowerings
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    model = engine.model
    owned: dict[int, bool] = {}  # id -> is a parameter, for the model's parameters and buffers
    for _, b in model.named_buffers(remove_duplicate=False):
        owned[id(b)] = False
    for _, p in model.named_parameters(remove_duplicate=False):
        owned[id(p)] = True

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        checks: dict = {}  # node -> [(the dtype read, where)], each read of it
        for n, dtype, key in reads or ():
            checks.setdefault(n, []).append((dtype, key))
        if reads:
            reads.clear()
        _check_kept(engine, checks, gm)
        interpreter = _checked_interpreter(engine, checks) if checks else torch.fx.Interpreter
        drawn = keys[0] if keys else None  # the call being traced draws keys (draws_keys())
        kidx = next((i for i, e in enumerate(example_inputs) if e is drawn), None)
        if drawn is not None and kidx is None:
            raise RuntimeError("stochastic rounding's keys are not an input of the graph")
        keep, stand_in = _stand_ins(example_inputs, owned)

        def traced(*args):
            for i, pid, mark, logical in stand_in:
                if pid is not None:
                    setattr(args[i], PARAM, pid)
                if mark is not None:
                    setattr(args[i], MARK, mark)
                if logical is not None:
                    setattr(args[i], LOGICAL, logical)
            engine.keys_input = None if kidx is None else args[kidx]
            try:
                return engine.call_root(interpreter(gm).run, args, keep=keep)
            finally:
                engine.keys_input = None

        class Traced(nn.Module):
            def forward(self, *args):
                return traced(*args)

        def counted(kind, **flags):
            def run(g, ex, **kwargs):
                if stats is not None:
                    stats[kind] = stats.get(kind, 0) + roundings_in(g.graph)
                return (_inner if compiler == "inductor" else _aten)(g, ex, **kwargs, **flags)
            return run

        # the engine's roundings as graph ops while AOTAutograd traces the forward and, through
        # autograd, the backward (torch 2.11 reports is_compiling() False here)
        # fp16/bf16 roundings as cast round trips, which _inner keeps (emulate_precision_casts);
        # stochastic ones on a CPU as the opaque op (the C kernel)
        with tracing_graph(stochastic_kernel=True), _fused.native_casts():
            return aot_autograd(
                fw_compiler=counted("forward"), bw_compiler=counted("backward", is_backward=True),
                inference_compiler=counted("inference", is_inference=True),
                decompositions=_decompositions() if compiler == "inductor" else {},
                partition_fn=_partition(min_cut_rematerialization_partition),
                keep_inference_input_mutations=True)(Traced(), example_inputs)

    return compile_graph


def _check_kept(engine: Emulation, checks: dict, gm: torch.fx.GraphModule) -> None:
    """DtypeReadError where the model read the dtype of a tensor the graph does not keep
    (``checks``: node -> [(the dtype read, where)]), which the policy may answer otherwise than
    float32 (no answer to give a re-trace: the engine never sees that tensor)."""
    nodes = set(gm.graph.nodes)
    for node in checks:
        if node not in nodes and any(format_dtype(f) is not None for r in _rules(engine)
                                     for f in (r.compute, r.grads, r.params)):
            raise DtypeReadError(
                f"the model reads the dtype of a tensor its graph does not keep ({node.name}."
                "dtype), which this policy may answer otherwise than float32")


def _stand_ins(example_inputs, owned: dict) -> tuple[list, list]:
    """The positions of the graph inputs that are the model's parameters and buffers
    (``owned``: id -> is a parameter), and for each what its stand-in carries: (position,
    the parameter's id or None, its mark, its logical dtype)."""
    keep, stand_in = [], []
    for i, e in enumerate(example_inputs):
        if torch.is_tensor(e) and id(e) in owned:
            keep.append(i)
            stand_in.append((i, id(e) if owned[id(e)] else None, getattr(e, MARK, None),
                             getattr(e, LOGICAL, None)))
    return keep, stand_in


def _fresh_function(fn, keyed: bool = False):
    """A function calling ``fn`` with a code object of its own: Dynamo keeps its cache (and
    counts recompilations) per code object, so each model gets its own. ``keyed``: it takes
    stochastic rounding's base keys first and returns them (cloned: an input only passed
    through would not be a graph input) beside ``fn``'s output."""
    if keyed:
        def call(lowprec_keys, /, *args, **kwargs):
            return fn(*args, **kwargs), lowprec_keys.clone()
    else:
        def call(*args, **kwargs):
            return fn(*args, **kwargs)
    return types.FunctionType(call.__code__.replace(), call.__globals__,
                              "lowprec_compiled_forward", None, call.__closure__)


def _cause(err: BaseException) -> BaseException:
    """The backend's own error inside Dynamo's wrapper (``err`` where there is none)."""
    return getattr(err, "inner_exception", None) or err


def _why(err: BaseException) -> str:
    """One line naming a compile failure (the backend's own error, not Dynamo's wrapper)."""
    inner = _cause(err)
    text = str(inner)
    if isinstance(inner, DtypeReadError):  # torch.fx adds the node it was running
        text = text.split("While executing")[0]
    text = " ".join(text.split())
    return f"{type(inner).__name__}: {text[:200]}"


class CompiledForward:
    """The forward of a model set up under ``engine``, compiled with its roundings
    (module docstring); runs eagerly, after one warning line naming why, where it cannot."""

    def __init__(self, engine: Emulation, compiler: str = "inductor", **options) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compiler={compiler!r}; accepted: {', '.join(COMPILERS)}")
        self.engine = engine
        self.compiler = compiler
        self.options = dict(options)
        self.reason = unsupported(engine)  # None while it runs compiled
        #: lowprec::quantize nodes in the graphs compiled so far, by kind (see :func:`backend`)
        self.quantize_nodes: dict[str, int] = {}
        self._compiled: dict = {}  # (engine.active, keys drawn) -> the compiled forward
        self._reads: list = []  # dtype reads of the trace under way (_recording_dtype_reads)
        #: per state of the engine (as _compiled), the dtype reads answered as the eager
        #: engine answers them (_read_key -> dtype), learnt from traces that failed on them
        #: (DtypeReadError), for the next trace
        self._answers: dict = {}
        self._keys: list = [None]  # the base keys of the call under way (stochastic rounding)
        self._warned = False
        if self.reason is not None:
            self._fall_back(self.reason)

    def __deepcopy__(self, memo):
        # a copy of the model (fp32_twin, copy.deepcopy) gets its own engine and compiles its
        # own graphs: the compiled functions cached here are bound to this model's forward
        new = CompiledForward.__new__(CompiledForward)
        memo[id(self)] = new
        new.engine = copy.deepcopy(self.engine, memo)
        new.compiler, new.options = self.compiler, dict(self.options)
        new.reason, new._warned = self.reason, self._warned
        new.quantize_nodes, new._compiled, new._reads, new._keys = {}, {}, [], [None]
        new._answers = {k: dict(v) for k, v in self._answers.items()}
        return new

    def _fall_back(self, reason: str) -> None:
        self.reason = reason
        if not self._warned:
            self._warned = True
            warn(f"lowprec: compiled emulation runs this model eagerly: {reason}")

    def eager(self, *args, **kwargs):
        em = self.engine
        return em.call_root(em.original_forward, args, kwargs)

    def _eager_keyed(self, keys, args, kwargs):
        """The eager forward with the base keys this call drew already (not a second draw)."""
        em = self.engine
        if keys is None:
            return self.eager(*args, **kwargs)
        k0, k1 = keys.tolist()
        em.keys_input = (int(k0), int(k1))
        try:
            return self.eager(*args, **kwargs)
        finally:
            em.keys_input = None

    @torch.compiler.disable  # inside another torch.compile: run here, by this one's backend
    def __call__(self, *args, **kwargs):
        em = self.engine
        if self.reason is not None:
            return self.eager(*args, **kwargs)
        if em.observers:  # an analysis watching each op: it has to see them run
            return self.eager(*args, **kwargs)
        keyed = em.draws_keys()
        keys = None
        if keyed:  # the eager root forward's draw, on the model's device
            keys = seed_tensor(em.generator)
            dev = next((t.device for t in em.model.parameters()), None) or next(
                (t.device for t in tensors_in((args, kwargs), [])), keys.device)
            keys = keys.to(dev)
        self._keys[0] = keys
        try:
            first = None  # the failure that made it trace again, if one did
            answers = self._answers.setdefault((em.active, keyed), {})
            for attempt in range(_RETRACES + 1):
                try:
                    return self._run(keyed, keys, args, kwargs, answers)
                except Exception as err:  # noqa: BLE001 - any failure to compile: eager, said once
                    inner = _cause(err)
                    new = {k: v for k, v in getattr(inner, "answers", {}).items()
                           if answers.get(k) != v}
                    if isinstance(inner, DtypeReadError) and new and attempt < _RETRACES:
                        # trace again, the reads answered as the eager engine answers them
                        first = first or err
                        answers.update(new)
                        self._compiled.pop((em.active, keyed), None)
                        self._reads.clear()
                        continue
                    why = _why(err) if first is None or first is err else \
                        f"{_why(first)}; traced again with the engine's answers: {_why(err)}"
                    self._fall_back(why)
                    return self._eager_keyed(keys, args, kwargs)
        finally:
            self._keys[0] = None

    def _run(self, keyed: bool, keys, args, kwargs, answers: dict):
        """The compiled forward (compiled at its first call: one per state of the engine; its
        dtype reads answered by ``answers`` while traced)."""
        em = self.engine
        fn = self._compiled.get((em.active, keyed))
        if fn is None:
            # the engine's Python state the backend reads (whether it rounds) is no guard of
            # Dynamo's: one compiled function per state
            fn = self._compiled[(em.active, keyed)] = torch.compile(
                _fresh_function(em.original_forward, keyed), fullgraph=True, dynamic=False,
                backend=backend(em, self.compiler, self.quantize_nodes, self._reads,
                                self._keys),
                **self.options)
        # the backward compiled with the forward (torch compiles it lazily, at the first
        # loss.backward(), by default): a failure there falls back here too
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
                _recording_dtype_reads(self._reads, answers):
            return fn(keys, *args, **kwargs)[0] if keyed else fn(*args, **kwargs)


def compile_model(engine: Emulation, compiler: str = "inductor", **options) -> CompiledForward:
    """Run ``engine``'s model compiled from its next call on (``model(x)`` as before);
    returns the :class:`CompiledForward` now its forward. ``options`` go to torch.compile
    (``mode=``, ``options=``)."""
    model = engine.model
    if model is None:
        raise ValueError("compile_model needs an engine attached to a model (Emulation(model, "
                         "...)), got one of emulated()")
    fwd = CompiledForward(engine, compiler, **options)
    engine.compiled = True
    model.forward = fwd
    return fwd
