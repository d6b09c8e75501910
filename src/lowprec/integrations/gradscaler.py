"""``GradScaler``: ``torch.amp.GradScaler``'s interface over a lowprec :class:`Precision`.

Code written for torch.amp runs with the import changed: ``GradScaler("cuda")`` (torch's
signature: ``device, init_scale, growth_factor, backoff_factor, growth_interval, enabled``) is
torch's scaler over the user's own ``torch.autocast``. A lowprec policy is one keyword more::

    scaler = lowprec.integrations.GradScaler("cuda", policy="16-true")  # torch: GradScaler("cuda")
    model, optimizer = scaler.setup(model, optimizer)        # fp16 parameters (or model.half())
    for x, y in loader:
        optimizer.zero_grad()
        with scaler.autocast():                              # torch: torch.autocast("cuda", ...)
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
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
steps, the scale a float32 value computed as torch's kernel computes it (same values at
2**127 and with growth factors that are not powers of two; one difference: it never backs off
below float32's smallest normal, where torch's goes on to subnormals and 0); ``state_dict``
uses torch's keys, so checkpoints load either way.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ..training.caller import warn
from ..training.loss_scale import DynamicLossScale
from ..numerics.storage import storage_dtype
from ..training.policy import Policy, Scope
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


def _as_device(value) -> torch.device | None:
    """``value`` as a torch.device if it names one (``"cuda"``, ``"cpu"``, ``"cuda:1"``,
    ``"xpu"``, ``"mps"``, a torch.device), else None. No policy name or spec is a device
    string torch accepts, so a first positional argument is read unambiguously."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None



