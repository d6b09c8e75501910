"""Recurrent layers torch cannot run in a 16-bit dtype on this device: run them in fp32.

On a CPU without AVX-512 (an AMD EPYC with AVX2 only, measured), ``torch.autocast("cpu",
torch.bfloat16)`` around an ``nn.LSTM`` fails: for an fp32 input ATen's LSTM calls oneDNN's
``mkldnn_rnn_layer``, which CPU autocast runs in bf16, and oneDNN there has no bf16 LSTM
("could not create a primitive descriptor for the LSTM forward propagation primitive"). CPUs
with AVX-512 run it. Which layer runs where is asked at run time, never read off the CPU's name:
:func:`native_failure` builds a tiny copy of the layer (same sizes and options, one example, two
time steps, constant weights: no random numbers drawn) and runs it forward and backward on the
device, in the dtype, under autocast or with its parameters in that dtype; the answer is cached
per (layer configuration, device, dtype, autocast or not).

A layer whose probe fails runs as autocast runs an op it has no low-precision kernel for
(:func:`install_fp32_fallback`): floating inputs (hidden states and ``PackedSequence`` data included) cast
to fp32, autocast disabled inside, 16-bit parameters used through fp32 copies (gradients still
reach them), and the outputs cast to the dtype the layer gives where it runs (the autocast dtype,
which oneDNN's layer returns under autocast; the parameters' dtype for a converted model), so the
code downstream sees the same dtypes on every CPU. ``Precision.setup`` installs it with one
warning naming the layer types and the error.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .caller import warn
from .tree import cast_floating

__all__ = ["RECURRENT", "native_failure", "install_fp32_fallback"]

# the torch layer classes probed (a subclass is probed as the class it derives from)
RECURRENT = (nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell)


def _kind_and_config(module: nn.Module) -> tuple[type, tuple] | None:
    """The torch class ``module`` is and the constructor arguments a probe copy needs."""
    for kind in RECURRENT:
        if isinstance(module, kind) and type(module).forward is kind.forward:
            break
    else:  # not a torch recurrent layer, or a subclass with a forward of its own
        return None
    options = {"bias": module.bias}
    if isinstance(module, nn.RNNBase):
        options.update(num_layers=module.num_layers, batch_first=module.batch_first,
                       bidirectional=module.bidirectional)
        if kind is nn.LSTM:
            options["proj_size"] = module.proj_size
    if kind in (nn.RNN, nn.RNNCell):
        options["nonlinearity"] = module.nonlinearity
    return kind, (module.input_size, module.hidden_size, tuple(sorted(options.items())))


def _build(kind: type, config: tuple) -> nn.Module:
    """A layer of ``kind`` with ``config`` on the meta device (no memory, no random numbers)."""
    input_size, hidden_size, options = config
    return kind(input_size, hidden_size, **dict(options), device="meta")


@functools.lru_cache(maxsize=None)
def _probe(kind: type, config: tuple, device: str, dtype: torch.dtype,
           autocast: bool) -> str | None:
    """None when a tiny ``kind(*config)`` runs forward and backward on ``device`` in ``dtype``
    (under autocast, or with its parameters in ``dtype``); else the error's first line."""
    dev = torch.device(device)
    try:
        with torch.enable_grad(), torch.autocast(dev.type, enabled=False):
            layer = _build(kind, config).to_empty(device=dev)
            with torch.no_grad():
                for p in layer.parameters():  # constant weights: the global RNG is not drawn
                    p.fill_(0.125)
            if not autocast:
                layer = layer.to(dtype)
            cell = not isinstance(layer, nn.RNNBase)
            shape = (1, layer.input_size) if cell else (1, 2, layer.input_size)
            x = torch.full(shape, 0.5, device=dev, dtype=dtype if not autocast else torch.float32,
                           requires_grad=True)
            with torch.autocast(dev.type, dtype=dtype, enabled=autocast):
                out = layer(x)
            while not torch.is_tensor(out):
                out = out[0]
            out.float().sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        # the first sentence ("could not create a primitive descriptor for the LSTM forward
        # propagation primitive"), without oneDNN's hint about its verbose mode
        first = str(e).strip().split("\n")[0].split(". ")[0].rstrip(".")
        return first or type(e).__name__
    return None


def native_failure(module: nn.Module, device: torch.device, dtype: torch.dtype, *,
                   autocast: bool) -> str | None:
    """Why ``module`` (a torch recurrent layer) cannot run on ``device`` in ``dtype`` (under
    autocast, or converted to it); None when it can, or when it is no recurrent layer."""
    found = _kind_and_config(module)
    if found is None:
        return None
    kind, config = found
    return _probe(kind, config, str(device), dtype, autocast)


class _Fp32Forward:
    """Stands in for one layer's ``forward`` (an instance attribute, which shadows the class's
    method); ``remove()`` restores the layer."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, autocast: bool) -> None:
        self.module, self.dtype, self.autocast = module, dtype, autocast
        self.inner = module.forward
        # a hook-free twin on the meta device: 16-bit parameters run through it as fp32 copies
        # (torch.func.functional_call), without calling the layer, its hooks, or this, again
        self.twin = _build(*_kind_and_config(module))
        module.forward = self

    def __call__(self, *args, **kwargs):
        module = self.module
        p = next(module.parameters(), None)
        device = p.device.type if p is not None else "cpu"
        if self.autocast:
            needed = (torch.is_autocast_enabled(device)
                      and torch.get_autocast_dtype(device) == self.dtype)
        else:
            needed = p is not None and p.dtype == self.dtype
        if not needed:
            return self.inner(*args, **kwargs)
        return _run_in_fp32(self, args, kwargs, device)

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward


def _run_in_fp32(fwd: _Fp32Forward, args: tuple, kwargs: dict, device: str):
    """One call of the layer in fp32, as autocast runs an op without a low-precision kernel;
    the outputs are cast to ``fwd.dtype``."""
    module = fwd.module
    with torch.autocast(device, enabled=False):
        args, kwargs = cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)
        params = dict(module.named_parameters())
        if any(p.dtype != torch.float32 for p in params.values()):
            out = torch.func.functional_call(
                fwd.twin, {n: p.float() for n, p in params.items()}, args, kwargs)
        else:
            out = fwd.inner(*args, **kwargs)
    return cast_floating(out, fwd.dtype)


def install_fp32_fallback(model: nn.Module, device: torch.device, dtype: torch.dtype, *,
                          autocast: bool, policy: str = "") -> list[_Fp32Forward]:
    """Run in fp32 every recurrent layer of ``model`` whose probe fails on ``device`` in
    ``dtype``; one warning names the layer types and the error. Returns the handles."""
    handles, failed = [], {}
    for module in model.modules():
        why = native_failure(module, device, dtype, autocast=autocast)
        if why is not None:
            handles.append(_Fp32Forward(module, dtype, autocast))
            failed.setdefault(type(module).__name__, why)
    if failed:
        names = ", ".join(f"nn.{n}" if hasattr(nn, n) else n for n in failed)
        dt = str(dtype).replace("torch.", "")
        how = (f"under torch.autocast({device.type!r}, torch.{dt})" if autocast
               else f"with {dt} parameters")
        which = "it" if len(handles) == 1 else f"these {len(handles)} layers"
        under = f" under policy {policy}" if policy else ""
        warn(
            f"{names} cannot run {how} on this {device.type} "
            f"({'; '.join(sorted(set(failed.values())))}): lowprec runs {which} in fp32{under} "
            f"(inputs cast to fp32, outputs back to {dt}), as autocast runs an op that has no "
            f"{dt} kernel")
    return handles
