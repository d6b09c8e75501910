"""How each op is emulated under a pure policy (scope "all"): the op table.

:meth:`.engine.Emulation.run_pure` rounds an op's inputs (unless it maps grid values onto the
grid), then runs it through :func:`run`: the handlers of the op's entry in :data:`PURE`, in
order, until one does not :data:`DECLINE` (its guard holds); an op no handler takes runs as
:func:`plain` (fp32, or this CPU's 16-bit kernel with ``match_cpu_kernels``). The engine then
rounds each floating output once to the compute format (:meth:`.engine.Emulation.round_outputs`).

Order matters where one op has several handlers: the first whose guard holds runs it.

=============================================== =============================================
op                                              handlers, in order
=============================================== =============================================
every op                                        :func:`accumulated` (a policy's ``acc=``: the
                                                GEMM in its accumulator, forward and backward)
``batch_norm``                                  :func:`batch_norm` (batch statistics: the
                                                16-bit kernel replayed, :mod:`.kernels`)
``embedding``                                   :func:`embedding` (its backward summed as the
                                                native kernel sums, tied weights' uses summed)
``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``   :func:`recurrent_native` (match_cpu_kernels: the
                                                CPU's own 16-bit layer), :func:`recurrent`
                                                (op by op, as ATen's CPU RNN,
                                                :mod:`.recurrent_kernels`)
``layer_norm``                                  :func:`layer_norm` (the 16-bit kernel replayed)
``scaled_dot_product_attention``                :func:`attention_native` (match_cpu_kernels),
                                                :func:`attention` (flash or math replayed)
``gelu``, ``erf``, ``sqrt``                     :func:`elementwise_native` (match_cpu_kernels);
                                                ``erf`` and ``sqrt`` then :func:`replayed`
REPLAYED ops (exp, tanh, sigmoid, softmax, ...) :func:`replayed` (differentiated from the
                                                rounded output in 16 bits,
                                                :mod:`.backward_kernels`)
``conv1d`` ... ``conv_transpose3d``             :func:`conv_bias_after` (CUDA's kernels: the
                                                bias added to the rounded output)
``linear``                                      :func:`split_linear` (a non-contiguous N-d input
                                                with a bias: matmul, then add)
any other                                       :func:`plain`
=============================================== =============================================

:func:`listing` prints the table as built. Adding the emulation of an op: one handler here and
its line in :data:`PURE` (plus its kernel, where it needs one, in :mod:`.kernels`).
Casts, ``dtype=`` results, scaled GEMMs and mixed policies are dispatched before this table, by
the engine's mode (:class:`.engine.Emulation`); :func:`accumulated`, :func:`kernel_for`,
:func:`bias_after` and :func:`bias_view` serve the mixed path too.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...numerics import accumulation_ops, summation
from ...numerics.formats import FP32
from . import backward_kernels, kernels, native_gemm, recurrent_kernels
from .autograd_fns import ROUNDABLE
from .dtypes import format_dtype

__all__ = ["OpCall", "DECLINE", "PURE", "CONVS", "run", "plain", "listing", "accumulated",
           "kernel_for", "bias_after", "bias_view", "accumulated_kernel"]

#: what a handler returns when its guard does not hold: the next handler is tried
DECLINE = object()

# convolutions whose bias CUDA adds to the rounded output (:func:`bias_after`)
CONVS = {"conv1d": torch.conv1d, "conv2d": torch.conv2d, "conv3d": torch.conv3d,
         "conv_transpose1d": torch.conv_transpose1d, "conv_transpose2d": torch.conv_transpose2d,
         "conv_transpose3d": torch.conv_transpose3d}


class OpCall:
    """One call of an op as the table runs it: ``args``/``kwargs`` as rounded for it (a handler
    may replace them: the engine reads them back), ``given`` the arguments before rounding."""

    __slots__ = ("func", "name", "rule", "key", "args", "kwargs", "given")

    def __init__(self, func, name: str, rule, key: str, args, kwargs) -> None:
        self.func, self.name, self.rule, self.key = func, name, rule, key
        self.args, self.kwargs, self.given = args, kwargs, (args, kwargs)


# -- helpers shared with the mixed path -------------------------------------------------------
def accumulated_kernel(em, name: str, rule, args, kwargs):
    """acc=: the GEMMs of linear, matmul, conv2d and attention accumulate in the policy's
    accumulator, forward and backward (their output then rounded as any op's); None else."""
    if rule.accumulator is None:
        return None
    return accumulation_ops.bind(name, rule.accumulator, em.generator, args, kwargs)


def kernel_for(em, func, name: str, rule=None, args=(), kwargs=None):
    """The kernel that runs ``func``: itself, or with match_cpu_kernels convolutions summed as
    torch's reference CPU 16-bit kernel sums, matrix products by this CPU's own 16-bit kernel
    (:mod:`.native_gemm` explains why)."""
    if not em.match_cpu_kernels:
        return func
    if name == "conv2d":  # (where torch's own 16-bit convolution is the reference kernel)
        dt = format_dtype(rule.compute) if rule is not None else None
        return summation.conv2d if native_gemm.conv_is_reference(dt) else func
    if name in native_gemm.INDEX_OPS and rule is not None:
        dt = native_gemm.index_dtype(name, rule, args, kwargs or {})
        return func if dt is None else native_gemm.native_gemm(func, dt)
    if name in native_gemm.GEMM_OPS and rule is not None:
        dt = format_dtype(rule.compute)
        if native_gemm.applies(rule, args, kwargs or {}, dt):
            return native_gemm.native_gemm(func, dt)
    return func


def bias_after(em, name: str, rule, args, kwargs):
    """Under CUDA's kernels, a convolution with a bias as a call of it without the bias
    (the caller rounds its output and adds the bias, a second rounding), else None.

    ATen's CUDA convolution (``_convolution``, ConvBackend::Cudnn and CudnnTranspose in
    aten/src/ATen/native/Convolution.cpp) runs ``cudnn_convolution`` without the bias
    ("cuDNN convolutions does not handle bias", cudnn/ConvShared.cpp), which accumulates in
    fp32 and writes a 16-bit output, then ``output.add_(reshape_bias(...))``: a 16-bit add,
    computed in fp32 and rounded. The CPU kernels add the bias to the fp32 sum and round
    once. (CUDA's own depthwise and 3-d fallback kernels, not cuDNN, take the bias inside:
    not modelled.)"""
    if name not in CONVS or len(args) < 2 or rule.accumulator is not None or \
            not kernels.plain_formats(rule):
        return None
    b = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
    if not (torch.is_tensor(b) and b.dtype in ROUNDABLE) or not em.cuda_kernels(args):
        return None
    if len(args) > 2:
        a2, k2 = args[:2] + (None,) + tuple(args[3:]), kwargs
    else:
        a2, k2 = args, dict(kwargs, bias=None)
    fn = kernel_for(em, CONVS[name], name, rule, a2, k2)
    return lambda: fn(*a2, **(k2 or {}))


def bias_view(name: str, args, kwargs) -> torch.Tensor:
    """The bias of a convolution call shaped to add to its output (``reshape_bias``; an
    unbatched input has its channels first)."""
    b = args[2] if len(args) > 2 else kwargs["bias"]
    batched = args[0].dim() == int(name[-2]) + 2
    return b.reshape([1, -1] + [1] * (args[0].dim() - 2) if batched
                     else [-1] + [1] * (args[0].dim() - 1))


# -- the handlers: ``handler(em, op)`` -> the op's output, or DECLINE ------------------------
def accumulated(em, op: OpCall):
    acc_op = accumulated_kernel(em, op.name, op.rule, op.args, op.kwargs)
    return DECLINE if acc_op is None else acc_op(*op.args, **op.kwargs)


def batch_norm(em, op: OpCall):
    if not kernels.uses_batch_stats(op.args, op.kwargs):
        return DECLINE
    out = kernels.batch_norm(em, op.rule, op.key, *op.args, cuda=em.cuda_kernels(op.args))
    return kernels.label_kernel_nodes(out, op.args, op.name)


def embedding(em, op: OpCall):
    if op.rule.grads == FP32 or not torch.is_grad_enabled() or \
            not kernels.plain_embedding(op.args, op.kwargs):
        return DECLINE
    w = em.tied_weight(op.args[0], op.rule)  # a grid op: its inputs were not rounded
    if w is not op.args[0]:
        op.args = (w,) + tuple(op.args[1:])
    return kernels.embedding(em, op.rule, *op.args, cuda=em.cuda_kernels(op.args), **op.kwargs)


def recurrent_native(em, op: OpCall):
    if not em.match_cpu_kernels:
        return DECLINE
    dt = native_gemm.recurrent_dtype(op.rule, op.args, op.kwargs)
    # the CPU's own 16-bit layer
    return DECLINE if dt is None else native_gemm.native_nested(op.func, dt)(*op.args)


def recurrent(em, op: OpCall):
    call = recurrent_kernels.parse(op.name, op.args, op.kwargs)
    # op by op, as ATen's CPU RNN
    return DECLINE if call is None else recurrent_kernels.replay(em, op.rule, op.key, call)


def layer_norm(em, op: OpCall):
    if not kernels.plain_layer_norm(em, op.rule, op.args, op.kwargs):
        return DECLINE
    return kernels.layer_norm(em, op.rule, op.key, *op.args, cuda=em.cuda_kernels(op.args))


def _cpu_kernel(em, op: OpCall, dtype_of):
    """match_cpu_kernels: the op by this CPU's own 16-bit kernel, in the dtype ``dtype_of``
    gives (None: declined)."""
    if not em.match_cpu_kernels:
        return DECLINE
    dt = dtype_of(op.rule, op.args, op.kwargs)
    return DECLINE if dt is None else native_gemm.native_gemm(op.func, dt)(*op.args, **op.kwargs)


def attention_native(em, op: OpCall):
    return _cpu_kernel(em, op, native_gemm.attention_dtype)


def attention(em, op: OpCall):
    if not kernels.plain_attention(op.args, op.kwargs):
        return DECLINE
    qkv, kw = kernels.sdpa_arguments(op.args, op.kwargs)
    if kernels.flash_possible(op.args, op.kwargs):
        return kernels.label_kernel_nodes(kernels.attention(em, op.rule, op.key, *qkv, **kw),
                                          qkv, op.name)
    return kernels.attention_math(*qkv, **kw)


def elementwise_native(em, op: OpCall):
    return _cpu_kernel(em, op, native_gemm.elementwise_dtype)


def replayed(em, op: OpCall):
    # differentiated from its rounded output, in 16-bit arithmetic, as the native backward
    # does (exp, tanh, sigmoid, softmax...)
    if not kernels.plain_formats(op.rule):
        return DECLINE
    if op.name in backward_kernels.DTYPE_KERNELS and format_dtype(op.rule.compute) is None:
        return DECLINE  # (fp16/bf16 kernels' formulas: other formats keep one rounding)
    opts = backward_kernels.replayable(op.name, op.args, op.kwargs)
    if opts is False:
        return DECLINE
    return backward_kernels.replayed(op.rule, op.name, op.func, op.args, op.kwargs, opts,
                                     cuda=em.cuda_kernels(op.args))


def conv_bias_after(em, op: OpCall):
    # CUDA: cuDNN convolves without the bias; ATen adds it to the 16-bit output
    conv = bias_after(em, op.name, op.rule, op.args, op.kwargs)
    if conv is None:
        return DECLINE
    return em.round(conv(), op.rule, op.key) + bias_view(op.name, op.args, op.kwargs)


def split_linear(em, op: OpCall):
    # aten's linear on a non-contiguous N-d input with a bias: matmul, then add (two 16-bit
    # results, two roundings), as nn.MultiheadAttention(batch_first=True) runs; decided on the
    # arguments as given (rounding them makes them contiguous)
    if not kernels.split_linear(*op.given):
        return DECLINE
    args, kwargs = op.args, op.kwargs
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    return em.round(kernel_for(em, op.func, op.name, op.rule, (x, w))(x, w), op.rule,
                    op.key) + b


def plain(em, op: OpCall):
    """Any other op: fp32 (or this CPU's 16-bit kernel with match_cpu_kernels)."""
    return kernel_for(em, op.func, op.name, op.rule, op.args, op.kwargs)(*op.args, **op.kwargs)


# -- the table ----------------------------------------------------------------------------------
#: the handlers every op tries first, and those of an op with no entry
FIRST: tuple[Callable, ...] = (accumulated,)
#: op name -> its handlers in priority order (FIRST's included)
PURE: dict[str, tuple[Callable, ...]] = {}


def _add(names, handler: Callable) -> None:
    for n in names:
        PURE[n] = PURE.get(n, FIRST) + (handler,)


# priority order: an op in several of these lists tries them in this order
_add(["batch_norm"], batch_norm)
_add(["embedding"], embedding)
_add(sorted(recurrent_kernels.RNN_OPS), recurrent_native)
_add(sorted(recurrent_kernels.RNN_OPS), recurrent)
_add(["layer_norm"], layer_norm)
_add(["scaled_dot_product_attention"], attention_native)
_add(["scaled_dot_product_attention"], attention)
_add(sorted(native_gemm.ELEMENTWISE_OPS), elementwise_native)
_add(list(backward_kernels.REPLAYED), replayed)
_add(list(CONVS), conv_bias_after)
_add(["linear"], split_linear)


def run(em, op: OpCall):
    """``op``'s output by the first handler of its entry that does not decline, else
    :func:`plain`."""
    for handler in PURE.get(op.name, FIRST):
        out = handler(em, op)
        if out is not DECLINE:
            return out
    return plain(em, op)


def listing() -> str:
    """The table as built: one line per op, its handlers in order."""
    rows = [f"{'(any other op)':<32} {' -> '.join(h.__name__ for h in FIRST)} -> plain"]
    rows += [f"{name:<32} {' -> '.join(h.__name__ for h in hs)} -> plain"
             for name, hs in sorted(PURE.items())]
    return "\n".join(rows)
