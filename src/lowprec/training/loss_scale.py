"""Loss scaling behind one interface: no scaling, a static scale, a dynamic scale.

Micikevicius et al. (2018): fp16 gradients are often below fp16's smallest subnormal (2**-24) and
flush to zero; multiplying the loss by S shifts every gradient up by S before it is stored, and
the optimizer divides by S in fp32. Too large an S overflows (Inf/NaN); too small leaves values
underflowing. ``DynamicLossScale`` follows torch.amp.GradScaler: halve on a non-finite gradient
and skip that step, double after ``interval`` clean steps.
"""

from __future__ import annotations

import math



__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "make_loss_scale"]


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
