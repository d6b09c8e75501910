"""Lost updates: the thread's "updates that should be different but become equal".

For each layer, the fraction of parameter elements with a nonzero update Δw for which the
stored parameter does not change: w + Δw rounds back to w in the parameter format.

* nearest: |Δw| below half the spacing of the format at w is always lost;
* stochastic: lost with probability 1 - |Δw| / spacing (one draw is measured), but unbiased;
* kahan: the update is lost only if the compensation buffer (stored in the parameter format)
  cannot hold it either, i.e. w + Δw rounds to w and -Δw rounds to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .common import untouched, parameter_groups, run_model, scaled_policy, static_format
from ..numerics.formats import Format
from ..numerics.quantize import quantize
from ..numerics.rounding import check_generator

__all__ = ["lost_updates", "lost_fractions", "LostUpdates"]


@dataclass(frozen=True)
class LostUpdates:
    layer: str  # module path; a parameter the root module owns: its own name
    n: int  # elements with a nonzero update
    nearest: float
    stochastic: float
    kahan: float


def lost_fractions(w: torch.Tensor, dw: torch.Tensor, fmt: Format,
                   generator: torch.Generator | None = None) -> dict:
    """Fractions for one tensor; ``w`` is taken on the format's grid."""
    w = quantize(w.detach().float(), fmt)
    dw = dw.detach().float()
    moving = dw != 0
    n = int(moving.sum())
    if n == 0:
        return {"n": 0, "nearest": 0.0, "stochastic": 0.0, "kahan": 0.0}
    target = w + dw
    rn = quantize(target, fmt) == w
    sr = quantize(target, fmt, "stochastic", generator=generator) == w
    kahan = rn & (quantize(-dw, fmt) == 0)
    return {"n": n, "nearest": (rn & moving).sum().item() / n,
            "stochastic": (sr & moving).sum().item() / n,
            "kahan": (kahan & moving).sum().item() / n}


def lost_updates(model: nn.Module, batch, loss_fn, fmt: str | Format = "bf16", *,
                 lr: float = 0.01, optimizer: str = "sgd", eps: float = 1e-8,
                 generator: torch.Generator | None = None, output_fn=None
                 ) -> list[LostUpdates]:
    """Per layer, for the update of one optimizer step on ``batch`` computed in float32:
    ``sgd``: Δw = -lr g; ``adam``: its first step, Δw = -lr g / (|g| + eps)."""
    check_generator(generator)
    pol = scaled_policy(fmt)  # a scaled-GEMM recipe: updates land in its parameter format
    fmt = static_format(pol.params if pol is not None else fmt, "the lost-update analysis")
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"optimizer={optimizer!r}; accepted: sgd, adam")
    inputs, targets = batch
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    with untouched(model):
        loss_fn(run_model(model, inputs, output_fn), targets).float().backward()
        rows = []
        for mname, m in model.named_modules():
            for name, group in parameter_groups(mname, m):
                own = [p for _, p in group if p.grad is not None]
                if not own:
                    continue
                w = torch.cat([p.detach().float().flatten() for p in own])
                g = torch.cat([p.grad.float().flatten() for p in own])
                dw = -lr * g if optimizer == "sgd" else -lr * g / (g.abs() + eps)
                f = lost_fractions(w, dw, fmt, gen)
                rows.append(LostUpdates(name, f["n"], f["nearest"], f["stochastic"],
                                        f["kahan"]))
    return rows
