"""``auto`` checked by the model's own steps: native and emulated timed side by side.

The device's facts (:mod:`lowprec.training.hardware`) say whether torch has fast kernels for a
format, not whether this model's ops reach them: on a CPU with AVX512-BF16 the yun2023
transformer's native bf16 step is slower than its fp32 step (torch's bf16 attention backward
is most of it), while its ResNet-20's is faster (benchmarks/RESULTS.md, figure F25). So a
caller holding a sample batch may time a few training steps of the model under both backends
where the facts say native, and keep the faster: ``Precision.setup(model, example=inputs)``, through
:func:`lowprec.training.precision.time_backends`; this module holds the timing loop and the
rule (:func:`decide`). Native stays unless clearly slower (:data:`SLOWER`): for that
transformer emulated bf16 was about as slow (figure F26), and native was kept.

The choice changes a run's bits, and a timing on a loaded machine can differ from one call to
the next: the facts alone decide unless a batch is given, and a caller that must reproduce a
run stores ``prec.backend_choice`` and gives it back (``setup(model, choice=...)``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..policy import Backend, Policy
from .choice import BackendChoice

__all__ = ["BackendTiming", "time_steps", "build_copies", "loss_of", "decide", "SLOWER"]

#: native is left for emulated only when its step takes more than this times emulation's:
#: a margin wider than the spread of repeated timings on a shared machine (of ratios measured
#: side by side: benchmarks/RESULTS.md, figure F27), so that a near tie keeps native
SLOWER = 1.25


@dataclass(frozen=True)
class BackendTiming:
    """Seconds per training step of one model under each backend (the fastest of the rounds,
    native and emulated steps interleaved so that a load on the machine hits both)."""

    native: float
    emulated: float
    rounds: int

    @property
    def ratio(self) -> float:
        """native / emulated step time."""
        return self.native / self.emulated


def loss_of(out, target, loss_fn) -> torch.Tensor:
    """The scalar a timed step differentiates: ``loss_fn(out, target)``; without one, a Hugging
    Face output's ``loss``, else the mean square of the output (or of its ``logits``, or of its
    first element), which reaches every output so that the whole backward runs."""
    if loss_fn is not None:
        return loss_fn(out, target)
    if getattr(out, "loss", None) is not None:
        return out.loss
    if not torch.is_tensor(out):
        out = getattr(out, "logits", None) if hasattr(out, "logits") else out[0]
    return out.float().square().mean()


def time_steps(build: Callable[[], nn.Module], policy: Policy,
               make_step: Callable[[nn.Module, Policy], Callable[[], None]], *,
               rounds: int = 3, device_sync: Callable[[], None] = lambda: None,
               devices: tuple = ()) -> BackendTiming:
    """Seconds per training step under ``policy`` run natively and emulated: ``make_step(model,
    policy)`` sets a model ``build()`` returned up under the policy (its backend named) and
    returns one training step. One warm-up step each, then ``rounds`` of each, interleaved so
    that a load on the machine hits both; the fastest of each is kept. torch's random state is
    restored, the CPU's and that of the CUDA ``devices`` (a dropout's draws are the copies')."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    with torch.random.fork_rng(devices=list(devices)):
        steps = {b: make_step(build(), policy.with_(backend=b))
                 for b in (Backend.NATIVE, Backend.EMULATED)}
        for step in steps.values():
            step()  # warm-up: kernels chosen, buffers allocated (and compiled, with compile)
        best = {b: float("inf") for b in steps}
        for _ in range(rounds):
            for b, step in steps.items():
                t0 = time.perf_counter()
                step()
                device_sync()
                best[b] = min(best[b], time.perf_counter() - t0)
    return BackendTiming(best[Backend.NATIVE], best[Backend.EMULATED], rounds)


def build_copies(model: nn.Module | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """A function building the models to time: deep copies of a module, or the calls of a
    function building one."""
    if isinstance(model, nn.Module):
        return lambda: copy.deepcopy(model)
    if not callable(model):
        raise TypeError(f"model={model!r:.40} ({type(model).__name__}) must be an nn.Module or "
                        "a function building one")
    return model


def decide(facts_choice: BackendChoice, timing: BackendTiming | None) -> BackendChoice:
    """The backend ``auto`` runs, given the facts' choice and the model's timing (None: not
    timed). Only an automatic choice of native is checked; native stays unless its step takes
    more than :data:`SLOWER` times the emulated one."""
    if timing is None or not facts_choice.automatic or facts_choice.backend is not Backend.NATIVE:
        return facts_choice
    measured = (f"this model's training step took {timing.native * 1e3:.0f} ms native, "
                f"{timing.emulated * 1e3:.0f} ms emulated")
    if timing.native > SLOWER * timing.emulated:
        return BackendChoice(Backend.EMULATED, f"{facts_choice.reason}, but {measured}",
                             automatic=True)
    return BackendChoice(Backend.NATIVE, f"{facts_choice.reason}; {measured}", automatic=True)
