"""Loss scaling behind one interface: no scaling, a static scale, a dynamic scale.

Micikevicius et al. (2018): fp16 gradients are often below fp16's smallest subnormal (2**-24) and
flush to zero; multiplying the loss by S shifts every gradient up by S before it is stored, and
the optimizer divides by S in fp32. Too large an S overflows (Inf/NaN); too small leaves values
underflowing. ``DynamicLossScale`` follows torch.amp.GradScaler: halve on a non-finite gradient
and skip that step, double after ``interval`` clean steps.

The scale is a float32 value, as torch.amp.GradScaler keeps it (``_scale``, a float32 tensor):
every scale set or computed is rounded to float32, and growth and backoff follow torch's
``_amp_update_scale_`` kernel (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp): the product
``scale * factor`` taken in double and rounded to float32, a grown scale that rounds to Inf not
applied. A Python double would differ from torch's scale after a few steps of a growth factor
that is not a power of two, and at the top of float32's range (2**127 * 2 is Inf in float32).
"""

from __future__ import annotations

import math
import re

import torch
from torch import is_tensor as torch_is_tensor

__all__ = ["LossScale", "NoLossScale", "StaticLossScale", "DynamicLossScale", "make_loss_scale",
           "parse_loss_scale", "loss_scale_spec", "to_f32", "LOSS_SCALE_GRAMMAR",
           "DYNAMIC_OPTIONS"]

#: Options of a dynamic scale, in the canonical order of a spec.
DYNAMIC_OPTIONS = ("init", "growth", "backoff", "interval", "min", "max")
#: The ``ls=`` grammar, as error messages and the policy docstring give it.
LOSS_SCALE_GRAMMAR = ("none, static:S (S > 0), dynamic, or dynamic:OPT=V;OPT=V... with OPT in "
                      "init (> 0), growth (> 1), backoff (in (0, 1)), interval (integer >= 1), "
                      "min, max (0 < min <= init <= max; defaults 1 and 2**24, widened to hold "
                      "init), each once, "
                      "e.g. dynamic:init=1024;growth=4")


_F32_MAX = torch.finfo(torch.float32).max


def to_f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as a Python float; Inf beyond
    float32's range (C++'s ``static_cast<float>`` of a double, which torch's kernel does)."""
    return torch.tensor(float(value), dtype=torch.float64).float().item()


def _short(spec: str, limit: int = 60) -> str:
    """A long spec cut in the middle, so that an error message stays one bounded line."""
    s = repr(spec)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(spec)} chars)"


# a plain ASCII decimal (float() also takes "1_000" and non-ASCII digits: refused here)
_NUMBER_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?$|^[+-]?(?:inf|nan)$", re.ASCII)


def _number(spec: str, key: str, val: str) -> float:
    try:
        if not _NUMBER_RE.match(val.strip()):
            raise ValueError(val)
        v = float(val)
    except ValueError:
        raise ValueError(f"loss scale {_short(spec)}: {key}={_short(val, 30)} is not a number; "
                         f"accepted: {LOSS_SCALE_GRAMMAR}") from None
    if not math.isfinite(v):
        raise ValueError(f"loss scale {_short(spec)}: {key}={_short(val, 30)} must be finite; "
                         "accepted: "
                         f"{LOSS_SCALE_GRAMMAR}")
    return v


