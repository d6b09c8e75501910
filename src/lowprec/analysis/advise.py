"""``advise``: can this model train and run in a format, and what must be done for it to work?

It runs the analyses on a few batches of the user's model and data (optionally after a short
float32 training) and turns their measurements into a verdict with reasons. Every sentence it
prints quotes a number it measured; the thresholds are stated here:

* unsafe to run: a non-finite value appears in the forward pass in the format, or fewer than
  95% of the test predictions agree with float32;
* a loss scale is needed when more than 1% of the nonzero gradient values flush to zero at
  scale 1 (the recommended scale is :func:`lowprec.find_loss_scale`'s); where none is needed
  but more than 10% of them are subnormal there (fewer significant bits: what the report's
  range plots show), the reason says so and names the scale that would lift them;
* a layer whose nearest-rounding write-back loses more than 10% of its updates needs stochastic
  rounding or float32 master weights;
* otherwise: safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from ..numerics.formats import FP32, Format, parse_format
from ..numerics.rounding import RoundingSpec
from ..training.policy import Backend, Policy, parse_policy
from ..training.tree import batch_size_of, slice_batch
from .common import scaled_policy, static_format
from .scaling import find_loss_scale
from .certify import Certificate, certify
from .layers import LayerError, layer_errors
from .nonfinite import NonFiniteReport, first_nonfinite
from .ranges import RangeProfile, range_profile
from .updates import LostUpdates, lost_updates

__all__ = ["advise", "advise_target", "Advice", "judge", "gradient_subnormals", "AGREEMENT_MIN",
           "UNDERFLOW_MAX", "SUBNORMAL_NOTE", "LOST_MAX"]

AGREEMENT_MIN = 0.95
UNDERFLOW_MAX = 0.01
SUBNORMAL_NOTE = 0.10
LOST_MAX = 0.10


@dataclass
class Advice:
    format: str
    verdict: str  # "safe", "needs care", "unsafe"
    reasons: list[str]
    certificate: Certificate
    loss_scale: float
    underflow_at_1: float
    underflow_at_scale: float
    lost: list[LostUpdates]
    layers: list[LayerError]
    ranges: RangeProfile
    nonfinite: NonFiniteReport
    measurements: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The verdict, its reasons and the headline numbers as plain data (``--json``)."""
        worst = max(self.lost, key=lambda r: r.nearest, default=None)
        return {"format": self.format, "verdict": self.verdict, "reasons": list(self.reasons),
                "certificate": self.certificate.summary(), "loss_scale": self.loss_scale,
                "underflow_at_1": self.underflow_at_1,
                "underflow_at_scale": self.underflow_at_scale,
                "worst_lost_updates": None if worst is None else {
                    "layer": worst.layer, "nearest": worst.nearest,
                    "stochastic": worst.stochastic, "kahan": worst.kahan},
                "forward_nonfinite": None if self.nonfinite.forward is None
                else str(self.nonfinite.forward),
                "backward_nonfinite": None if self.nonfinite.backward is None
                else str(self.nonfinite.backward)}

    def __str__(self) -> str:
        head = f"pure {self.format}: {self.verdict}"
        return head + "\n" + "\n".join(f"  - {r}" for r in self.reasons)


def _field(row, name: str):
    return row[name] if isinstance(row, dict) else getattr(row, name)


