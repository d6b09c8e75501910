"""The operator-level emulation engine: every floating tensor an op produces on the policy's grid.

A :class:`torch.overrides.TorchFunctionMode` sees each call of the torch API that a model's
forward makes (``F.linear``, ``x + y``, ``x += y``, ``torch.softmax``, attention, views) in its
own ``forward``, in a container's ``forward`` or in a plain function. For each call it

* runs the op in fp32 (matmuls, convolutions and reductions accumulate in fp32) and rounds each
  floating output once to the compute format, as tensor cores and torch's CPU fp16/bf16 kernels
  do; the rounding is an autograd function whose backward rounds the gradient reaching that
  output to the gradient format (every activation gradient an op's backward produces lands
  there, summed over the op's consumers);
* leaves integer and bool tensors alone, and skips ops whose output is a selection of on-grid
  inputs (views, ``relu``, max-pooling, ``cat``, embedding lookups): no copy, no rounding;
* rounds in place what an in-place op wrote (``x += y``, ``masked_fill_``, ``x[i] = v``);
* under a mixed policy (``scope="matmul"``) follows torch.autocast's op lists
  (:mod:`.oplists`): ops autocast runs in the low-precision dtype get rounded inputs, weights and
  output; its fp32 ops stay fp32; other ops produce the compute format when all their floating
  inputs are in it (autocast's dtype propagation), fp32 otherwise.

With ``match_cpu_kernels=True``, convolutions sum in the order of torch's reference CPU 16-bit
kernel (:mod:`lowprec.numerics.summation`) instead of oneDNN's fp32 order, and matrix products,
layer norm, attention without dropout, recurrent layers, gelu/erf/sqrt and selections by an
index tensor run on this CPU's own 16-bit kernels (:mod:`.native_gemm`), which makes an
emulated run's forward bit-exact with ``model.half()`` on CPUs where the reference
convolution runs (no AVX512-FP16), and its gradients too but through 2-D convolutions.

``target`` names whose 16-bit kernels the ops that round differently on a CPU and on CUDA
follow: "cpu" (torch's CPU kernels, above and in :mod:`.kernels`), "cuda" (cuDNN's and ATen's
CUDA kernels: a convolution's bias added after its rounded output, batch norm with fp32
statistics, layer norm's backward in fp32 rounded once, softmax's backward from the 16-bit
product ``grad * output``, log_softmax's forward rounded once, the embedding's backward summed
in fp32; :data:`TARGETS`) or None (each op as the device of its tensors computes it).

Tensors carry a mark (``_lowprec_grid``) once rounded, so an on-grid tensor is never rounded
twice; so do gradients (``_lowprec_grad_grid``, with their version): the gradient one consumer
sent back, rounded there, is not rounded again at the output it reaches unchanged. Module hooks
track which module is running, for per-module overrides and for naming ops.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import struct
import types
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...numerics.formats import FP32, BlockFormat, FixedFormat, FloatFormat, Format
from ...numerics.keys import derive_keys
from ...numerics.quantize import draw_seed, quantize, quantize_
from ...numerics import accumulation_ops, summation
from ...numerics.accumulation import Accumulator
from ...numerics.rounding import Rounding, check_generator
from ..policy import Policy, parse_policy, policy_or_format
from ..scaling import GemmScaling
from ..regimes.base import GroupKey, Role, Resolve, regimes_resolve, static_resolve
from ..tree import tensors_in
from . import backward_kernels, fastpath, kernels, native_gemm, recurrent_kernels, scaled
from .gradmarks import note_rounded, pass_through, rounded_already
from .dtypes import (CASTS, DTYPE_FORMATS, DTYPE_GETTER, LOGICAL, TYPE_NAMES, cast_target,
                     format_dtype, is_island)
from .oplists import (ACCUMULATOR_INPUTS, BROADCAST_OPS, BUFFER_OPS, EMPTY_OPS, FP32_OPS, GRID_OPS, LOWP_OPS,
                      NORM_OPS, PASS_OPS, is_inplace, reduction_axes,
                      returns_its_input)

__all__ = ["Rule", "Emulation", "emulated", "group_key", "op_name", "MARK", "PARAM", "TARGETS",
           "check_target"]

#: the kernels an emulation can follow where a CPU's 16-bit kernels and CUDA's round differently
TARGETS = ("cpu", "cuda")


def check_target(target, match_cpu_kernels: bool = False) -> str | None:
    """``target`` checked: "cpu", "cuda" or None (the device of the tensors)."""
    if target is not None and target not in TARGETS:
        raise ValueError(f"target={target!r:.40}; accepted: 'cpu', 'cuda' or None (the device "
                         "of the model's tensors)")
    if target == "cuda" and match_cpu_kernels:
        raise ValueError("target='cuda' with match_cpu_kernels=True: the second runs this "
                         "CPU's own 16-bit kernels; accepted: one or the other")
    return target

MARK = "_lowprec_grid"  # attribute set on a tensor whose values lie on that format's grid
# attribute of a traced stand-in for a parameter (compiled emulation, :mod:`.compiled`): the
# parameter's id, so that the stand-in is rounded, named and summed as the parameter would be
PARAM = "_lowprec_param"
_ROUNDABLE = (torch.float32, torch.float16, torch.bfloat16)
_BUFFER_POS = (3, 4)  # torch.batch_norm(input, weight, bias, running_mean, running_var, ...)


# convolutions whose bias CUDA adds to the rounded output (:meth:`Emulation._bias_after`)
_CONVS = {"conv1d": torch.conv1d, "conv2d": torch.conv2d, "conv3d": torch.conv3d,
          "conv_transpose1d": torch.conv_transpose1d, "conv_transpose2d": torch.conv_transpose2d,
          "conv_transpose3d": torch.conv_transpose3d}


def group_key(role: str, name: str) -> GroupKey:
    """The dynamic fixed-point group of a rounding: one range per role ("act" or "grad") and
    module (or parameter, for a weight rounded when used)."""
    return GroupKey(Role.ACTIVATION if role == "act" else Role.GRAD, name)


@dataclass(frozen=True)
class Rule:
    """The formats the ops of one module follow."""

    compute: Format
    grads: Format
    params: Format
    rounding: Rounding = Rounding.NEAREST_EVEN
    grad_rounding: Rounding = Rounding.NEAREST_EVEN
    scope: str = "all"
    scaled: GemmScaling | None = None  # the GEMMs it covers run as scaled GEMMs (.scaled)
    accumulator: Accumulator | None = None  # GEMMs accumulate in it (numerics.accumulation)

    @classmethod
    def of(cls, policy: Policy) -> "Rule":
        return cls(policy.compute, policy.grads, policy.params, policy.rounding,
                   policy.grad_rounding, policy.scope, policy.scaled, policy.accumulator)

    @property
    def active(self) -> bool:
        return self.compute != FP32 or self.grads != FP32 or self.accumulator is not None

    @property
    def block(self) -> bool:
        return isinstance(self.compute, BlockFormat)


def parse_override(value, base: Policy) -> Rule:
    """An override is a policy (``"32-true"``, a spec) or a format (``"bf16"``: pure)."""
    if isinstance(value, Rule):
        return value
    if isinstance(value, Policy):
        return Rule.of(value)
    try:
        found = policy_or_format(value)  # the grammar of every policy argument
    except (ValueError, TypeError):
        raise ValueError(f"override {value!r} is neither a policy (e.g. '32-true', "
                         "'p=fp32,c=bf16') nor a format (e.g. 'bf16', 'e4m3fn')") from None
    if isinstance(found, Policy):
        return Rule.of(found)
    return Rule(found, found, found, base.rounding, base.grad_rounding, "all")


_NAMES: dict = {}


def _widened(t):
    """A float16 or bfloat16 tensor as float32 (exact; its gradient flows back in its dtype)."""
    if torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _warn_if_compiling(module, args) -> None:
    if torch.compiler.is_compiling():
        warnings.warn("lowprec: an emulated policy runs the model eagerly under torch.compile "
                      "(its op-level rounding is Python); Precision(..., compile=True) "
                      "compiles it with every rounding in the graph", stacklevel=2)


def _eager_only(hook):
    """A module hook that does nothing while Dynamo traces: compiled emulation traces the
    model's plain graph first and runs the engine over that graph (:mod:`.compiled`)."""
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return hook(*args, **kwargs)
    return run


