"""Backward formulas of elementwise ops and softmaxes as torch's 16-bit CPU backward runs them.

A native 16-bit run differentiates ``torch.exp(x)`` from the 16-bit output the forward saved,
``grad * result`` in 16-bit arithmetic (derivatives.yaml), where autograd of the engine's fp32
op would use the unrounded fp32 output: one unit off on 20-60% of the input gradients (tanh:
hundreds of units where 1 - y*y cancels). Each op here is one autograd function whose forward
is the op rounded to the compute format and whose backward is the native one: the composite
of derivatives.yaml with each 16-bit op's result rounded, or the dedicated backward kernel
(``tanh_backward``, ``sigmoid_backward``, ``log_sigmoid_backward``, ``softmax_backward``),
which reads 16-bit operands and computes in fp32. Each formula was measured against torch 2.13's
fp16 and bf16 CPU kernels (tests/training/test_fidelity.py, ``BACKWARD_OPS``): bit-exact.

Only IEEE-style formats rounded to nearest take these (``kernels.plain_formats``), as for the
other kernels; ``q`` rounds to the gradient format, ``a`` to the compute format (forward
values a backward recomputes, such as cos(x) for sin).
"""

from __future__ import annotations

import math
from numbers import Number

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ...numerics.formats import BF16, FP16
from ...numerics.quantize import quantize
from . import kernels
from .gradmarks import rounded_grad
from .scalars import narrowed

__all__ = ["REPLAYED", "OWN_FORWARDS", "DTYPE_KERNELS", "replayable", "replayed"]


def _pow16(x, e, a, bf16: bool):
    """x ** e as the 16-bit pow kernel computes it: fp32, rounded once; BFloat16's x ** 3 and
    x ** -2 as (x * x) * x and 1 / (x * x), each operation rounded (measured)."""
    if bf16 and e == 3:
        return a(a(x * x) * x)
    if bf16 and e == -2:
        return a(1 / a(x * x))
    if e == 0:
        return torch.ones_like(x)
    return a(x ** e)