def judge(certificate: dict, *, underflow_at_1: float, loss_scale: float, lr: float,
          underflow_at_scale: float | None = None, lost=(), forward_nonfinite=None,
          backward_nonfinite=None, subnormal_at_1: float | None = None,
          write_back: str = "nearest", certified_on: str = "test inputs", scaled: bool = False
          ) -> tuple[str, list[str]]:
    """The verdict ("safe", "needs care", "unsafe") and its reasons from measured numbers, by
    the thresholds of this module: ``certificate`` is :meth:`Certificate.summary` (``n``,
    ``certified``, ``agreement``, ``violations``); ``underflow_at_1`` the fraction of nonzero
    gradient values that flush to zero unscaled and ``loss_scale`` the recommended scale
    (``underflow_at_scale`` the fraction left there, when measured; ``subnormal_at_1`` the
    fraction of nonzero gradient values that are subnormal unscaled, when measured); ``lost``
    the per-layer lost updates (:class:`LostUpdates` or their dicts) at ``lr``, judged by the column of the
    regime's ``write_back`` (nearest, stochastic or kahan); ``certified_on`` names what was
    certified ("test inputs" of a data set, "inputs" of a batch given); ``scaled``: a
    scaled-GEMM recipe, whose casts scale each gradient operand; the first non-finite op of
    the forward and backward passes where it was looked for. :func:`advise` and the compare
    report (from the analyses stored in results.db) both judge with it."""
    s = certificate
    reasons = [f"{100 * s['certified']:.1f}% of {s['n']} {certified_on} certified (Γ > 2δ), "
               f"{100 * s['agreement']:.2f}% predict the fp32 class, {s['violations']} violations"]
    verdict = "safe"
    if forward_nonfinite is not None:
        verdict = "unsafe"
        reasons.append(f"the forward pass overflows: first non-finite output at "
                       f"{forward_nonfinite}")
    if s["agreement"] < AGREEMENT_MIN:
        verdict = "unsafe"
        reasons.append(f"only {100 * s['agreement']:.1f}% of predictions agree with fp32 "
                       f"(below {100 * AGREEMENT_MIN:.0f}%)")
    if underflow_at_1 > UNDERFLOW_MAX:
        if verdict == "safe":
            verdict = "needs care"
        if scaled:  # (each gradient operand scaled by its cast: no loss scale to give)
            reasons.append(f"{100 * underflow_at_1:.1f}% of gradient values flush to zero after "
                           "the recipe's own scaling: they span more than the cast format's "
                           "range; a finer-grained recipe (rowwise, blockwise) or a wider "
                           "gradient cast keeps them")
        elif loss_scale != 1:
            left = ("" if underflow_at_scale is None else
                    f", {100 * underflow_at_scale:.2f}% at {loss_scale:g}")
            reasons.append(f"loss scale {loss_scale:g} recommended: {100 * underflow_at_1:.1f}% "
                           f"of gradient values underflow at scale 1{left}")
        else:  # (the largest gradient leaves no room for a scale: "loss scale 1 recommended")
            reasons.append(f"{100 * underflow_at_1:.1f}% of gradient values underflow at scale "
                           "1, and no loss scale lifts them: the largest gradient already "
                           "needs scale 1 to stay below the format's limit, so the gradients "
                           "span more than the format's range; keep gradients in a wider "
                           "format (g=bf16, g=fp32) or use dynamic fixed point")
    else:
        sub = ""
        if subnormal_at_1 is not None and subnormal_at_1 > SUBNORMAL_NOTE and loss_scale > 1:
            # (not a failure: a subnormal keeps its value to within the format's smallest
            # step; the range plots show these values, and the scale that would lift them)
            sub = (f"; {100 * subnormal_at_1:.1f}% are subnormal there, with fewer significant "
                   f"bits: a loss scale up to {loss_scale:g} would lift them without overflow")
        reasons.append(f"no loss scale needed: {100 * underflow_at_1:.2f}% of gradient "
                       f"values underflow at scale 1{sub}")
    if backward_nonfinite is not None:
        reasons.append(f"at scale 1 the backward pass overflows first at {backward_nonfinite}")
    col = write_back if write_back in ("stochastic", "kahan") else "nearest"
    worst = max(lost, key=lambda r: _field(r, col), default=None)
    if worst is not None and _field(worst, col) > LOST_MAX:
        if verdict == "safe":
            verdict = "needs care"
        if col == "nearest":
            reasons.append(f"layer {_field(worst, 'layer')} loses "
                           f"{100 * _field(worst, 'nearest'):.0f}% of its updates with nearest "
                           f"rounding at lr {lr:g} ({100 * _field(worst, 'stochastic'):.0f}% of "
                           f"one stochastic draw, {100 * _field(worst, 'kahan'):.0f}% with "
                           "Kahan): use stochastic rounding or fp32 master weights")
        else:  # (the regime writes back so already: its remedy is not the advice)
            how = "one stochastic draw" if col == "stochastic" else "Kahan summation"
            reasons.append(f"layer {_field(worst, 'layer')} loses "
                           f"{100 * _field(worst, col):.0f}% of its updates with {how} (the "
                           f"regime's write-back) at lr {lr:g} "
                           f"({100 * _field(worst, 'nearest'):.0f}% with nearest rounding): "
                           "keep fp32 master weights (m=fp32)")
    elif worst is not None:
        how = {"nearest": "nearest rounding", "stochastic": "one stochastic draw",
               "kahan": "Kahan summation"}[col]
        reasons.append(f"updates survive rounding: at most {100 * _field(worst, col):.1f}% "
                       f"lost with {how} (layer {_field(worst, 'layer')}) at lr {lr:g}")
    return verdict, reasons


