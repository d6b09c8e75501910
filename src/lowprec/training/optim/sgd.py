"""SGD with momentum, dampening, Nesterov and L2 weight decay, in lowprec's storage rules."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...numerics import kernel as _kernel
from ...numerics.storage import storage_dtype
from .base import LowPrecisionOptimizer
from .writeback import group_lr

__all__ = ["SGD"]


class SGD(LowPrecisionOptimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD's rule).

    The update of one element, in float32 (the definition both the torch path below and the
    fused kernel, lp_opt_step in csrc/optimizer.c, implement, bit for bit). Every operation is
    one correctly rounded IEEE 754 float32 operation; ``fma(a, b, c)`` is a * b + c rounded once,
    what torch's CPU ``add(x, alpha=a)`` computes (``vec::fmadd``). Constants are float64
    Python numbers rounded to float32, as torch rounds a scalar given to a float32 tensor op::

        g = grad * grad_scale                    # skipped without grad_scale (x * 1 is exact)
        g = fma(w, wd, g)                        # if wd        (g.add(w, alpha=wd))
        if momentum:
            b = g                                # first step   (clone)
            b = fma(g, 1 - dampening, b * momentum)  # later    (b.mul_(m).add_(g, alpha=1-d))
            b = round_state(b)                   # stored; the rounded b is used below
            g = fma(b, momentum, g) if nesterov else b
        w = round_param(fma(g, -lr, w))          # (w.add(g, alpha=-lr))

    ``round_state`` rounds to nearest even onto the state format; ``round_param`` applies the
    write-back mode (nearest, or stochastic with one seed drawn per parameter tensor per step
    from the optimizer's generator; see :mod:`.writeback`). With every format fp32 both roundings
    are the identity and this is torch.optim.SGD's sequence exactly.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 **storage) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, momentum={momentum}, weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov), **storage)

    def _moment_layout(self, p):
        momentum = self.param_groups[0]["momentum"] if self.param_groups else 0
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                momentum = g["momentum"]
        return {"momentum_buffer": self.storage.sformat(p)} if momentum else {}

    def _init_state(self, p, state) -> None:
        state["step"] = 0

    def _fused(self, p, state, group, grad_scale) -> bool:
        state["step"] += 1
        mom = group["momentum"]
        first = mom and "momentum_buffer" not in state
        if first:
            state["momentum_buffer"] = torch.zeros_like(
                p, dtype=storage_dtype(self.storage.sformat(p)))
        opt = _kernel.LPOpt(kind=0, nesterov=int(group["nesterov"]), first=int(bool(first)),
                            has_momentum=int(bool(mom)), neg_lr=-group_lr(group), momentum=mom,
                            damp_c=1 - group["dampening"], wd=group["weight_decay"])
        self._run_fused(p, state.get("momentum_buffer"), None, opt, grad_scale)
        return True

    def _new_weight(self, p, w32, g32, state, group):
        state["step"] += 1
        if group["weight_decay"]:
            g32 = g32.add(w32, alpha=group["weight_decay"])
        mom = group["momentum"]
        if mom:
            sf = self.storage.sformat(p)
            if "momentum_buffer" not in state:
                buf32 = torch.clone(g32).detach()
                state["momentum_buffer"] = self._state_tensor(p, buf32, sf)
            else:
                buf32 = state["momentum_buffer"].float().mul_(mom).add_(
                    g32, alpha=1 - group["dampening"])
            self._save(state["momentum_buffer"], buf32, sf, p, "momentum")
            buf32 = state["momentum_buffer"].float()
            g32 = g32.add(buf32, alpha=mom) if group["nesterov"] else buf32
        return w32.add(g32, alpha=-group_lr(group))
