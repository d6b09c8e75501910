"""Python numbers in a 16-bit op, as torch's CPU kernels read them.

A Python number beside a float16 (bfloat16) tensor is a "wrapped" scalar: type promotion keeps
the 16-bit dtype, and TensorIterator casts the scalar to it before the kernel runs, so
``x + 0.3`` on a float16 ``x`` adds float16(0.3) = 0.30004883, not 0.3 (a 0-dim float32
tensor beside a dimensioned 16-bit one is cast the same way). Some kernels read the number
before that cast, in float32 instead: ``mul`` and true ``div`` (``original_scalar_value<opmath_t>``
in aten/src/ATen/native/cpu/BinaryOpsKernel.cpp), and the ops whose number is a ``Scalar``
parameter read at float32 (``lerp``'s float weight, ``addcmul``'s value, ``leaky_relu``,
``elu``, ``softplus``, ``threshold``). Which is which is each kernel's choice, not an op
family's, so the ops below are the measured ones: torch 2.13's CPU float16 and bfloat16
kernels against both readings, on 200,000 values with scalar 0.3
(tests/training/test_fidelity.py). Emulation computes in float32 with the number as given, the
float32 reading; for these ops it casts the number first (``x + 0.3``: 89% of float16 results
equal native without, 100% with; ``torch.remainder(x, 0.3)`` 14% without). ``pow``'s number
exponent is cast by its replay (backward_kernels.py), whose backward reads it uncast.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ...numerics.quantize import emits_graph_ops, quantize

__all__ = ["NARROWING", "narrow_scalars", "narrowed", "may_narrow"]

# ops whose 16-bit CPU kernel reads a number (and ``alpha``) cast to the tensor's dtype
_NUMBERS = frozenset({
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
    "__isub__", "rsub", "subtract", "subtract_",
    "gt", "ge", "lt", "le", "eq", "ne", "gt_", "ge_", "lt_", "le_", "eq_", "ne_", "__gt__",
    "__ge__", "__lt__", "__le__", "__eq__", "__ne__", "greater", "greater_equal", "less",
    "less_equal", "not_equal",
    "remainder", "remainder_", "__mod__", "__imod__", "__rmod__", "fmod", "fmod_", "atan2",
    "atan2_", "arctan2", "hypot", "hypot_", "logaddexp", "logaddexp2", "hardshrink",
    "__rpow__",
})
# ops that cast a 0-dim tensor operand but read a number in float32 (``lerp``'s weight) or
# have it cast elsewhere (``pow``'s exponent: by its replay)
_TENSORS = frozenset({"lerp", "lerp_", "pow", "pow_", "__pow__", "__ipow__"})
# nan_to_num's default replacements of +-inf are the largest finite values of the tensor's dtype
_NAN_TO_NUM = frozenset({"nan_to_num", "nan_to_num_"})
NARROWING = _NUMBERS | _TENSORS | _NAN_TO_NUM
_KEYWORDS = ("other", "alpha", "input", "self", "exponent", "weight", "lambd")
_INT64 = (-2 ** 63, 2 ** 63)


@functools.lru_cache(maxsize=4096, typed=True)
def _cast(v, dtype: torch.dtype) -> float | int:
    # the wrapped scalar's cast: a float64 (int64) 0-dim tensor copied to the 16-bit dtype; an
    # int stays an int where it can (``ids + 1`` on an integer tensor keeps its dtype)
    r = torch.tensor(v, dtype=torch.float64).to(dtype).item()
    return int(r) if type(v) is int and math.isfinite(r) else r


def narrowed(v, dtype: torch.dtype):
    """The number ``v`` cast to ``dtype`` as a wrapped scalar is; ``v`` where it is not a
    real number (a bool, a tensor, a symbolic value) or is out of int64's range (native raises)."""
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    t = type(v)
    if t is float:
        # (zeros and NaNs as they are: the cache would take -0.0 for 0.0, and NaN is no key)
        return v if v == 0 or v != v else _cast(v, dtype)
    if t is int:
        return _cast(v, dtype) if _INT64[0] <= v < _INT64[1] else v
    return v


def may_narrow(args: tuple, kwargs: dict) -> bool:
    """Whether a call has an argument a 16-bit dtype might change: a float other than 0, an
    int beyond 256 (bf16's exact integers), a numpy number, a 0-dim floating tensor (a quick
    test before the comparisons' dtype inference: ``mask == 0`` needs none)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        t = type(a)
        if t is float:
            if a != 0:
                return True
        elif t is int:
            if not -256 <= a <= 256:
                return True
        elif isinstance(a, (np.floating, np.integer)) or \
                (isinstance(a, torch.Tensor) and a.dim() == 0 and a.is_floating_point()):
            return True
    return False


def _narrow(a, dtype: torch.dtype, numbers: bool, dims: bool):
    if not isinstance(a, torch.Tensor):
        return narrowed(a, dtype) if numbers else a
    if dims and a.dim() == 0 and not a.requires_grad and \
            a.dtype in (torch.float32, torch.float64):
        # a 0-dim float32 value beside a dimensioned 16-bit tensor (``torch.tensor(0.3)`` in
        # the forward): cast like a number (one on the 16-bit grid is unchanged). In a graph as
        # the opaque op: Inductor folds a constant's cast round trip into the literal 0.3
        fmt = "fp16" if dtype == torch.float16 else "bf16"
        with torch._C.DisableTorchFunction():
            if emits_graph_ops():
                return torch.ops.lowprec.quantize(a.float(), fmt, "nearest", 0, None)
            return quantize(a.float(), fmt)
    return a


def narrow_scalars(name: str, args: tuple, kwargs: dict, dtype: torch.dtype | None
                   ) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the numbers op ``name``'s kernel for ``dtype`` (float16,
    bfloat16) would cast to it so cast; unchanged for other ops and dtypes. A 0-dim tensor is
    cast only beside a dimensioned tensor (0-dim tensors alone promote among themselves)."""
    if name not in NARROWING or dtype not in (torch.float16, torch.bfloat16):
        return args, kwargs
    if name in _NAN_TO_NUM:  # (fp32's defaults would round to +-inf)
        return _inf_replacements(args, kwargs, dtype)
    # (pow's number base, 0.3 ** x, is cast: its replay takes a tensor base only)
    numbers = name in _NUMBERS or name == "pow" and args and not isinstance(args[0], torch.Tensor)
    dims = any(isinstance(a, torch.Tensor) and a.dim() for a in (*args, *kwargs.values()))
    args = tuple(_narrow(a, dtype, numbers, dims) for a in args)
    if kwargs:
        kwargs = {k: _narrow(v, dtype, numbers, dims) if k in _KEYWORDS else v
                  for k, v in kwargs.items()}
    return args, kwargs


def _inf_replacements(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """``nan_to_num(input, nan=0.0, posinf=None, neginf=None)``'s arguments with the 16-bit
    dtype's largest finite values where +-inf's replacements are left to the default."""
    kwargs = dict(kwargs)
    info = torch.finfo(dtype)
    for pos, key, value in ((2, "posinf", info.max), (3, "neginf", info.min)):
        if len(args) > pos:
            if args[pos] is None:  # (positional None: the default, given by keyword)
                args = args[:pos] + (value,) + args[pos + 1:]
        elif kwargs.get(key) is None:
            kwargs[key] = value
    return args, kwargs
