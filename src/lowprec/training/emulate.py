"""Emulated precision: fp32 kernels, values rounded onto a format's grid at every layer boundary.

This is how a GPU's tensor cores compute (products accumulated in fp32, the result rounded
once to the output format), and on this CPU it is the only fast way to study fp16: fp16
convolution backward falls to a reference kernel 15 to 70 times slower than fp32.

Hooks on the model do the rounding, so one model definition serves every policy:

* the model's floating inputs are rounded to the compute format;
* each target layer's output is rounded to the compute format on the way forward, and the
  gradient flowing back into it is rounded to the gradient format (``Quantizer``'s STE);
* when the compute format differs from the parameters' (mixed precision, binary weights), a
  layer's own parameters are rounded to the compute format while it runs; the gradient reaches
  the full-precision parameter (straight-through);
* layers that cannot leave the grid (ReLU, max-pooling, flatten...) are skipped.

``scope="all"`` targets every leaf layer (pure 16-bit: every layer stores 16-bit outputs);
``scope="matmul"`` only linear and convolution layers, as torch.autocast runs them in fp16
while the rest stays fp32. Block formats (MX) round a matmul's weight and input in blocks along
its reduction dimension (the last axis of a linear layer, the channel axis of a convolution) and
leave its output in fp32, as MX hardware accumulates. Dynamic fixed point (``dfxp<N>``) keeps a
range per layer and role in a :class:`lowprec.training.regimes.dynamic_fixed.Controller`. Parameter gradients are
rounded to the parameter format by :class:`lowprec.Precision` at the optimizer step (after any
all-reduce), as fp16 gradient storage would hold them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..numerics.autograd import quantize_ste
from .regimes.base import GroupKey, Role
from .regimes.dynamic_fixed import Controller, resolve
from ..numerics.formats import BlockFormat, DynamicFixedFormat
from .policy import Policy

__all__ = ["Emulation", "GRID_PRESERVING", "MATMUL_LAYERS", "CONV_LAYERS"]

# Layers whose output lies on its input's grid (selection, sign, reshaping): no rounding needed.
GRID_PRESERVING = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                   nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.Flatten,
                   nn.Unflatten, nn.Identity)
CONV_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d)
# What torch.autocast runs in the low-precision dtype.
MATMUL_LAYERS = (nn.Linear, nn.Bilinear, nn.MultiheadAttention) + CONV_LAYERS


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


class Emulation:
    """Attach the rounding hooks of ``policy`` to ``model``; ``detach()`` removes them.

    ``active`` switches the rounding on and off (mixed precision rounds only inside
    ``Precision.autocast()``, like torch.autocast).
    """

    def __init__(self, model: nn.Module, policy: Policy, generator: torch.Generator | None = None,
                 *, active: bool = True, controller: Controller | None = None) -> None:
        self.policy = policy
        self.generator = generator
        self.active = active
        self.controller = controller
        self.handles: list = []
        self.round_weights = policy.compute != policy.params
        block = isinstance(policy.compute, BlockFormat)
        if policy.scope == "all":
            self.handles.append(model.register_forward_pre_hook(self._inputs_hook("input")))
        for name, m in model.named_modules():
            if policy.scope == "matmul":
                target = isinstance(m, MATMUL_LAYERS)
            else:
                target = _is_leaf(m) or any(True for _ in m.parameters(recurse=False))
            if not target:
                continue
            # blocks run along the reduction dimension: the channels of a convolution
            axis = 1 if (block and isinstance(m, CONV_LAYERS)) else None
            if self.round_weights and any(True for _ in m.parameters(recurse=False)):
                self.handles.append(m.register_forward_pre_hook(self._swap_in_hook(name, axis)))
                self.handles.append(m.register_forward_hook(self._swap_out, always_call=True))
            if policy.scope == "matmul":
                self.handles.append(m.register_forward_pre_hook(self._inputs_hook(name, axis)))
            if not isinstance(m, GRID_PRESERVING) and not (block and policy.scope == "matmul"):
                self.handles.append(m.register_forward_hook(self._output_hook(name)))
        for m in model.modules():
            if isinstance(m, GRID_PRESERVING):
                self.handles.append(m.register_forward_hook(self._keep_mark))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- rounding ----------------------------------------------------------------------------
    def _formats(self, key: str, axis: int | None):
        """The forward and backward formats for a group: static ones as they are, dynamic
        fixed point as callables the STE resolves on the tensor it rounds."""
        c, g = self.policy.compute, self.policy.grads
        if axis is not None:
            c = replace(c, axis=axis) if isinstance(c, BlockFormat) else c
            g = replace(g, axis=axis) if isinstance(g, BlockFormat) else g
        ctrl = self.controller

        def dyn(fmt, role):
            if isinstance(fmt, DynamicFixedFormat):
                return lambda t: resolve(fmt, GroupKey(role, key), t, ctrl)
            return fmt

        return dyn(c, Role.ACTIVATION), dyn(g, Role.GRAD)

    def _q(self, t, key: str, axis: int | None = None):
        if torch.is_tensor(t) and t.is_floating_point():
            if axis is None and getattr(t, "_lowprec_grid", None) == self.policy.compute:
                return t  # already rounded by an earlier layer: no copy (autocast would not cast)
            fwd, bwd = self._formats(key, axis)
            out = quantize_ste(t, fwd, bwd, self.policy.rounding, self.policy.grad_rounding,
                               generator=self.generator)
            if axis is None:
                out._lowprec_grid = self.policy.compute
            return out
        if isinstance(t, (tuple, list)):
            return type(t)(self._q(v, key, axis) for v in t)
        return t

    # -- hooks -------------------------------------------------------------------------------
    def _inputs_hook(self, name: str, axis: int | None = None):
        def hook(module, args):
            if not self.active:
                return None
            return tuple(self._q(a, f"{name}.in", axis) for a in args)
        return hook

    def _output_hook(self, name: str):
        def hook(module, args, output):
            if not self.active:
                return None
            return self._q(output, name)
        return hook

    def _keep_mark(self, module, args, output):
        # a grid-preserving layer's output stays on the grid its input was on
        marks = {getattr(a, "_lowprec_grid", None) for a in args if torch.is_tensor(a)}
        if len(marks) == 1 and torch.is_tensor(output):
            output._lowprec_grid = marks.pop()
        return None

    def _swap_in_hook(self, name: str, axis: int | None):
        def hook(module, args):
            if not self.active:
                return None
            saved = {}
            for pname, p in module._parameters.items():
                if p is not None and p.is_floating_point():
                    saved[pname] = p
                    fwd, _ = self._formats(f"{name}.{pname}", axis if p.dim() > 1 else None)
                    # the layer sees the rounded weight; its gradient reaches p unchanged (STE)
                    module._parameters[pname] = quantize_ste(p, fwd, None, self.policy.rounding,
                                                             generator=self.generator)
            module._lowprec_saved = saved
            return None
        return hook

    def _swap_out(self, module, args, output):
        saved = getattr(module, "_lowprec_saved", None)
        if saved:
            for name, p in saved.items():
                module._parameters[name] = p
            module._lowprec_saved = None
        return None
