"""``PolicyOptimizer``: what an optimizer that applies a policy's storage rules itself promises.

:class:`lowprec.Precision` configures such an optimizer instead of wrapping it, checks the
gradients it names for Inf/NaN, and hands it the loss scale's inverse as ``step(grad_scale=...)``
so that 16-bit gradients are unscaled in fp32. lowprec's optimizers
(:class:`~lowprec.training.optim.LowPrecisionOptimizer`) and the wrapper of torch optimizers
(:class:`~lowprec.training.optim.FormatOptimizer`) implement it; any other optimizer is a plain
torch optimizer to Precision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["PolicyOptimizer"]


class PolicyOptimizer(ABC):
    #: whether ``param_groups[i]["lr_scale"]`` multiplies the group's learning rate
    honours_lr_scale: bool = False

    @abstractmethod
    def configure_storage(self, **kwargs) -> None:
        """Set the storage formats, write-back mode, generator and regime options
        (the keywords of :meth:`lowprec.training.optim.Storage.configure`)."""

    @abstractmethod
    def params_for_check(self) -> list[torch.Tensor]:
        """The parameters whose gradients Precision checks (and rounds) before a step."""

    @abstractmethod
    def step(self, closure=None, *, grad_scale: float | torch.Tensor | None = None):
        """One update, the gradients multiplied by ``grad_scale`` in fp32 first."""

    @abstractmethod
    def state_layout(self, p: torch.Tensor) -> dict:
        """Name -> format of every state tensor kept for parameter ``p``, each with one value per
        element of ``p`` (``"master"``: master weights). The optimizer only describes its state;
        the memory ledger (:func:`lowprec.training.memory.optimizer_bytes`) counts the bytes."""
