"""Regimes of the literature that need more than formats, as plug-ins of ``Precision``:
BinaryNet (a model transformation), dynamic fixed point (ranges that move with overflow
rates) and scaled GEMMs (the amax history of delayed scaling). :mod:`.base` holds the interface, the registry and the typed group keys."""

from . import base, binary, dynamic_fixed, scaled
from .base import (REGIMES, GroupKey, Regime, Resolve, Role, regimes_for, regimes_resolve,
                   register_regime, static_resolve)

__all__ = ["base", "binary", "dynamic_fixed", "scaled", "Regime", "REGIMES", "register_regime",
           "regimes_for", "GroupKey", "Role", "Resolve", "static_resolve", "regimes_resolve"]