def gradient_subnormals(ranges: RangeProfile) -> float:
    """The fraction of a range profile's nonzero gradient values (activation and weight
    gradients, weighted by their counts) that are subnormal in its format, unscaled."""
    rows = ranges.role("activation_grads") + ranges.role("weight_grads")
    n = sum(r.n for r in rows)
    return sum(r.subnormal * r.n for r in rows) / n if n else 0.0


def _as_policy(spec) -> Policy | None:
    """The policy ``spec`` is or names; None for a format (or its name) and for anything that
    is neither."""
    if isinstance(spec, str):
        try:
            parse_format(spec)
            return None
        except (ValueError, TypeError):
            pass
        try:
            return parse_policy(spec)
        except (ValueError, TypeError):
            return None
    return spec if isinstance(spec, Policy) else None


def _regime(spec) -> Policy | None:
    """The policy ``spec`` names when it is a regime with one static format for parameters,
    activations and gradients and its own rounding (``"q6.10-sr"``, ``"fixed<16,8>-rn"``, a
    spec such as ``"p=q6.10:stochastic,c=q6.10:sr,g=q6.10:sr"``), else None (``spec`` is a
    format, or a policy the analyses cannot study through one format). The analyses then study
    that format and the first non-finite op runs the regime itself, its rounding included."""
    spec = _as_policy(spec)
    if spec is None or spec.scaled is not None or spec.compute.dynamic:
        return None
    if spec.params == spec.compute == spec.grads and spec.scope == "all":
        return spec
    return None


def advise_target(fmt) -> tuple[Format | Policy, Policy | None]:
    """What :func:`advise` studies for ``fmt``: (a format, or a policy with scaled GEMMs;
    the regime when ``fmt`` names one of one format with its own rounding, else None); a
    ValueError naming what it accepts for anything else (``lowprec advise`` checks its
    ``--format`` with it before training the model)."""
    pol = scaled_policy(fmt)
    if pol is not None:
        return pol, None
    regime = _regime(fmt)
    other = _as_policy(fmt) if regime is None else None
    if other is not None:  # (a policy advise cannot study: one line saying why)
        why = [w for w, bad in (
            ("holds several formats", len({other.params, other.compute, other.grads}) > 1),
            ("rounds the matrix ops only (s=matmul)", other.scope != "all"),
            ("has a dynamic format (no one grid)", any(
                getattr(f, "dynamic", False)
                for f in (other.params, other.compute, other.grads)))) if bad]
        raise ValueError(
            f"advise studies one static format; the policy {str(fmt)!r} "
            f"({replace(other, name=None)}) {' and '.join(why) or 'is not one'}: "
            "give a format (fp16, bf16, e4m3fn), a regime of one format (q6.10-sr, "
            "16-true) or a scaled-GEMM recipe (fp8-tensorwise)")
    return static_format(regime.compute if regime is not None else fmt, "advise"), regime


def _island_hint(nf: NonFiniteReport, regime: Policy | None, fmt) -> str | None:
    """When the backward's first Inf/NaN comes from an op of values that were exactly 0 (an
    RMSNorm's variance rounded to 0, then rsqrt): the module, and the override that keeps its
    arithmetic in fp32 (its statistics, as fixed-point hardware keeps them in a wide
    accumulator) while its weights and gradients stay in the format."""
    b = nf.backward
    if b is None or not b.zero_forward_input or b.name in ("", "loss"):
        return None
    last = b.name.rpartition(".")[2]
    glob = f"*{last}" if "norm" in last.lower() else b.name
    base = regime if regime is not None else Policy(params=fmt, compute=fmt, grads=fmt,
                                                    optimizer_state=FP32)
    island = base.with_(compute=FP32, rounding=RoundingSpec()).spec
    return (f"the backward pass's first Inf/NaN is {b.kind} in {b.name}, of values that were "
            f"exactly 0 in the forward pass ({b.forward_input['zeros']} of "
            f"{b.forward_input['numel']}: a statistic that underflowed in {fmt}); keep that "
            f"module's arithmetic in fp32: Precision(..., overrides={{'{glob}': '{island}'}})")


