"""Choosing a loss scale by measurement: the gradients of one fp32 backward pass against a format.

``find_loss_scale`` picks the largest power-of-two scale that keeps the largest scaled gradient
``headroom`` below the format's maximum, and reports the underflow fractions at 1 and at that
scale (the thread's dilemma, "too large: Inf/NaN, too small: no convergence", as numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics.formats import Format, parse_format
from .common import untouched, run_model, scaled_policy, static_format

__all__ = ["LossScaleChoice", "find_loss_scale", "gradient_magnitudes", "power_of_two_scale"]


@dataclass(frozen=True)
class LossScaleChoice:
    """What :func:`find_loss_scale` measured and chose."""

    scale: float
    format: str
    n_values: int
    max_abs: float
    min_abs_nonzero: float
    underflow_at_1: float  # fraction of nonzero gradient values that flush to zero unscaled
    underflow_at_scale: float
    overflow_at_scale: float
    headroom: float

    def __str__(self) -> str:
        return (f"loss scale {self.scale:g} for {self.format}: {100 * self.underflow_at_1:.1f}% of "
                f"gradient values underflow at scale 1, {100 * self.underflow_at_scale:.2f}% at "
                f"{self.scale:g}; largest scaled gradient {self.max_abs * self.scale:.3g} "
                f"(max {parse_format(self.format).max:g})")


def power_of_two_scale(gmax: float, fmt, headroom: float = 2.0**3,
                       max_scale: float = 2.0**24) -> float:
    """The largest power of two S with gmax * S * headroom <= fmt.max (within [2**-24,
    max_scale]): the loss scale :func:`find_loss_scale` chooses for a largest gradient gmax."""
    if not gmax:
        return 1.0
    k = math.floor(math.log2(fmt.max / (headroom * gmax)))
    return float(min(max(2.0**k, 2.0**-24), max_scale))


def gradient_magnitudes(model: torch.nn.Module, batch, loss_fn, output_fn=None) -> torch.Tensor:
    """|gradient| values of one fp32 backward pass: every parameter gradient and every gradient
    flowing out of a leaf module (the activation gradients fp16 backward would store)."""
    inputs, targets = batch
    grads: list[torch.Tensor] = []
    handles = []

    def keep(g):
        grads.append(g.detach().abs().flatten().float())

    def watch(_m, _args, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(keep)

    for m in model.modules():
        if not list(m.children()):
            handles.append(m.register_forward_hook(watch))
    try:
        with untouched(model):
            loss = loss_fn(run_model(model, inputs, output_fn), targets)
            loss.float().backward()
            grads += [p.grad.detach().abs().flatten().float() for p in model.parameters()
                      if p.grad is not None]
    finally:
        for h in handles:
            h.remove()
    return torch.cat(grads) if grads else torch.zeros(0)


def find_loss_scale(model: torch.nn.Module, batch, loss_fn, fmt: str | Format = "fp16", *,
                    headroom: float = 2.0**3, max_scale: float = 2.0**24,
                    output_fn=None) -> LossScaleChoice:
    """Pick the largest power-of-two loss scale that keeps the largest scaled gradient at least
    ``headroom`` below ``fmt.max``; report the underflow fractions at 1 and at that scale.

    A gradient value g underflows when |g| * S rounds to zero in ``fmt`` (below half of its
    smallest subnormal); it overflows when |g| * S exceeds ``fmt.max``.
    """
    pol = scaled_policy(fmt)
    if pol is not None:
        return _recipe_loss_scale(model, batch, loss_fn, pol, headroom, output_fn)
    fmt = static_format(fmt, "the loss-scale search")
    mags = gradient_magnitudes(model, batch, loss_fn, output_fn).double()
    nz = mags[mags > 0]
    if nz.numel() == 0:
        return LossScaleChoice(1.0, str(fmt), int(mags.numel()), 0.0, 0.0, 0.0, 0.0, 0.0, headroom)
    gmax, gmin = nz.max().item(), nz.min().item()
    tiny = fmt.min_subnormal / 2

    def under(s):
        return (nz * s <= tiny).double().mean().item()

    if not math.isfinite(gmax):
        raise ValueError("the fp32 gradients already hold Inf/NaN: no loss scale can help")
    scale = power_of_two_scale(gmax, fmt, headroom, max_scale)
    return LossScaleChoice(
        scale=scale, format=str(fmt), n_values=int(mags.numel()), max_abs=gmax,
        min_abs_nonzero=gmin, underflow_at_1=under(1.0), underflow_at_scale=under(scale),
        overflow_at_scale=(nz * scale > fmt.max).double().mean().item(), headroom=headroom)


def _recipe_loss_scale(model, batch, loss_fn, policy, headroom: float, output_fn
                       ) -> LossScaleChoice:
    """Under a scaled-GEMM recipe every gradient operand is scaled by its cast, so the loss
    scale stays 1; what flushes or saturates is measured on the cast gradient operands."""
    from .scaled import gradient_rows, largest, scaled_operands, smallest, weighted

    rows = gradient_rows(scaled_operands(model, batch, loss_fn, policy, output_fn))
    cast = policy.scaled.grad_output
    fmt = "fp32" if cast.is_hp else str(cast.element)
    flushed = weighted(rows, "flushed")
    return LossScaleChoice(
        scale=1.0, format=fmt, n_values=sum(r["nonzero"] for r in rows), max_abs=largest(rows),
        min_abs_nonzero=smallest(rows), underflow_at_1=flushed, underflow_at_scale=flushed,
        overflow_at_scale=weighted(rows, "saturated"), headroom=headroom)
