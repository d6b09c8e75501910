"""Logical dtypes: the dtype model code sees under an emulated policy.

Emulation keeps every tensor in float32 and rounds values onto the policy's grid; model code
must still see what ``model.half()`` (or ``.bfloat16()``) would give it, because modern models
branch on dtypes (``if h.dtype == torch.float16: h = h.clamp(...)``) and open fp32 islands
(``h.to(torch.float32)`` ... ``.to(input_dtype)``). The engine's mode answers ``x.dtype`` with the
tensor's *logical* dtype, decided here:

* a tensor the engine put on the fp16 (bf16) grid reports float16 (bfloat16);
* a tensor an upcast produced (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``)
  carries ``LOGICAL = torch.float32``: an island, whose ops run and stay in fp32;
* anything else reports its physical dtype.

Only 16-bit formats with a torch dtype are reported as such. Formats with no torch dtype (fp8
compute, fixed point, MX) report float32: no framework runs model code on fp8 or MX activations
(torchao's float8 training and MX recipes cast inside the GEMM and hand float32/bf16 back), so
float32 is what model code sees there natively too.
"""

from __future__ import annotations

import torch

from ...numerics.formats import BF16, FP16, Format

__all__ = ["LOGICAL", "MARK", "DTYPE_FORMATS", "format_dtype", "CASTS", "cast_target", "is_island",
           "TYPE_NAMES", "DTYPE_GETTER"]

LOGICAL = "_lowprec_dtype"  # attribute: set on fp32 islands (the dtype a native run would have)
MARK = "_lowprec_grid"  # attribute set on a tensor whose values lie on that format's grid
DTYPE_FORMATS: dict[torch.dtype, Format] = {torch.float16: FP16, torch.bfloat16: BF16}
_FORMAT_DTYPES = {FP16: torch.float16, BF16: torch.bfloat16}
DTYPE_GETTER = torch._C.TensorBase.dtype  # the descriptor whose __get__ the mode sees
CASTS = frozenset({"to", "float", "half", "bfloat16", "double", "type", "type_as"})
TYPE_NAMES = {torch.float16: "torch.HalfTensor", torch.bfloat16: "torch.BFloat16Tensor",
              torch.float32: "torch.FloatTensor", torch.float64: "torch.DoubleTensor"}
_NAMED_TYPES = {v: k for k, v in TYPE_NAMES.items()}
_METHOD_TARGETS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                   "double": torch.float64}


def format_dtype(fmt) -> torch.dtype | None:
    """The 16-bit torch dtype whose values are ``fmt``'s (None for every other format)."""
    try:
        return _FORMAT_DTYPES.get(fmt)
    except TypeError:  # an unhashable format
        return None


def is_island(t) -> bool:
    return getattr(t, LOGICAL, None) is not None


def cast_target(name: str, args, kwargs, logical) -> torch.dtype | None:
    """The floating dtype a cast call converts to (None: no dtype change, or not floating);
    ``logical(t)`` gives a tensor argument's logical dtype (``x.to(other)``, ``type_as``)."""
    if name in _METHOD_TARGETS:
        return _METHOD_TARGETS[name]
    if name == "type_as":
        return logical(args[1]) if len(args) > 1 and torch.is_tensor(args[1]) else None
    cand = list(args[1:]) + [kwargs.get("dtype")]
    for a in cand:
        if isinstance(a, torch.dtype):
            return a if a.is_floating_point else None
        if name == "type" and isinstance(a, str):
            d = _NAMED_TYPES.get(a)
            return d
        if name == "to" and torch.is_tensor(a):
            d = logical(a)
            return d if d.is_floating_point else None
    return None
