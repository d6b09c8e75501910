"""The state of dynamic fixed point: one range per group of tensors, moved by overflow rates.

Courbariaux, Bengio and David (2014), "Training deep neural networks with low precision
multiplications": each group (a layer's activations, its gradients, its weights, its biases,
their gradients, the momentum) has a range r, values living in [-2**r, 2**r) on a grid of
2**(r + 1 - bits). At every observation the controller counts the values at or beyond 2**r
(the overflow rate at the current range) and at or beyond 2**(r - 1) (the rate range - 1 would
have); every ``interval`` observations: if the first rate exceeds ``max_overflow`` the range grows
by one, else if the second does the range stays, else it shrinks by one (their code's rule).
A group's first observation starts it at the smallest range holding its largest value.

Groups are named by a :class:`~lowprec.training.regimes.base.GroupKey` (a role and a parameter
or layer name). :class:`DynamicFixedRegime` plugs the controller into ``Precision``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from ...numerics.formats import DynamicFixedFormat, FixedFormat, Format
from .base import GroupKey, Regime, register_regime

__all__ = ["Controller", "resolve", "DynamicFixedRegime"]


class Controller:
    """The ranges of the groups, keyed by :class:`GroupKey` (any hashable key works)."""

    def __init__(self) -> None:
        self.groups: dict[Hashable, dict] = {}

    @staticmethod
    def _clamp(r: int, fmt: DynamicFixedFormat) -> int:
        # frac bits = bits - r - 1 must stay in [0, 149] (the grid must be a float32 value) and
        # the integer bits r + 1 at or above -126 (FixedFormat's range): a group that only ever
        # sees zeros (an all-zero initial LSTM state) shrinks to that floor and stays there
        return max(min(r, fmt.bits - 1), fmt.bits - 150, -127)

    def range_of(self, key: Hashable) -> int | None:
        g = self.groups.get(key)
        return None if g is None else g["range"]

    def observe(self, key: Hashable, fmt: DynamicFixedFormat, over: int, over1: int, n: int) -> None:
        """Record counts (for the tests and callers that count themselves) and apply the rule."""
        g = self.groups[key]
        g["over"] += over
        g["over1"] += over1
        g["n"] += n
        g["calls"] += 1
        if g["calls"] % fmt.interval == 0:
            r = g["over"] / g["n"] if g["n"] else 0.0
            r1 = g["over1"] / g["n"] if g["n"] else 0.0
            if r > fmt.max_overflow:
                g["range"] = self._clamp(g["range"] + 1, fmt)
            elif r1 > fmt.max_overflow:
                pass
            else:
                g["range"] = self._clamp(g["range"] - 1, fmt)
            g["over"] = g["over1"] = g["n"] = 0

    def start(self, key: Hashable, fmt: DynamicFixedFormat, x: torch.Tensor | None = None,
              range_: int | None = None) -> None:
        if range_ is None:
            amax = float(x.detach().abs().max()) if x is not None and x.numel() else 0.0
            range_ = (math.floor(math.log2(amax)) + 1) if amax > 0 and math.isfinite(amax) else 0
        self.groups[key] = {"range": self._clamp(range_, fmt), "over": 0, "over1": 0, "n": 0,
                            "calls": 0}

    @torch.no_grad()
    def format(self, key: Hashable, fmt: DynamicFixedFormat, x: torch.Tensor) -> FixedFormat:
        """The static format to round ``x`` with now; counts ``x``'s overflows for the rule."""
        if key not in self.groups:
            self.start(key, fmt, x)
        r = self.groups[key]["range"]
        bound = 2.0**r
        over, over1 = _count(x.detach(), bound, bound / 2)
        self.observe(key, fmt, over, over1, x.numel())
        return fmt.at_range(r)

    def state_dict(self) -> dict:
        return {k: dict(v) for k, v in self.groups.items()}

    _FIELDS = ("range", "over", "over1", "n", "calls")

    def load_state_dict(self, state: dict) -> None:
        """The ranges of :meth:`state_dict`; ValueError (nothing changed) when a group's entry
        is not five integers (counts >= 0): a NaN range would break every later rounding."""
        if not isinstance(state, dict):
            raise ValueError(f"dynamic fixed-point state must be a dict of groups, got "
                             f"{type(state).__name__}")
        for key, g in state.items():
            if not isinstance(g, dict) or set(g) != set(self._FIELDS):
                raise ValueError(f"dynamic fixed-point state of group {key!r}: expected the "
                                 f"fields {', '.join(self._FIELDS)}, got {g!r:.80}")
            for name in self._FIELDS:
                v = g[name]
                if isinstance(v, bool) or not isinstance(v, int) or (name != "range" and v < 0):
                    raise ValueError(f"dynamic fixed-point state of group {key!r}: {name}="
                                     f"{v!r:.40} must be an integer" +
                                     ("" if name == "range" else " >= 0"))
        self.groups = {k: dict(v) for k, v in state.items()}


def _count(x: torch.Tensor, t1: float, t2: float) -> tuple[int, int]:
    from ...numerics import kernel as _kernel

    if x.device.type == "cpu" and x.dtype == torch.float32 and _kernel.available():
        return _kernel.count_abs_ge(x.contiguous(), t1, t2)
    a = x.abs()
    return int((a >= t1).sum()), int((a >= t2).sum())


def resolve(fmt: Format, key: GroupKey, x: torch.Tensor, controller: Controller | None) -> Format:
    """``fmt`` itself, or for dynamic fixed point the static format its group has now."""
    if isinstance(fmt, DynamicFixedFormat):
        if controller is None:
            raise ValueError(f"{fmt} needs a dynamic fixed-point Controller (use Precision)")
        return controller.format(key, fmt, x)
    return fmt


def _roles(policy) -> list:
    return [policy.params, policy.compute, policy.grads, policy.optimizer_state, policy.master]


@register_regime
class DynamicFixedRegime(Regime):
    """Dynamic fixed point in any role: one :class:`Controller` for the emulation engine, the
    optimizers' storage and Precision's gradient rounding; its ranges are the regime's state."""

    name = "dynamic_fixed"

    def __init__(self, policy, generator: torch.Generator | None = None) -> None:
        super().__init__(policy, generator)
        self.controller = Controller()

    @classmethod
    def applies(cls, policy) -> bool:
        return any(isinstance(f, DynamicFixedFormat) for f in _roles(policy))

    def resolve(self, fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
        return resolve(fmt, key, x, self.controller)

    def state_dict(self) -> dict:
        return {"ranges": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "ranges" not in state:
            raise ValueError(f"dynamic fixed-point regime state must be a dict with 'ranges', "
                             f"got {state!r:.80}")
        self.controller.load_state_dict(state["ranges"])
