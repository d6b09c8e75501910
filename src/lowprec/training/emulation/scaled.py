"""Scaled GEMMs in the emulation engine: ``F.linear`` (and, if the recipe says so, ``matmul``,
``mm``, ``bmm``) run as torchao's ``Float8Linear`` runs them with ``emulate=True``.

:class:`_ScaledMatmul` is ``a @ b`` as a custom autograd function that casts each operand for
each of the three GEMMs with the recipe's :class:`lowprec.numerics.scaling.ScaledCast`
(:mod:`lowprec.training.scaling`), computes each GEMM in fp32 on the values brought back to
their scale, and returns fp32 (the "high precision" output of torchao's emulate mode)::

    forward      out    = cast(a, input, axis -1)        @ cast(b, weight, axis -2)
    backward     grad_a = cast(g, grad_output, -1)       @ cast(b, weight_gi, -1)^T
                 grad_b = (cast(g, grad_output_gw, -2)^T @ cast(a, input_gw, -2))^T

For ``F.linear(x, w, bias)``, a is x reshaped to (-1, in_features) and b is w^T, the GEMMs are
the same ``torch.mm`` calls on operands of the same layout as torchao's
(``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``), the bias is added
after in fp32 (``output + bias``): the outputs and both gradients then have torchao's bits.

Under a rule whose compute format is not fp32 (a mixed policy with ``sc=``), the operands are
first rounded to the compute format, as torchao's layer casts its input to the autocast dtype,
and the output is rounded to it (with its gradient, to the gradient format).

A recipe covers only its ops (``linear``, and ``matmul``/``mm``/``bmm`` where it says so): as
torchao's ``Float8Linear`` converts ``nn.Linear`` only, no recipe defines a convolution. Each
engine whose rules carry a recipe keeps a :class:`CoverageLog` of the modules whose GEMMs the
recipe cast and of those that ran convolutions it left alone; after its first forward it warns
(:class:`RecipeCoverageWarning`) when the recipe cast nothing, or left convolutions uncast, so
that a convolutional network never trains silently as fp32 under an fp8 name.

Delayed scaling keeps the amaxes of each operand (key: module, op, role) in an
:class:`lowprec.numerics.scaling.AmaxHistory`; ``Precision`` binds its regime's history to the
model (:func:`bind_history`), so it travels in ``Precision.state_dict()``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..caller import warn
from ...numerics.scaling import AmaxHistory, scaled_cast

__all__ = ["run_scaled", "bind_history", "history_of", "scaled_matmul", "record_casts",
           "CoverageLog", "RecipeCoverageWarning", "UNCOVERED_OPS", "coverage_of"]

#: GEMM-like ops no recipe defines: a module running them under a recipe computes them in the
#: rule's compute format, uncast (torchao's Float8Linear converts nn.Linear only)
UNCOVERED_OPS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                           "conv_transpose3d", "convolution", "_convolution", "conv_tbc"})
_LISTED = 8  # module names a warning lists before "and N more"


class RecipeCoverageWarning(UserWarning):
    """A scaled-GEMM recipe cast nothing in a model's forward, or left its convolutions uncast."""


class CoverageLog:
    """Which modules a recipe touched: ``touched`` (module name -> {"recipe", "ops"}, the
    GEMMs cast to the recipe) and ``uncovered`` (module name -> {"recipe", "ops"}, the
    convolutions run under a recipe that does not define them); ``forwards``: root forwards
    seen. Module "" is the root (ops of its own forward, outside any submodule)."""

    def __init__(self) -> None:
        self.touched: dict[str, dict] = {}
        self.uncovered: dict[str, dict] = {}
        self.forwards = 0
        self.warned = False

    @staticmethod
    def _note(table: dict, module: str, recipe, op: str) -> None:
        entry = table.get(module)
        if entry is None:
            table[module] = entry = {"recipe": str(recipe), "ops": []}
        if op not in entry["ops"]:
            entry["ops"].append(op)

    def touch(self, module: str, recipe, op: str) -> None:
        self._note(self.touched, module, recipe, op)

    def miss(self, module: str, recipe, op: str) -> None:
        self._note(self.uncovered, module, recipe, op)

    def by_recipe(self) -> dict[str, dict]:
        """recipe -> {"touched": [modules], "uncovered": [modules]} (the run's record)."""
        out: dict[str, dict] = {}
        for key, table in (("touched", self.touched), ("uncovered", self.uncovered)):
            for module, entry in table.items():
                item = out.setdefault(entry["recipe"], {"touched": [], "uncovered": []})
                item[key].append(module or "(root)")
        return out

    def to_json(self) -> dict:
        return {"recipes": self.by_recipe(), "forwards": self.forwards,
                "touched": {m or "(root)": e for m, e in self.touched.items()},
                "uncovered": {m or "(root)": e for m, e in self.uncovered.items()}}


