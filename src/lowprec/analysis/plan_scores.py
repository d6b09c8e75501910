"""Per-module sensitivity for precision planning, and the greedy assignment it feeds.

:func:`module_profile` runs one float32 forward and backward pass and keeps, for every module
that owns parameters, what each role would have to hold: the module's floating inputs and
outputs (activations), the gradient reaching its output, its weights and weight gradients,
and their element counts (the bytes of a candidate format follow from them).

:func:`judge_level` measures one module against one candidate policy (a "level": parameter,
compute and gradient formats) with what lowprec already measures: the range classification of
:func:`lowprec.analysis.classify` (overflow of inputs, outputs, weights and output gradients;
output gradients flushed to zero, unscaled and at the power-of-two loss scale
:func:`lowprec.analysis.scaling.power_of_two_scale` recommends), lost updates
(:func:`lowprec.analysis.lost_fractions` at the training learning rate: above 10% the level
passes with a stochastic write-back), and a perturbation
score: the relative change of the loss on a few batches when only that module runs in the
level (:func:`perturbation`). The thresholds are :mod:`lowprec.analysis.advise`'s (1% of
gradients flushed, 10% of updates lost) and ``PERTURB_MAX`` for the loss.

:func:`assign` is the search: every module at the cheapest level it passes, cost measured per
module (see docs/design.md, "Planning", for why a greedy with repair rather than an ILP).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..numerics.formats import FP32, Format
from ..numerics.storage import format_bytes
from ..training.emulation.scaled import RecipeCoverageWarning
from ..training.policy import Policy
from ..training.precision import Precision
from .advise import LOST_MAX, UNDERFLOW_MAX
from .common import fp32_twin, untouched, run_model
from .plan_costs import MATMUL_KINDS, block_refusal, bytes_of, covered, module_time, role_bits
from .ranges import classify
from .roofline import PROFILES
from .scaling import power_of_two_scale
from .updates import lost_fractions

__all__ = ["ModuleProfile", "module_profile", "judge_level", "perturbation", "loss_under",
           "module_cost", "assign", "PERTURB_MAX", "GRAD_COS_MIN", "COSTS"]

#: a module fails a level when running it alone there changes the loss by more than this
#: fraction (relative to the float32 loss) on the probe batches
PERTURB_MAX = 0.05
#: a block-scaled level fails a linear layer whose weight gradient, computed by the level's
#: grad_weight GEMM from this step's operands, has a cosine below this with float32's
GRAD_COS_MIN = 0.9

COSTS = ("memory", "bits", "time")


@dataclass
class ModuleProfile:
    """What one module's roles hold in one float32 training step (flattened, float32)."""

    name: str
    kind: str
    inputs: torch.Tensor
    outputs: torch.Tensor
    out_grads: torch.Tensor
    weights: torch.Tensor
    weight_grads: torch.Tensor
    n_params: int
    n_in: int
    n_out: int
    extra: dict = field(default_factory=dict)


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    ts = [t.detach().float().flatten() for t in ts if t is not None and t.numel()]
    return torch.cat(ts) if ts else torch.zeros(0)


def planned_modules(model: nn.Module) -> list[str]:
    """The modules a plan assigns: every named module owning parameters (the root's own
    parameters follow the base policy)."""
    return [n for n, m in model.named_modules()
            if n and any(True for _ in m.parameters(recurse=False))]


def _gemm_extra(mod: nn.Module, ins: list, outs: list) -> dict:
    """The GEMM shape of a linear or convolution layer: ``in_features`` (K, the forward's
    reduction axis), ``out_features`` (N), ``rows`` (M: the input's rows, tokens of the batch),
    ``fwd_flops`` (2 x the forward's multiply-adds) and, for a linear layer, its weight's
    (N, K) and its first input's (M, K) shapes for the block-scaled judgement."""
    w = getattr(mod, "weight", None)
    if not torch.is_tensor(w) or w.dim() < 2 or not outs:
        return {}
    n_out = sum(t.numel() for t in outs)
    if isinstance(mod, nn.Linear):
        k, n = mod.in_features, mod.out_features
        rows = sum(t.numel() for t in ins) // k if ins else 0
        return {"in_features": k, "out_features": n, "rows": rows,
                "fwd_flops": 2 * rows * k * n}
    if isinstance(mod, nn.modules.conv._ConvNd):
        # each output element of a convolution takes in_channels / groups x kernel
        # multiply-adds (weight (out, in / groups, *kernel)); each input element of a
        # transposed one scatters out_channels / groups x kernel (weight (in, out / groups, *k))
        per = w.numel() // w.shape[0]
        n = sum(t.numel() for t in ins) if mod.transposed else n_out
        return {"fwd_flops": 2 * n * per}
    return {}