def _as_read(e, kind: str):
    """A number (pow's exponent, logit's eps) as the 16-bit kernel reads it: cast to the dtype
    (:mod:`.scalars`; x ** 1.7 raises to fp16(1.7) = 1.7001953)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(kind)
    return e if dtype is None else narrowed(e, dtype)


def _xlogy(x, y, a):
    """xlogy as the 16-bit kernel computes it: x * log(y), the log and the product rounded; 0
    where x is 0, NaN where y is (measured against torch's fp16 and bf16)."""
    out = a(x * a(torch.log(y))).masked_fill_(x == 0, 0)
    return torch.where(torch.isnan(y), y, out)


def _xlogy_operands(xs, a, kind):
    """xlogy's operands as its 16-bit kernel reads them: a number, or a 0-dim float32 tensor
    beside a dimensioned one, cast to the 16-bit dtype (TensorIterator's common dtype: a
    wrapped scalar; 0.3 -> 0.30004883 in float16), a number as a 0-dim tensor (``a``: the
    rounding to that dtype, an opaque op when traced)."""
    if all(torch.is_tensor(v) and (v.dim() > 0 or not v.is_floating_point() or
                                   v.dtype in (torch.float16, torch.bfloat16)) for v in xs):
        return xs
    dims = any(torch.is_tensor(v) and v.dim() > 0 for v in xs)

    def read(v):
        if not torch.is_tensor(v):
            return torch.tensor(float(_as_read(v, kind)))
        if dims and v.dim() == 0 and v.is_floating_point() and not v.requires_grad and \
                v.dtype not in (torch.float16, torch.bfloat16):
            return a(v.to(torch.float32))  # (float64 too: cast to the 16-bit dtype via float32)
        return v

    return tuple(read(v) for v in xs)


def _logit_bounds(eps, a, kind):
    # the kernel's lo = eps and hi = 1 - eps in its 16-bit dtype (each cast, the subtraction
    # rounded)
    lo = _as_read(eps, kind)
    return lo, float(a(torch.tensor(1.0 - lo)))


def _logit(x, eps, a, kind):
    """logit as the 16-bit kernel computes it: log(x / (1 - x)), each operation rounded; with
    ``eps``, x clamped to [eps, 1 - eps] first (measured against torch's fp16 and bf16)."""
    if eps is not None:
        x = x.clamp(*_logit_bounds(eps, a, kind))
    return a(torch.log(a(x / a(1 - x))))


def _logit_backward(g, x, eps, a, q, kind):
    d = q(g / a(x * a(1 - x)))
    if eps is not None:
        lo, hi = _logit_bounds(eps, a, kind)
        d = d.masked_fill((x < lo) | (x > hi), 0)
    return d


def _dims(x, dim):
    if dim is None:
        return tuple(range(x.dim()))
    return tuple(d % max(x.dim(), 1) for d in ((dim,) if isinstance(dim, int) else dim))


def _expand(g, x, dim, keepdim):
    """A reduction's gradient with its reduced dimensions back (``unsqueeze_multiple``)."""
    if keepdim or x.dim() == 0 or g.dim() == x.dim():
        return g
    for d in sorted(_dims(x, dim)):
        g = g.unsqueeze(d)
    return g


def _var_options(args, kwargs):
    """(dim, correction, keepdim) of var/std(x, dim, unbiased | correction=, keepdim)."""
    rest = list(args[1:])
    dim, correction, keepdim = None, 1, False
    if rest and isinstance(rest[0], bool):  # var(x, unbiased)
        correction = int(rest.pop(0))
    else:
        if rest:
            dim = rest.pop(0)
        if rest:
            u = rest.pop(0)
            if u is not None:
                correction = int(u) if isinstance(u, bool) else u
        if rest:
            keepdim = bool(rest.pop(0))
    dim = kwargs.get("dim", dim)
    if "unbiased" in kwargs and kwargs["unbiased"] is not None:
        correction = int(kwargs["unbiased"])
    if kwargs.get("correction") is not None:
        correction = kwargs["correction"]
    return dim, correction, bool(kwargs.get("keepdim", keepdim))


def _var_backward(g, x, dim, correction, keepdim, a, q):
    # var_backward (FunctionsManual.cpp): (2 / (n - correction)) * grad * (x - x.mean(dim))
    dims = _dims(x, dim)
    n = 1
    for d in dims:
        n *= x.shape[d] if x.dim() else 1
    g = _expand(g, x, dim, keepdim)
    mean = a(x.mean(dims, keepdim=True)) if x.dim() else x
    return q(q((2.0 / (n - correction)) * g) * a(x - mean))


def _sigmoid(g, y, a, q, kind):
    if kind == "fp16":  # float16's sigmoid_backward runs in c10::Half arithmetic, each op rounded
        return q(q(g * q(1 - y)) * y)
    return q(g * (1 - y) * y)  # BFloat16 (and the rest): fp32 from the 16-bit operands


def _log_sigmoid(g, x, a, q):
    # log_sigmoid_backward reads the forward's 16-bit buffer z = exp(-|x|):
    # (max_deriv - sign * (z / (1 + z))) * grad in fp32
    z = a(torch.exp(-x.abs()))
    neg = x < 0
    return q((neg.to(g.dtype) - torch.where(neg, 1.0, -1.0) * (z / (1 + z))) * g)


def _unary(f, saves="y"):
    return saves, lambda g, xs, y, o, a, q, k: (f(g, xs[0] if xs else None, y, a, q, k),)


_ERF = 2.0 / math.sqrt(math.pi)

# name: (what the backward reads: "x" the inputs, "y" the rounded output, "xy" both;
# backward(g, inputs, y, options, a, q, kind) -> a gradient per tensor input), kind "fp16",
# "bf16" or "other" (the compute format)
REPLAYED = {
    "exp": _unary(lambda g, x, y, a, q, k: q(g * y)),
    "expm1": _unary(lambda g, x, y, a, q, k: q(g * a(y + 1))),
    "tanh": _unary(lambda g, x, y, a, q, k: q(g * (1 - y * y))),  # tanh_backward, fp32
    "sigmoid": _unary(lambda g, x, y, a, q, k: _sigmoid(g, y, a, q, k)),
    "special_expit": _unary(lambda g, x, y, a, q, k: _sigmoid(g, y, a, q, k)),
    "rsqrt": _unary(lambda g, x, y, a, q, k: q(q(-0.5 * g) * _pow16(y, 3, a, k == "bf16"))),
    "sqrt": _unary(lambda g, x, y, a, q, k: q(g / (2 * y))),
    "reciprocal": _unary(lambda g, x, y, a, q, k: q(-g * a(y * y))),
    "sin": _unary(lambda g, x, y, a, q, k: q(g * a(torch.cos(x))), "x"),
    "cos": _unary(lambda g, x, y, a, q, k: q(g * a(-torch.sin(x))), "x"),
    "atan": _unary(lambda g, x, y, a, q, k: q(g / a(a(x * x) + 1)), "x"),
    "erf": _unary(lambda g, x, y, a, q, k: q(a(_ERF * a(torch.exp(-a(x * x)))) * g), "x"),
    "log1p": _unary(lambda g, x, y, a, q, k: q(g / a(x + 1)), "x"),
    "log_sigmoid": _unary(lambda g, x, y, a, q, k: _log_sigmoid(g, x, a, q), "x"),
    # x ** e: grad * (e * x ** (e - 1)), each op in 16 bits (pow_backward)
    # (the pow kernel reads e - 1 cast to the 16-bit dtype; the product reads e in float32)
    "pow": ("x", lambda g, xs, y, e, a, q, k: (
        q(g * a(e * _pow16(xs[0], _as_read(e - 1, k), a, k == "bf16"))) if e
        else torch.zeros_like(g),)),
    # x / p: grad / p and -grad * ((x / p) / p) (div_tensor_other_backward)
    "div": ("x", lambda g, xs, y, o, a, q, k: (
        q(g / xs[1]), q(-g * a(a(xs[0] / xs[1]) / xs[1])))),
    # softmax_backward / log_softmax_backward: fp32 from the 16-bit output, rounded once
    "softmax": ("y", lambda g, xs, y, dim, a, q, k: (
        q((g - (g * y).sum(dim, keepdim=True)) * y),)),
    "log_softmax": ("y", lambda g, xs, y, dim, a, q, k: (
        q(g - torch.exp(y) * g.sum(dim, keepdim=True)),)),
    # logsumexp_backward: grad * (x - result).exp(), each op in 16 bits
    "logsumexp": ("xy", lambda g, xs, y, o, a, q, k: (
        q(_expand(g, xs[0], *o) * a(torch.exp(a(xs[0] - _expand(y, xs[0], *o))))),)),
    # the 2-norm's norm_backward: grad * (x / norm).masked_fill_(norm == 0, 0), each op in 16
    # bits (cosine_similarity, F.normalize)
    "linalg_vector_norm": ("xy", lambda g, xs, y, o, a, q, k: (q(_expand(g, xs[0], *o) * a(
        xs[0] / (n := _expand(y, xs[0], *o))).masked_fill_(n == 0, 0)),)),
    # xlogy: grad * xlogy(x != 0, y) and grad * x / y, each op in 16 bits
    "xlogy": ("x", lambda g, xs, y, o, a, q, k: (
        q(g * _xlogy((xs[0] != 0).to(g.dtype), xs[1], a)),
        q(a(g * (xs[0] if o[0] is None else o[0])) / xs[1]))),  # (a number x: as given)
    # logit_backward: grad / (x * (1 - x)), each op in 16 bits; 0 outside [eps, 1 - eps]
    "logit": ("x", lambda g, xs, y, o, a, q, k: (_logit_backward(g, xs[0], o[0], a, q, k),)),
    "var": ("x", lambda g, xs, y, o, a, q, k: (_var_backward(g, xs[0], *o, a, q),)),
    # std_backward: var_backward(grad / (2 * result))
    "std": ("xy", lambda g, xs, y, o, a, q, k: (
        _var_backward(q(g / (2 * y)), xs[0], *o, a, q),)),
}
REPLAYED["special_xlogy"] = REPLAYED["xlogy"]


def _log_softmax(x, dim, a, kind):
    """_vec_log_softmax_lastdim (SoftMaxKernel.cpp) keeps each row's sum of exp(x - max) and
    its log in the 16-bit type: (x - max) - log16(sum16), the subtraction in fp32; along
    other dimensions fp32 throughout, rounded once."""
    if x.dim() and dim % x.dim() != x.dim() - 1:
        return a(torch.log_softmax(x, dim))
    # (the row's max as it is: a row holding +inf is NaN throughout, as the kernel's; an
    # infinite max replaced by 0, as logsumexp's composite does, left it NaN only there)
    m = x.amax(-1, keepdim=True)
    return a((x - m) - a(torch.log(a(torch.exp(x - m).sum(-1, keepdim=True)))))


def _logsumexp(x, opts, a, kind):
    """logsumexp's composite (ReduceOps.cpp): log(sum(exp(x - max))) + max, each op's
    result in the 16-bit type."""
    dim, keepdim = opts
    dims = _dims(x, dim)
    m = x.amax(dims, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    y = a(a(torch.log(a(a(torch.exp(a(x - m))).sum(dims, keepdim=True)))) + m)
    return y if keepdim else y.squeeze(dims) if dims else y


def _vectorized(outer: int, inner: int, device=None):
    """Which (outer, inner) positions ``_vec_softmax`` computes on whole 16-bit vectors: the
    positions are split into one contiguous chunk per thread (``at::parallel_for``), and each
    chunk walks them in vectors of ``lanes`` that must fit both in the row of the inner
    dimensions and in the chunk; the others take the scalar tail. Measured with 1-4 threads
    on 12 shapes: one chunk per thread (a grain of at most a few positions). A bool tensor on
    ``device``; with none, a numpy array, whose values are known while a graph is traced."""
    lanes = 2 * kernels._vector_lanes()
    n = outer * inner
    if not lanes:
        return np.zeros((outer, inner), bool) if device is None else \
            torch.zeros(outer, inner, dtype=torch.bool, device=device)
    chunks = max(1, min(torch.get_num_threads(), n))
    size = -(-n // chunks)
    p = np.arange(n) if device is None else torch.arange(n, device=device)
    begin = p // size * size
    end = (begin + size).clip(max=n)
    row, j = p // inner, p % inner
    start = (row == begin // inner) * (begin % inner)
    v = start + (j - start) // lanes * lanes  # (floor division, as at::parallel_for's walk)
    return ((v + lanes <= inner) & (row * inner + v + lanes <= end)).reshape(outer, inner)


def _softmax(x, dim, a, kind):
    """softmax along a dimension other than the last (``_vec_softmax``, SoftMaxKernel.cpp):
    positions computed on whole 16-bit vectors (:func:`_vectorized`) in fp32, rounded once;
    the scalar tail stores each exp in the 16-bit type and divides it by the fp32 sum
    (measured, fp16 and bf16). Along the last dimension: fp32, rounded once."""
    y = a(torch.softmax(x, dim))
    if kind == "other" or x.dim() < 2 or dim % x.dim() == x.dim() - 1:
        return y
    d = dim % x.dim()
    outer = inner = 1
    for n in x.shape[:d]:
        outer *= n
    for n in x.shape[d + 1:]:
        inner *= n
    if _vectorized(outer, inner).all():  # (decided on numpy: a trace cannot read a tensor)
        return y
    m = x.amax(d, keepdim=True)
    e = torch.exp(x - m)
    tail = a(a(e) / e.sum(d, keepdim=True))
    vec = _vectorized(outer, inner, x.device).reshape(*x.shape[:d], 1, *x.shape[d + 1:])
    return torch.where(vec, y, tail)


# CUDA's kernels where they differ from the CPU's (``replayed(..., cuda=True)``): softmax's
# backward (softmax_backward_cuda_out, aten/src/ATen/native/cuda/SoftMax.cu) first forms
# ``tmp = grad * output``, a 16-bit tensor op (fp32 product rounded), then in fp32 from the
# 16-bit tmp and output (SoftMaxBackwardEpilogue, softmax_warp_backward): tmp - output *
# sum(tmp), rounded once; log_softmax's backward is the CPU's formula (fp32 from the 16-bit
# output, rounded once); both forwards compute in fp32 and round once (softmax_warp_forward,
# cunn_SoftMaxForward: no 16-bit row sum nor scalar tail as the CPU's)
_CUDA_BACKWARDS = {
    "softmax": lambda g, xs, y, dim, a, q, k: (
        q((t := q(g * y)) - y * t.sum(dim, keepdim=True)),),
}
_CUDA_ONE_ROUNDING = ("softmax", "log_softmax")

# forwards that are not one rounding of the fp32 op
_FORWARDS = {
    "softmax": _softmax,
    "pow": lambda x, e, a, kind: _pow16(x, _as_read(e, kind), a, kind == "bf16"),
    "log_softmax": _log_softmax,
    "logsumexp": _logsumexp,
    "logit": lambda x, o, a, kind: _logit(x, o[0], a, kind),
    "xlogy": lambda x, y, o, a, kind: _xlogy(x, y, a),
}
_FORWARDS["special_xlogy"] = _FORWARDS["xlogy"]
# replays of what the fp16/bf16 kernels compute, each intermediate rounded: for formats with
# no such kernel (fp8, fixed point) an intermediate in the format can leave its range (logit's
# x / (1 - x) clipped at q6.10's 32; e4m3's 1 - eps rounded to 1): they keep one rounding
DTYPE_KERNELS = frozenset({"logit", "xlogy", "special_xlogy", "linalg_vector_norm"})
_BINARY = ("div", "xlogy", "special_xlogy")  # replays of two tensors
OWN_FORWARDS = frozenset(_FORWARDS)  # replayed with or without a gradient


def _options(name: str, args, kwargs):
    """The non-tensor arguments a backward needs, or ``False`` when this call is not one the
    formula stands for (a tensor exponent, a ``dtype=``, a rounding mode, out=)."""
    if "out" in kwargs:
        return False
    if name in ("softmax", "log_softmax"):
        if kwargs.get("dtype") is not None or len(args) > 2 and args[2] is not None:
            return False
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return dim if isinstance(dim, int) else False
    if name == "pow":
        e = args[1] if len(args) > 1 else kwargs.get("exponent")
        return e if isinstance(e, Number) and not isinstance(e, bool) and \
            torch.is_tensor(args[0]) else False
    if name == "div":  # x / p, same shapes (a broadcast operand comes expanded), no mode
        ok = len(args) == 2 and not kwargs and torch.is_tensor(args[1]) and \
            args[1].shape == args[0].shape
        return None if ok else False
    if name == "logsumexp":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        return (dim, bool(keep))
    if name in ("var", "std"):
        return _var_options(args, kwargs)
    if name in ("xlogy", "special_xlogy"):  # two tensors of one shape, or a tensor and a
        # number or a 0-dim tensor; no out=. Options: x when it is a number (its gradient
        # formula reads it as given)
        if len(args) != 2 or kwargs:
            return False
        x, y = args
        if torch.is_tensor(x) and torch.is_tensor(y):
            ok = x.shape == y.shape or (x.dim() == 0) != (y.dim() == 0)
        else:
            ok = (torch.is_tensor(x) or torch.is_tensor(y)) and all(
                torch.is_tensor(v) or type(v) in (float, int) for v in args)
        if not ok:
            return False
        # x's gradient formula grad * x / y reads a number, or a 0-dim tensor beside a
        # dimensioned y, as given (a CPU scalar of mul: float32), not cast
        if not torch.is_tensor(x):
            return (x,)
        if x.dim() == 0 and y.dim() > 0 and x.is_floating_point() and \
                x.dtype not in (torch.float16, torch.bfloat16):
            return (x.detach().to(torch.float32),)
        return (None,)
    if name == "logit":  # (x, eps=None)
        rest = dict(zip(("eps",), args[1:]), **kwargs)
        return (rest.get("eps"),) if set(rest) <= {"eps"} else False
    if name == "linalg_vector_norm":  # (x, ord=2, dim=None, keepdim=False, *, dtype=None)
        rest = dict(zip(("ord", "dim", "keepdim"), args[1:]), **kwargs)
        if rest.get("ord", 2) != 2 or rest.get("dtype") is not None or set(rest) - {
                "ord", "dim", "keepdim", "dtype"}:
            return False
        return rest.get("dim"), bool(rest.get("keepdim", False))
    return None if len(args) == 1 and not kwargs else False


def replayable(name: str, args, kwargs):
    """The options of a call :func:`replayed` stands for (``False``: not this call): one whose
    gradient is needed, or one whose forward is not one rounding (pow, log_softmax,
    logsumexp), gradient or not."""
    if not args or not (torch.is_tensor(args[0]) or name in ("xlogy", "special_xlogy") and
                        len(args) > 1 and torch.is_tensor(args[1])):
        return False
    opts = _options(name, args, kwargs)
    if opts is False:
        return False
    if name in _FORWARDS:
        return opts
    # div: only the divisor's gradient differs from fp32's rounded once
    t = args[1] if name == "div" else args[0]
    return opts if t.requires_grad and torch.is_grad_enabled() else False


class _Replayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, *xs):
        name, func, args, kwargs, opts, a, q, kind, cuda = spec
        forward = None if cuda and name in _CUDA_ONE_ROUNDING else _FORWARDS.get(name)
        y = a(func(*args, **kwargs)) if forward is None else forward(*xs, opts, a, kind)
        saves = REPLAYED[name][0]
        ctx.save_for_backward(*(xs if "x" in saves else ()), *((y,) if "y" in saves else ()))
        ctx.spec = (name, opts, a, q, kind, "x" in saves, "y" in saves, cuda)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        name, opts, a, q, kind, has_x, has_y, cuda = ctx.spec
        saved = ctx.saved_tensors
        xs = saved[:-1] if has_y and has_x else saved if has_x else ()
        y = saved[-1] if has_y else None
        # g: the gradient reaching the output, rounded there by the engine
        formula = _CUDA_BACKWARDS.get(name) if cuda else None
        grads = (formula or REPLAYED[name][1])(g, xs, y, opts, a, q, kind)
        grads = tuple(d if need else None for d, need in zip(grads, ctx.needs_input_grad[1:]))
        return (None, *grads)


def replayed(rule, name: str, func, args, kwargs, opts, *, cuda: bool = False):
    """``func(*args, **kwargs)`` rounded to the compute format, its backward as the 16-bit
    kernel's (the caller's rounding of the output is then a no-op on the values and rounds
    the gradient reaching it); ``cuda``: CUDA's kernel's where it differs (softmax and
    log_softmax, :data:`_CUDA_BACKWARDS`)."""
    compute, grads = rule.compute, rule.grads

    def a(t):
        return quantize(t, compute)

    def q(t):
        return rounded_grad(t, grads)

    xs = tuple(args[:2]) if name in _BINARY else (args[0],)
    kind = "fp16" if compute == FP16 else "bf16" if compute == BF16 else "other"
    if name in ("xlogy", "special_xlogy"):
        xs = _xlogy_operands(xs, a, kind)
    return _Replayed.apply((name, func, args, kwargs, opts, a, q, kind, cuda), *xs)
