"""Which gradients are already on a format's grid, so that the engine does not round them again.

The engine rounds a gradient where a consumer's backward writes it (``Consumed``, in
:mod:`.autograd_fns`) and where it reaches the op output it belongs to (``Round``); a
replayed 16-bit kernel (batch norm, layer norm, attention, activations) rounds the input
gradient it writes itself. Where the same tensor, unchanged, meets a second rounding to the
same element format, that rounding is the identity in any mode. A rounding records the fact
on the tensor (the format and the tensor's version counter, which moves if autograd
accumulates into it in place) and the next one skips the pass. The same holds for a forward
value a kernel rounded as it wrote it (the batch-norm replay's output, which ``RoundInplace``
then leaves as it is).
"""

from __future__ import annotations

import torch

from ...numerics.formats import FixedFormat, FloatFormat
from ...numerics.quantize import quantize, quantize_

__all__ = ["GRAD_MARK", "note_rounded", "rounded_already", "rounded_grad", "rounded_grad_",
           "pass_through"]

GRAD_MARK = "_lowprec_grad_grid"  # a gradient's (format, version) when rounded


def note_rounded(g: torch.Tensor, fmt) -> None:
    """Record that ``g``'s values, as they are now, lie on ``fmt``'s grid, where rounding them
    to ``fmt`` again changes nothing in any mode: element formats with a fixed grid (not a
    dynamic format, whose scale is chosen from the tensor, nor a block format, whose shared
    scale can move when the block's largest value rounds up). While a graph is traced
    (compiled emulation) too: the rounding left out is one the graph would compute as the
    identity, and a second cast round trip Inductor does not see through (benchmarks/
    RESULTS.md, "Issue 37, second session": the same bits, a faster compiled step)."""
    if isinstance(fmt, (FloatFormat, FixedFormat)) and not fmt.dynamic:
        try:
            setattr(g, GRAD_MARK, (fmt, g._version))
        except (AttributeError, RuntimeError):
            pass


def rounded_already(g: torch.Tensor, fmt) -> bool:
    """Whether :func:`note_rounded` saw ``g`` rounded to ``fmt``, unchanged since."""
    m = getattr(g, GRAD_MARK, None)
    return m is not None and (m[0] is fmt or m[0] == fmt) and m[1] == g._version


def rounded_grad(t: torch.Tensor, fmt) -> torch.Tensor:
    """``t`` rounded to nearest ``fmt``, noted (a replayed kernel's input gradient)."""
    out = quantize(t, fmt)
    note_rounded(out, fmt)
    return out


def rounded_grad_(t: torch.Tensor, fmt) -> torch.Tensor:
    """:func:`rounded_grad` in place, for a tensor the caller has just computed and nothing
    else holds (a replayed kernel's fresh fp32 gradient): no second buffer, which a large
    activation's gradient would otherwise take in a write-allocate pass (benchmarks/
    RESULTS.md, figure F39)."""
    quantize_(t, fmt)
    note_rounded(t, fmt)
    return t


def _pass_note(grad_inputs, grad_outputs) -> None:
    go = grad_outputs[0] if grad_outputs else None
    m = getattr(go, GRAD_MARK, None) if go is not None else None
    if m is None or m[1] != go._version:
        return
    for gi in grad_inputs:
        if gi is not None and gi is not go:
            note_rounded(gi, m[0])


def pass_through(out: torch.Tensor) -> None:
    """``out`` came from an elementwise mask (ReLU, hardtanh, clamp), whose backward keeps or
    zeroes each gradient value (``where(mask, g, 0)``): a gradient on a grid gives one on that
    grid, so its note is passed on to the input's gradient (a node hook), and the rounding
    that meets it next (the producer's ``Round``) is skipped."""
    fn = out.grad_fn
    if fn is not None:
        fn.register_hook(_pass_note)
