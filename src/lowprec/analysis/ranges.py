"""Range profiles: where the values of each role and layer fall against a format's range.

For weights, activations, gradients (of activations and of parameters) and optimizer state,
per layer: a histogram of log2|x| over the nonzero values, and the fractions that overflow
(|x| at or beyond the point where round-to-nearest leaves the finite range), flush to zero
(|x| at most half the smallest subnormal, which rounds to 0) and land in the subnormal range
(below the smallest normal, where precision is lost). The gradient histogram is Micikevicius
et al.'s (2018) argument for loss scaling: the loss scale shifts it right, and the scale that
keeps the largest gradient below max is :func:`lowprec.find_loss_scale`'s choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .common import untouched, parameter_groups, run_model, scaled_policy, static_format
from ..numerics.formats import FixedFormat, FloatFormat, Format, parse_format
from ..numerics.quantize import memory_order

__all__ = ["range_profile", "RangeProfile", "RoleStats", "overflow_threshold", "classify",
           "has_subnormals",
           "log2_histogram"]

BINS = np.arange(-160, 131)  # log2 bin edges covering float32


def overflow_threshold(fmt: Format) -> float:
    """The magnitude from which round-to-nearest overflows (max + half the last spacing)."""
    if isinstance(fmt, FloatFormat):
        return fmt.max + 2.0 ** (fmt.emax - fmt.man_bits) / 2
    if isinstance(fmt, FixedFormat):
        return fmt.max + fmt.step / 2
    return fmt.max


def _magnitudes(values: torch.Tensor) -> torch.Tensor:
    """|x| of the nonzero finite values, in any order (a dense tensor read in its memory
    order: no copy of a channels-last activation): float64 for a float64 tensor, float32
    otherwise (every 16- and 32-bit value is exact there)."""
    v = values.detach()
    perm = memory_order(v)
    v = (v.permute(perm) if perm is not None else v).reshape(-1)
    v = (v if v.dtype in (torch.float32, torch.float64) else v.float()).abs()
    return v[torch.isfinite(v) & (v > 0)]


def _at_most(t: float, dtype: torch.dtype, strict: bool = False) -> float:
    """The largest value of ``dtype`` at most ``t`` (below ``t`` with ``strict``): ``v <= it``
    in that dtype is exactly ``v <= t`` (``v < t``) in real numbers, where comparing with
    ``t`` itself would round ``t`` to the dtype first (half fp16's smallest subnormal, 2**-25,
    is a float32; a 40-bit format's is not)."""
    np_type = np.float32 if dtype == torch.float32 else np.float64
    with np.errstate(over="ignore"):
        f = np_type(t)  # to nearest (inf beyond the dtype's range)
    if float(f) > t or (strict and float(f) == t):
        f = np.nextafter(f, np_type(-np.inf))
    return float(f)


def has_subnormals(fmt: str | Format) -> bool:
    """Whether the format (or its name) has subnormal values: not fixed point nor a -nosub
    format, whose smallest step is their smallest normal."""
    fmt = parse_format(fmt)
    return fmt.min_subnormal < fmt.min_normal


def _counts(v: torch.Tensor, fmt: Format) -> dict:
    """How many of the magnitudes ``v`` (:func:`_magnitudes`) there are, and how many
    overflow, flush to zero, are subnormal."""
    n = int(v.numel())
    if n == 0:
        return {"n": 0, "overflow": 0, "flush": 0, "subnormal": 0}
    half_sub = _at_most(fmt.min_subnormal / 2, v.dtype)
    flush = (v <= half_sub).sum().item()
    # a format without subnormals has none: the values below its smallest step round to it
    # or to zero
    sub = (v <= _at_most(fmt.min_normal, v.dtype, strict=True)).sum().item() - flush \
        if has_subnormals(fmt) else 0
    over = n - (v <= _at_most(overflow_threshold(fmt), v.dtype, strict=True)).sum().item()
    return {"n": n, "overflow": over, "flush": flush, "subnormal": sub}


def _classify(v: torch.Tensor, fmt: Format) -> dict:
    c = _counts(v, fmt)
    n = c["n"]
    return {k: (c[k] / n if n else 0.0) if k != "n" else n for k in c}


def classify(values: torch.Tensor, fmt: Format) -> dict:
    """Fractions of the nonzero finite values that overflow, flush to zero, are subnormal."""
    return _classify(_magnitudes(values), fmt)


def log2_histogram(v: torch.Tensor) -> list[int]:
    """Counts of ``log2(v)`` per bin of :data:`BINS` (``v``: positive finite magnitudes), as
    ``np.histogram(np.log2(v), bins=BINS)`` counts them. For float32 the bin is read from the
    exponent (``floor(log2 v)``, exact: ``torch.frexp`` gives ``v = m * 2**e``, m in [0.5, 1)),
    one integer pass where numpy's log2 and binary search over the edges took seconds per
    MobileNet profile."""
    if v.numel() == 0:
        return []
    if v.dtype != torch.float32:  # float64 magnitudes reach beyond the bins: numpy decides
        return np.histogram(np.log2(v.double().numpy()), bins=BINS)[0].tolist()
    _, e = torch.frexp(v)
    return torch.bincount(e.sub_(1 + int(BINS[0])), minlength=len(BINS) - 1).tolist()


@dataclass
class RoleStats:
    layer: str  # module path; a parameter the root module owns: its own name
    role: str  # weights, activations, activation_grads, weight_grads, optimizer_state
    n: int
    overflow: float
    flush: float
    subnormal: float
    max_abs: float
    min_abs: float
    # counts per log2 bin (BINS[:-1] edges); left out of the repr (256 numbers a row: a
    # profile's repr was ~40 KB for a 2-block CNN)
    hist: list = field(default_factory=list, repr=False)


@dataclass
class RangeProfile:
    format: str
    stats: list[RoleStats]

    def role(self, role: str) -> list[RoleStats]:
        return [s for s in self.stats if s.role == role]

    def fraction(self, role: str, kind: str) -> float:
        """Weighted fraction over all layers of a role (kind: overflow, flush, subnormal)."""
        rows = self.role(role)
        total = sum(r.n for r in rows)
        return sum(getattr(r, kind) * r.n for r in rows) / total if total else 0.0

    def gradient_scale(self, headroom: float = 2.0**3, max_scale: float = 2.0**24) -> float:
        """The power-of-two loss scale this profile recommends (find_loss_scale's rule)."""
        from .scaling import power_of_two_scale

        if scaled_policy(self.format) is not None:
            return 1.0  # a scaled-GEMM recipe scales each gradient operand itself
        gmax = max((r.max_abs for r in self.stats if r.role.endswith("grads") and r.n), default=0)
        return power_of_two_scale(gmax, parse_format(self.format), headroom, max_scale)


def _tally(t: torch.Tensor, fmt: Format) -> dict:
    """What a profile row keeps of the values of ``t``: :func:`_counts`, the largest and
    smallest magnitude, the log2 histogram; tallies of several tensors add up
    (:func:`_row`)."""
    v = _magnitudes(t)
    c = _counts(v, fmt)
    c["max"] = float(v.max()) if v.numel() else 0.0
    c["min"] = float(v.min()) if v.numel() else 0.0
    c["hist"] = log2_histogram(v)
    return c


def _row(layer: str, role: str, tallies: list[dict]) -> RoleStats:
    """The profile row of the values the ``tallies`` counted (of one tensor, or of a layer's
    outputs over its calls: the same numbers as of their concatenation)."""
    seen = [c for c in tallies if c["n"]]
    n = sum(c["n"] for c in seen)
    frac = {k: sum(c[k] for c in seen) / n if n else 0.0
            for k in ("overflow", "flush", "subnormal")}
    hist = [sum(col) for col in zip(*(c["hist"] for c in seen))] if seen else []
    return RoleStats(layer, role, n, frac["overflow"], frac["flush"], frac["subnormal"],
                     max((c["max"] for c in seen), default=0.0),
                     min((c["min"] for c in seen), default=0.0), hist)


def _stats(layer: str, role: str, t: torch.Tensor, fmt: Format) -> RoleStats:
    return _row(layer, role, [_tally(t, fmt)])


def range_profile(model: nn.Module, batch, loss_fn, fmt: str | Format = "fp16", *,
                  optimizer=None, loss_scale: float = 1.0, output_fn=None) -> RangeProfile:
    """Profile one float32 forward and backward pass of ``model`` on ``batch`` (inputs,
    targets); gradients are taken at ``loss_scale`` (1: what unscaled training stores).

    Given a policy with scaled GEMMs (``"fp8-tensorwise"``), the profile is of the GEMM
    operands after their casts, one row per layer and role (``gemm:input``, ``gemm:weight``,
    ``gemm:grad_output``...; :mod:`lowprec.analysis.scaled`): overflow is the fraction saturated
    at the element's max, flush the fraction cast to zero, subnormal the fraction among the
    element's subnormals; no histogram."""
    pol = scaled_policy(fmt)
    if pol is not None:
        return _scaled_profile(model, batch, loss_fn, pol, loss_scale, output_fn)
    fmt = static_format(fmt, "the range profile")
    inputs, targets = batch
    # each layer's outputs and their gradients counted as they are made (:func:`_tally`),
    # none kept: a later in-place op (ReLU(inplace=True), ``out += identity``) cannot change
    # what was counted, and no copy of every activation is held to the end (a copy each had
    # raised ResNet-20's peak memory by 40% at batch 256)
    acts: dict[str, list[dict]] = {}
    agrads: dict[str, list[dict]] = {}
    handles = []

    for name, m in model.named_modules():
        if name and next(m.children(), None) is None:
            def hook(mod, args, out, name=name):
                if torch.is_tensor(out) and out.is_floating_point():
                    acts.setdefault(name, []).append(_tally(out, fmt))
                    if out.requires_grad:
                        out.register_hook(lambda g, name=name: agrads.setdefault(
                            name, []).append(_tally(g, fmt)))
            handles.append(m.register_forward_hook(hook))
    try:
        with untouched(model):
            loss = loss_fn(run_model(model, inputs, output_fn), targets)
            (loss.float() * loss_scale).backward()
            stats: list[RoleStats] = []
            for name, m in model.named_modules():
                for label, own in parameter_groups(name, m):
                    w = torch.cat([p.detach().flatten() for _, p in own])
                    stats.append(_stats(label, "weights", w, fmt))
                    gs = [p.grad.flatten() for _, p in own if p.grad is not None]
                    if gs:
                        stats.append(_stats(label, "weight_grads", torch.cat(gs), fmt))
                    if optimizer is not None:
                        st = [v.flatten() for _, p in own for v in optimizer.state.get(p, {}).values()
                              if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
                        if st:
                            stats.append(_stats(label, "optimizer_state", torch.cat(st).float(),
                                                fmt))
                if name in acts:
                    stats.append(_row(name, "activations", acts[name]))
                if name in agrads:
                    stats.append(_row(name, "activation_grads", agrads[name]))
    finally:
        for h in handles:
            h.remove()
    return RangeProfile(str(fmt), stats)


def _scaled_profile(model, batch, loss_fn, policy, loss_scale: float, output_fn) -> RangeProfile:
    from .scaled import scaled_operands

    def scaled_loss(out, targets):
        return loss_fn(out, targets).float() * loss_scale

    rows = scaled_operands(model, batch, scaled_loss, policy, output_fn)
    stats = [RoleStats(r["layer"], f"gemm:{r['role']}", r["nonzero"], r["saturated"],
                       r["flushed"], r["subnormal"], r["amax"], r["amin"]) for r in rows]
    return RangeProfile(str(policy), stats)
