"""The compiled emulated backend: the emulated backend with the model's forward and backward
compiled by Inductor, every rounding of the engine in the graph
(:mod:`lowprec.training.emulation.compiled`; eager, with one warning line naming why, where
it cannot compile).

``Precision(policy, compile=True)`` runs it where the policy runs on the emulated backend
(``b=emulated``, or ``auto`` choosing it); the choice between backends (``b=``) is unchanged:
this is how the emulated kind runs, compiled, registered with
:func:`.base.register_compiled_backend`. Its storage, gradient and checkpoint hooks are the
emulated backend's.
"""

from __future__ import annotations

from torch import nn

from ..emulation.compiled import compile_model
from ..policy import Backend
from .base import register_compiled_backend
from .emulated import EmulatedBackend

__all__ = ["CompiledEmulatedBackend"]


@register_compiled_backend
class CompiledEmulatedBackend(EmulatedBackend):
    """fp32 tensors rounded at every op by the engine, the model compiled by Inductor."""

    kind = Backend.EMULATED

    def convert_module(self, model: nn.Module, names: dict[int, str], *,
                       compute_replaced: bool = False) -> None:
        super().convert_module(model, names, compute_replaced=compute_replaced)
        if not compute_replaced:  # Inductor, every rounding in the graph (or eager, saying why)
            self.compiled = compile_model(self.engine)
