"""Adam and AdamW in lowprec's storage rules (sqrt(v) stored where the exponent range is narrow)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ...numerics import kernel as _kernel
from ...numerics.formats import FloatFormat
from .base import LowPrecisionOptimizer, sqrt_rn
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

    The update of one element, in float32 (the definition both the torch path below and the
    fused kernel, lp_opt_step in csrc/optimizer.c, implement, bit for bit). Every operation is
    one correctly rounded IEEE 754 float32 operation; ``fma(a, b, c)`` is a * b + c rounded once
    (torch's CPU ``add`` with alpha, ``lerp`` and ``addcmul`` compute exactly this:
    ``vec::fmadd``); ``addcdiv`` is w + (value * m) / d, unfused. Constants are float64 Python
    numbers rounded to float32, as torch rounds a scalar given to a float32 tensor op; t is the
    step count, c1 = 1 - beta1::

        g = grad * grad_scale                    # skipped without grad_scale (x * 1 is exact)
        w = w * (1 - lr * wd)                    # if wd, AdamW        (w.mul(1 - lr*wd))
        g = fma(w, wd, g)                        # if wd, Adam (L2)    (g.add(w, alpha=wd))
        m = fma(c1, g - m, m) if c1 < 0.5 else fma(c1 - 1, g - m, g)   # m.lerp_(g, c1)
        m = round_state(m)
        v = fma((1 - beta2) * g, g, v * beta2)   # v.mul_(beta2).addcmul_(g, g, value=1-beta2)
        v = round_state(v);  r = sqrt(v)         # v stored, or where sqrt(v) is stored:
        # v = fma((1 - beta2) * g, g, (s * s) * beta2);  s = r = round_state(sqrt(v))
        d = r / sqrt(1 - beta2**t) + eps
        w = round_param(w + (-(lr / (1 - beta1**t)) * m) / d)    # w.addcdiv(m, d, value=...)

    ``sqrt`` is the correctly rounded square root (IEEE 754 squareRoot). torch's float32 CPU
    ``sqrt`` is not (torch 2.13 with MKL: off by one unit in the last place on about a fifth of
    random inputs, and its bits depend on the build's vector-math library and the CPU). So the
    torch path takes the root in float64 and rounds it to float32, which is the correctly
    rounded float32 root (double rounding is harmless for sqrt when 53 >= 2 * 24 + 2, Figueroa
    1995), and the kernel uses sqrtf. Only with every format fp32, where the fused kernel never
    runs, does the torch path call torch.sqrt, so that it stays bit-identical to
    torch.optim.Adam. ``round_state`` and ``round_param`` are as in :class:`~.sgd.SGD`.
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

    def _sqrt(self, v32, p):
        """The root of the stored v: correctly rounded, or torch.optim's own kernel when every
        format is fp32 (see the class docstring)."""
        return v32.sqrt() if self._all_fp32(p) else sqrt_rn(v32)

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
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"]
        sqrt_key = "exp_avg_sq_sqrt" in state
        lr, wd = group_lr(group), group["weight_decay"]
        opt = _kernel.LPOpt(kind=1, decoupled=int(group["decoupled"]),
                            sqrt_storage=int(sqrt_key), wd=wd, decay=1 - lr * wd,
                            lerp_w=1 - beta1, beta2=beta2, beta2_c=1 - beta2, eps=group["eps"],
                            neg_step=-(lr / (1 - beta1**step)),
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
            root = self._sqrt(state["exp_avg_sq"].float(), p)
        else:
            v_old = state["exp_avg_sq_sqrt"].float().square()
            v32 = v_old.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            self._save(state["exp_avg_sq_sqrt"], sqrt_rn(v32), sf, p, "exp_avg_sq")
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