def _is_param(t) -> bool:
    return isinstance(t, nn.Parameter) or getattr(t, PARAM, None) is not None


def _pid(t) -> int:
    """The id of the parameter ``t`` is or stands for."""
    return getattr(t, PARAM, None) or id(t)


def op_name(func) -> str:
    """``linear``, ``add``, ``add_``, ``__getitem__``: the name torch gives a torch-API call."""
    try:
        return _NAMES[func]
    except (KeyError, TypeError):
        name = getattr(func, "__name__", None) or type(func).__name__
        try:
            _NAMES[func] = name
        except TypeError:
            pass
        return name


def _marked(t: torch.Tensor, fmt: Format) -> bool:
    m = getattr(t, MARK, None)
    return m is fmt or (m is not None and m == fmt)


def _mark(t: torch.Tensor, fmt: Format) -> None:
    try:
        setattr(t, MARK, fmt)
    except (AttributeError, RuntimeError):
        pass


# clamping ops -> (position and name of the lower bound, of the upper bound, their defaults):
# the output is on the input's grid when both bounds are (ReLU6 is hardtanh(x, 0, 6))
_BOUNDED = {
    "hardtanh": (1, "min_val", 2, "max_val", -1.0, 1.0),
    "hardtanh_": (1, "min_val", 2, "max_val", -1.0, 1.0),
    "clamp": (1, "min", 2, "max", None, None), "clamp_": (1, "min", 2, "max", None, None),
    "clip": (1, "min", 2, "max", None, None), "clip_": (1, "min", 2, "max", None, None),
}
# grid ops whose backward keeps or zeroes each gradient value (gradmarks.pass_through)
_MASKS = frozenset({"relu", "relu_", "relu6", *_BOUNDED})


def _representable(b, fmt: Format) -> bool:
    """Whether the finite Python number ``b`` is a value of the static element format ``fmt``
    (``fmt.represents``, decided from the format's fields: no tensor, so that it can run while
    compiled emulation traces with fake tensors) and of float32, which carries it. -0.0 is
    refused (a format may have no -0), and so are infinities and NaN."""
    if not isinstance(b, (int, float)) or isinstance(b, bool):
        return False  # a tensor bound: not checked
    b = float(b)
    if not math.isfinite(b):
        return False
    if b == 0.0:
        return math.copysign(1.0, b) > 0
    try:
        if struct.unpack("<f", struct.pack("<f", b))[0] != b:
            return False  # torch would clamp at b rounded to float32
    except OverflowError:
        return False
    if getattr(fmt, "dynamic", False) or not isinstance(fmt, (FixedFormat, FloatFormat)):
        return False
    return fmt.represents(b)


def _grid_op(name: str, args, kwargs, fmt: Format) -> bool:
    """Whether ``name`` maps values of ``fmt``'s grid onto it: the ops of GRID_OPS, and a clamp
    of a tensor on the grid (marked: an input off it is rounded first, as any op's) whose bounds
    are values of an element format (then its output needs no rounding)."""
    if name in GRID_OPS:
        return True
    spec = _BOUNDED.get(name)
    if spec is None or not args or not _floating(args[0]) or not _marked(args[0], fmt):
        return False
    lo_pos, lo_kw, hi_pos, hi_kw, lo_default, hi_default = spec
    kwargs = kwargs or {}
    lo = args[lo_pos] if len(args) > lo_pos else kwargs.get(lo_kw, lo_default)
    hi = args[hi_pos] if len(args) > hi_pos else kwargs.get(hi_kw, hi_default)
    return _bound_ok(lo, fmt) and _bound_ok(hi, fmt)


def _bound_ok(b, fmt: Format) -> bool:
    """No bound, an infinite one (no clamping on that side) or a value of the format."""
    return b is None or (isinstance(b, float) and math.isinf(b)) or _representable(b, fmt)


def _floating(t) -> bool:
    return torch.is_tensor(t) and t.dtype in _ROUNDABLE


