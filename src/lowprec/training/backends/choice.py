"""Which backend runs a policy: the user's ``b=``, or ``auto`` deciding by the device's facts.

``auto`` runs a policy natively when every low-precision format in it has a torch dtype and
the device has fast kernels for it (:func:`lowprec.training.hardware.native_speed`:
AVX512-BF16 or AMX for bf16 on a CPU, fp16 on no CPU, tensor cores on CUDA),
and emulated otherwise: on an AVX2-only CPU native bf16 steps were many times slower than
fp32, emulated ones far less (benchmarks/RESULTS.md, figure F22). The choice changes a run's
numbers (native kernels sum in their own order, emulation rounds each op's output once), so
:func:`announce` says it once per process, policy and device, with its reason, and the
experiment runner stores it with each run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..caller import warn
from ...numerics.formats import BF16, FP16, FP32
from ...numerics.rounding import Rounding
from ..hardware import DeviceFacts, native_speed
from ..policy import Backend, Policy, Scope

__all__ = ["BackendChoice", "BackendChoiceWarning", "choose_backend", "can_be_native",
           "native_obstacle",
           "announce", "NATIVE_FORMATS"]

NATIVE_FORMATS = (FP32, FP16, BF16)


class BackendChoiceWarning(UserWarning):
    """``auto`` chose a backend from the device's facts (shown once per process, policy and
    device; silence it with ``warnings.filterwarnings("ignore", category=...)``)."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend a policy runs on, why, and whether ``auto`` chose it from the device."""

    backend: Backend
    reason: str
    automatic: bool = False

    def __str__(self) -> str:
        return f"{self.backend} ({self.reason})"

    def to_json(self) -> dict:
        return {"backend": self.backend.value, "reason": self.reason,
                "automatic": self.automatic}

    @classmethod
    def from_json(cls, d: dict) -> "BackendChoice":
        """The choice :meth:`to_json` stored (a run's, given back when it resumes)."""
        return cls(Backend.parse(d["backend"]), str(d.get("reason", "")),
                   bool(d.get("automatic", False)))


def native_obstacle(policy: Policy) -> str | None:
    """Why torch's own dtypes cannot run ``policy`` as it is written, in a few words, or None
    when they can. Native casts the model to the parameter format and computes in it (scope
    ``all``: ``model.half()``), or keeps fp32 parameters and casts the matrix products
    (``matmul``: ``torch.autocast``); torch computes gradients in the forward's dtype and rounds
    only to nearest-even."""
    if policy.is_fp32:
        return None
    if getattr(policy, "scaled", None) is not None:  # scaled GEMMs are emulated (emulation/scaled.py)
        return "scaled matrix products are emulated"
    if getattr(policy, "accumulator", None) is not None:
        return "narrow accumulators are emulated"
    roles = [policy.params, policy.compute, policy.grads, policy.optimizer_state]
    if policy.master is not None:
        roles.append(policy.master)
    if not all(f in NATIVE_FORMATS for f in roles):
        return "native needs fp32, fp16 or bf16 formats"
    if any(r.mode is not Rounding.NEAREST_EVEN for r in (policy.rounding, policy.grad_rounding)):
        return "torch's kernels round to nearest-even only"
    if policy.grads != policy.compute:
        return "torch computes gradients in the compute format"
    if policy.scope is Scope.ALL and policy.params != policy.compute:
        return "with s=all native computes in the parameter format (p= must equal c=)"
    if policy.scope is Scope.MATMUL and policy.params != FP32:
        return "with s=matmul native autocasts from fp32 parameters (p=fp32)"
    return None


def can_be_native(policy: Policy) -> bool:
    """Whether torch's own dtypes can run ``policy`` as written (:func:`native_obstacle`)."""
    return native_obstacle(policy) is None


def choose_backend(policy: Policy, facts: DeviceFacts, *,
                   overrides: bool = False) -> BackendChoice:
    """The backend ``policy`` runs on, on the device ``facts`` describe; ``overrides``: the
    Precision has per-module overrides (the engine applies them). ValueError for a policy
    that forces ``native`` but cannot have it."""
    pol = policy
    obstacle = native_obstacle(pol)
    if pol.backend is Backend.NATIVE:
        if obstacle is not None:
            raise ValueError(f"policy {pol} cannot run natively: {obstacle}; use b=emulated")
        if overrides:
            raise ValueError("per-module overrides need backend=emulated (or auto)")
        return BackendChoice(Backend.NATIVE, "b=native")
    if overrides:
        return BackendChoice(Backend.EMULATED, "per-module overrides")
    if pol.is_fp32:
        return BackendChoice(Backend.NATIVE, "fp32")
    if pol.backend is Backend.EMULATED:
        return BackendChoice(Backend.EMULATED, "b=emulated")
    if obstacle is not None:
        return BackendChoice(Backend.EMULATED, obstacle)
    lowp = sorted({f for f in (pol.params, pol.compute, pol.grads) if f != FP32}, key=str)
    slow = []
    fast = []
    for fmt in lowp:
        ok, why = native_speed(fmt, facts)
        (fast if ok else slow).append(f"{fmt}: {why}")
    where = facts.describe()
    if slow:
        return BackendChoice(Backend.EMULATED, f"{where} has no fast kernels for "
                             f"{'; '.join(slow)}", automatic=True)
    return BackendChoice(Backend.NATIVE, f"{where} has fast kernels ({'; '.join(fast)})",
                         automatic=True)


_ANNOUNCED: set = set()


def announce(policy: Policy, choice: BackendChoice, facts: DeviceFacts) -> bool:
    """Warn once per process, policy and device which backend ``auto`` chose and why; returns
    whether it warned (choices the user made, or ``auto`` could not make otherwise, are not
    announced)."""
    if not choice.automatic:
        return False
    key = (policy.spec, facts, choice.backend)  # a timed choice's reason varies
    if key in _ANNOUNCED:
        return False
    _ANNOUNCED.add(key)
    other = Backend.NATIVE if choice.backend is Backend.EMULATED else Backend.EMULATED
    warn(f"lowprec: policy {policy} runs {choice.backend} (backend=auto): {choice.reason}; "
         f"b={other} in the policy chooses the other backend", BackendChoiceWarning)
    return True

