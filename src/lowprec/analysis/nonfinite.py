"""The first op that produced Inf or NaN, in the forward pass and then in the backward pass.

Forward: the first op, in execution order, whose floating output holds Inf/NaN (as the policy
stores it: under emulation, after the rounding that turns 70000 into fp16's Inf), named by its
module path and op name (``"layers.0" / "add"``), wherever it runs: a leaf layer, a residual add
in a container's ``forward``, a functional call, the loss. Backward: the first op whose backward
produced a non-finite gradient for one of its inputs (after the rounding of the policy's gradient
format) while the gradient reaching its output had none. Each finding carries its input and
output ranges.

A non-finite value is reported only where the format made it and something uses it:

* **fp32 has none there.** The same model (same weights, same random draws: the global
  generator is replayed) runs first in fp32, observed the same way; ops are matched by
  (module, op name, occurrence), and only positions where the fp32 op's output (or gradient) is
  finite count. ``torch.log(0) = -inf`` that fp32 computes too, an attention mask filled with
  -inf and what is computed from it, a fully masked row's NaN: the model's own, not an overflow.
  An op fp32 does not run (the emulation's LSTM kernel runs the gates as ops of their own)
  counts only if it produced the value from finite inputs and finite numbers. Under an
  all-fp32 policy there is no twin to compare with: every non-finite value counts.
* **It reaches the model's output or the loss** (forward): through ops that read it while it
  still holds those values and whose own outputs then hold non-finite values fp32 does not
  have, each in turn (under an all-fp32 policy: any non-finite value). A value selected away
  (``torch.where(mask, torch.log(x), 0)``; T5's relative-position buckets, where ``log(0)``
  flows through a division and a product into ``.long()`` and ``torch.where`` discards it),
  or overwritten in place, is read by nobody and not reported.

Uninitialised buffers (``torch.empty``, ``x.new_empty``: timm's DropPath) are not values: the
engine neither rounds nor shows them (:data:`lowprec.training.emulation.oplists.EMPTY_OPS`)
and neither does the native probe; the op that fills them is observed like any other.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..numerics.formats import FP32
from ..numerics.quantize import quantize
from ..training.emulation import Emulation, op_name
from ..training.emulation.oplists import EMPTY_OPS
from ..training.policy import parse_policy
from ..training.precision import Precision
from ..training.tree import cast_floating, tensors_in
from .common import fp32_twin, run_model, static_format, tensor_range

__all__ = ["first_nonfinite", "NonFiniteReport", "Finding"]


@dataclass(frozen=True)
class Finding:
    name: str  # module path ("" for the model's own forward, "loss" for the loss function)
    kind: str  # the op: "linear", "add", "add_", "softmax"...
    input_range: dict
    output_range: dict
    # backward findings: what the op computed from in the forward pass (rsqrt of a variance
    # that rounded to 0: "forward input ... all zero"); None for forward findings
    forward_input: dict | None = None

    @property
    def zero_forward_input(self) -> bool:
        """Some of the op's forward input was exactly 0 (a statistic that underflowed:
        rsqrt(0) is Inf, and its backward 0 * Inf NaN)."""
        return bool(self.forward_input) and self.forward_input.get("zeros", 0) > 0

    def __str__(self) -> str:
        def r(d):
            return (f"|x| in [{d['min_abs']:.3g}, {d['max_abs']:.3g}], {d['inf']} Inf, "
                    f"{d['nan']} NaN" if d.get("max_abs") is not None else
                    f"{d.get('inf', 0)} Inf, {d.get('nan', 0)} NaN")
        where = self.name or "<model>"
        out = f"{where} ({self.kind}): input {r(self.input_range)}; output {r(self.output_range)}"
        if self.forward_input:
            out += f"; forward input {r(self.forward_input)}"
            if self.zero_forward_input:
                out += (f", {self.forward_input['zeros']} of {self.forward_input['numel']} "
                        "exactly 0 (underflowed in the format?)")
        return out


@dataclass(frozen=True)
class NonFiniteReport:
    forward: Finding | None
    backward: Finding | None
    loss: float

    @property
    def clean(self) -> bool:
        return self.forward is None and self.backward is None


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MISSING = object()  # an op (or gradient) the fp32 twin has no counterpart for


def _floats(obj) -> list:
    return [t for t in tensors_in(obj, []) if t.dtype in _FLOATS]


def _finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _numbers_finite(obj) -> bool:
    """False if a Python number among an op's arguments is Inf or NaN (``masked_fill(m, -inf)``)."""
    if isinstance(obj, float):
        return obj == obj and obj not in (float("inf"), float("-inf"))
    if isinstance(obj, (list, tuple)):
        return all(_numbers_finite(v) for v in obj)
    if isinstance(obj, dict):
        return all(_numbers_finite(v) for v in obj.values())
    return True