def _map(fn, obj):
    """``fn`` over the tensors of nested tuples, lists, namedtuples (PackedSequence) and dicts."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, tuple):
        vals = [_map(fn, v) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple (torch.return_types are structseqs: tuples)
            return type(obj)(*vals)
        try:
            return type(obj)(vals)
        except TypeError:
            return tuple(vals)
    if isinstance(obj, list):
        return [_map(fn, v) for v in obj]
    if isinstance(obj, dict):
        return type(obj)((k, _map(fn, v)) for k, v in obj.items())
    return obj


def _fresh(y: torch.Tensor) -> torch.Tensor:
    # quantize returns ``out.reshape(x.shape)``, a same-shape view of its own buffer; autograd
    # forbids modifying a custom Function's view output in place (``relu_`` after it), so hand
    # back the buffer itself
    b = y._base
    if b is not None and b.shape == y.shape and b.stride() == y.stride() and \
            b.storage_offset() == y.storage_offset():
        return b
    return y if b is None else y.clone()


class _Site:
    """Stochastic rounding's keys for the roundings of one site of one forward (an op's output
    rounded, its gradient rounded in backward): the ``j``-th rounding gets the keys of counter
    ``j * 2**31 + n`` under the forward's base keys. The site's number ``n`` is fixed when the
    forward meets it, so whether the forward runs eagerly (the base a pair of ints) or is traced
    into a graph (the base a graph input), every rounding gets the same keys, given the same
    roundings in the same order (a 16-bit sum of a tensor's gradients (``_Sum``) rounds with the
    site of the arrival that completes each add: autograd's order, the same in both)."""

    __slots__ = ("base", "n", "j")

    def __init__(self, base, n: int) -> None:
        self.base, self.n, self.j = base, n, 0

    def next(self):
        self.j += 1
        return derive_keys(self.base, (self.j - 1) * 2**31 + self.n)


class _Stream:
    """The sites of one forward (:class:`_Site`), numbered in the order the engine meets them."""

    __slots__ = ("base", "n")

    def __init__(self, base) -> None:
        self.base, self.n = base, 0

    def site(self) -> _Site:
        self.n += 1
        return _Site(self.base, self.n - 1)


def _keyword(mode, keys) -> dict:
    """quantize's keyword for stochastic rounding's keys from ``keys``: a :class:`_Site`'s
    next keys, or a generator (None: torch's default) drawn from at each call."""
    if type(keys) is _Site:
        return {"seed": keys.next() if mode.is_stochastic else None}
    return {"generator": keys}


def _skips(g, fmt, mode, keys) -> bool:
    """Whether rounding the gradient ``g`` to ``fmt`` can be skipped: it is on that grid
    already, unchanged (:mod:`.gradmarks`), and no generator would be drawn from; a site's
    stochastic keys advance as if it had rounded, so later roundings keep theirs."""
    if not rounded_already(g, fmt) or (mode.is_stochastic and type(keys) is not _Site):
        return False
    if mode.is_stochastic:
        keys.next()
    return True


def _round_grad(g, bwd, bmode, keys):
    """The gradient ``g`` rounded to ``bwd`` (a format, or a function of the tensor giving one:
    dynamic formats) and noted (:mod:`.gradmarks`); ``g`` itself where it is on that grid
    already (:func:`_skips`)."""
    if _skips(g, bwd, bmode, keys):
        return g
    out = _fresh(_q(g, bwd(g) if callable(bwd) else bwd, bmode, keys))
    note_rounded(out, bwd)
    return out


def _q(x, fmt, mode, keys):
    return quantize(x, fmt, mode, **_keyword(mode, keys))


def _q_(x, fmt, mode, keys):
    return quantize_(x, fmt, mode, **_keyword(mode, keys))


class _Round(torch.autograd.Function):
    """Values to ``fwd``; the gradient reaching the output to ``bwd`` (None: unchanged)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen):
        ctx.spec = (bwd, bmode, gen)
        return _fresh(_q(x, fwd, mode, gen))

    @staticmethod
    def backward(ctx, g):
        bwd, bmode, gen = ctx.spec
        if bwd is not None and g is not None and g.dtype in _ROUNDABLE:
            # (not again: the one consumer's gradient its _Consumed node rounded)
            g = _round_grad(g, bwd, bmode, gen)
        return g, None, None, None, None, None


class _Sum:
    """The 16-bit sum native autograd forms of the gradients an activation's consumers send
    back: each arrival added to the running sum and rounded (``InputBuffer::add`` in the
    tensor's dtype), in the order the backward runs the consumers. Shared by the
    :class:`_Consumed` / :class:`_Upcast` nodes of one tensor; ``n`` counts them."""

    __slots__ = ("n", "seen", "task", "value")

    def __init__(self) -> None:
        self.n, self.seen, self.task, self.value = 0, 0, None, None

    def add(self, g: torch.Tensor, fmt, mode, gen) -> torch.Tensor:
        """``g`` (rounded) arrives; returns what to hand autograd instead: the change in the
        rounded running sum, so that autograd's fp32 sum of the consumers' returns is the
        rounded sum (telescoping; each difference of two 16-bit values is exact in fp32 but
        for exponents more than 13 binades apart)."""
        if self.n <= 1:
            return g
        task = torch._C._current_graph_task_id()
        if self.value is None or task != self.task or self.value.shape != g.shape:
            self.task, self.value, self.seen = task, g, 1
            return g
        new = _q(self.value + g, fmt(g) if callable(fmt) else fmt, mode, gen)
        out = new - self.value
        self.seen += 1
        self.value = None if self.seen >= self.n else new  # every consumer in: let it go
        return out


SUM = "_lowprec_sum"  # attribute of an activation: its consumers' _Sum


def _consumer_sum(t: torch.Tensor) -> _Sum:
    acc = getattr(t, SUM, None)
    if acc is None:
        acc = _Sum()
        try:
            setattr(t, SUM, acc)
        except (AttributeError, RuntimeError):
            pass
    acc.n += 1
    return acc


class _Upcast(torch.autograd.Function):
    """A 16-bit value cast up (``h.to(torch.float32)``): a copy, exact; the gradient reaching
    it is cast back to the 16-bit format, as the cast's backward does natively, and added to
    the tensor's other consumers' (``acc``: :class:`_Sum`, or None)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen, acc=None):
        ctx.spec = (bwd, bmode, gen, acc)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        bwd, bmode, gen, acc = ctx.spec
        if bwd is not None and g is not None and g.dtype in _ROUNDABLE:
            g = _round_grad(g, bwd, bmode, gen)
            if acc is not None:
                g = acc.add(g, bwd, bmode, gen)
        return g, None, None, None, None, None, None


class _Consumed(torch.autograd.Function):
    """An activation an op reads: unchanged forward; the gradient this one op sends back to it
    is rounded, then added to the other consumers' as a native 16-bit run adds them (one
    16-bit sum per arrival, in the tensor's dtype: :class:`_Sum`)."""

    @staticmethod
    def forward(ctx, x, bwd, bmode, gen, acc=None):
        ctx.spec = (bwd, bmode, gen, acc)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        bwd, bmode, gen, acc = ctx.spec
        if g is not None and g.dtype in _ROUNDABLE:
            g = _round_grad(g, bwd, bmode, gen)  # (not again: what a replayed kernel rounded)
            if acc is not None:
                g = acc.add(g, bwd, bmode, gen)
        return g, None, None, None, None


class _Broadcast(torch.autograd.Function):
    """An operand broadcast by an elementwise op (``weight * h``): expanded here, so that its
    gradient arrives at the output's size and is rounded there before being summed down, as a
    native 16-bit backward computes it (the full-size product in 16 bits, then the sum)."""

    @staticmethod
    def forward(ctx, x, shape, bwd, bmode, gen):
        ctx.spec = (bwd, bmode, gen, x.shape)
        return x.expand(shape)

    @staticmethod
    def backward(ctx, g):
        bwd, bmode, gen, shape = ctx.spec
        if g is not None and g.dtype in _ROUNDABLE:
            g = _q(g, bwd(g) if callable(bwd) else bwd, bmode, gen)
            g = g.sum_to_size(shape)
        return g, None, None, None, None


class _RoundInplace(torch.autograd.Function):
    """In-place form for what an in-place op wrote (``x += y``)."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, mode, bmode, gen):
        ctx.spec = (bwd, bmode, gen)
        _q_(x, fwd, mode, gen)
        ctx.mark_dirty(x)
        return x

    backward = _Round.backward


_MHA_FORWARD = torch.nn.functional.multi_head_attention_forward
_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_EXPANDED: dict = {}


def _no_torch_function(*args, **kwargs) -> bool:
    return False


def _expanded(func: types.FunctionType) -> types.FunctionType:
    """``func`` with its ``if has_torch_function(...): return handle_torch_function(...)``
    preamble made false, so that, run under the mode, it executes its body (whose builtins the
    mode then sees) instead of handing itself back to the mode. A function that checks some
    other way comes back to the mode, which then runs it as one op (``expanding``)."""
    body = _EXPANDED.get(func)
    if body is None:
        glb = func.__globals__
        if any(n in glb for n in _CHECKS):
            glb = dict(glb)
            glb.update({n: _no_torch_function for n in _CHECKS if n in glb})
            body = types.FunctionType(func.__code__, glb, func.__name__, func.__defaults__,
                                      func.__closure__)
            body.__kwdefaults__ = func.__kwdefaults__
        else:
            body = func
        _EXPANDED[func] = body
    return body


class _Mode(TorchFunctionMode):
    def __init__(self, engine: "Emulation") -> None:
        super().__init__()
        self.engine = engine
        self.expanding: set = set()

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if name in PASS_OPS:
            if name == "__get__" and args and getattr(func, "__self__", None) is DTYPE_GETTER:
                return self.engine.reported_dtype(args[0])  # x.dtype: its logical dtype
            if name == "element_size" and args:
                return self.engine.reported_dtype(args[0]).itemsize
            return func(*args, **kwargs)
        em = self.engine
        if returns_its_input(name, args, kwargs):  # (its compiled decomposition copies it)
            for fn in em.observers:
                fn(name, em.module_name(), args, kwargs, args[0])
            return args[0]
        if func is _MHA_FORWARD and em.attention and \
                (call := fastpath.native_call(em.attention.get(em.module_name()), args, kwargs,
                                              em.fast_path_dtype())) is not None:
            # nn.MultiheadAttention's inference fast path, as a native run takes it
            return fastpath.run_native(em, em.rule(), em.module_name(), call)
        if isinstance(func, types.FunctionType) and func not in self.expanding:
            # a Python function of torch (F.layer_norm, F.multi_head_attention_forward,
            # Tensor.split): run its body under the mode, so each builtin it calls is an op
            body = _expanded(func)
            self.expanding.add(func)
            try:
                with self:
                    return body(*args, **kwargs)
            finally:
                self.expanding.discard(func)
        rule = em.rule()
        if rule.scaled is not None and name in scaled.UNCOVERED_OPS:  # (run as any other op)
            em.scaled_log.miss(em.module_name(), rule.scaled, name)
        dt = kwargs.get("dtype")
        if name in CASTS and args and torch.is_tensor(args[0]):
            out = em.cast(func, name, rule, args, kwargs)
        elif isinstance(dt, torch.dtype) and dt in DTYPE_FORMATS:  # dtype=torch.float16: fp32, rounded
            out = em.run_16(func, name, rule, args, dict(kwargs, dtype=torch.float32),
                            DTYPE_FORMATS[dt])
        elif rule.scaled is not None and name in rule.scaled.op_names:
            out = scaled.run_scaled(em, func, name, rule, args, kwargs)
        elif not rule.active:
            out = func(*args, **kwargs)
        elif rule.scope == "all":
            out = em.run_pure(func, name, rule, args, kwargs)
        else:
            out = em.run_mixed(func, name, rule, args, kwargs)
        if em.observers and name not in EMPTY_OPS:  # nothing to see before it is written
            for fn in em.observers:
                fn(name, em.module_name(), args, kwargs, out)
        return out


class Emulation:
    """Round every op of ``model``'s forward onto ``policy``'s grids while it runs.

    ``active`` switches the rounding on and off (mixed precision rounds only inside
    ``Precision.autocast()``, like torch.autocast). ``overrides`` maps glob patterns on module
    names to a policy or a format: ops run inside a matching module (or its children) follow it.
    ``detach()`` removes the hooks. ``with emulation.enabled():`` rounds ops run outside the
    model's forward too (a loss, a functional model). ``target`` ("cpu", "cuda" or None: each
    op's device) picks whose 16-bit kernels the ops that round otherwise on CUDA follow (see
    the module docstring).
    """

    def __init__(self, model: nn.Module | None, policy: Policy, generator: torch.Generator | None
                 = None, *, active: bool = True, resolve: Resolve | None = None,
                 overrides: dict | None = None, match_cpu_kernels: bool = False,
                 target: str | None = None) -> None:
        self.policy = policy
        self.match_cpu_kernels = match_cpu_kernels
        #: whose 16-bit kernels the ops that differ follow ("cpu", "cuda"; None: each op's
        #: device); match_cpu_kernels runs this CPU's kernels, so it means "cpu"
        self.target = check_target(target, match_cpu_kernels)
        if match_cpu_kernels and self.target is None:
            self.target = "cpu"
        self.generator = check_generator(generator)
        self.active = active
        # the static format a group of a dynamic format rounds with now (the regimes' resolve)
        self.resolve = resolve if resolve is not None else static_resolve
        self.root_rule = Rule.of(policy)
        self.overrides = {str(k): parse_override(v, policy) for k, v in (overrides or {}).items()}
        #: whether any rule rounds stochastically: a root forward then draws one base pair of
        #: keys from the generator and derives each rounding's from it (:class:`_Site`)
        self.stochastic = any(r.rounding.is_stochastic or r.grad_rounding.is_stochastic
                              for r in (self.root_rule, *self.overrides.values()))
        self._stream: _Stream | None = None
        #: the base keys compiled emulation's trace passes in (a graph input), None eagerly
        self.keys_input = None
        self.observers: list[Callable] = []
        self.handles: list = []
        self.rules: dict[str, Rule] = {}  # module name -> rule, for modules under an override
        #: the modules a scaled-GEMM recipe touched, or left uncast (None: no rule has one)
        self.scaled_log = scaled.CoverageLog() if any(
            r.scaled is not None for r in (self.root_rule, *self.overrides.values())) else None
        self._stack: list[tuple[str, Rule]] = []
        self._entered: list[bool] = []
        self._mode = _Mode(self)
        self._depth = 0
        self._pnames: dict[int, str] = {}
        self._tied: set = set()
        self._param_sums: dict = {}  # id(tied parameter) -> its _Sum in this forward
        self._cast_rules: dict = {}
        #: nn.MultiheadAttention modules by name (their inference fast path: :mod:`.fastpath`)
        self.attention: dict[str, nn.Module] = {}
        #: set by compiled emulation (:mod:`.compiled`) while it runs the model's forward: the
        #: root's hooks then leave the call to it
        self.compiled = False
        self.original_forward = None
        if model is not None:
            self._pnames = {id(p): n for n, p in model.named_parameters()}
            # parameters under more than one name (tied embeddings): each use's gradient is
            # summed into the 16-bit gradient as native autograd sums them (_Sum)
            names: dict = {}
            for _, p in model.named_parameters(remove_duplicate=False):
                names[id(p)] = names.get(id(p), 0) + 1
            self._tied = {i for i, n in names.items() if n > 1}
            self._attach(model)

    # -- modules -----------------------------------------------------------------------------
    def _match(self, name: str) -> Rule | None:
        for pat, rule in self.overrides.items():
            if fnmatch.fnmatchcase(name, pat):
                return rule
        return None

    def _attach(self, model: nn.Module) -> None:
        rules = {"": self._match("") or self.root_rule}
        # torch.compile cannot hold the mode's Python-level rounding: the model's forward and
        # the hooks run eagerly (a graph break), with a one-line warning, never without rounding
        self.handles.append(model.register_forward_pre_hook(
            self._root_hook(_warn_if_compiling)))
        for name, m in model.named_modules():
            if name:
                parent = name.rpartition(".")[0]
                rules[name] = self._match(name) or rules.get(parent, self.root_rule)
                # submodules: traced as no-ops under compiled emulation (the root's forward
                # runs eagerly under a plain torch.compile, and these with it)
                pre, post = _eager_only(self._pre(name, rules[name])), _eager_only(self._post)
            else:  # the root: nothing to do when compiled emulation runs the forward
                pre = self._root_hook(torch.compiler.disable(self._pre(name, rules[name])))
                post = self._root_hook(torch.compiler.disable(self._post))
            self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(post, always_call=True))
        self.rules = rules
        self.attention = {name: m for name, m in model.named_modules()
                          if isinstance(m, nn.MultiheadAttention)}
        self._model = model
        self._had_forward = "forward" in model.__dict__
        #: the model's own forward (compiled emulation traces it)
        self.original_forward = model.forward
        if self._had_forward:
            model.forward = torch.compiler.disable(model.forward)
        else:  # a method bound to the model, so that copy.deepcopy rebinds it to the copy
            model.forward = types.MethodType(torch.compiler.disable(type(model).forward), model)

    def mark_storage(self, model: nn.Module) -> None:
        """Mark parameters stored in their module's compute format as on its grid (no rounding
        when an op uses them); call after the parameters were rounded to it."""
        for mname, m in model.named_modules():
            rule = self.rules.get(mname, self.root_rule)
            if rule.params == rule.compute and not (isinstance(rule.compute, BlockFormat)
                                                    or rule.compute.dynamic):
                for p in m.parameters(recurse=False):
                    _mark(p, rule.compute)
                if rule.scope == "all":  # model.half() converts floating buffers too
                    for b in m.buffers(recurse=False):
                        if b.is_floating_point():
                            _mark(b, rule.compute)

    @property
    def model(self) -> nn.Module | None:
        """The model whose forward this engine rounds (None for ``emulated()``)."""
        return getattr(self, "_model", None)

    def rule_of(self, name: str) -> Rule:
        """The rule of the module owning parameter (or buffer) ``name``."""
        return self.rules.get(name.rpartition(".")[0], self.root_rule)

    def param_format(self, name: str) -> Format:
        """The storage format of parameter (or buffer) ``name``: its module's rule's."""
        return self.rule_of(name).params

    def rule(self) -> Rule:
        return self._stack[-1][1] if self._stack else self.root_rule

    def module_name(self) -> str:
        return self._stack[-1][0] if self._stack else ""

    def _pre(self, name: str, rule: Rule):
        def hook(module, args, kwargs):
            self._stack.append((name, rule))
            enter = self.active and self._depth == 0
            self._entered.append(enter)
            if not enter:
                return None
            pure = rule.active and rule.scope == "all"
            if pure:  # real 16-bit inputs, as a model.half() run takes them: their exact fp32
                args, kwargs = _map(_widened, (args, kwargs))  # (before the mode: no island)
            self._mode.__enter__()
            self._depth += 1
            self._param_sums = {}
            if self.stochastic:
                base = self.keys_input
                self._stream = _Stream(draw_seed(self.generator) if base is None else base)
            if pure:  # the model's floating inputs; one tensor given twice stays one tensor
                done: dict = {}  # (``attn(x, x, x)``: self-attention, as the module checks)

                def rin(t):
                    if id(t) not in done:
                        done[id(t)] = (t, self._in(t, rule, "input"))
                    return done[id(t)][1]

                return _map(rin, args), _map(rin, kwargs)
            return None
        return hook

    def _post(self, module, args, output):
        if self._stack:
            self._stack.pop()
        if self._entered and self._entered.pop():
            self._depth -= 1
            self._stream = None
            self._mode.__exit__(None, None, None)
            if self.scaled_log is not None and self._depth == 0:
                scaled.after_forward(self)  # the recipe's coverage: one warning if it lacks
        return None

    def scaled_rules(self) -> list[Rule]:
        """The rules of this model's modules that carry a scaled-GEMM recipe."""
        rules = {id(r): r for r in (self.root_rule, *self.rules.values(),
                                    *self.overrides.values()) if r.scaled is not None}
        return list(rules.values())

    def _root_hook(self, hook):
        def run(*args, **kwargs):
            return None if self.compiled else hook(*args, **kwargs)
        return run

    def call_root(self, fn, args: tuple, kwargs: dict | None = None, *, keep=()):
        """``fn(*args, **kwargs)`` run as the root module's hooks run its forward: its rule on
        the stack, the mode entered (when active), the floating arguments rounded as model
        inputs but for the positions in ``keep`` (parameters and buffers: compiled emulation's
        graph inputs). Compiled emulation traces its graphs through this, and falls back to it."""
        kwargs = kwargs or {}
        keep = set(keep)
        given = tuple(a for i, a in enumerate(args) if i not in keep)
        try:  # (the hook enters the mode before it rounds the inputs, which may fail)
            new = self._pre("", self.rules.get("", self.root_rule))(self._model, given, kwargs)
            if new is not None:
                rounded = iter(new[0])
                args = tuple(a if i in keep else next(rounded) for i, a in enumerate(args))
                kwargs = new[1]
            return fn(*args, **kwargs)
        finally:
            self._post(self._model, args, None)

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        model = getattr(self, "_model", None)
        if model is not None and not self._had_forward:
            model.__dict__.pop("forward", None)
        self._model = None

    @contextlib.contextmanager
    def enabled(self):
        """Round the ops run in this block (outside a model's forward too)."""
        if self._depth:
            yield self
            return
        self._depth += 1
        try:
            with self._mode:
                yield self
        finally:
            self._depth -= 1

    # -- rounding ----------------------------------------------------------------------------
    def draws_keys(self) -> bool:
        """Whether a root forward called now draws stochastic rounding's base keys."""
        return self.stochastic and self.active and self._depth == 0

    def _keys(self):
        """Where a rounding site's stochastic keys come from: the forward's stream, or (outside
        a model's forward, ``enabled()``) the generator at each rounding."""
        s = self._stream
        return self.generator if s is None else s.site()

    def mode(self):
        """The engine's mode, to re-enter from inside it (an op it computes from ops)."""
        return self._mode

    def cuda_kernels(self, args) -> bool:
        """Whether the op with these arguments follows CUDA's 16-bit kernels: target "cuda",
        or no target and a tensor argument on a CUDA device."""
        if self.target is not None:
            return self.target == "cuda"
        return any(t.is_cuda for t in tensors_in(args, []))

    def operand(self, t, rule: Rule, key: str):
        """``t`` as an op reads it: on the compute grid (a parameter rounded when used)."""
        return self._in(t, rule, key)

    def fast_path_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype a native run of the running module would hold (a pure rule with
        one), for which torch's inference fast paths are followed (:mod:`.fastpath`)."""
        rule = self.rule()
        if not rule.active or rule.scope != "all" or rule.block:
            return None
        return format_dtype(rule.compute)

    def _fmts(self, rule: Rule, key: str, x: torch.Tensor, axis: int | None, grads: bool):
        c, g = rule.compute, (rule.grads if grads else None)
        if axis is not None:
            c = replace(c, axis=axis) if isinstance(c, BlockFormat) else c
            g = replace(g, axis=axis) if isinstance(g, BlockFormat) else g
        if c.dynamic:
            c = self.resolve(c, group_key("act", key), x)
        if g is not None and g.dynamic:
            gfmt, res, gkey = g, self.resolve, group_key("grad", key)
            g = lambda t: res(gfmt, gkey, t)  # noqa: E731 (resolved on the gradient)
        if g is not None and g == FP32:
            g = None
        return c, g

    def round(self, t: torch.Tensor, rule: Rule, key: str, *, axis: int | None = None,
              grads: bool = True) -> torch.Tensor:
        """``t`` on ``rule.compute``'s grid; its gradient on ``rule.grads``'s (if ``grads``)."""
        with torch._C.DisableTorchFunction():
            fwd, bwd = self._fmts(rule, key, t, axis, grads)
            if t.requires_grad and torch.is_grad_enabled():
                out = _Round.apply(t, fwd, bwd, rule.rounding, rule.grad_rounding,
                                   self._keys())
            else:
                out = _fresh(_q(t, fwd, rule.rounding, self._keys()))
        if axis is None:
            _mark(out, rule.compute)
        return out

    def round_(self, t: torch.Tensor, rule: Rule, key: str) -> None:
        """Round in place what an in-place op wrote into ``t``."""
        with torch._C.DisableTorchFunction():
            fwd, bwd = self._fmts(rule, key, t, None, True)
            done = False
            if t.requires_grad and torch.is_grad_enabled() and not t.is_leaf:
                try:
                    _RoundInplace.apply(t, fwd, bwd, rule.rounding, rule.grad_rounding,
                                        self._keys())
                    done = True
                except RuntimeError:  # a view autograd cannot rebase: round the values only
                    pass
            if not done:
                with torch.no_grad():
                    _q_(t, fwd, rule.rounding, self._keys())
        _mark(t, rule.compute)

    def _in(self, t, rule: Rule, key: str):
        if not _floating(t):
            return t
        if _marked(t, rule.compute):
            if self._tied and _pid(t) in self._tied and _is_param(t):
                return self._tied_use(t, rule)
            return t
        if _is_param(t):
            # the op sees the rounded weight; its gradient reaches the parameter unrounded: the
            # gradient format is the activations' (Precision rounds parameter gradients to
            # their storage format at the step)
            return self.round(t, rule, self._pnames.get(_pid(t), key), grads=False)
        return self.round(t, rule, key)

    def _tied_use(self, p: nn.Parameter, rule: Rule) -> torch.Tensor:
        """One use of a parameter stored in a 16-bit format under several names: its
        gradient rounded to that format and added to the other uses' with a rounding per
        add, as autograd sums a 16-bit parameter's gradients (the sum then accumulates
        into ``p.grad`` in fp32, as every parameter gradient does)."""
        if not (p.requires_grad and torch.is_grad_enabled()) or \
                format_dtype(rule.params) is None:
            return p
        acc = self._param_sums.get(_pid(p))
        if acc is None:
            acc = self._param_sums[_pid(p)] = _Sum()
        acc.n += 1
        with torch._C.DisableTorchFunction():
            out = _Consumed.apply(p, rule.params, Rounding.NEAREST_EVEN, self._keys(), acc)
        _mark(out, rule.compute)
        return out

    # -- logical dtypes ----------------------------------------------------------------------
    def logical_dtype(self, t: torch.Tensor) -> torch.dtype:
        """The dtype ``t`` would have in a native run (see :mod:`.dtypes`)."""
        d = getattr(t, LOGICAL, None)
        if d is not None:
            return d
        m = getattr(t, MARK, None)
        if m is not None:
            d = format_dtype(m)
            if d is not None:
                return d
        if _is_param(t):  # rounded when used: the 16-bit copy native runs hold
            name = self._pnames.get(_pid(t))
            if name is not None:
                r = self.rule_of(name)
                if r.active and r.scope == "all":
                    d = format_dtype(r.compute)
                    if d is not None:
                        return d
        return t.dtype

    def reported_dtype(self, t) -> torch.dtype:
        """What ``t.dtype`` answers in model code: the logical dtype under a pure rule, as
        ``model.half()`` would; the physical one under a mixed rule, where torch.autocast's
        own state (which model code also reads) is not emulated."""
        if not torch.is_tensor(t):
            return t.dtype
        if self.rule().scope != "all":
            d = getattr(t, LOGICAL, None)
            return t.dtype if d is None else d
        return self.logical_dtype(t)

    def _cast_rule(self, rule: Rule, fmt: Format) -> Rule:
        """The rule a cast (or a ``dtype=`` result) to ``fmt`` rounds with: the module's own when
        ``fmt`` is its compute format, else ``fmt`` everywhere with round-to-nearest-even."""
        if rule.active and rule.compute == fmt:
            return rule
        r = self._cast_rules.get(fmt)
        if r is None:
            r = self._cast_rules[fmt] = Rule(fmt, fmt, fmt)
        return r

    def cast(self, func, name: str, rule: Rule, args, kwargs):
        """``.to(dtype)``, ``.float()``, ``.half()``, ``.type_as(y)`` as a native run does them:
        down to a 16-bit dtype rounds once; up from one opens an fp32 island (a copy, its
        gradient cast back when it leaves)."""
        x = args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # x.type(): the type's name
            return TYPE_NAMES.get(self.reported_dtype(x)) or func(*args, **kwargs)
        target = cast_target(name, args, kwargs, self.reported_dtype)
        if target is None:
            return func(*args, **kwargs)
        src = self.logical_dtype(x)
        if src == target:
            return x if x.dtype in _ROUNDABLE or x.dtype == target else func(*args, **kwargs)
        key = self.module_name()
        fmt = DTYPE_FORMATS.get(target)
        with torch._C.DisableTorchFunction():
            if fmt is not None:  # down (or sideways) to 16 bits: fp32, rounded once
                y = x if x.dtype == torch.float32 else x.float()
                return self.round(y, self._cast_rule(rule, fmt), key)
            sfmt = DTYPE_FORMATS.get(src)
            if sfmt is None or x.dtype != torch.float32:  # an int or fp64 tensor, cast natively
                y = func(*args, **kwargs)
            elif x.requires_grad and torch.is_grad_enabled():
                r = self._cast_rule(rule, sfmt)
                _, bwd = self._fmts(r, key, x, None, True)
                acc = _consumer_sum(x) if x.grad_fn is not None and bwd is not None and \
                    format_dtype(r.grads) is not None else None
                y = _Upcast.apply(x, sfmt, bwd, r.rounding, r.grad_rounding, self._keys(), acc)
            else:
                y = x.clone()
            if target != torch.float32:
                y = y.to(target)
        if y.dtype == torch.float32:
            setattr(y, LOGICAL, torch.float32)
        return y

    def run_16(self, func, name: str, rule: Rule, args, kwargs, fmt: Format):
        """An op given ``dtype=torch.float16`` (a factory, ``sum``, ``softmax``): computed in
        fp32 and rounded once to that 16-bit format; uninitialised memory is only marked."""
        out = func(*args, **kwargs)
        inputs = tensors_in(args, [])
        r = self._cast_rule(rule, fmt)
        key = self.module_name()

        def rout(o):
            if not _floating(o) or any(o is a for a in inputs):
                return o
            if name in EMPTY_OPS:
                _mark(o, fmt)
                return o
            return self.round(o, r, key)

        return _map(rout, out)

    def _promoted(self, t, rule: Rule, key: str):
        """A 16-bit tensor an fp32 island op reads: a copy whose gradient is rounded to 16 bits
        (autograd casts the gradient of a promoted operand back to its dtype)."""
        if not (_floating(t) and t.requires_grad) or is_island(t):
            return t
        fmt = DTYPE_FORMATS.get(self.logical_dtype(t))
        if fmt is None:
            return t
        r = self._cast_rule(rule, fmt)
        with torch._C.DisableTorchFunction():
            _, bwd = self._fmts(r, key, t, None, True)
            if bwd is None:
                return t
            acc = _consumer_sum(t) if t.grad_fn is not None and \
                format_dtype(r.grads) is not None else None
            return _Upcast.apply(t, fmt, bwd, r.rounding, r.grad_rounding, self._keys(), acc)

    @staticmethod
    def _island(name: str, args, inplace: bool, inputs) -> bool:
        """Whether an op's result is a float32 island value: torch's type promotion over the
        logical dtypes (dimensioned tensors before 0-dim ones; an in-place op keeps its
        target's), a matmul-like op only when every operand is fp32 (otherwise autocast-like:
        the weight's 16 bits win), and results of no floating input (``torch.ones(n)``,
        ``ids * 0.5``) in the default dtype."""
        if inplace:
            return bool(args) and is_island(args[0])
        fl = [t for t in inputs if _floating(t)]
        if not fl:
            return True
        if name in LOWP_OPS:
            return all(is_island(t) for t in fl)
        if name in NORM_OPS:
            return bool(args) and is_island(args[0])
        dims = [t for t in fl if t.dim()]
        return any(is_island(t) for t in (dims or fl))

    # -- ops ---------------------------------------------------------------------------------
    def run_pure(self, func, name: str, rule: Rule, args, kwargs):
        """scope "all": every op's floating output on the compute grid, except in fp32 islands
        (see :mod:`.dtypes`)."""
        key = self.module_name()
        fmt = rule.compute
        grid = _grid_op(name, args, kwargs, fmt)
        inplace = is_inplace(name)
        if name in EMPTY_OPS:  # uninitialised memory: nothing to round until it is written
            out = func(*args, **kwargs)
            src = args[0] if args and _floating(args[0]) else None
            if src is not None and _floating(out) and out is not src:  # the source's dtype
                if is_island(src):
                    setattr(out, LOGICAL, torch.float32)
                elif getattr(src, MARK, None) is not None:
                    _mark(out, getattr(src, MARK))
            return out
        inputs = tensors_in(args, tensors_in(kwargs, []))
        if (kwargs.get("dtype") == torch.float32 if kwargs else False) or \
                self._island(name, args, inplace, inputs):
            if inplace:
                return func(*args, **kwargs)
            if torch.is_grad_enabled() and any(a.requires_grad for a in inputs):
                # a 16-bit operand promoted to fp32: its gradient is cast back to 16 bits
                args, kwargs = _map(lambda t: self._promoted(t, rule, key), (args, kwargs))
                inputs = tensors_in(args, tensors_in(kwargs, []))
            out = func(*args, **kwargs)

            def island(o):
                if _floating(o) and not any(o is a for a in inputs):
                    setattr(o, LOGICAL, torch.float32)
                return o

            return _map(island, out)
        split = name == "linear" and kernels.split_linear(args, kwargs)  # before rounding
        if not grid:
            okey = key  # one dynamic fixed-point group per module and role
            lowp = name in LOWP_OPS

            shape = None
            # native 16-bit autograd: gradients held (and summed) in the tensor's 16-bit dtype;
            # formats with no dtype (fp8, fixed point) keep one rounding of the fp32 sum
            native_grads = format_dtype(rule.grads) is not None and torch.is_grad_enabled()
            if name in BROADCAST_OPS and native_grads:
                fl = [t.shape for t in tensors_in(args, []) if _floating(t)]
                try:
                    shape = torch.broadcast_shapes(*fl) if len(fl) > 1 else None
                except RuntimeError:
                    shape = None

            consumed = native_grads and not inplace

            def rin(t):
                if not lowp and is_island(t):  # a 0-dim fp32 value: used as it is
                    return t
                t = self._in(t, rule, okey + ".in")
                if consumed and _floating(t) and t.requires_grad and t.grad_fn is not None \
                        and not _is_param(t):
                    with torch._C.DisableTorchFunction():
                        _, bwd = self._fmts(rule, okey, t, None, True)
                        t2 = _Consumed.apply(t, bwd, rule.grad_rounding, self._keys(),
                                             _consumer_sum(t))
                    if getattr(t, MARK, None) is not None:
                        _mark(t2, getattr(t, MARK))
                    t = t2
                if shape is not None and _floating(t) and t.requires_grad and \
                        t.shape != shape and t.dim():
                    with torch._C.DisableTorchFunction():
                        _, bwd = self._fmts(rule, okey, t, None, True)
                        t = _Broadcast.apply(t, shape, bwd, rule.grad_rounding, self._keys())
                    _mark(t, rule.compute)
                return t

            if name in BUFFER_OPS:
                args = tuple(a if i in _BUFFER_POS else _map(rin, a) for i, a in enumerate(args))
            elif inplace:
                args = (args[0],) + tuple(_map(rin, a) for a in args[1:])
            else:
                args = _map(rin, args)
            kwargs = _map(rin, kwargs) if kwargs else kwargs
        if (acc_op := self._accumulated(name, rule, args, kwargs)) is not None:
            out = acc_op(*args, **kwargs)
        elif name == "batch_norm" and kernels.uses_batch_stats(args, kwargs):
            out = kernels.label_kernel_nodes(
                kernels.batch_norm(self, rule, key, *args, cuda=self.cuda_kernels(args)),
                args, name)
        elif name == "embedding" and rule.grads != FP32 and torch.is_grad_enabled() and \
                kernels.plain_embedding(args, kwargs):
            if self._tied and _pid(args[0]) in self._tied and _marked(args[0], fmt):
                args = (self._tied_use(args[0], rule),) + tuple(args[1:])  # a grid op: no rin
            out = kernels.embedding(self, rule, *args, cuda=self.cuda_kernels(args), **kwargs)
        elif name in recurrent_kernels.RNN_OPS and self.match_cpu_kernels and \
                (dt := native_gemm.recurrent_dtype(rule, args, kwargs)) is not None:
            out = native_gemm.native_nested(func, dt)(*args)  # the CPU's own 16-bit layer
        elif name in recurrent_kernels.RNN_OPS and \
                (call := recurrent_kernels.parse(name, args, kwargs)) is not None:
            out = recurrent_kernels.replay(self, rule, key, call)  # op by op, as ATen's CPU RNN
        elif name == "layer_norm" and kernels.plain_layer_norm(self, rule, args, kwargs):
            out = kernels.layer_norm(self, rule, key, *args, cuda=self.cuda_kernels(args))
        elif name == "scaled_dot_product_attention" and self.match_cpu_kernels and \
                (dt := native_gemm.attention_dtype(rule, args, kwargs)) is not None:
            out = native_gemm.native_gemm(func, dt)(*args, **kwargs)  # the kernel itself
        elif name == "scaled_dot_product_attention" and kernels.plain_attention(args, kwargs):
            qkv, kw = kernels.sdpa_arguments(args, kwargs)
            if kernels.flash_possible(args, kwargs):
                out = kernels.label_kernel_nodes(kernels.attention(self, rule, key, *qkv, **kw),
                                                 qkv, name)
            else:
                out = kernels.attention_math(*qkv, **kw)
        elif name in native_gemm.ELEMENTWISE_OPS and self.match_cpu_kernels and \
                (dt := native_gemm.elementwise_dtype(rule, args, kwargs)) is not None:
            out = native_gemm.native_gemm(func, dt)(*args, **kwargs)
        elif name in backward_kernels.REPLAYED and kernels.plain_formats(rule) and \
                (opts := backward_kernels.replayable(name, args, kwargs)) is not False:
            # differentiated from its rounded output, in 16-bit arithmetic, as the native
            # backward does (exp, tanh, sigmoid, softmax...)
            out = backward_kernels.replayed(rule, name, func, args, kwargs, opts,
                                            cuda=self.cuda_kernels(args))
        elif (conv := self._bias_after(name, rule, args, kwargs)) is not None:
            # CUDA: cuDNN convolves without the bias; ATen adds it to the 16-bit output
            out = self.round(conv(), rule, key) + self._bias_view(name, args, kwargs)
        elif split:
            # aten's linear on a non-contiguous N-d input with a bias: matmul, then add (two
            # 16-bit results, two roundings), as nn.MultiheadAttention(batch_first=True) runs
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            out = self.round(self._conv(func, name, rule, (x, w))(x, w), rule, key) + b
        else:
            out = self._conv(func, name, rule, args, kwargs)(*args, **kwargs)
        if name in BUFFER_OPS:
            self._round_buffers(args, rule)
        if inplace:
            t = args[0] if args else None
            if _floating(t) and not (grid and _marked(t, fmt)):
                self.round_(t, rule, key)
            elif name in _MASKS and _floating(t) and t.requires_grad:
                pass_through(t)  # relu_, hardtanh_, clamp_: the node that wrote t
            return out
        inputs = tensors_in(args, tensors_in(kwargs, []))
        on_grid = grid and all(_marked(a, fmt) for a in inputs if _floating(a))
        okey = key  # one dynamic fixed-point group per module and role

        def rout(o):
            if not _floating(o) or any(o is a for a in inputs):
                return o
            if on_grid:
                _mark(o, fmt)
                if name in _MASKS and o.requires_grad:
                    pass_through(o)
                return o
            if grid and o._is_view():  # a view of an off-grid tensor stays a view
                return o
            return self.round(o, rule, okey)

        return _map(rout, out)

    def run_mixed(self, func, name: str, rule: Rule, args, kwargs):
        """scope "matmul": torch.autocast's lists and dtype propagation."""
        key = self.module_name()
        fmt = rule.compute
        okey = key  # one dynamic fixed-point group per module and role
        if name in EMPTY_OPS:  # uninitialised memory: nothing to round until it is written
            return func(*args, **kwargs)
        if name in LOWP_OPS:
            # the additive operand (bias, attention mask) stays fp32 for block and Inf-less
            # formats: the hardware adds it to the fp32 accumulator (see ACCUMULATOR_INPUTS)
            keep_pos, keep_kw = ACCUMULATOR_INPUTS.get(name, (-1, ""))
            if not (rule.block or not getattr(fmt, "has_inf", False)):
                keep_pos, keep_kw = -1, ""
            if rule.block:
                axes = reduction_axes(name, len(args), bool(kwargs.get("transposed", False)))
                args = tuple(a if i == keep_pos else
                             _map(lambda t, ax=ax: self.round(t, rule, f"{okey}.{i}", axis=ax)
                                  if _floating(t) else t, a)
                             for i, (a, ax) in enumerate(zip(args, axes)))
                kwargs = {k: v if k == keep_kw else _map(
                    lambda t: self.round(t, rule, okey, axis=-1) if _floating(t) else t, v)
                    for k, v in kwargs.items()} if kwargs else kwargs
                return func(*args, **kwargs)  # MX accumulates in fp32 and outputs fp32
            args = tuple(a if i == keep_pos else _map(lambda t: self._in(t, rule, okey + ".in"), a)
                         for i, a in enumerate(args))
            kwargs = ({k: v if k == keep_kw else _map(lambda t: self._in(t, rule, okey + ".in"), v)
                       for k, v in kwargs.items()} if kwargs else kwargs)
            if keep_pos < 0 and (conv := self._bias_after(name, rule, args, kwargs)) is not None:
                # CUDA: cuDNN convolves without the bias; ATen adds it to the 16-bit output
                out = self.round(conv(), rule, okey) + self._bias_view(name, args, kwargs)
            else:
                out = (self._accumulated(name, rule, args, kwargs)
                       or self._conv(func, name, rule, args, kwargs))(*args, **kwargs)
            inputs = tensors_in(args, [])
            return _map(lambda o: o if not _floating(o) or any(o is a for a in inputs)
                        else self.round(o, rule, okey), out)
        if name in FP32_OPS or rule.block:
            return func(*args, **kwargs)
        inplace = is_inplace(name)
        if name in NORM_OPS:
            lowp = bool(args) and _floating(args[0]) and _marked(args[0], fmt)
            inputs = tensors_in(args, [])
        else:
            inputs = tensors_in(args, tensors_in(kwargs, []))
            fl = [a for a in inputs if _floating(a) and (a.dim() > 0 or len(inputs) == 1)]
            lowp = bool(fl) and all(_marked(a, fmt) for a in fl)
        out = func(*args, **kwargs)
        if inplace:
            t = args[0] if args else None
            if _floating(t) and _marked(t, fmt) and not _grid_op(name, args, kwargs, fmt):
                self.round_(t, rule, okey)
            return out
        if not lowp:
            return out
        grid = _grid_op(name, args, kwargs, fmt)

        def rout(o):
            if not _floating(o) or any(o is a for a in inputs):
                return o
            if grid:
                _mark(o, fmt)
                return o
            return self.round(o, rule, okey)

        return _map(rout, out)

    def _accumulated(self, name: str, rule: Rule, args, kwargs):
        # acc=: the GEMMs of linear, matmul, conv2d and attention accumulate in the policy's
        # accumulator, forward and backward; their output is then rounded as any op's
        if rule.accumulator is None:
            return None
        return accumulation_ops.bind(name, rule.accumulator, self.generator, args, kwargs)

    def _conv(self, func, name: str, rule: Rule | None = None, args=(), kwargs=None):
        # match_cpu_kernels: convolutions summed as torch's reference CPU 16-bit kernel sums,
        # matrix products by this CPU's own 16-bit kernel (native_gemm explains why)
        if not self.match_cpu_kernels:
            return func
        if name == "conv2d":
            return summation.conv2d
        if name in native_gemm.INDEX_OPS and rule is not None:
            dt = native_gemm.index_dtype(name, rule, args, kwargs or {})
            return func if dt is None else native_gemm.native_gemm(func, dt)
        if name in native_gemm.GEMM_OPS and rule is not None:
            dt = format_dtype(rule.compute)
            if native_gemm.applies(rule, args, kwargs or {}, dt):
                return native_gemm.native_gemm(func, dt)
        return func

    def _bias_after(self, name: str, rule: Rule, args, kwargs):
        """Under CUDA's kernels, a convolution with a bias as a call of it without the bias
        (the caller rounds its output and adds the bias, a second rounding), else None.

        ATen's CUDA convolution (``_convolution``, ConvBackend::Cudnn and CudnnTranspose in
        aten/src/ATen/native/Convolution.cpp) runs ``cudnn_convolution`` without the bias
        ("cuDNN convolutions does not handle bias", cudnn/ConvShared.cpp), which accumulates in
        fp32 and writes a 16-bit output, then ``output.add_(reshape_bias(...))``: a 16-bit add,
        computed in fp32 and rounded. The CPU kernels add the bias to the fp32 sum and round
        once. (CUDA's own depthwise and 3-d fallback kernels, not cuDNN, take the bias inside:
        not modelled.)"""
        if name not in _CONVS or len(args) < 2 or rule.accumulator is not None or \
                not kernels.plain_formats(rule):
            return None
        b = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
        if not (torch.is_tensor(b) and _floating(b)) or not self.cuda_kernels(args):
            return None
        if len(args) > 2:
            a2, k2 = args[:2] + (None,) + tuple(args[3:]), kwargs
        else:
            a2, k2 = args, dict(kwargs, bias=None)
        fn = self._conv(_CONVS[name], name, rule, a2, k2)
        return lambda: fn(*a2, **(k2 or {}))

    @staticmethod
    def _bias_view(name: str, args, kwargs) -> torch.Tensor:
        """The bias of a convolution call shaped to add to its output (``reshape_bias``; an
        unbatched input has its channels first)."""
        b = args[2] if len(args) > 2 else kwargs["bias"]
        batched = args[0].dim() == int(name[-2]) + 2
        return b.reshape([1, -1] + [1] * (args[0].dim() - 2) if batched
                         else [-1] + [1] * (args[0].dim() - 1))

    def _round_buffers(self, args, rule: Rule) -> None:
        # running statistics as the parameter format stores them (pure policies: fp16 buffers)
        if rule.params == FP32 or isinstance(rule.params, BlockFormat) or rule.params.dynamic:
            return
        with torch._C.DisableTorchFunction(), torch.no_grad():
            for i in _BUFFER_POS:
                if i < len(args) and _floating(args[i]):
                    quantize_(args[i], rule.params)


@contextlib.contextmanager
def emulated(policy: str | Policy, generator: torch.Generator | None = None, *,
             resolve: Resolve | None = None, match_cpu_kernels: bool = False,
             target: str | None = None):
    """Round every op run in this block onto ``policy``'s grids (no model needed):

    >>> with emulated("16-true"):
    ...     y = torch.nn.functional.gelu(x)     # fp32 gelu, rounded once to fp16

    ``target``: whose 16-bit kernels the ops that differ follow ("cpu", "cuda"; None: the
    device of each op's tensors), as :class:`Emulation`.
    """
    check_generator(generator)
    pol = parse_policy(policy)
    if resolve is None and any(f.dynamic for f in (pol.compute, pol.grads)):
        resolve = regimes_resolve(pol, generator)  # the regimes the policy needs, this block's
    em = Emulation(None, pol, generator, resolve=resolve,
                   match_cpu_kernels=match_cpu_kernels, target=target)
    with em.enabled():
        yield em