def module_profile(model: nn.Module, batch, loss_fn, *, output_fn=None
                   ) -> dict[str, ModuleProfile]:
    """One float32 forward and backward pass of ``model`` on ``batch`` (inputs, targets);
    per module of :func:`planned_modules`, its roles' values. The model is left as it was
    (gradients and buffers restored)."""
    names = planned_modules(model)
    mods = dict(model.named_modules())
    ins: dict[str, list] = {n: [] for n in names}
    outs: dict[str, list] = {n: [] for n in names}
    grads: dict[str, list] = {n: [] for n in names}
    handles = []
    for name in names:
        def hook(mod, args, out, name=name):
            # copies: a later in-place op (ReLU(inplace=True) after a batch norm, ``out +=
            # identity``) would otherwise change what is kept of the values the layer saw
            ins[name] += [a.detach().clone() for a in args
                          if torch.is_tensor(a) and a.is_floating_point()]
            if torch.is_tensor(out) and out.is_floating_point():
                outs[name].append(out.detach().clone())
                if out.requires_grad:
                    out.register_hook(lambda g, name=name: grads[name].append(g.detach()))
        handles.append(mods[name].register_forward_hook(hook))
    inputs, targets = batch
    try:
        with untouched(model):
            loss = loss_fn(run_model(model, inputs, output_fn), targets)
            loss.float().backward()
            prof = {}
            for name in names:
                own = [p for p in mods[name].parameters(recurse=False)]
                prof[name] = ModuleProfile(
                    name, type(mods[name]).__name__, _flat(ins[name]), _flat(outs[name]),
                    _flat(grads[name]), _flat(own), _flat([p.grad for p in own]),
                    sum(p.numel() for p in own), sum(t.numel() for t in ins[name]),
                    sum(t.numel() for t in outs[name]),
                    _gemm_extra(mods[name], ins[name], outs[name]))
    finally:
        for h in handles:
            h.remove()
    return prof


def _moved_bytes(p: ModuleProfile, level: Policy) -> int:
    r = role_bits(p, level)
    return (2 * bytes_of(r["act"], p.n_in) + 2 * bytes_of(r["weight_op"], p.n_params)
            + bytes_of(r["out"], p.n_out) + 2 * bytes_of(r["grad_op"], p.n_out)
            + bytes_of(r["grad_out"], p.n_in) + bytes_of(r["grad_out"], p.n_params)
            + 2 * bytes_of(r["params"], p.n_params))


def module_cost(p: ModuleProfile, level: Policy, cost: str = "memory", *,
                hardware=None) -> float:
    """What ``level`` costs for module ``p`` per training step
    (:func:`lowprec.analysis.plan_costs.role_bits` gives each role's width). ``memory``: bytes
    of its parameters and their gradients (parameter format) and of its output activations
    (the width the level keeps them at for the backward; under a scaled recipe's level, the
    GEMM's input operand as cast, which is what it keeps). ``bits``: bits its GEMM moves:
    forward reads input and weight (compute format, or a scaled recipe's operands with their
    scales) and writes the output; backward reads the output gradient (gradient format) twice,
    the input and weight again, and writes the input and weight gradients; the weight is read
    and written once more in its storage format by the update. ``time``: seconds on the named
    ``hardware`` profile, the roofline max(GEMM flops / the format's peak, the ``bits`` bytes /
    bandwidth) (:mod:`lowprec.analysis.roofline`)."""
    if cost == "memory":
        r = role_bits(p, level)
        # what the backward keeps: the output (the next module's input) at the compute width;
        # under a scaled recipe the GEMM keeps its own input operand, cast (n_in elements)
        kept = p.n_in if covered(p, level) else p.n_out
        return 2 * format_bytes(level.params, p.n_params) + bytes_of(r["saved"], kept)
    if cost == "bits":
        return 8 * _moved_bytes(p, level)
    if cost == "time":
        if hardware is None:
            raise ValueError("cost='time' needs hardware=NAME; accepted: "
                             f"{', '.join(PROFILES)}")
        return module_time(p, level, hardware, _moved_bytes(p, level))["seconds"]
    raise ValueError(f"cost={cost!r}; accepted: {', '.join(COSTS)}")


