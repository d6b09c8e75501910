"""Scaled GEMMs as a regime: the amax history of delayed scaling, saved with Precision.

A policy with ``sc=`` (:mod:`lowprec.training.scaling`) needs no model transformation: the
emulation engine runs its GEMMs (:mod:`lowprec.training.emulation.scaled`). What it needs from
``Precision`` is state: delayed scaling computes each operand's scale from the amaxes of its
previous casts. This regime owns that :class:`lowprec.numerics.scaling.AmaxHistory`, binds it to
the model at set-up and saves it in ``Precision.state_dict()["regimes"]["scaled"]``, so that a
resumed run scales as the uninterrupted one does.
"""

from __future__ import annotations

import torch
from torch import nn

from ...numerics.scaling import AmaxHistory
from ..emulation.scaled import bind_history
from .base import Regime, register_regime

__all__ = ["ScaledRegime"]


@register_regime
class ScaledRegime(Regime):
    """The state of a policy's scaled GEMMs (the delayed casts' amax history)."""

    name = "scaled"

    def __init__(self, policy, generator: torch.Generator | None = None) -> None:
        super().__init__(policy, generator)
        self.history = AmaxHistory()

    @classmethod
    def applies(cls, policy) -> bool:
        return getattr(policy, "scaled", None) is not None

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        bind_history(model, self.history)
        return []

    def state_dict(self) -> dict:
        return {"amax_history": self.history.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "amax_history" not in state:
            raise ValueError(f"scaled regime state must be a dict with 'amax_history', got "
                             f"{state!r:.80}")
        self.history.load_state_dict(state["amax_history"])
