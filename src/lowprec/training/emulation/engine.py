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
kernel (:mod:`lowprec.numerics.summation`) instead of oneDNN's fp32 order where torch runs
that kernel (not fp16 with AVX512-FP16 or AMX-FP16: oneDNN's, as the default), and matrix products,
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
from dataclasses import replace
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..caller import warn
from ...numerics.formats import FP32, BlockFormat, FixedFormat, FloatFormat, Format
from ...numerics.quantize import draw_seed, emits_graph_ops, quantize_
from ...numerics.rounding import Rounding, check_generator
from ..policy import Policy, parse_policy
from ..regimes.base import Resolve, regimes_resolve, static_resolve
from ..tree import tensors_in
from . import autograd_fns, fastpath, kernels, optable, scaled
from .composites import COMPOSITES, COMPUTE_DTYPE, CPU_KERNELS
from .kernels import plain_formats
from .scalars import NARROWING, may_narrow, narrow_scalars
from .backward_kernels import OWN_FORWARDS, REPLAYED
from .autograd_fns import (ROUNDABLE, GradSum, Stream, broadcast_apply, consumed_apply,
                           consumer_sum, fresh, owned, owned_base, round_apply,
                           round_inplace_apply, upcast_apply)
from .gradmarks import pass_through
from .rules import TARGETS, Rule, check_target, group_key, parse_override
from .dtypes import (CASTS, DTYPE_FORMATS, DTYPE_GETTER, LOGICAL, MARK, TYPE_NAMES,
                     cast_target, format_dtype, is_island)
from .oplists import (ACCUMULATOR_INPUTS, BROADCAST_OPS, BUFFER_OPS, EMPTY_OPS, FP32_OPS, GRID_OPS, LOWP_OPS,
                      NORM_OPS, PASS_OPS, is_inplace, reduction_axes,
                      returns_its_input)

# (Rule, group_key, TARGETS, check_target, parse_override: :mod:`.rules`, named here too)
__all__ = ["Rule", "Emulation", "emulated", "group_key", "op_name", "MARK", "PARAM", "TARGETS",
           "check_target", "parse_override"]

# attribute of a traced stand-in for a parameter (compiled emulation, :mod:`.compiled`): the
# parameter's id, so that the stand-in is rounded, named and summed as the parameter would be
PARAM = "_lowprec_param"
_BUFFER_POS = (3, 4)  # torch.batch_norm(input, weight, bias, running_mean, running_var, ...)


_NAMES: dict = {}


def _widened(t):
    """A float16 or bfloat16 tensor as float32 (exact; its gradient flows back in its dtype)."""
    if torch.is_tensor(t) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _warn_if_compiling(module, args) -> None:
    if torch.compiler.is_compiling():
        warn("lowprec: an emulated policy runs the model eagerly under torch.compile (its "
             "op-level rounding is Python); Precision(..., compile=True) compiles it with "
             "every rounding in the graph")


def _eager_only(hook):
    """A module hook that does nothing while Dynamo traces: compiled emulation traces the
    model's plain graph first and runs the engine over that graph (:mod:`.compiled`)."""
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return None
        return hook(*args, **kwargs)
    return run


def _is_param(t) -> bool:
    # (a plain tensor is a Parameter's when torch marks it ``_is_param``: what Parameter's
    # metaclass checks, in Python, for ``isinstance``)
    if type(t) is torch.Tensor:
        return getattr(t, "_is_param", False) or getattr(t, PARAM, None) is not None
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


# the replayed unary ops whose backward reads only their rounded output: their in-place forms
# run as the op, then a copy (Engine.run_pure)
_FROM_OUTPUT = frozenset(n for n, (saves, _) in REPLAYED.items() if saves == "y")
# those whose backward reads their input (sin, log1p, erf, pow): with gradients, their in-place
# forms run as the op on a copy of the input (which the replay saves), then a copy back
_FROM_INPUT = frozenset(n for n, (saves, _) in REPLAYED.items() if saves == "x")
_REPLAYED_IN_PLACE = _FROM_OUTPUT | _FROM_INPUT


# in-place ops not run as a replay and a copy whose autograd node saves the result (torch's
# derivatives.yaml: relu_'s threshold_backward(grad, result, 0), hardtanh_, elu_, leaky_relu_...)
_SAVES_RESULT = frozenset({"relu_", "threshold_", "hardtanh_", "relu6_", "elu_", "celu_",
                           "selu_", "leaky_relu_", "rrelu_", "hardsigmoid_", "hardswish_",
                           "silu_", "mish_"})


def _saves_output(t: torch.Tensor) -> bool:
    """Whether the autograd node of the in-place op that wrote ``t`` saved its output (``t``
    itself: ``sigmoid_``, ``tanh_``, ``exp_``, ``relu_``), so that rounding ``t`` in place as an
    autograd op (which moves its version) would make that node refuse it in backward. Not
    while a graph is traced (functionalised in-place ops)."""
    node = t.grad_fn
    return node is not None and hasattr(node, "_saved_result") and not emits_graph_ops()


def _round_saved_output(t: torch.Tensor, fwd, bwd, rule, keys) -> None:
    """Round ``t``, which an in-place op wrote and whose node saved it (:func:`_saves_output`),
    as :class:`.autograd_fns.RoundInplace` would, without moving its version: its values
    through ``t.data`` (the node's saved output becomes the rounded one, as native 16-bit
    autograd saves the 16-bit result), and the gradient reaching ``t`` rounded by a hook, with
    the same keys (one site: the values' rounding, then the gradient's)."""
    mode = rule.rounding
    if not autograd_fns._skips(t, fwd, mode, keys):
        with torch.no_grad():
            autograd_fns.quantize_keyed_(t.data, fwd, mode, keys)
    if bwd is not None:
        bmode = rule.grad_rounding
        t.register_hook(lambda g: autograd_fns.round_grad(g, bwd, bmode, keys)
                        if g.dtype in ROUNDABLE else g)


def _mark(t: torch.Tensor, fmt: Format) -> None:
    try:
        setattr(t, MARK, fmt)
    except (AttributeError, RuntimeError):
        pass


def _on_grid(o: torch.Tensor, fmt: Format, masks: bool) -> torch.Tensor:
    """``o``, an op's output on ``fmt``'s grid already, marked so; from a mask (``masks``: ReLU,
    clamp) its gradient's note passed through."""
    _mark(o, fmt)
    if masks and o.requires_grad:
        pass_through(o)
    return o


# clamping ops -> (position and name of the lower bound, of the upper bound, their defaults):
# the output is on the input's grid when both bounds are (ReLU6 is hardtanh(x, 0, 6))
_BOUNDED = {
    "hardtanh": (1, "min_val", 2, "max_val", -1.0, 1.0),
    "hardtanh_": (1, "min_val", 2, "max_val", -1.0, 1.0),
    "clamp": (1, "min", 2, "max", None, None), "clamp_": (1, "min", 2, "max", None, None),
    "clip": (1, "min", 2, "max", None, None), "clip_": (1, "min", 2, "max", None, None),
}
IN_PLACE = True  # an op's fresh output rounded in place where it can be (autograd_fns.owned)
# grid ops whose backward keeps or zeroes each gradient value (gradmarks.pass_through)
_MASKS = frozenset({"relu", "relu_", "relu6", *_BOUNDED})
# names run_fast leaves to the general path (every list that path consults by name)
_NOT_FAST = frozenset().union(PASS_OPS, EMPTY_OPS, COMPOSITES, CASTS, BUFFER_OPS, NARROWING,
                               BROADCAST_OPS, _BOUNDED)
# ops with op-table handlers that decline for CPU targets without an accumulator
_FAST_HANDLED = frozenset({"linear", *optable.CONVS})


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
    return isinstance(t, torch.Tensor) and t.dtype in ROUNDABLE


def _broadcast(shapes: list) -> torch.Size | None:
    """``torch.broadcast_shapes(*shapes)``, None where they do not broadcast. Sizes of plain
    ints (eager) are broadcast here: torch's function goes through its symbolic-shape checks,
    39 us a call, half the time the engine took for a (32, 64) ``add`` on an Intel Xeon
    (benchmarks/RESULTS.md, "Issue 37, thirteenth session")."""
    if not all(type(d) is int for s in shapes for d in s):  # (symbolic sizes of a trace)
        try:
            return torch.broadcast_shapes(*shapes)
        except RuntimeError:
            return None
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            if d != 1:
                if out[i] == 1:
                    out[i] = d
                elif out[i] != d:
                    return None
    return torch.Size(out)


def _each_output(fn, out, inputs):
    """``fn`` over each floating output of an op but one of its inputs (an op returning its
    input, ``x.to(x.dtype)``); the rest as it is. The one walk over an op's outputs."""
    return _map(lambda o: o if not _floating(o) or any(o is a for a in inputs) else fn(o), out)


def _map(fn, obj):
    """``fn`` over the tensors of nested tuples, lists, namedtuples (PackedSequence) and dicts."""
    if isinstance(obj, torch.Tensor):
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


_SLOW = object()  # run_fast: the general path takes this call


def _nested(a) -> bool:
    """Whether a list or tuple argument may hold a tensor (run_fast leaves those to the general
    path; a tuple of ints, floats, None or slices holds none)."""
    return any(not (v is None or type(v) in (int, float, bool, slice)) for v in a)


_FAST: dict = {}  # func -> _fast_func's verdict
_OP, _GRID = 1, 2  # _fast_func: an op whose outputs run_fast rounds; one it only marks


def _fast_func(func, name: str) -> int:
    """Whether ``func`` (named ``name``) is an op :meth:`Emulation.run_fast` may take (0: no):
    a builtin op none of the general path's lists, composites or op-table handlers treat
    otherwise (linear's and the convolutions' handlers decline for CPU targets: checked by
    run_fast), or a grid op (:data:`_GRID`: values of the grid onto it) none of them treats
    otherwise."""
    try:
        ok = _FAST.get(func)
    except TypeError:  # (an unhashable callable dispatching to the mode)
        return 0
    if ok is None:
        ok = 0
        if not isinstance(func, types.FunctionType) and not is_inplace(name) and \
                name not in _NOT_FAST and (name not in optable.PURE or name in _FAST_HANDLED):
            ok = _GRID if name in GRID_OPS else _OP
        _FAST[func] = ok
    return ok


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
            if name in NARROWING and may_narrow(args, kwargs):  # x > 0.3: with fp16(0.3)
                args, kwargs = self.engine.narrow_compared(name, args, kwargs)
            return func(*args, **kwargs)
        em = self.engine
        if returns_its_input(name, args, kwargs):  # (its compiled decomposition copies it)
            for fn in em.observers:
                fn(name, em.module_name(), args, kwargs, args[0])
            return args[0]
        if em.observers or (out := em.run_fast(func, name, args, kwargs)) is _SLOW:
            out = self._general(em, func, name, args, kwargs)
        return out

    def _general(self, em: "Emulation", func, name: str, args, kwargs):
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
        if name in COMPOSITES and rule.active and rule.scope == "all" and \
                rule.scaled is None and plain_formats(rule) and \
                format_dtype(rule.compute) is not None:
            # an ATen composite (cosine_similarity, instance_norm, cross_entropy) op by op,
            # each emulated, as a native 16-bit run computes and differentiates them; or an op
            # whose value the 16-bit kernel computes otherwise (nll_loss's reduction, 1-d
            # linear interpolation): the op as before, that value swapped in (.composites)
            token = COMPUTE_DTYPE.set(format_dtype(rule.compute))
            cpu = CPU_KERNELS.set(not em.cuda_kernels(args))
            try:
                with self:
                    out = COMPOSITES[name](*args, **kwargs)
            finally:
                COMPUTE_DTYPE.reset(token)
                CPU_KERNELS.reset(cpu)
            if out is not NotImplemented:
                return out
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
        #: keys from the generator and derives each rounding's from it (:class:`.autograd_fns.Site`)
        self.stochastic = any(r.rounding.is_stochastic or r.grad_rounding.is_stochastic
                              for r in (self.root_rule, *self.overrides.values()))
        self._stream: Stream | None = None
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
        self._param_sums: dict = {}  # id(tied parameter) -> its GradSum in this forward
        self._cast_rules: dict = {}
        self._fast_rules: dict = {}  # id(rule) -> (rule, run_fast's verdict on it)
        #: nn.MultiheadAttention modules by name (their inference fast path: :mod:`.fastpath`)
        self.attention: dict[str, nn.Module] = {}
        #: set by compiled emulation (:mod:`.compiled`) while it runs the model's forward: the
        #: root's hooks then leave the call to it
        self.compiled = False
        self.original_forward = None
        if model is not None:
            self._pnames = {id(p): n for n, p in model.named_parameters()}
            # parameters under more than one name (tied embeddings): each use's gradient is
            # summed into the 16-bit gradient as native autograd sums them (GradSum)
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
                self._stream = Stream(draw_seed(self.generator) if base is None else base)
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

    def next_site_keys(self) -> tuple[int, int] | None:
        """The stochastic keys of the next rounding site's first rounding, for a kernel that
        rounds ahead what the engine rounds next (the batch norm's output: its rounding then
        skips, :func:`autograd_fns._skips`, advancing the site as if it had rounded); None
        outside a forward's stream or where its base keys are not ints (a trace)."""
        s = self._stream
        if s is None or type(s.base) is not tuple:
            return None
        return s.peek()

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
              grads: bool = True, own: bool = False) -> torch.Tensor:
        """``t`` on ``rule.compute``'s grid; its gradient on ``rule.grads``'s (if ``grads``);
        ``own``: ``t`` is an op's output nobody else holds yet, rounded in place where its
        producer's backward did not save it (:func:`autograd_fns.owned`)."""
        with torch._C.DisableTorchFunction():
            fwd, bwd = self._fmts(rule, key, t, axis, grads)
            if t.requires_grad and torch.is_grad_enabled():
                base = owned_base(t) if own and IN_PLACE else None
                if base is t:
                    out = round_inplace_apply(t, fwd, bwd, rule.rounding, rule.grad_rounding,
                                             self._keys())
                elif base is not None:
                    # a view of all of an op's fresh output (linear on a 3-d input): that
                    # output rounded in place, and viewed again (t's own node would be
                    # replayed by as_strided, a pass more in backward); the view's backward
                    # passes a gradient's note on (a reshape keeps its grid), so that the
                    # rounding node behind it skips a gradient rounded already
                    out = round_inplace_apply(base, fwd, bwd, rule.rounding,
                                             rule.grad_rounding, self._keys()).view(t.shape)
                    if bwd is not None:
                        pass_through(out)
                else:
                    out = round_apply(t, fwd, bwd, rule.rounding, rule.grad_rounding,
                                      self._keys())
            else:
                out = fresh(autograd_fns.quantize_keyed(t, fwd, rule.rounding, self._keys()))
        if axis is None:
            _mark(out, rule.compute)
        return out

    def round_(self, t: torch.Tensor, rule: Rule, key: str, name: str = "") -> None:
        """Round in place what an in-place op (``name``) wrote into ``t``."""
        with torch._C.DisableTorchFunction():
            fwd, bwd = self._fmts(rule, key, t, None, True)
            done = False
            if t.requires_grad and torch.is_grad_enabled() and not t.is_leaf:
                # (a view's node after an in-place op is its view replay: the op's own node,
                # wrapped in the base's CopySlices, is known by the op's name)
                if _saves_output(t) or (name in _SAVES_RESULT and t._is_view()):
                    _round_saved_output(t, fwd, bwd, rule, self._keys())
                    _mark(t, rule.compute)
                    return
                try:
                    round_inplace_apply(t, fwd, bwd, rule.rounding, rule.grad_rounding,
                                        self._keys())
                    done = True
                except RuntimeError:  # a view autograd cannot rebase: round the values only
                    pass
            if not done:
                with torch.no_grad():
                    autograd_fns.quantize_keyed_(t, fwd, rule.rounding, self._keys())
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

    def tied_weight(self, t, rule: Rule):
        """``t``, or where it is a parameter used under several names and on the compute grid,
        its use with the gradient summed as native 16-bit autograd sums it (an embedding's
        tied weight: :mod:`.optable`)."""
        if self._tied and _pid(t) in self._tied and _marked(t, rule.compute):
            return self._tied_use(t, rule)
        return t

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
            acc = self._param_sums[_pid(p)] = GradSum()
        acc.n += 1
        with torch._C.DisableTorchFunction():
            out = consumed_apply(p, rule.params, Rounding.NEAREST_EVEN, self._keys(), acc)
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

    def narrow_compared(self, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A comparison of a 16-bit tensor with a number: the number cast to its dtype, as the
        16-bit kernel compares (:mod:`.scalars`). The tensors' dtype by torch's promotion over
        their logical dtypes (dimensioned tensors before 0-dim ones); none where they differ."""
        rule = self.rule()
        if not rule.active:
            return args, kwargs
        fl = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and _floating(a)]
        dims = [t for t in fl if t.dim()] or fl
        if rule.scope == "all":
            dts = {self.logical_dtype(t) for t in dims}
        else:
            dts = {format_dtype(rule.compute) if _marked(t, rule.compute) else t.dtype
                   for t in dims}
        if len(dts) != 1:
            return args, kwargs
        return narrow_scalars(name, args, kwargs, dts.pop())

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
            return x if x.dtype in ROUNDABLE or x.dtype == target else func(*args, **kwargs)
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
                acc = consumer_sum(x) if x.grad_fn is not None and bwd is not None and \
                    format_dtype(r.grads) is not None else None
                y = upcast_apply(x, sfmt, bwd, r.rounding, r.grad_rounding, self._keys(), acc)
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
        return self.round_outputs(out, inputs, r, self.module_name(),
                                  on_grid=fmt if name in EMPTY_OPS else None)

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
            acc = consumer_sum(t) if t.grad_fn is not None and \
                format_dtype(r.grads) is not None else None
            return upcast_apply(t, fmt, bwd, r.rounding, r.grad_rounding, self._keys(), acc)

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
    def _fast_rule(self, rule: Rule):
        """(gradient format or None, whether gradients are native 16-bit) for a rule the fast
        path takes: pure, static formats, no scaled GEMMs, accumulator or blocks; else None."""
        seen = self._fast_rules.get(id(rule))
        if seen is None or seen[0] is not rule:
            ok = rule.active and rule.scope == "all" and rule.scaled is None and \
                rule.accumulator is None and not rule.block and not rule.compute.dynamic and \
                not rule.grads.dynamic
            # (static formats: _fmts reads neither the key nor the tensor)
            verdict = (self._fmts(rule, "", None, None, True)[1],
                       format_dtype(rule.grads) is not None) if ok else None
            seen = self._fast_rules[id(rule)] = (rule, verdict)
        return seen[1]

    def run_fast(self, func, name: str, args, kwargs):
        """The engine's commonest call, without its general path's checks: under a pure rule, an
        op of no special treatment (none of the lists, composites or op-table handlers the
        general path consults; linear and the convolutions where theirs decline) given
        positional arguments, its floating tensors CPU activations on the compute grid or
        parameters stored in it: each activation read through a :class:`.autograd_fns.Consumed`
        node, the op run, its outputs rounded. The same calls, in the same order, as
        :meth:`run_pure` makes for it (so the same bits and stochastic keys); :data:`_SLOW`
        where any of this does not hold. The general path's checks cost more than the op on a
        small batch (LeNet-5 at batch 32: benchmarks/RESULTS.md, "Issue 37, seventeenth
        session")."""
        if kwargs or not (kind := _fast_func(func, name)) or self.match_cpu_kernels or \
                self.target == "cuda" or self._tied:
            return _SLOW
        rule = self._stack[-1][1] if self._stack else self.root_rule
        fr = self._fast_rule(rule)
        if fr is None:
            return _SLOW
        fmt = rule.compute
        reads = None
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.dtype not in ROUNDABLE:
                    continue
                if not a.is_cpu or getattr(a, LOGICAL, None) is not None or \
                        not _marked(a, fmt):
                    return _SLOW
                if reads is None:
                    reads = []
                reads.append(a)
            elif isinstance(a, (list, tuple, dict)) and (type(a) not in (list, tuple) or
                                                         _nested(a)):
                return _SLOW  # (a namedtuple, Dynamo's immutable_list: maybe tensors inside)
        if reads is None or (name == "linear" and kernels.split_linear(args, {})):
            return _SLOW
        key = self._stack[-1][0] if self._stack else ""
        if kind == _GRID:  # on the grid already: marked (run_pure's on_grid)
            out = func(*args)
            masks = name in _MASKS
            if isinstance(out, torch.Tensor):
                if out.dtype in ROUNDABLE and not any(out is a for a in args):
                    _on_grid(out, fmt, masks)
                return out
            return self.round_outputs(out, tensors_in(args, []), rule, key, on_grid=fmt,
                                      masks=masks, keep_views=True)
        if fr[1] and torch.is_grad_enabled():
            bwd = fr[0]
            with torch._C.DisableTorchFunction():
                args = tuple(self._consumed(a, bwd, rule) if isinstance(a, torch.Tensor) and
                             a.requires_grad and a.grad_fn is not None and
                             a.dtype in ROUNDABLE and not _is_param(a) else a for a in args)
        out = func(*args)
        if isinstance(out, torch.Tensor):
            if out.dtype not in ROUNDABLE or any(out is a for a in args):
                return out
            return self.round(out, rule, key, own=True)
        return self.round_outputs(out, tensors_in(args, []), rule, key)

    def run_pure(self, func, name: str, rule: Rule, args, kwargs):
        """scope "all": every op's floating output on the compute grid, except in fp32 islands
        (see :mod:`.dtypes`); how each op runs: :mod:`.optable`."""
        key = self.module_name()
        fmt = rule.compute
        grid = _grid_op(name, args, kwargs, fmt)
        inplace = is_inplace(name)
        if name in EMPTY_OPS:  # uninitialised memory: nothing to round until it is written
            return self._run_empty(func, args, kwargs)
        inputs = tensors_in(args, tensors_in(kwargs, []))
        if (kwargs.get("dtype") == torch.float32 if kwargs else False) or \
                self._island(name, args, inplace, inputs):
            return self._run_island(func, rule, key, args, kwargs, inplace, inputs)
        if inplace and (base := name[:-1]) in _REPLAYED_IN_PLACE and len(inputs) == 1 and \
                _floating(args[0]) and (oop := getattr(torch.Tensor, base, None)):
            # sigmoid_, tanh_, exp_ (backward from the rounded output), log1p_, sin_, erf_,
            # pow_(e) (backward from the input): the op (its 16-bit kernel's replay), then a
            # copy into the target, as functionalisation runs an in-place op; run in place, the
            # output autograd saves would be rounded after it was saved, and the fp32 formula
            # would differentiate the others (log1p_'s gradient off native). The replay of an op
            # reading its input runs on a copy, which it saves (the copy back would overwrite
            # it), read as any consumer reads the input (its gradient rounded and summed with
            # the others'); without a gradient only pow_, whose replayed forward is not one
            # rounding (bf16's x ** 3), runs so
            t = c = args[0]
            if base in _FROM_INPUT:
                if t.requires_grad and torch.is_grad_enabled():
                    (x,), _ = self._pure_inputs(base, rule, key, args[:1], {}, False)
                    with torch._C.DisableTorchFunction():
                        c = x.clone()
                    _mark(c, fmt)
                elif base not in OWN_FORWARDS:
                    c = None
            if c is not None:
                t.copy_(self.run_pure(oop, base, rule, (c, *args[1:]), kwargs))
                _mark(t, fmt)
                autograd_fns.new_version(t)
                return t
        if name in NARROWING:  # x + 0.3 adds fp16(0.3), as the 16-bit kernel does
            args, kwargs = narrow_scalars(name, args, kwargs, format_dtype(fmt))
        op = optable.OpCall(func, name, rule, key, args, kwargs)
        if not grid:
            op.args, op.kwargs = self._pure_inputs(name, rule, key, args, kwargs, inplace)
        reads = name in BUFFER_OPS and self._reads_buffers(args)
        if reads:
            self._round_buffers(args, rule)
        out = optable.run(self, op)
        if op.args is not args or op.kwargs is not kwargs:  # (rounded, or a handler's)
            args, kwargs = op.args, op.kwargs
            inputs = tensors_in(args, tensors_in(kwargs, []))
        if name in BUFFER_OPS and not reads:
            self._round_buffers(args, rule)
        if inplace:
            t = args[0] if args else None
            if _floating(t):
                autograd_fns.new_version(t)
            if _floating(t) and not (grid and _marked(t, fmt)):
                self.round_(t, rule, key, name)
            elif name in _MASKS and _floating(t) and t.requires_grad:
                pass_through(t)  # relu_, hardtanh_, clamp_: the node that wrote t
            return out
        on_grid = grid and all(_marked(a, fmt) for a in inputs if _floating(a))
        # one dynamic fixed-point group per module and role
        return self.round_outputs(out, inputs, rule, key, on_grid=fmt if on_grid else None,
                                  masks=name in _MASKS, keep_views=grid)

    @staticmethod
    def _run_empty(func, args, kwargs):
        """An op giving uninitialised memory: marked with its source's dtype, not rounded."""
        out = func(*args, **kwargs)
        src = args[0] if args and _floating(args[0]) else None
        if src is not None and _floating(out) and out is not src:  # the source's dtype
            if is_island(src):
                setattr(out, LOGICAL, torch.float32)
            elif getattr(src, MARK, None) is not None:
                _mark(out, getattr(src, MARK))
        return out

    def _run_island(self, func, rule: Rule, key: str, args, kwargs, inplace: bool, inputs):
        """An op whose result is a float32 island value: run in fp32, its outputs marked so."""
        if inplace:
            return func(*args, **kwargs)
        if torch.is_grad_enabled() and any(a.requires_grad for a in inputs):
            # a 16-bit operand promoted to fp32: its gradient is cast back to 16 bits
            args, kwargs = _map(lambda t: self._promoted(t, rule, key), (args, kwargs))
            inputs = tensors_in(args, tensors_in(kwargs, []))
        out = func(*args, **kwargs)

        def island(o):
            setattr(o, LOGICAL, torch.float32)
            return o

        return _each_output(island, out, inputs)

    def _consumed(self, t, bwd, rule: Rule):
        """``t`` read through a :class:`.autograd_fns.Consumed` node (its gradient from this
        consumer rounded to ``bwd`` and summed with its others'), marked as ``t`` is."""
        t2 = consumed_apply(t, bwd, rule.grad_rounding, self._keys(), consumer_sum(t))
        if getattr(t, MARK, None) is not None:
            _mark(t2, getattr(t, MARK))
        return t2

    def _pure_inputs(self, name: str, rule: Rule, key: str, args, kwargs, inplace: bool):
        """An op's floating arguments on the compute grid (buffers and an in-place op's target
        as they are); under native 16-bit autograd, each activation's gradient from this op
        rounded and summed with its other consumers' (:class:`.autograd_fns.Consumed`), and a
        broadcast operand's gradient rounded at the output's size
        (:class:`.autograd_fns.Broadcast`)."""
        okey = key  # one dynamic fixed-point group per module and role
        lowp = name in LOWP_OPS
        shape = None
        # native 16-bit autograd: gradients held (and summed) in the tensor's 16-bit dtype;
        # formats with no dtype (fp8, fixed point) keep one rounding of the fp32 sum
        native_grads = format_dtype(rule.grads) is not None and torch.is_grad_enabled()
        if name in BROADCAST_OPS and native_grads:
            fl = [t.shape for t in tensors_in(args, []) if _floating(t)]
            shape = _broadcast(fl) if len(fl) > 1 else None

        consumed = native_grads and not inplace

        def rin(t):
            if not lowp and is_island(t):  # a 0-dim fp32 value: used as it is
                return t
            t = self._in(t, rule, okey + ".in")
            if consumed and _floating(t) and t.requires_grad and t.grad_fn is not None \
                    and not _is_param(t):
                with torch._C.DisableTorchFunction():
                    t = self._consumed(t, self._fmts(rule, okey, t, None, True)[1], rule)
            if shape is not None and _floating(t) and t.requires_grad and \
                    t.shape != shape and t.dim():
                with torch._C.DisableTorchFunction():
                    _, bwd = self._fmts(rule, okey, t, None, True)
                    t = broadcast_apply(t, shape, bwd, rule.grad_rounding, self._keys())
                _mark(t, rule.compute)
            return t

        if name in BUFFER_OPS:
            args = tuple(a if i in _BUFFER_POS else _map(rin, a) for i, a in enumerate(args))
        elif inplace:
            args = (args[0],) + tuple(_map(rin, a) for a in args[1:])
        else:
            args = _map(rin, args)
        kwargs = _map(rin, kwargs) if kwargs else kwargs
        return args, kwargs

    def round_outputs(self, out, inputs, rule: Rule, key: str, *, on_grid: Format | None = None,
                      masks: bool = False, keep_views: bool = False):
        """Each floating output of an op (an input it returns as it is: left alone) rounded
        onto ``rule``'s grids; with ``on_grid`` (a format the outputs lie on already: a grid
        op on grid values, uninitialised memory) only marked so, and with ``masks`` (ReLU,
        clamp) their gradients' notes passed through; ``keep_views``: a view stays a view.
        Every path that rounds an op's outputs goes through here."""
        def each(o):
            if on_grid is not None:
                return _on_grid(o, on_grid, masks)
            if keep_views and o._is_view():  # a view of an off-grid tensor stays a view
                return o
            return self.round(o, rule, key, own=True)

        return _each_output(each, out, inputs)

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
            if keep_pos < 0 and (conv := optable.bias_after(self, name, rule, args, kwargs)) \
                    is not None:
                # CUDA: cuDNN convolves without the bias; ATen adds it to the 16-bit output
                out = self.round(conv(), rule, okey) + optable.bias_view(name, args, kwargs)
            else:
                out = (optable.accumulated_kernel(self, name, rule, args, kwargs)
                       or optable.kernel_for(self, func, name, rule, args, kwargs))(*args,
                                                                                    **kwargs)
            return self.round_outputs(out, tensors_in(args, []), rule, okey)
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
            if lowp and name in NARROWING:  # a 16-bit op: x + 0.3 adds fp16(0.3)
                args, kwargs = narrow_scalars(name, args, kwargs, format_dtype(fmt))
        out = func(*args, **kwargs)
        if inplace:
            t = args[0] if args else None
            if _floating(t) and _marked(t, fmt) and not _grid_op(name, args, kwargs, fmt):
                self.round_(t, rule, okey, name)
            return out
        if not lowp:
            return out
        grid = _grid_op(name, args, kwargs, fmt)
        return self.round_outputs(out, inputs, rule, okey, on_grid=fmt if grid else None)

    @staticmethod
    def _reads_buffers(args) -> bool:
        """Whether a BUFFER_OPS call only reads its running statistics: eval mode
        (batch_norm's ``training``, instance_norm's ``use_input_stats`` false)."""
        return len(args) > 5 and isinstance(args[5], bool) and not args[5]

    def _round_buffers(self, args, rule: Rule) -> None:
        # running statistics as the parameter format stores them (pure policies: fp16 buffers):
        # after an op that wrote them; before one that only reads them (eval mode: values
        # loaded after setup are read as the 16-bit buffers would hold them, and under compiled
        # emulation the rounding comes before the op saves them for its backward: rounded after
        # it, autograd refused the copy into a saved tensor and the model ran eagerly)
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
