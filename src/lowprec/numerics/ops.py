"""``lowprec::quantize``: :func:`quantize` as a ``torch.library`` custom op for compiled code.

``torch.compile`` cannot trace the compiled kernel (a ctypes call): as a custom op with a fake
(meta) implementation, quantization is one opaque node of the graph, whose output has the
input's shape, dtype and device (torchao registers its quantization primitives the same way).
The op is registered when this module is imported (``import lowprec`` imports it), as torchao
registers its ops: registered lazily, on first use, the registration itself ran inside the first
Dynamo trace that reached it and broke that graph.

The format and rounding travel as their canonical strings (``"fp16"``, ``"block<e2m1fn,32,
axis=1>"``, ``"nearest"``), which parse back to the same objects. Stochastic rounding draws its
seed from a ``torch.Generator`` in Python, which a graph cannot hold: :func:`quantize_call` routes
it (and dynamic fixed point, whose format depends on the tensor's values) to the eager path.
"""

from __future__ import annotations

import torch

from .formats import Format, parse_format
from .quantize import quantize
from .rounding import Rounding, parse_rounding

__all__ = ["quantize_op", "quantize_call"]


@torch.library.custom_op("lowprec::quantize", mutates_args=())
def _quantize(x: torch.Tensor, fmt: str, rounding: str, random_bits: int) -> torch.Tensor:
    y = quantize(x, fmt, rounding, random_bits=random_bits or None)
    return y.clone() if y._base is not None else y  # an op may not return a view


@_quantize.register_fake
def _(x, fmt, rounding, random_bits):
    return torch.empty_like(x)


_OP = torch.ops.lowprec.quantize.default


def quantize_op():
    """The registered ``torch.ops.lowprec.quantize`` (its default overload)."""
    return _OP


_SPELLS: dict = {}


@torch.compiler.assume_constant_result  # a graph treats it as a constant: no tracing of parsing
def _spelling(fmt: Format) -> str | None:
    """The string ``fmt`` parses back from, or None."""
    s = _SPELLS.get(fmt)
    if s is None:
        s = str(fmt)
        try:
            ok = parse_format(s) == fmt
        except (ValueError, TypeError):
            ok = False
        s = _SPELLS[fmt] = s if ok else ""
    return s or None


def quantize_call(x: torch.Tensor, fmt: Format, rounding: Rounding, random_bits: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`quantize` through the custom op where a graph can hold it (deterministic rounding
    of a format given by a string), directly otherwise; the same bits either way."""
    mode, bits = parse_rounding(rounding, random_bits or None)
    spell = None if mode.is_stochastic else _spelling(fmt)
    if spell is None:
        return quantize(x, fmt, mode, generator=generator, random_bits=bits or None)
    return quantize_op()(x, spell, mode.value, int(bits or 0))
