"""Matrix products computed by this CPU's own 16-bit kernels (``match_cpu_kernels=True``).

An fp32 matrix product rounded once to fp16 differs from ``model.half()``'s product by one unit
on a few outputs in a thousand: torch's CPU 16-bit GEMMs sum in their own order. Measured here
(torch 2.13, AVX2; ``tests/training/test_native_gemm.py`` re-derives it against the kernel):

* ``linear``/``mm`` forward, ``C = A @ W.T`` with both operands contiguous along the reduction
  (``gemm_transa_``): ``fp16_dot_with_fp32_arith`` of
  ``aten/src/ATen/native/cpu/ReducedPrecisionFloatGemvFastPathKernel.cpp``, eight fp32 vector
  registers of 8 lanes over blocks of 64 terms, folded pairwise, a 16-term vector tail, a scalar
  tail;
* the input gradient ``G @ W`` (``gemm_notrans_``): BlasKernel.cpp's four interleaved partial
  sums, the order :func:`lowprec.numerics.summation.dot4` reproduces;
* the weight gradient ``G.T @ X`` (``gemm_transb_``): one sequential fp32 sum per output.

Three orders chosen by the operands' strides, each rounded once to 16 bits at the end (a bias
added to the fp32 sum before that rounding). Rather than re-derive the kernel's dispatch on
strides and vector widths (which changes with the CPU's ISA: 16 lanes on AVX-512), the product
is computed by that kernel itself on the operands, which are on the 16-bit grid already, so
the cast is exact: the result is native's bit for bit, forward and backward (the backward is
the kernel's own backward, gradients held in the 16-bit dtype as native autograd holds them).
It costs what native costs (fp16 ``linear`` is several times oneDNN's fp32 on a CPU with AVX2
only: benchmarks/RESULTS.md, figure F28), which is why it is opt-in, as the convolution order is.

Used only where it is exactly right: a format with a torch dtype (float16, bfloat16), operands
on CPU, round-to-nearest-even, and gradients in the same format as compute (pure or mixed
policies alike); everywhere else the engine keeps its fp32 product.
"""

from __future__ import annotations

import torch

from ...numerics.rounding import Rounding
from ..hardware import device_facts
from .dtypes import format_dtype

__all__ = ["conv_is_reference", "ELEMENTWISE_OPS", "elementwise_dtype", "GEMM_OPS", "INDEX_OPS", "index_dtype", "applies", "attention_dtype", "cpu_fp32", "native_gemm", "native_nested",
           "recurrent_dtype", "rule_applies"]

# the torch API calls that end in aten's CPU 16-bit GEMM (matmul folds to mm/bmm)
GEMM_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "mv", "addmv",
                      "__matmul__", "__rmatmul__"})


