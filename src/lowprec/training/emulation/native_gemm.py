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
It costs what native costs (fp16 ``linear`` is ~6x oneDNN's fp32 on an AMD EPYC with AVX2),
which is why it is opt-in, as the convolution order is.

Used only where it is exactly right: a format with a torch dtype (float16, bfloat16), operands
on CPU, round-to-nearest-even, and gradients in the same format as compute (pure or mixed
policies alike); everywhere else the engine keeps its fp32 product.
"""

from __future__ import annotations

import torch

from ...numerics.rounding import Rounding
from .dtypes import format_dtype

__all__ = ["GEMM_OPS", "applies", "attention_dtype", "native_gemm"]

# the torch API calls that end in aten's CPU 16-bit GEMM (matmul folds to mm/bmm)
GEMM_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "mv", "addmv",
                      "__matmul__", "__rmatmul__"})


def _floating(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()


def native_gemm(func, dtype: torch.dtype):
    """``func`` run on ``dtype`` copies of its floating operands, its result back in fp32 (the
    operands must already be on ``dtype``'s grid, so both casts are exact)."""

    def to16(t):
        return t.to(dtype) if _floating(t) and t.dtype == torch.float32 else t

    def run(*args, **kwargs):
        out = func(*[to16(a) for a in args], **{k: to16(v) for k, v in kwargs.items()})
        return out.float() if _floating(out) else out

    return run


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


def applies(rule, args, kwargs, fmt_dtype) -> bool:
    """Whether ``native_gemm`` gives this op's emulated result exactly, under a pure or a mixed
    policy alike (see the module docstring)."""
    if fmt_dtype is None or not _nearest(rule.rounding):
        return False
    # the kernel's backward holds gradients in the 16-bit dtype, rounded to nearest: right only
    # where the policy's gradients are the compute format (mixed policies included: under
    # p=fp32,c=fp16,g=fp32 the engine's product gradients stay fp32 and must not overflow)
    if rule.grads != rule.compute or not _nearest(rule.grad_rounding):
        return False
    if "out" in kwargs:
        return False
    tensors = [t for t in list(args) + list(kwargs.values()) if _floating(t)]
    return bool(tensors) and all(t.device.type == "cpu" and t.dtype == torch.float32
                                 for t in tensors)