@torch.no_grad()
def loss_under(model: nn.Module, batches, loss_fn, policy, overrides: dict | None = None,
               *, output_fn=None) -> float:
    """The mean loss of a copy of ``model`` run under ``policy`` with ``overrides`` on
    ``batches`` (forward only); inf when it is not finite."""
    twin = fp32_twin(model).eval()
    prec = Precision(policy, overrides=overrides or None)
    twin, _ = prec.setup(twin)
    total = 0.0
    for x, y in batches:
        with prec.autocast(), warnings.catch_warnings():
            # a level tried on one module may carry a recipe that module has no GEMM for:
            # what the measurement is for, not news for the planner's user
            warnings.simplefilter("ignore", RecipeCoverageWarning)
            v = float(loss_fn(run_model(twin, prec.convert_input(x), output_fn).float(), y))
        if not math.isfinite(v):
            return math.inf
        total += v
    return total / max(1, len(batches))


def perturbation(model: nn.Module, batches, loss_fn, name: str, level: Policy, *,
                 base_loss: float, output_fn=None) -> float:
    """Relative change of the loss when only module ``name`` runs under ``level`` (the rest in
    float32): |L - L32| / max(L32, 1e-12); inf when the loss is not finite."""
    v = loss_under(model, batches, loss_fn, "32-true", {name: level.spec}, output_fn=output_fn)
    if not math.isfinite(v):
        return math.inf
    return abs(v - base_loss) / max(abs(base_loss), 1e-12)


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.0f}%"


def judge_level(p: ModuleProfile, level: Policy, *, lr: float, perturb: float | None = None,
                optimizer: str = "sgd", generator: torch.Generator | None = None) -> dict:
    """The measurements of module ``p`` in ``level`` and whether it passes: ``ok``,
    ``needs_loss_scale`` (passes only with a loss scale), ``needs_stochastic`` (more than
    ``LOST_MAX`` of its updates are lost with a nearest write-back), ``reasons`` (a sentence per failed
    check, each quoting its number) and the numbers themselves."""
    c, g, w = level.compute, level.grads, level.params
    if level.scope == "matmul" and p.kind not in MATMUL_KINDS:
        c = g = FP32  # torch.autocast runs norms and embeddings in fp32
    act_in = classify(p.inputs, c) if c != FP32 else {"overflow": 0.0}
    act_out = classify(p.outputs, c) if c != FP32 else {"overflow": 0.0}
    wts = classify(p.weights, w) if w != FP32 else {"overflow": 0.0}
    gr = classify(p.out_grads, g) if g != FP32 else {"overflow": 0.0, "flush": 0.0}
    m = {"input_overflow": act_in["overflow"], "output_overflow": act_out["overflow"],
         "weight_overflow": wts["overflow"], "grad_overflow": gr["overflow"],
         "grad_flush": gr["flush"], "loss_scale": 1.0, "grad_flush_scaled": gr["flush"],
         "lost_updates": 0.0, "lost_updates_sr": 0.0, "perturbation": perturb,
         "formats": {"params": str(w), "compute": str(c), "grads": str(g)}}
    if g != FP32 and gr["flush"] > UNDERFLOW_MAX and p.out_grads.numel():
        gmax = float(p.out_grads.abs().max())
        scale = power_of_two_scale(gmax, g, 2.0 ** 3, 2.0 ** 24)
        m["loss_scale"] = scale
        m["grad_flush_scaled"] = classify(p.out_grads * scale, g)["flush"]
    if w != FP32 and p.weights.numel() and p.weight_grads.numel() == p.weights.numel():
        dw = -lr * p.weight_grads
        if optimizer == "adam":
            dw = -lr * p.weight_grads / (p.weight_grads.abs() + 1e-8)
        lf = lost_fractions(p.weights, dw, w, generator)
        m["lost_updates"], m["lost_updates_sr"] = lf["nearest"], lf["stochastic"]
    reasons = []
    for key, what in (("input_overflow", f"inputs overflow {c}"),
                      ("output_overflow", f"outputs overflow {c}"),
                      ("weight_overflow", f"weights overflow {w}"),
                      ("grad_overflow", f"output gradients overflow {g}")):
        if m[key] > 0:
            reasons.append(f"{_pct(m[key])} of {what}")
    needs_scale = False
    if m["grad_flush"] > UNDERFLOW_MAX:
        if m["grad_flush_scaled"] <= UNDERFLOW_MAX:
            needs_scale = True
        else:
            reasons.append(f"{_pct(m['grad_flush'])} of output gradients flush to zero in {g} "
                           f"({_pct(m['grad_flush_scaled'])} at loss scale "
                           f"{m['loss_scale']:g})")
    # lost updates are a remedy, not a refusal: a stochastic write-back keeps every update in
    # expectation (the plan then writes back stochastically); training verifies it
    needs_sr = m["lost_updates"] > LOST_MAX
    if perturb is not None and not perturb <= PERTURB_MAX:
        reasons.append("the loss is not finite with this module alone in it"
                       if math.isinf(perturb) else
                       f"the loss moves {_pct(perturb)} with this module alone in it")
    if covered(p, level):
        m["formats"]["compute"] = f"{c}, {level.scaled} GEMMs"
        refusal = block_refusal(p, level)
        if refusal:
            reasons.insert(0, refusal)
        m.update(_block_scaled(p, level, generator))
        if m["grad_cosine"] is not None and not m["grad_cosine"] >= GRAD_COS_MIN:
            reasons.append(f"the weight gradient through the {level.scaled} GEMMs keeps cosine "
                           f"{m['grad_cosine']:.2f} with fp32's (< {GRAD_COS_MIN})")
    m.update(ok=not reasons, needs_loss_scale=needs_scale, needs_stochastic=needs_sr,
             reasons=reasons)
    return m


