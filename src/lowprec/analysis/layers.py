"""Layer-wise error propagation: how far each layer's output in a format drifts from float32.

Both twins run the same input; forward hooks collect every leaf layer's output, and the error of
layer l is ||y16_l - y32_l|| / ||y32_l|| (Frobenius norms, in float64). Plotted against depth it
shows whether rounding errors stay at the format's eps or grow through the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..numerics.formats import Format, parse_format
from ..training.tree import cast_floating
from .common import fp32_twin, low_precision_copy, plan_of, run_model, scaled_policy

__all__ = ["layer_errors", "LayerError"]


@dataclass(frozen=True)
class LayerError:
    name: str
    kind: str
    depth: int
    rel_error: float
    max_abs_error: float


def _leaf_outputs(model: nn.Module, run) -> dict[str, torch.Tensor]:
    outs: dict[str, torch.Tensor] = {}
    order: list[str] = []
    handles = []
    for name, m in model.named_modules():
        if next(m.children(), None) is None and name:
            def hook(mod, args, out, name=name):
                if torch.is_tensor(out) and name not in outs:
                    # read outside the emulation's mode: under it, the copy would be an op of
                    # the parent module, rounded to the parent's format (a plan's fp32 module
                    # inside an fp16 model would read as its fp16 overflow)
                    with torch._C.DisableTorchFunction():
                        outs[name] = out.detach().double()
                    order.append(name)
            handles.append(m.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return {n: outs[n] for n in order}


@torch.no_grad()
def layer_errors(model: nn.Module, x, fmt: str | Format = "fp16", *,
                 backend: str = "emulated") -> list[LayerError]:
    """``x``: a tensor or a dict of keyword inputs (integer tensors are passed as they are)."""
    # a format, a scaled-GEMM recipe, or a per-layer plan (each module in its formats)
    fmt = plan_of(fmt) or scaled_policy(fmt) or parse_format(fmt)
    m32 = fp32_twin(model).eval()
    m16, prec = low_precision_copy(model, fmt, backend)
    m16.eval()
    x32 = cast_floating(x, torch.float32)
    a = _leaf_outputs(m32, lambda: run_model(m32, x32))
    with prec.autocast():  # as training runs it (a mixed policy rounds only there)
        b = _leaf_outputs(m16, lambda: run_model(m16, prec.convert_input(x32)))
    kinds = {n: type(m).__name__ for n, m in m32.named_modules()}
    rows = []
    for depth, (name, y32) in enumerate(a.items()):
        if name not in b or b[name].shape != y32.shape:
            continue
        d = b[name] - y32
        norm = y32.norm().item()
        rows.append(LayerError(name, kinds.get(name, "?"), depth,
                               d.norm().item() / norm if norm > 0 else float("nan"),
                               d.abs().max().item()))
    return rows
