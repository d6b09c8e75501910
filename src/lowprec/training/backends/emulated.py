"""The emulated backend: fp32 carriers, every value rounded onto the policy's grids.

The operator-level engine (:mod:`lowprec.training.emulation`) rounds each op's output and the
gradient reaching it; parameters and, for pure policies, floating buffers are kept on their
storage format's grid in fp32 tensors; the optimizer applies the storage formats at its
write-back and ``Precision.step`` rounds parameter gradients to the parameter format. Any
format works (fp8, fixed point, MX blocks, dynamic fixed point), and per-module overrides.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ...numerics.formats import FP32, Format
from ...numerics.quantize import quantize_
from ..emulation import Emulation
from ..policy import Backend, Scope
from ..regimes import GroupKey, Role
from .base import PrecisionBackend, register_backend

__all__ = ["EmulatedBackend"]


@register_backend
class EmulatedBackend(PrecisionBackend):
    """fp32 tensors rounded at every op by the eager engine."""

    kind = Backend.EMULATED
    carriers = True
    #: the model's compiled forward (:class:`.compiled.CompiledEmulatedBackend`; None here)
    compiled = None

    def convert_module(self, model: nn.Module, names: dict[int, str], *,
                       compute_replaced: bool = False) -> None:
        super().convert_module(model, names, compute_replaced=compute_replaced)
        if compute_replaced:
            return
        pol = self.policy
        self.engine = Emulation(model, pol, self.generator, active=pol.scope is Scope.ALL,
                                overrides=self.overrides,
                                match_cpu_kernels=self.match_cpu_kernels, resolve=self.resolve,
                                target=self.target,
                                **self.engine_options)
        self._store(model)

    @torch.no_grad()
    def _store(self, model: nn.Module) -> None:
        """Parameters (and, for pure policies, floating buffers such as BatchNorm's running
        statistics, which ``model.half()`` would convert too) on their storage format's grid."""
        em = self.engine
        for name, p in model.named_parameters():
            fmt = em.param_format(name)
            if fmt != FP32:
                quantize_(p.data, self.resolve(fmt, GroupKey(Role.PARAM, name), p.data))
        for name, b in model.named_buffers():
            fmt = em.param_format(name)
            if (b.is_floating_point() and fmt != FP32 and em.rule_of(name).scope == "all"
                    and not fmt.dynamic):
                quantize_(b, fmt)
        em.mark_storage(model)

    @contextlib.contextmanager
    def autocast(self):
        em = self.engine
        if em is None:  # a regime's prepared model computes its own precision
            yield
            return
        prev, em.active = em.active, True
        try:
            yield
        finally:
            em.active = prev

    def optimizer_storage(self) -> dict:
        pfmt = self.policy.params
        out: dict = {"param_format": pfmt}
        if self.engine is not None and self.engine.overrides:
            # parameters under a per-module override keep their own storage format
            own = {id(p): self.engine.param_format(n)
                   for n, p in self.model.named_parameters()}
            own = {k: f for k, f in own.items() if f != pfmt}
            if own:
                out["param_formats"] = own
        return out

    def grad_formats(self, params: list) -> list[Format]:
        em = self.engine
        return [em.param_format(self.names.get(id(p), "")) if em is not None
                else self.policy.params for p in params]

    def stored_formats(self) -> dict[str, Format]:
        em, model = self.engine, self.model
        if em is None or model is None:
            return {}
        out: dict[str, Format] = {}
        for name, _ in model.named_parameters(remove_duplicate=False):
            out[name] = em.param_format(name)
        for name, b in model.named_buffers(remove_duplicate=False):
            fmt = em.param_format(name)
            if (b.is_floating_point() and em.rule_of(name).scope == "all"
                    and not fmt.dynamic):
                out[name] = fmt
        return {k: f for k, f in out.items() if f != FP32}

    def ledger_compute(self) -> Format | None:
        return self.policy.compute
