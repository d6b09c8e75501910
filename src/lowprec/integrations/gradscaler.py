"""``GradScaler``: ``torch.amp.GradScaler``'s interface over a lowprec :class:`Precision`.

Code written for torch.amp runs unchanged but for the constructor::

    scaler = lowprec.integrations.GradScaler("16-true")     # was torch.amp.GradScaler("cuda")
    model, optimizer = scaler.setup(model, optimizer)        # fp16 parameters (or model.half())
    for x, y in loader:
        optimizer.zero_grad()
        scaler.scale(loss_fn(model(x), y)).backward()
        scaler.unscale_(optimizer)                           # optional: clip unscaled gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

torch's GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients", pytorch#74739):
unscaling in fp16 flushes gradients below 2**-24 to zero. This one accepts them: without
``unscale_`` the gradients stay scaled and lowprec's optimizers (and the wrapper of torch's) take
``1 / scale`` into their fp32 arithmetic; with ``unscale_`` they are unscaled in place, in their
own dtype, as clipping needs. The scale follows torch's rule (Micikevicius et al. 2018): halve
and skip the step on Inf/NaN, multiply by ``growth_factor`` after ``growth_interval`` clean
steps; ``state_dict`` uses torch's keys, so checkpoints load either way.
"""

from __future__ import annotations

import math

import torch

from ..training.loss_scale import DynamicLossScale
from ..training.policy import Policy
from ..training.precision import Precision

