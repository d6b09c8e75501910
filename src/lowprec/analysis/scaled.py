"""What a scaled-GEMM recipe does to its operands, measured on one training step.

Under a recipe (``fp8-tensorwise``, ``mxfp4``...) the values that lose range are not the
activations or gradients as stored (fp32) but the GEMM operands after their scaled casts. One
forward and backward pass of a copy set up under the policy records every cast
(:func:`lowprec.training.emulation.scaled.record_casts`): per layer and role (``input``,
``weight``, ``grad_output`` and their second uses), the fraction of nonzero values flushed to
zero, landing among the element's subnormals, saturated at its max after scaling, and the
amax. :func:`lowprec.analysis.range_profile` and :func:`lowprec.find_loss_scale` report these
when given such a policy.
"""

from __future__ import annotations

from torch import nn

from ..training.emulation.scaled import record_casts
from ..training.policy import Policy
from .common import untouched, low_precision_copy, run_model

__all__ = ["scaled_operands", "weighted", "gradient_rows", "largest", "smallest"]


def scaled_operands(model: nn.Module, batch, loss_fn, policy: Policy, output_fn=None
                    ) -> list[dict]:
    """One row per operand cast of one forward and backward pass of ``model``'s copy under
    ``policy``: ``layer`` (module and op), ``role``, ``cast`` and the counts of
    :func:`lowprec.numerics.scaling.cast_stats` (``n``, ``nonzero``, ``flushed``,
    ``subnormal``, ``saturated``, ``amax``, ``amin``, ``nonfinite``)."""
    inputs, targets = batch
    low, prec = low_precision_copy(model, policy)
    with untouched(low), record_casts() as rows:
        loss = loss_fn(run_model(low, prec.convert_input(inputs), output_fn), targets)
        loss.float().backward()
    prec.emulation.detach()
    return rows


def weighted(rows: list[dict], key: str) -> float:
    """The fraction ``key`` over ``rows``, weighted by their nonzero counts."""
    total = sum(r["nonzero"] for r in rows)
    return sum(r[key] * r["nonzero"] for r in rows) / total if total else 0.0


def gradient_rows(rows: list[dict]) -> list[dict]:
    """The casts of gradients (``grad_output`` in either backward GEMM)."""
    return [r for r in rows if r["role"].startswith("grad_output")]


def largest(rows: list[dict]) -> float:
    """The largest |value| any of ``rows``' operands held (0 without nonzero values)."""
    return max((r["amax"] for r in rows if r["nonzero"]), default=0.0)


def smallest(rows: list[dict]) -> float:
    """The smallest nonzero |value| any of ``rows``' operands held (0 without one)."""
    return min((r["amin"] for r in rows if r["nonzero"]), default=0.0)

