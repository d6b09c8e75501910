"""Autograd wrappers over :func:`quantize`: what emulated training inserts between layers.

The forward pass rounds the values to one format; the backward pass rounds the incoming gradient
to another (its own format and rounding), and is otherwise the identity: the straight-through
estimator (Bengio et al. 2013), as in QPyTorch's ``Quantizer``.
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import Format, parse_format
from .quantize import quantize
from .rounding import Rounding, check_generator, parse_rounding

__all__ = ["quantize_ste", "Quantizer"]


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, fwd_round, fwd_bits, bwd, bwd_round, bwd_bits, generator):
        ctx.bwd = (bwd, bwd_round, bwd_bits, generator)
        if fwd is None:
            return x.view_as(x)
        if callable(fwd):  # a format chosen from the tensor itself (dynamic fixed point)
            fwd = fwd(x)
        # inside torch.compile, one lowprec::quantize node (lowprec.numerics.ops)
        return quantize(x, fwd, fwd_round, generator=generator, random_bits=fwd_bits or None)

    @staticmethod
    def backward(ctx, grad):
        bwd, bwd_round, bwd_bits, generator = ctx.bwd
        if callable(bwd) and grad is not None:
            bwd = bwd(grad)
        if bwd is not None and grad is not None:
            grad = quantize(grad, bwd, bwd_round, generator=generator,
                            random_bits=bwd_bits or None)
        return grad, None, None, None, None, None, None, None


def _specs(forward, backward, rounding, backward_rounding, random_bits) -> tuple:
    """(forward format, mode, bits, backward format, mode, bits); the backward rounding
    defaults to the forward one."""
    br = rounding if backward_rounding is None else backward_rounding
    return (*_spec(forward, rounding, random_bits), *_spec(backward, br, random_bits))


def _spec(fmt, rounding, random_bits):
    if fmt is not None and not callable(fmt):
        fmt = parse_format(fmt)
    mode, bits = parse_rounding(rounding, random_bits)
    return fmt, mode, bits


def quantize_ste(
    x: torch.Tensor,
    forward: str | Format | None = None,
    backward: str | Format | None = None,
    rounding: str | Rounding = "nearest",
    backward_rounding: str | Rounding | None = None,
    *,
    random_bits: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Differentiable quantization: values to ``forward``, gradients to ``backward``.

    ``None`` leaves that direction in full precision. ``backward_rounding`` defaults to
    ``rounding``.
    """
    return _QuantizeSTE.apply(x, *_specs(forward, backward, rounding, backward_rounding,
                                         random_bits), check_generator(generator))


class Quantizer(nn.Module):
    """Module form of :func:`quantize_ste`.

    >>> q = Quantizer(forward="fp16", backward="e5m2", backward_rounding="stochastic")
    >>> y = q(torch.randn(4, requires_grad=True))
    """

    def __init__(
        self,
        forward: str | Format | None = None,
        backward: str | Format | None = None,
        rounding: str | Rounding = "nearest",
        backward_rounding: str | Rounding | None = None,
        *,
        random_bits: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self._specs = _specs(forward, backward, rounding, backward_rounding, random_bits)
        (self.forward_format, self.rounding, self.random_bits, self.backward_format,
         self.backward_rounding, self.backward_bits) = self._specs
        self.generator = check_generator(generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantizeSTE.apply(x, *self._specs, self.generator)

    def extra_repr(self) -> str:
        return (f"forward={self.forward_format}, rounding={self.rounding}, "
                f"backward={self.backward_format}, backward_rounding={self.backward_rounding}")
