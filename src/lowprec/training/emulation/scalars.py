"""Python numbers in a 16-bit op, as torch's CPU kernels read them.

A Python number beside a float16 (bfloat16) tensor is a "wrapped" scalar: type promotion keeps
the 16-bit dtype, and TensorIterator casts the scalar to it before the kernel runs, so
``x + 0.3`` on a float16 ``x`` adds float16(0.3) = 0.2998046875, not 0.3 (a 0-dim float32
tensor is cast the same way). Some kernels read the number before that cast, in float32
instead: ``mul`` and true ``div`` (``original_scalar_value<opmath_t>`` in
aten/src/ATen/native/cpu/BinaryOpsKernel.cpp), and the ops whose number is a ``Scalar``
parameter read at float32 (``lerp``'s weight, ``addcmul``'s value, ``leaky_relu``, ``elu``,
``softplus``, ``pow``'s exponent). Which is which is each kernel's choice, not an op family's,
so the ops below are the measured ones: torch 2.13's CPU float16 and bfloat16 kernels against
both readings, on 200,000 values with scalar 0.3 (tests/training/test_fidelity.py). Emulation
computes in float32 with the number as given, the float32 reading; for these ops it narrows
the number first (``x + 0.3``: 89% of float16 results equal native without, 100% with;
bfloat16 76%; ``torch.remainder(x, 0.3)`` 14% without).
"""

from __future__ import annotations

import functools
import math

import torch


__all__ = ["NARROWING", "narrow_scalars"]

# ops whose 16-bit CPU kernel reads a Python number (and ``alpha``) cast to the tensor's dtype
NARROWING = frozenset({
    "add", "add_", "__add__", "__radd__", "__iadd__", "sub", "sub_", "__sub__", "__rsub__",
    "__isub__", "rsub", "subtract", "subtract_",
    "gt", "ge", "lt", "le", "eq", "ne", "gt_", "ge_", "lt_", "le_", "eq_", "ne_", "__gt__",
    "__ge__", "__lt__", "__le__", "__eq__", "__ne__", "greater", "greater_equal", "less",
    "less_equal", "not_equal",
    "remainder", "remainder_", "__mod__", "__imod__", "fmod", "fmod_", "atan2", "atan2_",
    "arctan2", "hypot", "hypot_",
})


@functools.lru_cache(maxsize=4096, typed=True)
def _narrowed(v, dtype: torch.dtype) -> float | int:
    # the wrapped scalar's cast: a float64 (int64) 0-dim tensor copied to the 16-bit dtype; an
    # int stays an int where it can (``ids + 1`` on an integer tensor keeps its dtype)
    r = torch.tensor(v, dtype=torch.float64).to(dtype).item()
    return int(r) if type(v) is int and math.isfinite(r) else r


def _narrow(a, dtype: torch.dtype):
    if type(a) is float or type(a) is int:  # (not bool: a bool operand stays a bool)
        return _narrowed(a, dtype)
    if isinstance(a, torch.Tensor) and a.dim() == 0 and not a.requires_grad and \
            a.dtype in (torch.float32, torch.float64):
        # a 0-dim float32 value (``torch.tensor(0.3)`` in the forward): cast like a number
        # (one already on the 16-bit grid is unchanged)
        with torch._C.DisableTorchFunction():
            return a.to(dtype).to(torch.float32)
    return a


def narrow_scalars(name: str, args: tuple, kwargs: dict, dtype: torch.dtype | None
                   ) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the numbers op ``name``'s kernel for ``dtype`` (float16,
    bfloat16) would cast to it so cast; unchanged for other ops and dtypes."""
    if name not in NARROWING or dtype not in (torch.float16, torch.bfloat16):
        return args, kwargs
    args = tuple(_narrow(a, dtype) for a in args)
    if kwargs:
        kwargs = {k: _narrow(v, dtype) if k in ("other", "alpha") else v
                  for k, v in kwargs.items()}
    return args, kwargs
