"""The rules the engine's ops follow: a module's formats (:class:`Rule`, from its policy or a
per-module override), the dynamic fixed-point group of a rounding, and whose 16-bit kernels an
emulation follows where a CPU's and CUDA's round differently (``target``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...numerics.accumulation import Accumulator
from ...numerics.formats import FP32, BlockFormat, Format
from ...numerics.rounding import Rounding
from ..policy import Policy, policy_or_format
from ..regimes.base import GroupKey, Role
from ..scaling import GemmScaling

__all__ = ["TARGETS", "check_target", "group_key", "Rule", "parse_override"]

#: the kernels an emulation can follow where a CPU's 16-bit kernels and CUDA's round differently
TARGETS = ("cpu", "cuda")


def check_target(target, match_cpu_kernels: bool = False) -> str | None:
    """``target`` checked: "cpu", "cuda" or None (the device of the tensors)."""
    if target is not None and target not in TARGETS:
        raise ValueError(f"target={target!r:.40}; accepted: 'cpu', 'cuda' or None (the device "
                         "of the model's tensors)")
    if target == "cuda" and match_cpu_kernels:
        raise ValueError("target='cuda' with match_cpu_kernels=True: the second runs this "
                         "CPU's own 16-bit kernels; accepted: one or the other")
    return target


def group_key(role: str, name: str) -> GroupKey:
    """The dynamic fixed-point group of a rounding: one range per role ("act" or "grad") and
    module (or parameter, for a weight rounded when used)."""
    return GroupKey(Role.ACTIVATION if role == "act" else Role.GRAD, name)


@dataclass(frozen=True)
class Rule:
    """The formats the ops of one module follow."""

    compute: Format
    grads: Format
    params: Format
    rounding: Rounding = Rounding.NEAREST_EVEN
    grad_rounding: Rounding = Rounding.NEAREST_EVEN
    scope: str = "all"
    scaled: GemmScaling | None = None  # the GEMMs it covers run as scaled GEMMs (.scaled)
    accumulator: Accumulator | None = None  # GEMMs accumulate in it (numerics.accumulation)

    @classmethod
    def of(cls, policy: Policy) -> "Rule":
        return cls(policy.compute, policy.grads, policy.params, policy.rounding,
                   policy.grad_rounding, policy.scope, policy.scaled, policy.accumulator)

    @property
    def active(self) -> bool:
        return self.compute != FP32 or self.grads != FP32 or self.accumulator is not None

    @property
    def block(self) -> bool:
        return isinstance(self.compute, BlockFormat)


def parse_override(value, base: Policy) -> Rule:
    """An override is a policy (``"32-true"``, a spec) or a format (``"bf16"``: pure)."""
    if isinstance(value, Rule):
        return value
    if isinstance(value, Policy):
        return Rule.of(value)
    try:
        found = policy_or_format(value)  # the grammar of every policy argument
    except (ValueError, TypeError):
        raise ValueError(f"override {value!r} is neither a policy (e.g. '32-true', "
                         "'p=fp32,c=bf16') nor a format (e.g. 'bf16', 'e4m3fn')") from None
    if isinstance(found, Policy):
        return Rule.of(found)
    return Rule(found, found, found, base.rounding, base.grad_rounding, "all")