def parse_loss_scale(spec: str) -> tuple[str, dict]:
    """Read and validate a loss-scale spec: ``(kind, options)`` with kind none, static or dynamic.

    Grammar: ``none`` | ``static:S`` | ``dynamic[:OPT=V;OPT=V...]`` (a ``,`` may stand for ``;``
    where the spec is not inside a comma-separated policy). Every value is checked here, so a bad
    one is refused when a policy is parsed, not in the middle of training.
    """
    if not isinstance(spec, str):
        raise TypeError(f"a loss scale spec must be a str, got {type(spec).__name__}")
    s = spec.strip().lower()
    kind, sep, args = s.partition(":")
    if kind not in ("none", "static", "dynamic"):
        raise ValueError(f"loss scale {_short(spec)}; accepted: {LOSS_SCALE_GRAMMAR}")
    if kind == "none":
        if sep:
            raise ValueError(f"loss scale {_short(spec)}: 'none' takes no options")
        return "none", {}
    if kind == "static":
        scale = _number(spec, "static", args) if args else 0.0
        if not scale > 0:
            raise ValueError(f"loss scale {_short(spec)}: static needs a positive finite scale, "
                             "e.g. static:1024")
        return "static", {"scale": scale}
    opts: dict = {}
    for item in filter(None, (i.strip() for i in args.replace(",", ";").split(";"))):
        key, eq, val = item.partition("=")
        if key not in DYNAMIC_OPTIONS or not eq:
            raise ValueError(f"loss scale {_short(spec)}: unknown option {_short(item, 30)}; "
                             f"accepted: {LOSS_SCALE_GRAMMAR}")
        if key in opts:
            raise ValueError(f"loss scale {_short(spec)}: {key} given twice")
        v = _number(spec, key, val)
        if key == "interval":
            if v != int(v) or v < 1:
                raise ValueError(f"loss scale {_short(spec)}: interval={val} must be an integer "
                                 ">= 1")
            v = int(v)
        opts[key] = v
    try:
        DynamicLossScale(**opts)  # the ranges: init > 0, growth > 1, 0 < backoff < 1, ...
    except ValueError as err:
        raise ValueError(f"loss scale {_short(spec)}: {err}; accepted: {LOSS_SCALE_GRAMMAR}"
                         ) from None
    return "dynamic", opts


def loss_scale_spec(kind: str, opts: dict) -> str:
    """The canonical spec of a parsed loss scale: ``parse_loss_scale`` gives the same back."""
    if kind == "static":
        return f"static:{opts['scale']:g}"
    if kind == "dynamic" and opts:
        return "dynamic:" + ";".join(f"{k}={opts[k]:g}" for k in DYNAMIC_OPTIONS if k in opts)
    return kind