def _listed(names) -> str:
    names = [n or "(root)" for n in names]
    more = len(names) - _LISTED
    return ", ".join(names[:_LISTED]) + (f" and {more} more" if more > 0 else "")


def after_forward(engine) -> None:
    """Called when a root forward under ``engine`` ends: after the first, one
    :class:`RecipeCoverageWarning` if its recipes cast no GEMM, or left convolutions uncast."""
    log = engine.scaled_log
    log.forwards += 1
    if log.warned:
        return
    log.warned = True
    recipes = sorted({str(r.scaled) for r in engine.scaled_rules()})
    ops = sorted({op for r in engine.scaled_rules() for op in r.scaled.op_names})
    compute = sorted({str(r.compute) for r in engine.scaled_rules()})
    name = " and ".join(recipes)
    convs = (f"; convolutions ran in {len(log.uncovered)} module(s) the recipe does not cover "
             f"({_listed(log.uncovered)}): no recipe defines a convolution (torchao's "
             "Float8Linear converts nn.Linear only), so they compute in "
             f"{'/'.join(compute)}") if log.uncovered else ""
    if not log.touched:
        warn(
            f"the scaled-GEMM recipe {name} covers {', '.join(ops)} (nn.Linear, F.linear) and "
            f"this model's forward ran none: nothing is cast to the recipe's formats, and the "
            f"model trains as {'/'.join(compute)} without it{convs}; round every op with a "
            "format policy instead (c=e4m3fn, 16-true, ...)", RecipeCoverageWarning)
    elif log.uncovered:
        warn(
            f"the scaled-GEMM recipe {name} cast the GEMMs of {len(log.touched)} module(s) "
            f"({_listed(log.touched)}){convs}", RecipeCoverageWarning)


def coverage_of(engine) -> dict | None:
    """The :class:`CoverageLog` of ``engine`` as data (None when no rule has a recipe)."""
    log = getattr(engine, "scaled_log", None)
    return None if log is None else log.to_json()

# model -> the amax history of its delayed casts (Precision's regime binds it); an engine
# without a bound model keeps one of its own
_HISTORIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def bind_history(model: torch.nn.Module, history: AmaxHistory) -> None:
    """Use ``history`` for the delayed casts of the scaled GEMMs run inside ``model``."""
    _HISTORIES[model] = history


def history_of(engine) -> AmaxHistory:
    """The amax history the scaled GEMMs of ``engine`` (an Emulation) read and extend."""
    model = engine.model
    if model is not None and model in _HISTORIES:
        return _HISTORIES[model]
    if engine not in _HISTORIES:
        _HISTORIES[engine] = AmaxHistory()
    return _HISTORIES[engine]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) if a.dim() == 2 and b.dim() == 2 else torch.matmul(a, b)


class _ScaledMatmul(torch.autograd.Function):
    """``a @ b`` (a: (..., M, K), b: (..., K, N), same batch shape) with scaled casts; see the
    module docstring. ``cast(role, tensor, axis)`` casts one operand for one GEMM."""

    @staticmethod
    def forward(ctx, a, b, cast):
        ctx.save_for_backward(a, b)
        ctx.cast = cast
        return _mm(cast("input", a, -1), cast("weight", b, -2))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        cast = ctx.cast
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _mm(cast("grad_output", g, -1), cast("weight_gi", b, -1).transpose(-1, -2))
        if ctx.needs_input_grad[1]:
            gb = _mm(cast("grad_output_gw", g, -2).transpose(-1, -2),
                     cast("input_gw", a, -2)).transpose(-1, -2)
        return ga, gb, None


