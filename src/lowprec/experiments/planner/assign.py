"""Step 2 of the search, assign: each module at the cheapest level it passes, the optimizer
state's format, the base policy and its overrides, and the repair that raises the most
sensitive module one level (used by the joint probe here and by the verification)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ...analysis.advise import UNDERFLOW_MAX
from ...analysis.plan_scores import PERTURB_MAX, assign, loss_under
from ...analysis.ranges import classify
from ...numerics.formats import FP32, Format
from ...numerics.storage import format_bytes
from ...training.policy import WriteBack, parse_policy
from .levels import LEVELS
from .measure import Measurements, hw_note, why
from .settings import Settings

__all__ = ["Draft", "optimizer_state", "build", "raise_one", "joint_probe", "draft_plan"]


@dataclass
class Draft:
    """The assignment under search: module -> level, the optimizer state's format, the
    repairs that raised a module (module -> why) and how many ran out of ``budget``."""

    chosen: dict[str, str]
    state_fmt: Format
    budget: int
    repaired: dict[str, str] = field(default_factory=dict)
    repairs: int = 0
    settled: str | None = None  # the uniform level the plan settled on, and why (verify.settle)


def optimizer_state(m: Measurements, lr: float) -> tuple[Format, str]:
    """The narrowest parameter format of the menu that holds the weight gradients (momentum
    starts as the gradient): none overflows, at most 1% flush, counted over the elements whose
    update fp32 itself applies (w + lr g != w in float32; where fp32 loses the update too, a
    flushed momentum changes nothing). The format and the words saying why."""
    live = []
    for p in m.prof.values():
        if p.weight_grads.numel() == p.weights.numel():
            g = p.weight_grads
            live.append(g[(p.weights - lr * g) != p.weights])
    grads_all = torch.cat(live) if live else torch.zeros(0)
    candidates = []  # the menu's parameter formats, narrowest first (ties: the levels' order)
    for lv in m.order:
        if m.levels[lv].params not in candidates:
            candidates.append(m.levels[lv].params)
    for fmt in sorted(candidates, key=lambda f: format_bytes(f, 1 << 20)):
        c = classify(grads_all, fmt)
        if c["overflow"] == 0 and c["flush"] <= UNDERFLOW_MAX:
            return fmt, f"{fmt}: {100 * c['flush']:.2f}% of weight gradients flush, none overflow"
    return FP32, "fp32"


def build(m: Measurements, assignment: dict, state_fmt: Format) -> tuple[str, dict]:
    """The base policy (the level holding most parameters, with the optimizer state, a loss
    scale where a module's level needs one, a stochastic write-back where one needs it) and
    the override of every other module."""
    weight = {}
    for n, lv in assignment.items():
        weight[lv] = weight.get(lv, 0) + m.prof[n].n_params
    base_lv = max(m.order, key=lambda lv: (weight.get(lv, 0), -m.order.index(lv)))
    scale = any(m.judged[n][lv]["needs_loss_scale"] for n, lv in assignment.items())
    sr = any(m.judged[n][lv]["needs_stochastic"] for n, lv in assignment.items())
    pol = parse_policy(f"{LEVELS[base_lv]},o={state_fmt}")
    base = pol.with_(loss_scale="dynamic" if scale else "none",
                     update=WriteBack.STOCHASTIC if sr else WriteBack.NEAREST).spec
    over = {}
    for n, lv in assignment.items():
        if lv != base_lv:
            over[n] = LEVELS[lv]
    # a module under an overridden parent keeps its own level explicitly
    for n, lv in assignment.items():
        if n not in over and any(n.startswith(o + ".") for o in over):
            over[n] = LEVELS[lv]
    return base, over


def raise_one(m: Measurements, draft: Draft, reason: str,
              say: Callable[[str], None]) -> str | None:
    """Raise the module most sensitive in its current level (perturbation, then gradient
    flush) to the next level it passes, or fp32; the module, or None when all are fp32."""
    assignment = draft.chosen
    movable = [n for n, lv in assignment.items() if lv != "fp32"]
    if not movable:
        return None

    def score(n):
        pert = m.judged[n][assignment[n]]["perturbation"]
        return (math.inf if pert is None else pert, m.judged[n][assignment[n]]["grad_flush"])

    worst = max(movable, key=score)
    old = assignment[worst]
    up = [lv for lv in m.order[m.order.index(old) + 1:] if m.passes[worst][lv] or lv == "fp32"]
    assignment[worst] = up[0]
    draft.repaired[worst] = reason
    say(f"repair: {reason}; raise {worst} from {old} to {up[0]} (loss moved "
        f"{100 * score(worst)[0]:.2f}% with it alone in {old})")
    return worst


def joint_probe(model: nn.Module, loss_fn, m: Measurements, draft: Draft,
                say: Callable[[str], None], output_fn=None) -> None:
    """The whole plan on the probe batches before any training: while it moves the loss by
    more than ``PERTURB_MAX``, repair (within the budget)."""
    while True:
        base, over = build(m, draft.chosen, draft.state_fmt)
        joint = loss_under(model, m.probe, loss_fn, base, over, output_fn=output_fn)
        moved = abs(joint - m.base_loss) / max(abs(m.base_loss), 1e-12) \
            if math.isfinite(joint) else math.inf
        if moved <= PERTURB_MAX or draft.repairs >= draft.budget:
            say(f"probe: the plan moves the loss {100 * moved:.2f}% on {len(m.probe)} batches")
            break
        if raise_one(m, draft, f"the plan moves the probe loss {100 * moved:.2f}%", say) is None:
            break
        draft.repairs += 1


def draft_plan(model: nn.Module, loss_fn, m: Measurements, cfg: Settings,
               say: Callable[[str], None]) -> Draft:
    """The assignment step: the cheapest passing level per module (logged with why), the
    optimizer state, and the joint probe with its repairs."""
    chosen = assign({n: {lv: m.costs[n][lv] for lv in m.order} for n in m.prof}, m.passes,
                    m.order)
    for name in m.prof:
        note = hw_note(m, cfg.profile, name, chosen[name])
        say(f"measure {name}: {chosen[name]} ({why(chosen[name], m.order, m.judged[name])}"
            f"{'; ' + note if note else ''})")
    state_fmt, state_why = optimizer_state(m, cfg.lr)
    say(f"optimizer state in {state_why}")
    budget = cfg.max_repairs if cfg.max_repairs is not None else len(m.prof) * len(m.order)
    draft = Draft(chosen=chosen, state_fmt=state_fmt, budget=budget)
    joint_probe(model, loss_fn, m, draft, say, output_fn=cfg.output_fn)
    return draft
