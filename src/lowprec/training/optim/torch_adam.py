"""Will a torch Adam lose eps or its second moment in its formats? Asked at its first step.

torch.optim.Adam (AdamW, NAdam, RAdam alike) updates, per element::

    m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g**2
    w = w - lr m_hat / (sqrt(v_hat) + eps)

with its state in the parameters' dtype (fp16 after ``model.half()`` or under a native pure
policy; its for-each and single-tensor paths also compute in that dtype, its fused kernel in
fp32), and under an emulated policy lowprec rounds that state to the policy's state format after
every step (:class:`~.wrapper.FormatOptimizer`). In a format with fp16's 5-bit exponent:

* eps = 1e-8 is below fp16's smallest subnormal (2**-24 = 6.0e-8): where the arithmetic is fp16
  it rounds to 0, so sqrt(v) + eps is 0 wherever v is, and m / 0 is Inf (0 / 0 NaN). Measured:
  fp16 parameters, gradients 1e-4 and 1e-3, one step of torch.optim.Adam: both weights -inf;
* v after the first step is (1 - beta2) g**2 = 1e-3 g**2: every gradient below
  sqrt(2**-25 / 1e-3) = 5.5e-3 gives a v that flushes to 0 while m = 0.1 g does not, so the
  update is lr m / eps, up to 5.5e-3 / 1e-8 = 5e5 times lr (the fused kernel and the emulated
  wrapper, whose arithmetic is fp32, keep eps and blow up this way: NaN within a few steps);
* g**2 beyond the format's largest value (|g| > 256 in fp16): v tends to g**2 and overflows.

bf16 and fp32 have fp32's exponent range: eps = 1e-8 and v hold. lowprec's Adam
(:class:`~.adam.Adam`) does its arithmetic in fp32 and stores sqrt(v), which has the magnitude of
g like m, where the state format's exponent is narrow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...numerics.formats import FP32, FixedFormat, FloatFormat, Format
from ...numerics.quantize import quantize

__all__ = ["TORCH_ADAMS", "OptimizerPrecisionWarning", "AdamRisk", "adam_risks",
           "adam_warning"]

# torch's optimizers with Adam's second moment (exp_avg_sq) and eps
TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam)


class OptimizerPrecisionWarning(UserWarning):
    """A torch optimizer will lose eps or its state in the formats it runs in (it diverges or
    turns NaN); the message says what to use instead."""


@dataclass
class AdamRisk:
    """What the first step of a torch Adam loses, for the parameters sharing one (eps,
    arithmetic format, state format)."""

    eps: float
    beta1: float
    beta2: float
    arithmetic: Format  # where sqrt(v) + eps is computed
    state: Format  # where m and v are stored
    n: int = 0  # nonzero gradient elements
    underflow: int = 0  # of them: (1 - beta2) g**2 rounds to 0 in the state format, m does not
    overflow: int = 0  # of them: g**2 beyond the state format's largest value

    @property
    def eps_lost(self) -> bool:
        return self.eps > 0 and float(quantize(torch.tensor([self.eps]), self.arithmetic)) == 0

    @property
    def failing(self) -> bool:
        return self.eps_lost or self.underflow > 0 or self.overflow > 0

    @property
    def safe_eps(self) -> float:
        """The eps at or above which the update where v flushes, lr |m| / eps, stays within
        about lr: the largest gradient whose first v = (1 - beta2) g**2 flushes (half the
        state format's smallest step rounds to 0)."""
        return math.sqrt(self.state.min_subnormal / 2 / max(1.0 - self.beta2, 1e-30))


def adam_risks(entries) -> list[AdamRisk]:
    """``entries``: (eps, (beta1, beta2), arithmetic format, state format, gradient or None) per
    parameter, the gradient as the step uses it (unscaled). Formats other than floating or
    fixed point with a static grid are not checked (a dynamic fixed-point or MX state has a
    range chosen per block or group)."""
    out: dict[tuple, AdamRisk] = {}
    for eps, betas, arith, state, grad in entries:
        if not isinstance(state, (FloatFormat, FixedFormat)) or \
                not isinstance(arith, (FloatFormat, FixedFormat)):
            continue
        if arith == FP32 and state == FP32:
            continue
        b1, b2 = (float(b) for b in betas)
        key = (float(eps), b1, b2, arith, state)
        risk = out.setdefault(key, AdamRisk(float(eps), b1, b2, arith, state))
        if grad is None:
            continue
        with torch.no_grad():
            g = grad.detach().float().flatten()
            g = g[g != 0]
            if not g.numel():
                continue
            sq = g * g  # float32: beyond 3.4e38 it is Inf, beyond every state format
            v = quantize((1.0 - b2) * sq, state)
            m = quantize((1.0 - b1) * g, state)
            gq = quantize(sq, state)
            risk.n += int(g.numel())
            risk.underflow += int(((v == 0) & (m != 0)).sum())
            risk.overflow += int((~torch.isfinite(gq) | (sq > state.max)).sum())
    return [r for r in out.values() if r.failing]


def adam_warning(name: str, policy, risks: list[AdamRisk]) -> str:
    """One message for the risks of one optimizer: what happens, measured, and what to use."""
    parts = []
    for r in risks:
        what = []
        if r.eps_lost:
            what.append(f"eps={r.eps:g} rounds to 0 in {r.arithmetic}, where it adds eps to "
                        "sqrt(v): m / 0 gives Inf or NaN wherever v is 0")
        if r.underflow:
            what.append(f"v = (1 - beta2) g**2 flushes to 0 in {r.state} for {r.underflow:,} of "
                        f"{r.n:,} nonzero gradient elements (those below {r.safe_eps:.1e}) while "
                        f"m does not: their update is lr m / eps with eps={r.eps:g}")
        if r.overflow:
            what.append(f"g**2 exceeds {r.state}'s largest value ({r.state.max:g}) for "
                        f"{r.overflow:,} of {r.n:,} gradient elements: v, which tends to "
                        "g**2, overflows")
        parts.append(f"state in {r.state}, arithmetic in {r.arithmetic}: " + "; ".join(what))
    eps_hint = max(r.safe_eps for r in risks)
    return (f"torch.optim.{name} under policy {policy} loses eps or its second moment v "
            f"(checked at its first step; it diverges or turns NaN on many models): "
            f"{' | '.join(parts)}. Use lowprec.optim.Adam / "
            "lowprec.optim.AdamW (fp32 arithmetic, sqrt(v) stored where the exponent is narrow), "
            "or keep its state in fp32 (fp32 master weights: policy 16-master), or, with this "
            f"optimizer, eps >= {eps_hint:.1e}.")
