"""Training under a policy: the policy as data, loss scaling, ``Precision`` (the one object a
training loop uses), the emulation engine, optimizers with low-precision storage, the memory
ledger and the regimes of the literature."""

from . import optim
from .loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale, make_loss_scale
from .memory import MemoryLedger, measure_memory
from .policy import POLICIES, Policy, parse_policy, register_policy
from .precision import Precision
from .regimes import binary, dynamic_fixed

__all__ = [
    "optim", "binary", "dynamic_fixed",
    "DynamicLossScale", "LossScale", "NoLossScale", "StaticLossScale", "make_loss_scale",
    "MemoryLedger", "measure_memory",
    "POLICIES", "Policy", "parse_policy", "register_policy",
    "Precision",
]