def _merge(tensors) -> dict:
    if not tensors:
        return {}
    return tensor_range(torch.cat([t.detach().float().flatten() for t in tensors]))


def _bad(t: torch.Tensor) -> torch.Tensor | None:
    """Where ``t`` is Inf or NaN (a bool tensor), or None when it is finite."""
    bad = ~torch.isfinite(t)
    return bad if bool(bad.any()) else None


def _new(bad: torch.Tensor | None, ref) -> tuple[torch.Tensor | None, bool]:
    """The non-finite positions fp32 has finite (``ref``: fp32's mask, None when fp32 is
    finite, _MISSING when fp32 has no such op), and whether fp32 was compared with."""
    if bad is None:
        return None, True
    if ref is _MISSING or (ref is not None and ref.shape != bad.shape):
        return bad, False
    if ref is None:
        return bad, True
    new = bad & ~ref.to(bad.device)
    return (new if bool(new.any()) else None), True


def _storages(ts) -> set[int]:
    out = set()
    for t in ts:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a functional or meta tensor)
            continue
        if ptr:
            out.add(ptr)
    return out


@dataclass
class _Reference:
    """What the fp32 twin computed: per op, where its floating outputs (and the gradients
    reaching them) are non-finite; None for a finite one."""

    outputs: dict = field(default_factory=dict)  # (module, op, n) -> (mask or None, ...)
    grads: dict = field(default_factory=dict)  # ((module, op, n), i) -> mask or None
    compare: bool = True  # False: an all-fp32 policy, nothing to compare with


@dataclass
class _Candidate:
    """An op whose output holds non-finite values fp32 does not; a finding once read."""

    finding: Finding
    tensors: list  # its outputs holding them, and where
    masks: list
    storages: set
    read: bool = False

    def still_there(self) -> bool:
        """The values have not been overwritten since (an in-place write, ``bernoulli_``)."""
        return any(bool((~torch.isfinite(t) & m).any()) for t, m in zip(self.tensors, self.masks))