def _splits(data) -> tuple:
    """(training inputs, training targets, what certify reads) of a Dataset (its test split
    certified) or of an (inputs, targets) pair (certified itself); inputs may be a tensor or a
    dict of keyword inputs."""
    if isinstance(data, (tuple, list)):
        if len(data) != 2:
            raise ValueError(f"advise: data is a tuple of {len(data)} items; accepted: a Dataset "
                             "or an (inputs, targets) pair")
        return data[0], data[1], tuple(data)
    if not all(hasattr(data, a) for a in ("x_train", "y_train", "x_test", "y_test")):
        raise TypeError(f"advise: data of type {type(data).__name__}; accepted: a Dataset "
                        "(lowprec.experiments.data) or an (inputs, targets) pair")
    return data.x_train, data.y_train, data


def advise(model: nn.Module, data, fmt: str | Format = "fp16", *, loss_fn=None,
           batches: int = 4, batch_size: int = 64, lr: float = 0.01,
           optimizer: str = "sgd", output_fn=None) -> Advice:
    """``data``: a :class:`lowprec.experiments.data.Dataset`, or an ``(inputs, targets)`` pair
    (one batch, analysed and certified). The model is analysed as given (train it first,
    or let ``lowprec advise --epochs N`` do it). Its inputs may be a tensor or a dict of keyword
    inputs; ``output_fn`` picks the output tensor (default: ``logits``, else the first tensor).
    ``fmt`` may be a policy with scaled GEMMs (``"fp8-tensorwise"``): each analysis then
    studies the recipe (see :func:`lowprec.analysis.common.scaled_policy`); or a regime of one
    format with its own rounding (``"q6.10-sr"``): the analyses study the format, the first
    non-finite op runs the regime (stochastic rounding included), and an Inf/NaN the backward
    makes from values that underflowed to 0 (an RMSNorm's variance) names the module and the
    fp32 override for it."""
    x_train, y_train, test = _splits(data)
    fmt, regime = advise_target(fmt)
    pol = fmt if isinstance(fmt, Policy) else None  # a scaled-GEMM recipe
    loss_fn = loss_fn or nn.functional.cross_entropy
    n = min(batch_size_of(x_train), batches * batch_size)
    xb, yb = slice_batch(x_train, 0, n), y_train[:n]
    batch = (xb, yb)
    model = model.float()

    first = slice_batch(xb, 0, batch_size)
    cert = certify(model, test, fmt, output_fn=output_fn)
    choice = find_loss_scale(model, batch, loss_fn, fmt, output_fn=output_fn)
    ranges = range_profile(model, batch, loss_fn, fmt, output_fn=output_fn)
    lost = lost_updates(model, batch, loss_fn, fmt, lr=lr, optimizer=optimizer,
                        output_fn=output_fn)
    errs = layer_errors(model, first, fmt)
    nf = first_nonfinite(model, (first, yb[:batch_size]), loss_fn,
                         pol if pol is not None else
                         regime.with_(backend=Backend.EMULATED, name=str(regime))
                         if regime is not None else
                         Policy(params=fmt, compute=fmt, grads=fmt, optimizer_state=fmt,
                                backend=Backend.EMULATED), output_fn=output_fn)

    s = cert.summary()
    verdict, reasons = judge(s, underflow_at_1=choice.underflow_at_1, loss_scale=choice.scale,
                             underflow_at_scale=choice.underflow_at_scale, lost=lost, lr=lr,
                             forward_nonfinite=nf.forward, backward_nonfinite=nf.backward,
                             subnormal_at_1=gradient_subnormals(ranges),
                             write_back=str(regime.update) if regime is not None else "nearest",
                             certified_on="inputs" if isinstance(data, (tuple, list))
                             else "test inputs", scaled=pol is not None)
    if errs:
        last = errs[-1]
        eps = "" if pol is not None else f" (format eps {fmt.eps:.1e})"
        reasons.append(f"relative error of the output layer {last.name}: {last.rel_error:.2e}"
                       + eps)
    if (hint := _island_hint(nf, regime, fmt)) is not None:
        verdict = "unsafe"  # NaN gradients from the first step
        reasons.append(hint)
    act_over = ranges.fraction("activations", "overflow")
    if act_over > 0:
        reasons.append(f"{100 * act_over:.3f}% of activation values exceed the format's range")
    return Advice(str(regime if regime is not None else fmt), verdict, reasons, cert, choice.scale, choice.underflow_at_1,
                  choice.underflow_at_scale, lost, errs, ranges, nf,
                  {"certificate": s, "loss_scale": choice.scale})