def _flag(name: str, value) -> bool:
    """A switch given as a bool (or numpy's): ``enabled="no"`` is truthy and would turn the
    scaler on, so anything else is refused, naming the value."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    raise TypeError(f"{name}={value!r} is not a bool; accepted: True, False")

class GradScaler:
    """See the module docstring. torch.amp.GradScaler's signature, same defaults and checks
    (growth > 1, backoff in (0, 1), a positive int interval, a positive finite init):
    ``device`` (``"cuda"``, ``"cpu"``... or a torch.device; recorded: the scaler works on the
    device the gradients are on, where torch's disables itself with a warning when CUDA is
    missing), ``init_scale=2.0**16``, ``growth_factor=2.0``,
    ``backoff_factor=0.5``, ``growth_interval=2000``, ``enabled=True``.

    ``policy``: a policy name or spec (a :class:`Precision` is built with this scaler's
    dynamic loss scale), a :class:`Policy` or a :class:`Precision`; ``"32-true"`` when not
    given, which is torch's scaler over the loop's own autocast. A policy string (or Policy,
    Precision) in first place, as earlier versions took it, is still read as the policy.
    With a Precision, the scale arguments given set its dynamic loss scale (the scale starts
    at ``init_scale``, within the policy's ``[min, max]``); a Precision without a dynamic loss
    scale refuses them (its policy has ``ls=none`` or ``ls=static:S``)."""

    def __init__(self, device: str | torch.device | None = "cuda",
                 init_scale: float | None = None, growth_factor: float | None = None,
                 backoff_factor: float | None = None, growth_interval: int | None = None,
                 enabled: bool = True, *, policy: str | Policy | Precision | None = None
                 ) -> None:
        dev = _as_device(device) if device is not None else torch.device("cuda")
        if dev is None:
            if not isinstance(device, (str, Policy, Precision)):
                raise TypeError(f"GradScaler's first argument is the device ('cuda', 'cpu', a "
                                f"torch.device) or a policy, got {type(device).__name__}")
            if policy is not None:
                raise TypeError(f"GradScaler got the policy twice: {device!r:.40} in first "
                                f"place and policy={policy!r:.40}; the first argument is the "
                                "device ('cuda', 'cpu')")
            policy, dev = device, None  # the earlier signature: GradScaler("16-true", ...)
        self.device = dev
        policy = "32-true" if policy is None else policy
        if isinstance(init_scale, (str, Policy, Precision)):
            raise TypeError(f"init_scale={init_scale!r:.40}: the policy is a keyword, "
                            f"GradScaler({str(device)!r}, policy={str(init_scale)!r})")
        given = {k: v for k, v in (("init_scale", init_scale), ("growth_factor", growth_factor),
                                   ("backoff_factor", backoff_factor),
                                   ("growth_interval", growth_interval)) if v is not None}
        init = _positive_finite("init_scale", given.get("init_scale", 2.0**16))
        growth = _growth_factor(given.get("growth_factor", 2.0))
        backoff = _backoff_factor(given.get("backoff_factor", 0.5))
        interval = _growth_interval(given.get("growth_interval", 2000))
        if isinstance(policy, Precision):
            precision = policy
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
        elif isinstance(policy, (str, Policy)):
            # torch's scale has no floor and no ceiling but fp32's own range
            finfo = torch.finfo(torch.float32)
            self.precision = Precision(policy, loss_scale=DynamicLossScale(
                init, growth, backoff, interval, min=finfo.tiny, max=finfo.max))
        else:
            raise TypeError(f"GradScaler's policy is a policy name, spec, Policy or Precision, "
                            f"got {type(policy).__name__}")
        self._enabled = _flag("enabled", enabled)
        self._stage: dict[int, str] = {}
        self._found: dict[int, bool] = {}
        self._warned_not_set_up = False

    # -- set-up ------------------------------------------------------------------------------
    def setup(self, model, optimizer=None):
        """``self.precision.setup``: convert the model, configure or wrap the optimizer."""
        return self.precision.setup(model, optimizer)

    def is_enabled(self) -> bool:
        return self._enabled

    def _check_set_up(self, what: str) -> None:
        """Warn (once per scaler) when a policy that is not fp32 drives a loop whose model was
        never given to ``setup``: nothing would run in the policy's formats."""
        prec = self.precision
        if self._warned_not_set_up or prec.model is not None or prec.policy.is_fp32:
            return
        self._warned_not_set_up = True
        warn(
            f"GradScaler.{what}() under policy {prec.policy}, but no model was set up: the "
            "model trains in fp32 with loss scaling only. Call model, optimizer = "
            "scaler.setup(model, optimizer) before the loop (or use policy='32-true' with "
            "your own torch.autocast)")

    # -- the loop ----------------------------------------------------------------------------
    def autocast(self, device_type: str | None = None, dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None):
        """The policy's autocast, used as ``torch.autocast`` is in a GradScaler loop::

            with scaler.autocast():            # or scaler.autocast("cuda", torch.float16)
                loss = loss_fn(model(x), y)

        Mixed policies (``16-mixed``...) compute matmul layers in the compute format inside it
        (torch.autocast on the native backend, the emulation's rounding otherwise); pure
        policies and fp32 have nothing to do there. torch.autocast's arguments are accepted:
        ``device_type`` and ``dtype``, if given, must agree with the set-up model's device and
        the policy's compute format (the policy says the format, not this call);
        ``enabled=False`` is a no-op context; ``cache_enabled`` is ignored."""
        prec = self.precision
        if not _flag("enabled", enabled):
            return nullcontext()
        if device_type is not None:
            if not isinstance(device_type, str):
                raise TypeError(f"device_type={device_type!r:.40} must be a str such as "
                                "'cuda' or 'cpu', as torch.autocast takes it")
            if prec.device is not None and torch.device(device_type).type != prec.device.type:
                raise ValueError(f"autocast(device_type={device_type!r}) but the model set up "
                                 f"by this scaler is on {prec.device.type}")
        pol = prec.policy
        compute = pol.compute if pol.scope is Scope.MATMUL else pol.params
        if dtype is not None and dtype != storage_dtype(compute):
            raise ValueError(f"autocast(dtype={dtype}) but this scaler's policy {pol} computes "
                             f"in {compute}: the policy names the format (GradScaler(..., "
                             "policy=...))")
        self._check_set_up("autocast")
        if prec.model is None:
            return nullcontext()
        return prec.autocast()

    def scale(self, outputs):
        """``outputs`` (a tensor or a nested list/tuple of them) times the scale, in fp32."""
        if not self._enabled:
            return outputs
        self._check_set_up("scale")
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
        self._check_set_up("step")
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
        dev = "" if self.device is None else f"{str(self.device)!r}, "
        return (f"GradScaler({dev}policy={str(self.precision.policy)!r}, "
                f"scale={self.get_scale():g}, enabled={self._enabled})")