__all__ = ["GradScaler"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _positive_finite(name: str, value) -> float:
    """``value`` as a float if it is a positive finite number (or a 1-element tensor of one)."""
    if torch.is_tensor(value):
        if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
            raise ValueError(f"{name} must be a positive finite float or a 1-element floating "
                             f"tensor without grad, got a tensor of shape {tuple(value.shape)}, "
                             f"dtype {value.dtype}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r:.40} must be a positive finite float")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a positive finite float")
    return float(value)


def _growth_factor(value) -> float:
    v = _positive_finite("growth_factor", value)
    if not v > 1.0:
        raise ValueError(f"growth_factor={value!r} must be > 1.0 (as torch.amp.GradScaler)")
    return v


def _backoff_factor(value) -> float:
    v = _positive_finite("backoff_factor", value)
    if not v < 1.0:
        raise ValueError(f"backoff_factor={value!r} must be in (0, 1) (as "
                         "torch.amp.GradScaler)")
    return v


def _growth_interval(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"growth_interval={value!r:.40} must be a positive int (as "
                         "torch.amp.GradScaler)")
    return int(value)


class GradScaler:
    """See the module docstring. ``precision``: a policy name or spec (a :class:`Precision`
    is built with this scaler's dynamic loss scale), or a :class:`Precision`. The scale
    arguments follow torch.amp.GradScaler (defaults ``init_scale=2.0**16``,
    ``growth_factor=2.0``, ``backoff_factor=0.5``, ``growth_interval=2000``) and are checked as
    torch checks them (growth > 1, backoff in (0, 1), a positive int interval, a positive
    finite init). With a Precision, those given set its dynamic loss scale (the scale starts
    at ``init_scale``, within the policy's ``[min, max]``); a Precision without a dynamic loss
    scale refuses them (its policy has ``ls=none`` or ``ls=static:S``)."""

    def __init__(self, precision: str | Policy | Precision = "32-true", *,
                 init_scale: float | None = None, growth_factor: float | None = None,
                 backoff_factor: float | None = None, growth_interval: int | None = None,
                 enabled: bool = True) -> None:
        given = {k: v for k, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                                   ("backoff_factor", backoff_factor),
                                   ("growth_interval", growth_interval)) if v is not None}
        init = _positive_finite("init_scale", given.get("init_scale", 2.0**16))
        growth = _growth_factor(given.get("growth_factor", 2.0))
        backoff = _backoff_factor(given.get("backoff_factor", 0.5))
        interval = _growth_interval(given.get("growth_interval", 2000))
        if isinstance(precision, Precision):
            ls = precision.loss_scale
            if given and not isinstance(ls, DynamicLossScale):
                raise ValueError(
                    f"{', '.join(given)} given, but {precision.policy} has loss scale "
                    f"{precision.policy.loss_scale}, not dynamic: give the policy "
                    "ls=dynamic[:init=...] or leave the scale arguments out")
            if given:
                if not ls.min <= init <= ls.max:
                    raise ValueError(f"init_scale={init:g} is outside the loss scale's [min, max]"
                                     f" = [{ls.min:g}, {ls.max:g}] of {precision.policy}")
                if "init_scale" in given:
                    ls.scale = init
                if "growth_factor" in given:
                    ls.growth = growth
                if "backoff_factor" in given:
                    ls.backoff = backoff
                if "growth_interval" in given:
                    ls.interval = interval
            self.precision = precision
        elif isinstance(precision, (str, Policy)):
            # torch's scale has no floor and no ceiling but fp32's own range
            finfo = torch.finfo(torch.float32)
            self.precision = Precision(precision, loss_scale=DynamicLossScale(
                init, growth, backoff, interval, min=finfo.tiny, max=finfo.max))
        else:
            raise TypeError(f"GradScaler takes a policy name, spec, Policy or Precision, got "
                            f"{type(precision).__name__}")
        self._enabled = bool(enabled)
        self._stage: dict[int, str] = {}
        self._found: dict[int, bool] = {}

    # -- set-up ------------------------------------------------------------------------------
    def setup(self, model, optimizer=None):
        """``self.precision.setup``: convert the model, configure or wrap the optimizer."""
        return self.precision.setup(model, optimizer)

    def is_enabled(self) -> bool:
        return self._enabled

    # -- the loop ----------------------------------------------------------------------------
    def scale(self, outputs):
        """``outputs`` (a tensor or a nested list/tuple of them) times the scale, in fp32."""
        if not self._enabled:
            return outputs
        s = self.precision.loss_scale.scale
        if torch.is_tensor(outputs):
            return outputs.float() * s
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"scale() takes a tensor or a list/tuple of tensors, got "
                        f"{type(outputs).__name__}")

    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record Inf/NaN; at most
        once per optimizer between two ``update()`` calls, and before ``step``."""
        if not self._enabled:
            return
        stage = self._stage.get(id(optimizer), _READY)
        if stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._found[id(optimizer)] = self.precision.unscale_(optimizer)
        self._stage[id(optimizer)] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """Unscale (unless ``unscale_`` did), step unless a gradient holds Inf/NaN. A closure is
        refused, as torch's scaler refuses it (``None`` is accepted: accelerate passes it)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        closure = kwargs.pop("closure", args[0] if args else None)
        if closure is not None or kwargs or len(args) > 1:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        if self._stage.get(id(optimizer), _READY) == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        n = len(self.precision.trace)
        self.precision.step(optimizer, update=False)
        if len(self.precision.trace) > n:
            self._found[id(optimizer)] = self.precision.trace[-1]["found_inf"]
        self._stage[id(optimizer)] = _STEPPED
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off if any optimizer stepped since the last update saw Inf/NaN, else count a
        clean step (growing the scale every ``growth_interval``); or set ``new_scale``."""
        if not self._enabled:
            return
        ls = self.precision.loss_scale
        if new_scale is not None:
            v = _positive_finite("new_scale", new_scale)
            if isinstance(ls, DynamicLossScale) and not ls.min <= v <= ls.max:
                raise ValueError(f"new_scale={v:g} is outside the loss scale's [min, max] = "
                                 f"[{ls.min:g}, {ls.max:g}]")
            ls.scale = v
        else:
            if not self._found:
                raise RuntimeError("No inf checks were recorded prior to update().")
            ls.update(any(self._found.values()))
        self._stage.clear()
        self._found.clear()

    # -- scale and state ---------------------------------------------------------------------
    def get_scale(self) -> float:
        return float(self.precision.loss_scale.scale) if self._enabled else 1.0

    def _dynamic(self) -> DynamicLossScale:
        ls = self.precision.loss_scale
        if not isinstance(ls, DynamicLossScale):
            raise TypeError(f"this scaler's loss scale is {ls!r}, not dynamic")
        return ls

    def get_growth_factor(self) -> float:
        return self._dynamic().growth

    def set_growth_factor(self, new_factor: float) -> None:
        ls = self._dynamic()
        ls.growth = _growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._dynamic().backoff

    def set_backoff_factor(self, new_factor: float) -> None:
        ls = self._dynamic()
        ls.backoff = _backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._dynamic().interval

    def set_growth_interval(self, new_interval: int) -> None:
        ls = self._dynamic()
        ls.interval = _growth_interval(new_interval)

    def state_dict(self) -> dict:
        """torch.amp.GradScaler's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus the Precision's state under
        ``lowprec``; empty when disabled, as torch's."""
        if not self._enabled:
            return {}
        ls = self.precision.loss_scale
        out = {"scale": float(ls.scale)}
        if isinstance(ls, DynamicLossScale):
            out.update(growth_factor=ls.growth, backoff_factor=ls.backoff,
                       growth_interval=ls.interval, _growth_tracker=ls.good_steps)
        out["lowprec"] = self.precision.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this scaler's or torch.amp.GradScaler's state."""
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict() takes a dict from state_dict(), got "
                            f"{type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        if not isinstance(state_dict, dict) or "scale" not in state_dict:
            raise ValueError("not a GradScaler state_dict: it needs a 'scale' (keys given: "
                             f"{', '.join(map(str, list(state_dict)[:8]))})")
        # checked before anything changes: torch's keys as torch's constructor checks them
        ls = self.precision.loss_scale
        scale = _positive_finite("scale", state_dict["scale"])
        dyn: dict = {}
        if isinstance(ls, DynamicLossScale):
            dyn["growth"] = _growth_factor(state_dict.get("growth_factor", ls.growth))
            dyn["backoff"] = _backoff_factor(state_dict.get("backoff_factor", ls.backoff))
            dyn["interval"] = _growth_interval(state_dict.get("growth_interval", ls.interval))
            tracker = state_dict.get("_growth_tracker", ls.good_steps)
            if torch.is_tensor(tracker) and tracker.numel() == 1:
                tracker = tracker.item()
            if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
                raise ValueError(f"_growth_tracker={tracker!r:.40} must be an int >= 0")
            dyn["good_steps"] = tracker
            if not ls.min <= scale <= ls.max:
                raise ValueError(f"scale={scale:g} is outside the loss scale's [min, max] = "
                                 f"[{ls.min:g}, {ls.max:g}]")
        if "lowprec" in state_dict:
            self.precision.load_state_dict(state_dict["lowprec"])
        ls.scale = scale
        for k, v in dyn.items():
            setattr(ls, k, v)

    def __repr__(self) -> str:
        return f"GradScaler({self.precision.policy}, scale={self.get_scale():g})"
