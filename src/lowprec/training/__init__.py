"""Training under a policy: the policy as data, loss scaling, ``Precision`` (the one object a
training loop uses), the emulation engine, optimizers with low-precision storage, the memory
ledger and the regimes of the literature."""

from . import optim
from .loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale, make_loss_scale
from .memory import MemoryLedger, measure_memory
from .policy import POLICIES, Backend, Policy, Scope, WriteBack, parse_policy, register_policy
from .precision import Precision
from . import regimes
from .regimes import Regime, binary, dynamic_fixed, register_regime

__all__ = [
    "optim", "regimes", "binary", "dynamic_fixed", "Regime", "register_regime",
    "DynamicLossScale", "LossScale", "NoLossScale", "StaticLossScale", "make_loss_scale",
    "MemoryLedger", "measure_memory",
    "POLICIES", "Policy", "parse_policy", "register_policy", "WriteBack", "Backend", "Scope",
    "Precision",
]
