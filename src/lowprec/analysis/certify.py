"""The 16-bit certificate of Yun, Kang, Rameau and Fu (2023), input by input.

With M32 the float32 classifier and M16 the same weights run in a 16-bit (or any) format, take
for an input x

    δ(x) = max_i |M16(x)_i - M32(x)_i|        (the l-inf distance of the two output vectors)
    Γ(x) = M32(x)_(1) - M32(x)_(2)            (the gap between M32's two largest outputs)

Every output of M16 lies within δ of M32's, so the winner's lead can shrink by at most 2δ: if
Γ > 2δ the two models predict the same class (strictly, which also rules out ties). The check is
done in float64, where the differences of float32 values are exact. A certified input whose
predictions differ would contradict the argument: such a "violation" is a bug, and the summary
counts them so that the tests can require zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..numerics.formats import Format, parse_format
from ..numerics.quantize import quantize
from ..training.policy import parse_policy
from ..training.tree import cast_floating
from .common import (as_batches, fp32_twin, low_precision_copy, plan_of, run_model,
                     scaled_policy, static_format)

__all__ = ["certify", "certify_target", "Certificate", "certificate_from_outputs"]


@dataclass
class Certificate:
    format: str
    outputs: str
    delta: np.ndarray  # float64, one per input
    gamma: np.ndarray
    certified: np.ndarray  # bool: gamma > 2 * delta
    agree: np.ndarray  # bool: same argmax
    pred32: np.ndarray
    pred16: np.ndarray
    labels: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.delta.size)

    @property
    def violations(self) -> int:
        """Certified inputs whose predictions differ: always 0 unless something is wrong."""
        return int((self.certified & ~self.agree).sum())

    def summary(self) -> dict:
        out = {
            "format": self.format, "outputs": self.outputs, "n": self.n,
            "certified": float(self.certified.mean()) if self.n else float("nan"),
            "agreement": float(self.agree.mean()) if self.n else float("nan"),
            "violations": self.violations,
            "delta_max": float(self.delta.max()) if self.n else float("nan"),
            "delta_median": float(np.median(self.delta)) if self.n else float("nan"),
        }
        if self.labels is not None and self.n:
            out["accuracy32"] = float((self.pred32 == self.labels).mean())
            out["accuracy16"] = float((self.pred16 == self.labels).mean())
        return out

    def per_class(self) -> list[dict]:
        """Breakdown by true label (or by M32's prediction when labels are unknown)."""
        key = self.labels if self.labels is not None else self.pred32
        rows = []
        for c in np.unique(key):
            m = key == c
            rows.append({"class": int(c), "n": int(m.sum()),
                         "certified": float(self.certified[m].mean()),
                         "agreement": float(self.agree[m].mean()),
                         "violations": int((self.certified[m] & ~self.agree[m]).sum())})
        return rows

    def to_payload(self, max_points: int = 2000) -> dict:
        """JSON-able form for the results database (δ and Γ subsampled for the scatter plot)."""
        idx = np.arange(self.n)[:max_points]
        return {"summary": self.summary(), "per_class": self.per_class(),
                "delta": self.delta[idx].tolist(), "gamma": self.gamma[idx].tolist(),
                "agree": self.agree[idx].astype(int).tolist()}

    def __str__(self) -> str:
        s = self.summary()
        return (f"{s['format']} ({s['outputs']}): {100 * s['certified']:.1f}% of {s['n']} inputs "
                f"certified (Γ > 2δ), {100 * s['agreement']:.2f}% same prediction, "
                f"{s['violations']} violations")


def certificate_from_outputs(out32: torch.Tensor, out16: torch.Tensor, *, fmt: str = "?",
                             outputs: str = "logits", labels=None) -> Certificate:
    """δ, Γ, certified and agree from the two output matrices (N, classes), in float64."""
    o32 = out32.detach().double().cpu().numpy()
    o16 = out16.detach().double().cpu().numpy()
    if o32.shape != o16.shape or o32.ndim != 2 or o32.shape[1] < 2:
        raise ValueError(f"outputs must be (N, classes >= 2) matrices of one shape, got "
                         f"{o32.shape} and {o16.shape}")
    delta = np.abs(o16 - o32).max(axis=1)
    top2 = np.sort(o32, axis=1)[:, -2:]
    gamma = top2[:, 1] - top2[:, 0]
    finite = np.isfinite(delta) & np.isfinite(gamma)
    certified = finite & (gamma > 2.0 * delta)
    pred32, pred16 = o32.argmax(axis=1), o16.argmax(axis=1)
    agree = pred32 == pred16
    lab = None if labels is None else np.asarray(torch.as_tensor(labels).cpu())
    return Certificate(str(fmt), outputs, delta, gamma, certified, agree, pred32, pred16, lab)


def certify_target(fmt, outputs: str = "logits"):
    """What :func:`certify` runs the twin in for ``fmt``: (a format, a scaled-GEMM policy or
    a plan; its label; the format the twin's softmax rounds to under ``outputs="probs"``,
    None: fp32); a ValueError naming what it accepts for anything else (``lowprec certify``
    checks its ``--format`` with it before training the model)."""
    if outputs not in ("logits", "probs"):
        raise ValueError(f"outputs={outputs!r}; accepted: logits, probs")
    plan = plan_of(fmt)
    if plan is not None:  # each module as the plan runs it; the softmax in the base policy
        base = parse_policy(plan.policy)
        softmax_fmt = None
        if outputs == "probs" and base.scaled is None:
            softmax_fmt = static_format(
                base.compute, "certify(outputs='probs'), which rounds the softmax onto the "
                "plan's base compute format,", "certify its logits (outputs='logits')")
        return plan, (fmt.strip() if isinstance(fmt, str) else "plan"), softmax_fmt
    if (pol := scaled_policy(fmt)) is not None:
        return pol, str(pol), None  # a scaled-GEMM recipe: its copy's softmax in fp32
    fmt = parse_format(fmt) if outputs == "logits" else static_format(
        fmt, "certify(outputs='probs'), which rounds the softmax onto the format,",
        "certify its logits (outputs='logits')")
    return fmt, str(fmt), fmt


@torch.no_grad()
def certify(model: torch.nn.Module, data, fmt: str | Format = "fp16", *,
            outputs: str = "logits", backend: str = "emulated",
            batch_size: int = 1000, output_fn=None) -> Certificate:
    """Run the same weights in float32 and in ``fmt`` on every input of ``data`` and certify.

    ``data``: a :class:`lowprec.experiments.data.Dataset` (its test split), an (x, y) pair, a tensor of
    inputs, or an iterable of (x, y). ``outputs``: ``"logits"`` or ``"probs"`` (softmax, taken
    in each model's own precision). ``fmt`` may also be a scaled-GEMM policy (the recipe is
    certified) or a per-layer plan (``"plan:FILE"`` or a :class:`lowprec.training.plan.Plan`):
    the twin then runs each module in the formats the plan assigns it, set up by
    ``Precision(plan)`` as training runs it, and ops outside any module (the softmax of
    ``probs``) in the plan's base policy. ``backend``: how the 16-bit twin runs (see Precision).
    Inputs may be a tensor or a dict of keyword inputs; only floating tensors are cast (token
    ids stay integers: fp16 holds integers exactly only up to 2048). The output is
    ``output_fn(out)``, else a ``ModelOutput``'s ``logits``, else the first tensor; outputs with
    more than two dimensions (a language model's (N, L, vocabulary)) are certified per position.
    """
    fmt, label, softmax_fmt = certify_target(fmt, outputs)
    m32 = fp32_twin(model).eval()
    m16, prec = low_precision_copy(model, fmt, backend)
    m16.eval()
    o32s, o16s, labels = [], [], []
    for x, y in as_batches(data, batch_size):
        x32 = cast_floating(x, torch.float32)
        o32 = run_model(m32, x32, output_fn).float()
        with prec.autocast():  # as training runs it (a mixed policy rounds only there)
            o16 = run_model(m16, prec.convert_input(x32), output_fn).float()
        if o32.dim() > 2:
            o32, o16 = o32.reshape(-1, o32.shape[-1]), o16.reshape(-1, o16.shape[-1])
        if y is not None:
            y = torch.as_tensor(y).reshape(-1)
            if y.numel() != o32.shape[0]:
                y = None
        if outputs == "probs":
            o32 = torch.softmax(o32, dim=1)
            o16 = torch.softmax(o16, dim=1)
            if softmax_fmt is not None:
                o16 = quantize(o16, softmax_fmt)  # the 16-bit model's softmax
        o32s.append(o32)
        o16s.append(o16)
        if y is not None:
            labels.append(torch.as_tensor(y))
    cert = certificate_from_outputs(torch.cat(o32s), torch.cat(o16s), fmt=label,
                                    outputs=outputs,
                                    labels=torch.cat(labels) if labels else None)
    cert.extra["backend"] = prec.backend
    return cert
