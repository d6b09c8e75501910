"""``lowprec::quantize``: :func:`quantize` as a ``torch.library`` custom op for compiled code.

``torch.compile`` cannot trace the compiled kernel (a ctypes call): as a custom op with a fake
(meta) implementation, quantization is one opaque node of the graph, whose output has the
input's shape, dtype and device (torchao registers its quantization primitives the same way).
Inside a compiled region :func:`lowprec.quantize`, :func:`lowprec.quantize_`, the autograd
wrappers (:mod:`.autograd`) and the optimizers' write-back call it (``quantize`` checks
``torch.compiler.is_compiling()``); eagerly they call the implementation directly. Being
opaque, the node cannot be simplified away as Inductor simplifies cast round trips.

The op is registered when this module is imported (``import lowprec.numerics`` imports it), as
torchao registers its ops: registered lazily, on first use, the registration itself ran inside
the first Dynamo trace that reached it and broke that graph.

Arguments: the tensor; the format and the rounding mode as their canonical strings
(``"fp16"``, ``"block<e2m1fn,32,axis=1>"``, ``"stochastic_limited"``), which parse back to the
same objects; the random bits of limited stochastic rounding; and ``seed``, stochastic
rounding's two 32-bit keys as an int64 tensor (None for deterministic modes), drawn from a
generator outside the graph (:func:`lowprec.numerics.quantize.seed_tensor`).
"""

from __future__ import annotations

import torch

from . import kernel
from .quantize import quantize

__all__ = ["quantize_op", "quantize_fused_op", "channel_sums_op", "define_op"]


# needs_fixed_stride_order: Inductor hands the op its input in the order of the traced strides
# (a channels-last activation or gradient stays channels-last: below, the op returns that
# layout). Without the tag it constrains a custom op only where the node records eager input
# values, and lays a pointwise producer out row-major where none are recorded. (Compiled
# emulation once lowered the op with contiguous inputs: ResNet-20's channels-last gradients
# were transposed for each rounding and back; benchmarks/RESULTS.md, "Issue 37, fifth
# session".) The layout changes no bit: stochastic rounding counts logical indices.
def _quantize(x: torch.Tensor, fmt: str, rounding: str, random_bits: int,
              seed: torch.Tensor | None = None) -> torch.Tensor:
    # (graphs pass random_bits 0 but for limited stochastic rounding: quantize._spelled)
    y = quantize(x, fmt, rounding, random_bits=random_bits or None, seed=seed)
    view = y is x or y._base is not None
    if view or y.stride() != x.stride():
        # an op may not return a view, and returns what its fake declares, empty_like(x)'s
        # layout: x's where x is dense (quantize keeps a dense layout: a channels-last
        # activation stays so), else a dense one (a sliced input's)
        want = torch.empty_like(x)
        if view or y.stride() != want.stride():
            y = want.copy_(y)
    return y


def _quantize_fake(x, fmt, rounding, random_bits, seed=None):
    return torch.empty_like(x)


# Defined with torch.library.Library rather than torch.library.custom_op (the same schema,
# inferred from the annotations as custom_op infers it): a compiled graph calls the op through
# the dispatcher, and custom_op's Python wrappers cost about 6.5 us a call more on an Intel
# Xeon (benchmarks/RESULTS.md, "Issue 37, thirteenth session"). No autograd formula: compiled
# graphs are traced at the ATen level, forward and backward, before they call it.
_LIB = torch.library.Library("lowprec", "FRAGMENT")  # (not "DEF": a reload may define again)


def define_op(lib: torch.library.Library, name: str, fn, tags=()) -> str:
    """Define ``<lib's namespace>::<name>`` in ``lib``, a functional op that runs ``fn`` on
    every device, its schema inferred from ``fn``'s annotations as ``torch.library.custom_op``
    infers it; returns the op's qualified name (for ``torch.library.register_fake``)."""
    # (pt2_compliant_tag: as custom_op tags its ops, for Dynamo's only_allow_pt2_compliant_ops)
    lib.define(name + torch.library.infer_schema(fn, mutates_args=()),
               tags=(*tags, torch.Tag.pt2_compliant_tag))
    lib.impl(name, fn, "CompositeExplicitAutograd")
    return f"{lib.ns}::{name}"


def _define(name: str, fn, fake, tags=()) -> None:
    torch.library.register_fake(define_op(_LIB, name, fn, tags), fake, lib=_LIB)


_define("quantize", _quantize, _quantize_fake, tags=(torch.Tag.needs_fixed_stride_order,))
_OP = torch.ops.lowprec.quantize.default


# The kernel's per-channel sums in the order of ATen's batch-norm statistics (pure bf16 batch
# norm), opaque to a trace as quantize is: compiled emulation keeps the kernel's order, where
# tracing into the ctypes call fails on fake tensors (the model then ran eagerly). ``kind``:
# "channel" (rows x channels, ``arg`` parts: kernel.channel_sums) or "plane" (batch x channels
# x plane, ``arg`` lanes: kernel.plane_sums).
def _channel_sums(x: torch.Tensor, kind: str, arg: int, mean: torch.Tensor | None
                  ) -> torch.Tensor:
    out = kernel.sums(kind, x, arg, mean)
    if out is None:
        raise RuntimeError(f"lowprec::channel_sums: the kernel's {kind} sums do not take x "
                           f"{tuple(x.shape)} {x.dtype}")
    return out


def _channel_sums_fake(x, kind, arg, mean):
    return x.new_empty((x.shape[1],))


_define("channel_sums", _channel_sums, _channel_sums_fake)


def channel_sums_op():
    """The registered ``torch.ops.lowprec.channel_sums`` (its default overload)."""
    return torch.ops.lowprec.channel_sums.default


def quantize_op():
    """The registered ``torch.ops.lowprec.quantize`` (its default overload)."""
    return _OP


# -- the fusible decomposition (lowprec.numerics.fused) -------------------------------------------
# A CompositeImplicitAutograd op: Dynamo records one node per rounding (the graph stays readable
# and countable), and AOTAutograd replaces it by its implementation, plain int32 torch ops that
# Inductor fuses into the neighbouring kernels. Its arguments are those of lowprec::quantize; the
# strings are parsed while tracing, so the format and mode are constants of the generated code.
_LIB.define("quantize_fused(Tensor x, str fmt, str rounding, int random_bits, "
            "Tensor? seed=None, str source=\"\") -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))


def _quantize_fused(x, fmt, rounding, random_bits, seed=None, source=""):
    # source: fused.source_token(), only there to key torch's compile caches (see there)
    from .formats import parse_format
    from .fused import quantize_fused
    from .rounding import parse_rounding

    mode, bits = parse_rounding(rounding, random_bits or None)
    return quantize_fused(x, parse_format(fmt), mode, bits, seed)


_LIB.impl("quantize_fused", _quantize_fused, "CompositeImplicitAutograd")
_FUSED_OP = torch.ops.lowprec.quantize_fused.default


def quantize_fused_op():
    """The registered ``torch.ops.lowprec.quantize_fused`` (its default overload)."""
    return _FUSED_OP
