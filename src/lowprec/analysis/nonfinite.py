"""The first op that produced Inf or NaN, in the forward pass and then in the backward pass.

Forward: the first op, in execution order, whose floating output holds Inf/NaN (as the policy
stores it: under emulation, after the rounding that turns 70000 into fp16's Inf), named by its
module path and op name (``"layers.0" / "add"``), wherever it runs: a leaf layer, a residual add
in a container's ``forward``, a functional call, the loss. Backward: the first op whose backward
produced a non-finite gradient for one of its inputs (after the rounding of the policy's gradient
format) while the gradient reaching its output was finite. Each finding carries its input and
output ranges.

An op is reported only where it *produced* the Inf/NaN: every floating input and every number
it was given was finite. A value a model writes on purpose (an attention mask filled with -inf,
``torch.full(..., -inf)``) and everything computed from it is not an overflow and is not
reported; an overflow that happens downstream of such a mask, in an op whose own inputs are
finite, still is.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..numerics.formats import FP32
from ..numerics.quantize import quantize
from ..training.emulation import op_name
from ..training.precision import Precision
from ..training.tree import tensors_in
from .common import run_model, static_format, tensor_range

__all__ = ["first_nonfinite", "NonFiniteReport", "Finding"]


@dataclass(frozen=True)
class Finding:
    name: str  # module path ("" for the model's own forward, "loss" for the loss function)
    kind: str  # the op: "linear", "add", "add_", "softmax"...
    input_range: dict
    output_range: dict

    def __str__(self) -> str:
        def r(d):
            return (f"|x| in [{d['min_abs']:.3g}, {d['max_abs']:.3g}], {d['inf']} Inf, "
                    f"{d['nan']} NaN" if d.get("max_abs") is not None else
                    f"{d.get('inf', 0)} Inf, {d.get('nan', 0)} NaN")
        where = self.name or "<model>"
        return f"{where} ({self.kind}): input {r(self.input_range)}; output {r(self.output_range)}"


@dataclass(frozen=True)
class NonFiniteReport:
    forward: Finding | None
    backward: Finding | None
    loss: float

    @property
    def clean(self) -> bool:
        return self.forward is None and self.backward is None


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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


class _Recorder:
    """Sees every op (name, module, inputs, outputs); keeps the first non-finite findings."""

    def __init__(self, grad_fmt) -> None:
        self.grad_fmt = grad_fmt
        self.forward: list[Finding] = []
        self.backward: list[Finding] = []
        self.consumer: dict[int, tuple[str, str]] = {}  # id(tensor) -> last op that read it
        self.grad_at: dict[tuple[str, str], dict] = {}  # op -> range of its output's gradient
        self.keep: list = []  # tensors whose ids are keys above stay alive

    def observe(self, op: str, module: str, args, kwargs, out) -> None:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            ins = _floats(kwargs) + _floats(args)
            outs = _floats(out)
            if not outs:
                return
            for a in ins:
                self.consumer[id(a)] = (module, op)
            self.keep.extend(ins)
            if (not self.forward and not _finite(outs) and _finite(ins)
                    and _numbers_finite(args) and _numbers_finite(kwargs)):
                self.forward.append(Finding(module, op, _merge(ins), _merge(outs)))
        for o in outs:
            if o.requires_grad and o.grad_fn is not None:
                o.register_hook(self._on_grad(o, (module, op)))

    def _on_grad(self, o: torch.Tensor, producer: tuple[str, str]):
        key = id(o)

        def hook(g):
            # g: the gradient the consumers' backward produced for this output, rounded as the
            # gradient format stores it
            fmt = self.grad_fmt
            gq = quantize(g, fmt) if fmt != FP32 and g.dtype in _FLOATS[:3] else g
            self.grad_at[producer] = tensor_range(gq)
            if not self.backward and not bool(torch.isfinite(gq).all()):
                cons = self.consumer.get(key, ("loss", "loss"))
                upstream = self.grad_at.get(cons, {"inf": 0, "nan": 0})
                if upstream.get("inf", 0) == 0 and upstream.get("nan", 0) == 0:
                    self.backward.append(Finding(cons[0], cons[1], upstream, tensor_range(gq)))
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
        self.recorder.observe(op_name(func), self.where(), args, kwargs, out)
        return out


def first_nonfinite(model: nn.Module, batch, loss_fn, policy="32-true", *,
                    output_fn=None) -> NonFiniteReport:
    """Run one training step's forward and backward of a copy of ``model`` under ``policy``
    and name the first op that produced Inf/NaN in each pass."""
    prec = Precision(policy)
    # the gradients are rounded here as their format stores them: a static grid is needed
    static_format(prec.policy.grads, f"first_nonfinite (policy {prec.policy}, gradients in "
                  f"{prec.policy.grads})", "give a policy whose gradient format is static")
    twin, _ = prec.setup(copy.deepcopy(model))
    inputs, targets = batch
    em = prec.emulation
    rec = _Recorder(prec.policy.grads if em is not None else FP32)
    handles = []
    stack: list[str] = []
    if em is not None:
        em.observers.append(rec.observe)  # the engine reports each op after its rounding
    else:  # native: track the running module for the probe
        for name, m in twin.named_modules():
            handles.append(m.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
            handles.append(m.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1],
                                                   always_call=True))
    probe_model = contextlib.nullcontext() if em is not None else \
        _Probe(rec, lambda: stack[-1] if stack else "")
    try:
        twin.train()
        with prec.autocast():
            with probe_model:
                out = run_model(twin, prec.convert_input(inputs), output_fn)
            with _Probe(rec, lambda: "loss"):
                loss = loss_fn(out, targets)
        if loss.requires_grad:
            loss.float().backward()
    finally:
        for h in handles:
            h.remove()
        if em is not None:
            em.observers.remove(rec.observe)
    return NonFiniteReport(rec.forward[0] if rec.forward else None,
                           rec.backward[0] if rec.backward else None, float(loss.detach()))