class _Recorder:
    """Sees every op (name, module, inputs, outputs). Without ``reference`` it records the fp32
    twin's non-finite positions into ``self.seen``; with one, it finds the policy's findings."""

    def __init__(self, grad_fmt, reference: _Reference | None = None) -> None:
        self.grad_fmt = grad_fmt
        self.reference = reference
        self.seen = _Reference()
        self.counts: dict[tuple[str, str], int] = {}
        self.pending: list[_Candidate] = []
        self.forward: list[Finding] = []
        self.backward: list[Finding] = []
        self.consumer: dict[int, tuple] = {}  # id(tensor) -> key of the last op that read it
        self.grad_at: dict[tuple, tuple[dict, bool]] = {}  # op -> its output's gradient: range,
        # and whether it held non-finite values fp32's has not
        self.keep: list = []  # tensors whose ids are keys above stay alive
        self.inputs_of: dict[tuple, list] = {}  # op -> its floating inputs (backward findings)

    def observe(self, op: str, module: str, args, kwargs, out) -> None:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            ins = _floats(kwargs) + _floats(args)
            outs = _floats(out)
            if not outs:
                return
            n = self.counts.get((module, op), 0)
            self.counts[(module, op)] = n + 1
            key = (module, op, n)
            if self.reference is None:
                self.seen.outputs[key] = tuple(_bad(o) for o in outs)
            else:
                self._forward(key, ins, outs, args, kwargs)
            for a in ins:
                self.consumer[id(a)] = key
            self.keep.extend(ins)
            if self.reference is not None:
                self.inputs_of[key] = ins
        for i, o in enumerate(outs):
            if o.requires_grad and o.grad_fn is not None:
                o.register_hook(self._on_grad(o, key, i))

    def _compared(self, key, i, o) -> tuple[torch.Tensor | None, bool]:
        ref = self.reference
        if not ref.compare:  # all-fp32 policy: as if fp32 had no such op
            return _bad(o), False
        refs = ref.outputs.get(key, ())
        return _new(_bad(o), refs[i] if i < len(refs) else _MISSING)

    def _forward(self, key, ins, outs, args, kwargs) -> None:
        compared = [self._compared(key, i, o) for i, o in enumerate(outs)]
        fresh = [(o, m, known) for o, (m, known) in zip(outs, compared) if m is not None]
        if not fresh:
            return
        # this op's output holds non-finite values fp32's does not: if it read an earlier
        # candidate's (through any view of their storage) while they were still there, those
        # values flow on into its output, which joins that candidate; the candidate is a finding
        # once its values reach the model's output or the loss (end_forward). A chain that
        # ends in an op whose output is finite or integer (torch.where selecting the values
        # away, ``.long()`` of T5's log-distance buckets) is read by nobody.
        read = _storages(ins)
        for c in self.pending:
            if c.storages & read and c.still_there():
                c.tensors += [o for o, _, _ in fresh]
                c.masks += [m for _, m, _ in fresh]
                c.storages |= _storages(o for o, _, _ in fresh)
                return
        if not all(known for _, _, known in fresh) and not (
                _finite(ins) and _numbers_finite(args) and _numbers_finite(kwargs)):
            # no fp32 op to compare with: only what it made from finite inputs counts
            fresh = [f for f in fresh if f[2]]
            if not fresh:
                return
        self.pending.append(_Candidate(Finding(key[0], key[1], _merge(ins), _merge(outs)),
                                       [o for o, _, _ in fresh], [m for _, m, _ in fresh],
                                       _storages(o for o, _, _ in fresh)))

    def end_forward(self, *results) -> None:
        """The model's output and the loss are read (by the caller, by backward)."""
        if self.reference is None:
            return
        with torch._C.DisableTorchFunction(), torch.no_grad():
            final = _storages(t for t in _floats(results) if _bad(t) is not None)
            for c in self.pending:
                if not c.read and c.storages & final and c.still_there():
                    c.read = True
            self.forward = [c.finding for c in self.pending if c.read][:1]
            self.pending.clear()

    def _on_grad(self, o: torch.Tensor, key: tuple, i: int):
        tid = id(o)

        def hook(g):
            # g: the gradient the consumers' backward produced for this output, rounded as the
            # gradient format stores it
            fmt = self.grad_fmt
            gq = quantize(g, fmt) if fmt != FP32 and g.dtype in _FLOATS[:3] else g
            bad = _bad(gq)
            if self.reference is None:
                self.seen.grads[(key, i)] = bad
                return None
            new = bad if not self.reference.compare else \
                _new(bad, self.reference.grads.get((key, i), _MISSING))[0]
            self.grad_at[key] = (tensor_range(gq), new is not None)
            if not self.backward and new is not None:
                cons = self.consumer.get(tid)
                upstream, upstream_new = self.grad_at.get(cons, ({"inf": 0, "nan": 0}, False))
                if not upstream_new:
                    name, op = cons[:2] if cons is not None else ("loss", "loss")
                    with torch.no_grad():
                        ins = self.inputs_of.get(cons, [])
                        fwd = _merge(ins) or None
                        if fwd is not None:
                            fwd["zeros"] = sum(int((t == 0).sum()) for t in ins)
                    self.backward.append(Finding(name, op, upstream, tensor_range(gq), fwd))
            return None
        return hook