def _floating(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()


def conv_is_reference(dtype: torch.dtype | None) -> bool:
    """Whether torch convolves ``dtype`` on this CPU with its reference kernel (``slow_conv2d``,
    the order :mod:`lowprec.numerics.summation` reproduces). For fp16 torch takes oneDNN's
    convolution instead where the CPU has AVX512-FP16 or AMX-FP16 (``mkldnn_fp16_device_check``),
    which sums in fp32 and rounds once, as the engine's default does (figure F43). Other dtypes
    (bf16, formats of no torch dtype) keep the reference order."""
    if dtype != torch.float16:
        return True
    return not ({"avx512_fp16", "amx_fp16"} & device_facts("cpu").features)


def native_gemm(func, dtype: torch.dtype):
    """``func`` run on ``dtype`` copies of its floating operands, its result back in fp32 (the
    operands must already be on ``dtype``'s grid, so both casts are exact)."""

    def to16(t):
        return t.to(dtype) if _floating(t) and t.dtype == torch.float32 else t

    def run(*args, **kwargs):
        out = func(*[to16(a) for a in args], **{k: to16(v) for k, v in kwargs.items()})
        return out.float() if _floating(out) else out

    return run


def _nested(t, f):
    if isinstance(t, (list, tuple)):
        return type(t)(_nested(a, f) for a in t)
    return f(t)


def native_nested(func, dtype: torch.dtype):
    """``native_gemm`` through lists and tuples of tensors (a recurrent op's hidden state and
    flat weights), its outputs back in fp32."""

    def to16(t):
        return t.to(dtype) if _floating(t) and t.dtype == torch.float32 else t

    def to32(t):
        return t.float() if _floating(t) else t

    def run(*args):
        return _nested(func(*_nested(args, to16)), to32)

    return run


def recurrent_dtype(rule, args, kwargs):
    """The dtype whose CPU kernel runs a whole ``torch.lstm``/``gru``/``rnn_*`` call under
    ``match_cpu_kernels`` (autograd through it, dropout's draws from torch's generator as
    ``model.half()`` draws them), or None. The op-by-op replay (``recurrent_kernels``) has the
    composite's bits where its fp32 products round as the 16-bit GEMM does (fp16: one unit off
    at times from hidden 128 on), and a bf16 LSTM goes to oneDNN where torch's CPU has
    AVX512-BF16 or AMX (other roundings altogether); the op itself is right on each."""
    fmt_dtype = format_dtype(rule.compute)
    flat = []
    _nested(list(args), lambda t: flat.append(t) if _floating(t) else None)
    if kwargs or not rule_applies(rule, fmt_dtype) or not cpu_fp32(flat, {}):
        return None
    return fmt_dtype


# selections whose backward accumulates into the 16-bit gradient one addition at a time
# (index_put_ with accumulate, index_add_, scatter_add_ on a 16-bit tensor round each sum)
INDEX_OPS = frozenset({"__getitem__", "index_select", "gather"})


def index_dtype(name, rule, args, kwargs):
    """The dtype whose kernels run a selection by an index tensor under ``match_cpu_kernels``
    (Swin's relative position bias ``table[index]``), or None. Its forward is a copy either
    way; its backward is the 16-bit run's accumulation, where the engine's autograd sums a
    row's gradients in fp32 and rounds once (fp16, Swin: 41 of 2,900 table gradients apart)."""
    if not args or not _floating(args[0]) or not args[0].requires_grad or \
            not torch.is_grad_enabled():
        return None
    if name == "__getitem__":
        idx = args[1] if len(args) > 1 else None
        parts = idx if isinstance(idx, (tuple, list)) else (idx,)
        if not any(torch.is_tensor(p) and not p.is_floating_point() for p in parts):
            return None  # basic indexing: a view, gradients added in place
    fmt_dtype = format_dtype(rule.compute)
    if not applies(rule, args[:1], {}, fmt_dtype):
        return None
    return fmt_dtype


# elementwise ops whose vectorised 16-bit kernels are not the fp32 result rounded once: gelu
# (erf), erf and sqrt now and then by one unit on some elements (fp16 GELU in Swin: 2 of
# 12,288 inputs of a block's fc2); under match_cpu_kernels the kernel runs them
ELEMENTWISE_OPS = frozenset({"gelu", "erf", "sqrt"})


def elementwise_dtype(rule, args, kwargs):
    """The dtype whose CPU kernel runs an ``ELEMENTWISE_OPS`` call (forward and backward), or
    None (as :func:`applies`)."""
    fmt_dtype = format_dtype(rule.compute)
    return fmt_dtype if applies(rule, args, kwargs, fmt_dtype) else None


def attention_dtype(rule, args, kwargs):
    """The dtype whose CPU kernel runs this ``scaled_dot_product_attention`` call, forward and
    backward, under ``match_cpu_kernels`` (as for the products, :func:`applies`), or None. Not
    with dropout: the engine draws its masks itself. The replay of the flash kernel
    (``kernels.attention``) has the kernel's forward bits, but its backward sums in fp32 in
    other orders (one unit on a few gradients, which GPT-2's depth spreads); the kernel has
    its own, on every path it dispatches to (flash, math) and vector width."""
    fmt_dtype = format_dtype(rule.compute)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    if dropout or not applies(rule, args, kwargs, fmt_dtype):
        return None
    return fmt_dtype


def _nearest(spec) -> bool:
    return getattr(spec, "mode", spec) == Rounding.NEAREST_EVEN


def rule_applies(rule, fmt_dtype) -> bool:
    """Whether the rule's arithmetic is a 16-bit kernel's: a torch dtype, rounded to nearest,
    gradients in the compute format."""
    if fmt_dtype is None or not _nearest(rule.rounding):
        return False
    # the kernel's backward holds gradients in the 16-bit dtype, rounded to nearest: right only
    # where the policy's gradients are the compute format (mixed policies included: under
    # p=fp32,c=fp16,g=fp32 the engine's product gradients stay fp32 and must not overflow)
    return rule.grads == rule.compute and _nearest(rule.grad_rounding)


def cpu_fp32(args, kwargs) -> bool:
    """Floating operands, all fp32 carriers on the CPU."""
    tensors = [t for t in list(args) + list(kwargs.values()) if _floating(t)]
    return bool(tensors) and all(t.device.type == "cpu" and t.dtype == torch.float32
                                 for t in tensors)


def applies(rule, args, kwargs, fmt_dtype) -> bool:
    """Whether ``native_gemm`` gives this op's emulated result exactly, under a pure or a mixed
    policy alike (see the module docstring)."""
    return rule_applies(rule, fmt_dtype) and "out" not in kwargs and cpu_fp32(args, kwargs)
