"""Loss scaling behind one interface, and a tool that chooses a static scale by measurement.

Micikevicius et al. (2018): fp16 gradients are often below fp16's smallest subnormal (2**-24) and
flush to zero; multiplying the loss by S shifts every gradient up by S before it is stored, and
the optimizer divides by S in fp32. Too large an S overflows (Inf/NaN); too small leaves values
underflowing. ``DynamicLossScale`` follows torch.amp.GradScaler: halve on a non-finite gradient
and skip that step, double after ``interval`` clean steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._util import fresh_grads
from .formats import Format, parse_format

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "make_loss_scale",
           "find_loss_scale", "LossScaleChoice"]


class LossScale:
    """Interface: ``scale`` multiplies the loss; ``update(found_inf)`` after each step attempt;
    ``skips_nonfinite`` says whether a step with Inf/NaN gradients is skipped."""

    skips_nonfinite = True

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:  # pragma: no cover - overridden
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale:g})"


class NoLossScale(LossScale):
    """Scale 1; steps are never skipped (plain training: Inf/NaN reach the parameters)."""

    skips_nonfinite = False

    def __init__(self) -> None:
        super().__init__(1.0)

    def update(self, found_inf: bool) -> None:
        pass


class StaticLossScale(LossScale):
    """A fixed scale; a step whose gradients hold Inf/NaN is skipped and counted."""

    def __init__(self, scale: float) -> None:
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"scale={scale!r} must be a positive finite number")
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        pass


class DynamicLossScale(LossScale):
    def __init__(self, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000, min: float = 1.0, max: float = 2.0**24) -> None:
        if not init > 0:
            raise ValueError(f"init={init!r} must be positive")
        if not growth > 1:
            raise ValueError(f"growth={growth!r} must be > 1")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff={backoff!r} must be in (0, 1)")
        if int(interval) < 1:
            raise ValueError(f"interval={interval!r} must be >= 1")
        if not 0 < min <= max:
            raise ValueError(f"min={min!r} and max={max!r} must satisfy 0 < min <= max")
        super().__init__(init)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.min, self.max = float(min), float(max)
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff, self.min)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.interval:
                self.scale = min(self.scale * self.growth, self.max)
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))


def make_loss_scale(spec: str | LossScale | None) -> LossScale:
    """From a policy's ``ls=`` spec: none, static:S, dynamic[:init=..,growth=..,...]."""
    if isinstance(spec, LossScale):
        return spec
    if spec is None or spec == "none":
        return NoLossScale()
    kind, _, args = spec.partition(":")
    if kind == "static":
        return StaticLossScale(float(args))
    if kind == "dynamic":
        kwargs = {}
        for item in filter(None, args.split(",")):
            key, _, val = item.partition("=")
            kwargs[key] = int(float(val)) if key == "interval" else float(val)
        return DynamicLossScale(**kwargs)
    raise ValueError(f"loss scale {spec!r}; accepted: none, static:S, dynamic[:init=..]")


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


def gradient_magnitudes(model: torch.nn.Module, batch, loss_fn) -> torch.Tensor:
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
        with fresh_grads(model):
            loss = loss_fn(model(inputs), targets)
            loss.float().backward()
            grads += [p.grad.detach().abs().flatten().float() for p in model.parameters()
                      if p.grad is not None]
    finally:
        for h in handles:
            h.remove()
    return torch.cat(grads) if grads else torch.zeros(0)


def find_loss_scale(model: torch.nn.Module, batch, loss_fn, fmt: str | Format = "fp16", *,
                    headroom: float = 2.0**3, max_scale: float = 2.0**24) -> LossScaleChoice:
    """Pick the largest power-of-two loss scale that keeps the largest scaled gradient at least
    ``headroom`` below ``fmt.max``; report the underflow fractions at 1 and at that scale.

    A gradient value g underflows when |g| * S rounds to zero in ``fmt`` (below half of its
    smallest subnormal); it overflows when |g| * S exceeds ``fmt.max``.
    """
    fmt = parse_format(fmt)
    mags = gradient_magnitudes(model, batch, loss_fn).double()
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