class _Probe(TorchFunctionMode):
    """Every op run in the block goes to ``recorder`` (ops the emulation engine already reports
    are left to it)."""

    def __init__(self, recorder: _Recorder, where) -> None:
        super().__init__()
        self.recorder, self.where = recorder, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = op_name(func)
        if name not in EMPTY_OPS:  # stale memory, not values (see the docstring)
            self.recorder.observe(name, self.where(), args, kwargs, out)
        return out


def _run(model: nn.Module, rec: _Recorder, em: Emulation | None, inputs, targets, loss_fn,
         output_fn, autocast) -> torch.Tensor:
    """One forward and backward of ``model``, every op shown to ``rec`` (by the engine ``em``,
    or by a probe and module hooks); returns the loss."""
    handles = []
    stack: list[str] = []
    if em is not None:
        em.observers.append(rec.observe)  # the engine reports each op after its rounding
    else:  # native: track the running module for the probe
        for name, m in model.named_modules():
            handles.append(m.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
            handles.append(m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1],
                                                   always_call=True))
    probe_model = contextlib.nullcontext() if em is not None else \
        _Probe(rec, lambda: stack[-1] if stack else "")
    try:
        model.train()
        with autocast():
            with probe_model:
                out = run_model(model, inputs, output_fn)
            with _Probe(rec, lambda: "loss"):
                loss = loss_fn(out, targets)
        rec.end_forward(out, loss)
        if loss.requires_grad:
            loss.float().backward()
    finally:
        for h in handles:
            h.remove()
        if em is not None:
            em.observers.remove(rec.observe)
    return loss


def first_nonfinite(model: nn.Module, batch, loss_fn, policy="32-true", *,
                    output_fn=None, overrides: dict | None = None) -> NonFiniteReport:
    """Run one training step's forward and backward of a copy of ``model`` under ``policy``
    (with Precision's per-module ``overrides``) and name the first op that produced Inf/NaN in
    each pass that fp32 does not produce there and that reaches the output (see the module
    docstring). A backward finding also gives the op's forward input: ``rsqrt`` of an RMSNorm
    variance that rounded to 0 under fixed point shows "all zero" there."""
    prec = Precision(policy, overrides=overrides)
    # the gradients are rounded here as their format stores them: a static grid is needed
    static_format(prec.policy.grads, f"first_nonfinite (policy {prec.policy}, gradients in "
                  f"{prec.policy.grads})", "give a policy whose gradient format is static")
    low, _ = prec.setup(copy.deepcopy(model))
    inputs, targets = batch
    em = prec.emulation
    ref = _Reference(compare=False)
    if not prec.policy.is_fp32:
        # the fp32 twin, observed the same way (the engine with an fp32 rule expands the same
        # functions into the same ops), from the same state of the global generator
        twin = fp32_twin(model)
        em32 = Emulation(twin, parse_policy("32-true")) if em is not None else None
        rec32 = _Recorder(FP32)
        devices = sorted({p.device.index or 0 for p in twin.parameters()
                          if p.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices):
                _run(twin, rec32, em32, cast_floating(inputs, torch.float32), targets, loss_fn,
                     output_fn, contextlib.nullcontext)
        finally:
            if em32 is not None:
                em32.detach()
        ref = rec32.seen
    rec = _Recorder(prec.policy.grads if em is not None else FP32, ref)
    loss = _run(low, rec, em, prec.convert_input(inputs), targets, loss_fn, output_fn,
                prec.autocast)
    return NonFiniteReport(rec.forward[0] if rec.forward else None,
                           rec.backward[0] if rec.backward else None, float(loss.detach()))