_RECORDERS: list[list] = []


@contextlib.contextmanager
def record_casts():
    """Collect one row per operand cast run in this block (the analyses' view of a recipe):
    ``layer`` (module and op), ``role``, ``cast`` and the counts of
    :func:`lowprec.numerics.scaling.cast_stats`."""
    rows: list[dict] = []
    _RECORDERS.append(rows)
    try:
        yield rows
    finally:
        _RECORDERS.remove(rows)


def _caster(recipe, history: AmaxHistory, key: str, generator=None):
    def cast(role: str, t: torch.Tensor, axis: int) -> torch.Tensor:
        t = t if t.dtype == torch.float32 else t.float()
        c = getattr(recipe, role)
        stats = {} if _RECORDERS and not c.is_hp else None
        y = scaled_cast(t, c, axis, history=history, key=f"{key}.{role}", stats=stats,
                        generator=generator)
        if stats is not None:
            for rows in _RECORDERS:
                rows.append({"layer": key, "role": role, "cast": str(c), **stats})
        return y
    return cast


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, recipe, *, history: AmaxHistory | None
                  = None, key: str = "", generator=None) -> torch.Tensor | None:
    """``a @ b`` under ``recipe`` (a :class:`lowprec.training.scaling.GemmScaling`), or None
    for shapes it does not cover (a vector, broadcast batch dimensions): a 2-d ``b`` with any
    ``a`` of 2 or more dimensions (``x @ W``), or equal batch shapes."""
    cast = _caster(recipe, history if history is not None else AmaxHistory(), key, generator)
    if a.dim() >= 2 and b.dim() == 2:
        a2 = a.reshape(-1, a.shape[-1])
        out = _ScaledMatmul.apply(a2, b, cast)
        return out.reshape(*a.shape[:-1], b.shape[-1])
    if a.dim() >= 3 and a.dim() == b.dim() and a.shape[:-2] == b.shape[:-2]:
        return _ScaledMatmul.apply(a, b, cast)
    return None


def _linear_args(args, kwargs):
    names = ("input", "weight", "bias")
    vals = list(args) + [None] * (3 - len(args))
    for i, n in enumerate(names):
        if n in kwargs:
            vals[i] = kwargs[n]
    return vals


def _is_f32(t) -> bool:
    return torch.is_tensor(t) and t.dtype == torch.float32


def run_scaled(engine, func, name: str, rule, args, kwargs):
    """Run ``func`` (``linear``, ``matmul``, ``mm`` or ``bmm``) as a scaled GEMM under
    ``rule.scaled``; ops it does not cover (integer tensors, other shapes) run as they are."""
    recipe = rule.scaled
    key = f"{engine.module_name()}.{name}"
    if name == "linear":
        x, w, bias = _linear_args(args, kwargs)
        operands = (x, w)
    else:
        if len(args) < 2 or kwargs:
            return func(*args, **kwargs)
        operands = args[:2]
    if not all(_is_f32(t) for t in operands) or (name == "linear" and bias is not None
                                                  and not _is_f32(bias)):
        return func(*args, **kwargs)
    a, b = operands
    engine.scaled_log.touch(engine.module_name(), recipe, name)
    if rule.active and rule.scope != "all":  # autocast-like: operands in the compute format
        a = engine.round(a, rule, key)
        b = engine.round(b, rule, key, grads=not isinstance(b, torch.nn.Parameter))
    history = history_of(engine)
    gen = engine.generator  # stochastic element casts draw from the Precision's generator
    with torch._C.DisableTorchFunction():
        if name == "linear":
            out = scaled_matmul(a, b.t(), recipe, history=history, key=key, generator=gen) \
                if a.dim() >= 2 else None
            if out is None:  # a 1-d input: one row
                out = scaled_matmul(a.unsqueeze(0), b.t(), recipe, history=history,
                                    key=key, generator=gen).squeeze(0)
            if bias is not None:
                out = out + bias  # in fp32, after the GEMM, as torchao's layer adds it
        else:
            out = scaled_matmul(a, b, recipe, history=history, key=key, generator=gen)
            if out is None:
                return func(*args, **kwargs)
    if rule.active:
        out = engine.round(out, rule, key)
    return out