def _block_scaled(p: ModuleProfile, level: Policy, generator) -> dict:
    """A linear layer's operands under ``level``'s scaled recipe: per role (input, weight,
    output gradient) the fraction of nonzero elements flushed to zero in their blocks and
    saturated (:func:`lowprec.numerics.scaling.cast_stats`), and the cosine between the weight
    gradient of the scaled grad_weight GEMM and float32's (go^T x, both from this step)."""
    from ..numerics.scaling import scaled_cast

    k, n, rows = (p.extra.get(key) for key in ("in_features", "out_features", "rows"))
    out = {"block_casts": {}, "grad_cosine": None}
    if not (k and n and rows) or p.inputs.numel() != rows * k \
            or p.out_grads.numel() != rows * n:
        return out
    sc = level.scaled
    x = p.inputs.reshape(rows, k)
    w = p.weights[:n * k].reshape(n, k)
    go = p.out_grads.reshape(rows, n)
    for role, t, cast in (("input", x, sc.input), ("weight", w, sc.weight),
                          ("grad_output", go, sc.grad_output)):
        if cast.is_hp:
            continue
        st: dict = {}
        scaled_cast(t, cast, -1, stats=st, generator=generator)
        out["block_casts"][role] = {"flushed": st["flushed"], "saturated": st["saturated"]}
    # grad_weight = go^T @ x, both cast along the rows (this GEMM's reduction axis)
    gq = scaled_cast(go, sc.grad_output_gw, -2, generator=generator)
    xq = scaled_cast(x, sc.input_gw, -2, generator=generator)
    ref = (go.double().T @ x.double()).flatten()
    got = (gq.double().T @ xq.double()).flatten()
    den = float(ref.norm() * got.norm())
    out["grad_cosine"] = float(ref @ got) / den if den > 0 else None
    return out


def assign(costs: dict[str, dict[str, int]], passes: dict[str, dict[str, bool]],
           order: list[str]) -> dict[str, str]:
    """Every module at the cheapest level it passes: ``costs[module][level]`` and
    ``passes[module][level]``; ``order``: the levels from cheapest to dearest as a tie-break
    (the last is the fallback, float32, taken when a module passes nothing cheaper)."""
    out = {}
    for name, by_level in costs.items():
        ok = [lv for lv in order if passes[name].get(lv)]
        if not ok:
            out[name] = order[-1]
            continue
        out[name] = min(ok, key=lambda lv: (by_level[lv], order.index(lv)))
    return out
