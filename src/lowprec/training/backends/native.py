"""The native backend: torch's own fp16/bf16 dtypes and kernels.

Pure policies (scope ``all``) convert the model to the parameter format's dtype and cast
floating inputs to it; mixed policies (scope ``matmul``) keep fp32 parameters and compute matmul
layers under ``torch.autocast``. Every format must be fp32, fp16 or bf16 with gradients in the
compute format (:func:`lowprec.training.backends.choice.can_be_native`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..caller import warn
from ...numerics.formats import FP32
from ...numerics.storage import storage_dtype
from ..policy import Backend, Scope
from ..recurrent import install_fp32_fallback
from ..tree import cast_floating, map_floating
from .base import PrecisionBackend, register_backend

__all__ = ["NativeBackend"]


@register_backend
class NativeBackend(PrecisionBackend):
    """Real torch dtypes: ``model.to(dtype)`` or ``torch.autocast``."""

    kind = Backend.NATIVE
    carriers = False
    compile_note = " (torch's own dtypes: torch.compile(model) compiles it as any model)"

    def convert_module(self, model: nn.Module, names: dict[int, str], *,
                       compute_replaced: bool = False) -> None:
        super().convert_module(model, names, compute_replaced=compute_replaced)
        if compute_replaced:
            return
        pol = self.policy
        if self.match_cpu_kernels:
            warn(f"match_cpu_kernels=True has no effect: policy {pol} runs on the native "
                 f"backend (torch's own kernels); it applies to emulated policies "
                 f"(b=emulated)")
        if pol.scope is Scope.ALL and pol.params != FP32:
            dtype = storage_dtype(pol.params)
            model.to(dtype)
            # oneDNN runs bf16 convolutions with its AMX/AVX-512 kernels on channels-last
            # (NHWC) tensors; NCHW bf16 takes a slower reordering path on CPU
            fmt = (torch.channels_last if dtype == torch.bfloat16 and self.device.type ==
                   "cpu" and any(isinstance(m, nn.Conv2d) for m in model.modules())
                   else None)
            if fmt is not None:
                model.to(memory_format=fmt)

            def cast(a):
                a = a.to(dtype)
                return a.contiguous(memory_format=fmt) if fmt is not None and a.dim() == 4 \
                    else a

            # floating tensors anywhere in the positional and keyword inputs; integer ones
            # (token ids, masks) stay as they are
            self.handles.append(model.register_forward_pre_hook(
                lambda m, args, kwargs: (map_floating(args, cast), map_floating(kwargs, cast)),
                with_kwargs=True))
        # a recurrent layer torch cannot run in the 16-bit dtype on this device (oneDNN has
        # no bf16 LSTM on AVX2-only CPUs) runs in fp32, as autocast runs ops it has no
        # kernel for; asked by a cached probe of the layer (lowprec.training.recurrent)
        mixed = pol.scope is Scope.MATMUL  # torch.autocast in autocast(), else a cast model
        low = pol.compute if mixed else pol.params
        if low != FP32:
            self.handles += install_fp32_fallback(
                model, self.device, storage_dtype(low), autocast=mixed, policy=str(pol))

    def convert_input(self, x):
        if self.policy.scope is Scope.ALL and self.policy.params != FP32:
            return cast_floating(x, storage_dtype(self.policy.params))
        return x

    @contextlib.contextmanager
    def autocast(self):
        with torch.autocast(device_type=self.device.type,
                            dtype=storage_dtype(self.policy.compute)):
            yield