class LossScale:
    """Interface: ``scale`` multiplies the loss; ``update(found_inf)`` after each step attempt;
    ``skips_nonfinite`` says whether a step with Inf/NaN gradients is skipped."""

    skips_nonfinite = True

    def __init__(self, scale: float) -> None:
        self.scale = scale

    @property
    def scale(self) -> float:
        """The scale, a float32 value (as torch's GradScaler holds it)."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = to_f32(value)

    def update(self, found_inf: bool) -> None:  # pragma: no cover - overridden
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def _checked_scale(self, state) -> float:
        """``state["scale"]`` if it is a positive finite number this scale can hold; else
        ValueError (a NaN, Inf, zero or negative scale would skip or corrupt every step)."""
        if not isinstance(state, dict) or "scale" not in state:
            raise ValueError(f"a loss-scale state must be a dict with a 'scale', got "
                             f"{_short(repr(state), 60)}")
        v = state["scale"]
        if torch_is_tensor(v) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not v > 0 or not 0 < to_f32(v) < math.inf:
            raise ValueError(f"loss-scale state: scale={v!r:.40} must be a positive "
                             "finite number within float32's range")
        return to_f32(v)

    def load_state_dict(self, state: dict) -> None:
        self.scale = self._checked_scale(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale:g})"


class NoLossScale(LossScale):
    """Scale 1; steps are never skipped (plain training: Inf/NaN reach the parameters)."""

    skips_nonfinite = False

    def __init__(self) -> None:
        super().__init__(1.0)

    def update(self, found_inf: bool) -> None:
        pass

    def load_state_dict(self, state: dict) -> None:
        if self._checked_scale(state) != 1.0:
            raise ValueError(f"loss-scale state: scale={state['scale']!r}, but this loss scale "
                             "is none (always 1)")


class StaticLossScale(LossScale):
    """A fixed scale; a step whose gradients hold Inf/NaN is skipped and counted."""

    def __init__(self, scale: float) -> None:
        if not scale > 0 or not math.isfinite(scale) or not 0 < to_f32(scale) < math.inf:
            raise ValueError(f"scale={scale!r} must be a positive finite number within "
                             "float32's range")
        super().__init__(scale)

    def update(self, found_inf: bool) -> None:
        pass


class DynamicLossScale(LossScale):
    def __init__(self, init: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000, min: float | None = None, max: float | None = None
                 ) -> None:
        # bounds not given default to 1 and 2**24, widened to hold init (init=2**30 alone
        # starts there and backs off, as torch's scaler would); given bounds must hold it
        if min is None:
            min = 1.0 if not (isinstance(init, (int, float)) and 0 < init < 1) else init
        if max is None:
            max = 2.0**24 if not (isinstance(init, (int, float)) and math.isfinite(init)
                                  and init > 2.0**24) else init
        for name, v in (("init", init), ("growth", growth), ("backoff", backoff), ("min", min),
                        ("max", max)):
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name}={v!r} must be a finite number")
        if not init > 0:
            raise ValueError(f"init={init!r} must be positive")
        for name, v in (("init", init), ("min", min), ("max", max)):
            if v > _F32_MAX or 0 < v and to_f32(v) == 0:
                raise ValueError(f"{name}={v!r} is outside float32's range (the scale is a "
                                 "float32, as torch.amp.GradScaler's)")
        if not growth > 1:
            raise ValueError(f"growth={growth!r} must be > 1")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff={backoff!r} must be in (0, 1)")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval={interval!r} must be an integer >= 1")
        if not 0 < min <= max:
            raise ValueError(f"min={min!r} and max={max!r} must satisfy 0 < min <= max")
        if not min <= init <= max:
            # the scale would start outside the range update() keeps it in, and stay there
            # until the first clamp (init=5 with max=1 would hold 5 for a whole clean run)
            raise ValueError(f"init={init!r} must be in [min, max] = [{min:g}, {max:g}]")
        super().__init__(init)
        self.growth, self.backoff, self.interval = float(growth), float(backoff), int(interval)
        self.min, self.max = to_f32(min), to_f32(max)
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        """torch's ``_amp_update_scale_``: the product in double, rounded to float32 (the
        ``scale`` setter); a grown scale that is Inf in float32 is not applied. Then the
        bounds: ``min`` (torch has none: its scale can back off to subnormals and 0) and
        ``max``."""
        if found_inf:
            self.scale = max(to_f32(self.scale * self.backoff), self.min)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.interval:  # >=: the interval may have been lowered
                grown = to_f32(self.scale * self.growth)
                if math.isfinite(grown):
                    self.scale = min(grown, self.max)
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        scale = self._checked_scale(state)
        if not self.min <= scale <= self.max:
            raise ValueError(f"loss-scale state: scale={scale:g} is outside this dynamic "
                             f"scale's [min, max] = [{self.min:g}, {self.max:g}]")
        good = state.get("good_steps", 0)
        if torch_is_tensor(good) and good.numel() == 1:
            good = good.item()
        if isinstance(good, bool) or not isinstance(good, (int, float)) \
                or not math.isfinite(good) or good < 0 or good != int(good):
            raise ValueError(f"loss-scale state: good_steps={good!r:.40} must be an "
                             "integer >= 0")
        self.scale, self.good_steps = scale, int(good)


def make_loss_scale(spec: str | LossScale | None) -> LossScale:
    """From a policy's ``ls=`` spec (see :func:`parse_loss_scale`): none, static:S,
    dynamic[:init=V;growth=V;...]."""
    if isinstance(spec, LossScale):
        return spec
    if spec is None:
        return NoLossScale()
    kind, opts = parse_loss_scale(spec)
    if kind == "static":
        return StaticLossScale(opts["scale"])
    if kind == "dynamic":
        return DynamicLossScale(**opts)
    return NoLossScale()
