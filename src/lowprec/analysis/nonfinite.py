"""The first layer that produced Inf or NaN, in the forward pass and then in the backward pass.

Forward: the first leaf layer, in execution order, whose output holds Inf/NaN while its inputs
were finite. Backward: the first layer whose backward produced a non-finite gradient for its
input (after the rounding that the policy's gradient format applies) while the gradient reaching
its output was finite; the loss function counts as the last "layer" of the forward pass and the
first of the backward pass. Each finding carries its input and output ranges.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..numerics.formats import FP32
from ..training.precision import Precision
from ..numerics.quantize import quantize
from .common import run_model, tensor_range

__all__ = ["first_nonfinite", "NonFiniteReport", "Finding"]


@dataclass(frozen=True)
class Finding:
    name: str
    kind: str
    input_range: dict
    output_range: dict

    def __str__(self) -> str:
        def r(d):
            return (f"|x| in [{d['min_abs']:.3g}, {d['max_abs']:.3g}], {d['inf']} Inf, "
                    f"{d['nan']} NaN" if d.get("max_abs") is not None else
                    f"{d.get('inf', 0)} Inf, {d.get('nan', 0)} NaN")
        return f"{self.name} ({self.kind}): input {r(self.input_range)}; output {r(self.output_range)}"


@dataclass(frozen=True)
class NonFiniteReport:
    forward: Finding | None
    backward: Finding | None
    loss: float

    @property
    def clean(self) -> bool:
        return self.forward is None and self.backward is None


def _finite(t) -> bool:
    return bool(torch.isfinite(t).all()) if torch.is_tensor(t) else True


def first_nonfinite(model: nn.Module, batch, loss_fn, policy="32-true", *,
                    output_fn=None) -> NonFiniteReport:
    """Run one training step's forward and backward of a copy of ``model`` under ``policy``
    and name the first layer that produced Inf/NaN in each pass."""
    prec = Precision(policy)
    twin, _ = prec.setup(copy.deepcopy(model))
    inputs, targets = batch
    grad_fmt = prec.policy.grads if prec.backend == "emulated" else FP32
    kinds = {n: type(m).__name__ for n, m in twin.named_modules()}
    consumer: dict[int, str] = {}  # id(tensor) -> name of the first layer that read it
    forward_found: list[Finding] = []
    backward_found: list[Finding] = []
    grad_at_output: dict[str, dict] = {}
    handles = []

    def pre(name):
        def hook(mod, args):
            for a in args:
                if torch.is_tensor(a):
                    consumer.setdefault(id(a), name)
        return hook

    def post(name):
        def hook(mod, args, out):
            tensors = [a for a in args if torch.is_tensor(a)]
            if not forward_found and not _finite(out) and all(_finite(a) for a in tensors):
                forward_found.append(Finding(name, kinds[name], _merge(tensors),
                                             tensor_range(out)))
            if torch.is_tensor(out) and out.requires_grad:
                key = id(out)

                def on_grad(g, name=name, key=key):
                    # g is the gradient the consumer's backward produced for this output; the
                    # gradient format rounds it as 16-bit storage would
                    gq = quantize(g, grad_fmt) if grad_fmt != FP32 else g
                    producer = consumer.get(key, "loss")
                    grad_at_output[name] = tensor_range(gq)
                    if not backward_found and not _finite(gq):
                        upstream = grad_at_output.get(producer, {"inf": 0, "nan": 0})
                        if upstream.get("inf", 0) == 0 and upstream.get("nan", 0) == 0:
                            backward_found.append(Finding(producer, kinds.get(producer, "loss"),
                                                          upstream, tensor_range(gq)))
                out.register_hook(on_grad)
        return hook

    # registered after Precision's hooks: they see the values as the policy stores them
    for name, m in twin.named_modules():
        if name and next(m.children(), None) is None:
            handles.append(m.register_forward_pre_hook(pre(name)))
            handles.append(m.register_forward_hook(post(name)))
    try:
        twin.train()
        with prec.autocast():
            out = run_model(twin, prec.convert_input(inputs), output_fn)
            loss = loss_fn(out, targets)
        if not forward_found and not _finite(loss) and _finite(out):
            forward_found.append(Finding("loss", "loss", tensor_range(out), tensor_range(loss)))
        grad_at_output["loss"] = {"inf": 0, "nan": 0, "min_abs": 1.0, "max_abs": 1.0,
                                  "numel": 1}
        if loss.requires_grad:
            loss.float().backward()
    finally:
        for h in handles:
            h.remove()
    return NonFiniteReport(forward_found[0] if forward_found else None,
                           backward_found[0] if backward_found else None, float(loss.detach()))


def _merge(tensors) -> dict:
    if not tensors:
        return {}
    return tensor_range(torch.cat([t.detach().float().flatten() for t in tensors]))
