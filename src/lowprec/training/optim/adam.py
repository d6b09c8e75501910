"""Adam and AdamW in lowprec's storage rules (sqrt(v) stored where the exponent range is narrow)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ...numerics.formats import FloatFormat
from .base import LowPrecisionOptimizer
from .writeback import group_lr

__all__ = ["Adam", "AdamW"]


class Adam(LowPrecisionOptimizer):
    """Adam (Kingma & Ba 2015) with torch.optim.Adam's rule; ``AdamW`` decouples weight decay.

    Why torch's Adam fails in pure fp16, and what this one does instead:

    * eps = 1e-8 is below fp16's smallest subnormal (6e-8): in fp16 arithmetic it rounds to 0,
      so sqrt(v) + eps is 0 wherever v is, and m / 0 gives Inf or NaN (keras#11860,
      pytorch#8860). Here every operation runs in fp32, where 1e-8 is an ordinary number.
    * v = E[g**2] spans twice the exponent range of g: gradients of 1e-4 give g**2 = 1e-8, which
      fp16 cannot store, so v flushes to zero while m (of the size of g) does not, and the
      update m / (sqrt(v) + eps) explodes. When the state format has a narrow exponent range
      (fewer than 8 exponent bits), this optimizer stores sqrt(v) instead of v
      (``exp_avg_sq_sqrt``): it has the magnitude of g, like m, so both fit or underflow together.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = False, **storage) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, decoupled=decoupled), **storage)

    def _sqrt_storage(self, p) -> bool:
        f = self.storage.sformat(p)
        return isinstance(f, FloatFormat) and f.exp_bits < 8

    def _moment_layout(self, p):
        sf = self.storage.sformat(p)
        second = "exp_avg_sq_sqrt" if self._sqrt_storage(p) else "exp_avg_sq"
        return {"exp_avg": sf, second: sf}

    def _init_state(self, p, state) -> None:
        sf = self.storage.sformat(p)
        state["step"] = 0
        state["exp_avg"] = self._state_tensor(p, p, sf)
        key = "exp_avg_sq_sqrt" if self._sqrt_storage(p) else "exp_avg_sq"
        state[key] = self._state_tensor(p, p, sf)

    def _fused(self, p, state, group, grad_scale) -> bool:
        from ...numerics import kernel as _kernel

        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"]
        sqrt_key = "exp_avg_sq_sqrt" in state
        opt = _kernel.LPOpt(kind=1, decoupled=int(group["decoupled"]),
                            sqrt_storage=int(sqrt_key), lr=group_lr(group), wd=group["weight_decay"],
                            beta1=beta1, beta2=beta2, eps=group["eps"],
                            step_size=group_lr(group) / (1 - beta1**step),
                            bc2_sqrt=math.sqrt(1 - beta2**step))
        s2 = state["exp_avg_sq_sqrt"] if sqrt_key else state["exp_avg_sq"]
        self._run_fused(p, state["exp_avg"], s2, opt, grad_scale)
        return True

    def _new_weight(self, p, w32, g32, state, group):
        sf = self.storage.sformat(p)
        beta1, beta2 = group["betas"]
        lr, eps, wd = group_lr(group), group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"]
        if wd:
            if group["decoupled"]:
                w32 = w32.mul(1 - lr * wd)
            else:
                g32 = g32.add(w32, alpha=wd)
        m32 = state["exp_avg"].float().lerp_(g32, 1 - beta1)
        if "exp_avg_sq" in state:
            v32 = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            self._save(state["exp_avg_sq"], v32, sf, p, "exp_avg_sq")
            root = state["exp_avg_sq"].float().sqrt()
        else:
            v_old = state["exp_avg_sq_sqrt"].float().square()
            v32 = v_old.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            self._save(state["exp_avg_sq_sqrt"], v32.sqrt(), sf, p, "exp_avg_sq")
            root = state["exp_avg_sq_sqrt"].float()
        self._save(state["exp_avg"], m32, sf, p, "exp_avg")
        m32 = state["exp_avg"].float()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (root / math.sqrt(bias_correction2)).add_(eps)
        return w32.addcdiv(m32, denom, value=-step_size)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), torch.optim.AdamW's rule."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **storage) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled=True, **storage)
