"""The regime interface: what a training regime may add to :class:`lowprec.Precision`.

Most policies are formats and rounding modes only. Some regimes of the literature need more:
BinaryNet transforms the model and clips its latent weights after every step; dynamic fixed
point keeps a range per group of tensors that moves with overflow rates. Each such regime is a
:class:`Regime` subclass, registered with :func:`register_regime`; :func:`regimes_for` picks the
ones a policy needs (each class says so in :meth:`Regime.applies`, typically by the type of a
format). ``Precision`` calls the hooks below at fixed points of its lifecycle and knows no
regime by name, so a new regime is a new module, not an edit of ``Precision`` (as Lightning's
precision plugins plug into its trainer).

Groups of tensors (a layer's activations, a parameter's gradient, a momentum buffer...) are
named by a :class:`GroupKey`, a typed key: a :class:`Role` and the parameter or layer name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch
from torch import nn

from ...numerics.formats import Format

__all__ = ["Role", "GroupKey", "Regime", "register_regime", "regimes_for", "REGIMES", "Resolve",
           "chain_resolve", "static_resolve", "regimes_resolve"]


class Role(str, Enum):
    """What a group of tensors is."""

    PARAM = "param"            # a parameter as stored
    PARAM_GRAD = "pgrad"       # a parameter's gradient, as the parameter format stores it
    ACTIVATION = "act"         # a layer's output, input or in-use weight in the forward pass
    GRAD = "grad"              # the gradient flowing back into a layer's output
    MASTER = "master"          # master weights
    COMPENSATION = "compensation"  # the Kahan write-back's rounding error
    STATE = "state"            # an optimizer state buffer (GroupKey.part names which)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GroupKey:
    """One group of tensors: ``GroupKey(Role.PARAM, "0.weight")``, or for optimizer state
    ``GroupKey(Role.STATE, "0.weight", "momentum")``."""

    role: Role
    name: str
    part: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            try:
                object.__setattr__(self, "role", Role(self.role))
            except ValueError:
                accepted = ", ".join(r.value for r in Role)
                raise ValueError(f"role={self.role!r}; accepted: {accepted}") from None
        object.__setattr__(self, "name", str(self.name))

    @classmethod
    def of(cls, role: "Role | str", name: object) -> "GroupKey":
        """The key an optimizer's storage uses: a :class:`Role` (or its value), else the name of
        a state buffer (``"momentum"``, ``"exp_avg"``)."""
        if isinstance(role, Role):
            return cls(role, str(name))
        if role in {r.value for r in Role}:
            return cls(Role(role), str(name))
        return cls(Role.STATE, str(name), role)

    def __str__(self) -> str:
        role = f"{self.role.value}.{self.part}" if self.part else self.role.value
        return f"{role}:{self.name}"


class Regime:
    """Hooks a regime gives :class:`lowprec.Precision`; every default does nothing.

    Lifecycle: ``Precision.__init__`` builds the regimes the policy needs (``cls(policy,
    generator)``); ``setup`` calls :meth:`prepare` on the model, then, with an optimizer,
    :meth:`configure_optimizer`; every rounding of a group goes through :meth:`resolve`; each
    step that is not skipped ends with :meth:`after_step`; the state travels in
    ``Precision.state_dict()["regimes"][name]``.
    """

    name = "regime"
    #: True when :meth:`prepare` makes the model compute in the policy's compute format itself
    #: (Precision then installs no casting or emulation hooks)
    replaces_compute = False

    def __init__(self, policy, generator: torch.Generator | None = None) -> None:
        self.policy = policy
        self.generator = generator

    @classmethod
    def applies(cls, policy) -> bool:
        """Whether ``policy`` needs this regime."""
        raise NotImplementedError

    def prepare(self, model: nn.Module) -> list[nn.Parameter]:
        """Transform ``model`` in place if the regime needs it; return the parameters it added
        (the optimizer receives them in :meth:`configure_optimizer`)."""
        return []

    def configure_optimizer(self, optimizer, added: list[nn.Parameter]) -> None:
        """Adjust the user's optimizer before Precision wraps or configures it."""

    def resolve(self, fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
        """The static format to round ``x`` (of group ``key``) with now."""
        return fmt

    def engine_options(self) -> dict:
        """Keyword arguments for the emulation engine and the optimizers' storage."""
        return {}

    def after_step(self, model: nn.Module) -> None:
        """Called after each optimizer step that was taken."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


REGIMES: list[type[Regime]] = []


def register_regime(cls: type[Regime]) -> type[Regime]:
    """Add a regime class (usable as a decorator); its ``name`` must be new."""
    if not (isinstance(cls, type) and issubclass(cls, Regime)):
        raise TypeError(f"a regime must be a Regime subclass, got {cls!r}")
    if any(r.name == cls.name for r in REGIMES if r is not cls):
        raise ValueError(f"a regime named {cls.name!r} is already registered")
    if cls not in REGIMES:
        REGIMES.append(cls)
    return cls


def regimes_for(policy, generator: torch.Generator | None = None) -> list[Regime]:
    """One instance of every registered regime ``policy`` needs, in registration order."""
    return [cls(policy, generator) for cls in REGIMES if cls.applies(policy)]


#: ``resolve(fmt, key, x)``: the static format group ``key`` rounds ``x`` with now (the engine,
#: the optimizers' storage and the backends take one; Precision's chains its regimes')
Resolve = Callable[[Format, GroupKey, torch.Tensor], Format]


def static_resolve(fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
    """``fmt`` itself; ValueError for a dynamic format (``fmt.dynamic``), which needs a regime
    to choose its grid (Precision, or :func:`regimes_resolve`)."""
    if fmt.dynamic:
        raise ValueError(f"{fmt} needs a dynamic fixed-point Controller (use Precision)")
    return fmt


class chain_resolve:  # noqa: N801 (a function to its callers; a class so that it pickles)
    """The resolve of ``regimes`` in order (each may refine the format the one before gave); a
    format still dynamic after them is refused as :func:`static_resolve` refuses it."""

    def __init__(self, regimes: list[Regime]) -> None:
        self.regimes = list(regimes)

    def __call__(self, fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
        for regime in self.regimes:
            fmt = regime.resolve(fmt, key, x)
        return static_resolve(fmt, key, x)


def regimes_resolve(policy, generator: torch.Generator | None = None) -> Resolve:
    """The resolve of fresh instances of the regimes ``policy`` needs: for code that rounds
    outside a Precision (``emulated(...)``, an optimizer built on its own)."""
    return chain_resolve(regimes_for(policy, generator))
