"""``plan``: the search from a model to a verified :class:`~lowprec.training.plan.Plan`, in
three named steps (measure, assign, verify), and the evidence and metadata the plan keeps."""

from __future__ import annotations

import math
import time

from torch import nn

from ...training.plan import Plan
from ...training.policy import parse_policy
from .assign import Draft, draft_plan
from .levels import DEFAULT_MENU
from .measure import Measurements, hw_note, measure, why
from .settings import SearchLog, Settings, check_settings
from .verify import Verified, verify

__all__ = ["plan", "evidence", "plan_meta"]


def evidence(m: Measurements, cfg: Settings, draft: Draft) -> dict:
    """Per module: kind, parameters, the level and its formats and cost, why (the
    measurements and repairs that decided), and every level's verdict and cost."""
    out = {}
    for n, p in m.prof.items():
        lv = draft.chosen[n]
        reason = why(lv, m.order, m.judged[n], draft.repaired.get(n), draft.settled)
        note = hw_note(m, cfg.profile, n, lv)
        out[n] = {
            "kind": p.kind, "params": p.n_params, "level": lv,
            "formats": dict(m.judged[n][lv]["formats"]),
            "cost": m.costs[n][lv],
            "why": reason + (f"; {note}" if note else ""),
            "levels": {k: {a: b for a, b in m.judged[n][k].items()} | {"cost": m.costs[n][k]}
                       for k in m.order}}
        if cfg.profile is not None:
            out[n]["time"] = m.times[n][lv]
    return out


def plan_meta(m: Measurements, cfg: Settings, draft: Draft, v: Verified, data,
              plan_seconds: float) -> dict:
    """What the search was asked and how it went: the settings, acceptance, repairs, the
    optimizer state, the best uniform level that held, the modules kept high, the seconds."""
    runs = v.runs
    uniform_ok = [k for k, r in runs.items() if k.startswith("uniform")
                  and math.isfinite(r["mean"]) and r["mean"] >= v.target
                  and not r.get("block_refused")]
    best_uniform = min(uniform_ok, key=lambda k: runs[k]["cost"], default=None)
    return {"menu": list(cfg.menu), "order": m.order, "minimise": cfg.minimise,
            "hardware": cfg.profile.to_json() if cfg.profile is not None else None,
            "compare_with": list(cfg.comparators),
            "tolerance": cfg.tolerance, "steps": cfg.steps, "seeds": list(cfg.seeds),
            "lr": cfg.lr, "momentum": cfg.momentum, "batch_size": cfg.batch_size,
            "accepted": v.accepted, "repairs": draft.repairs,
            "optimizer_state": str(parse_policy(v.policy).optimizer_state),
            "best_uniform": best_uniform,
            "high": sorted(n for n in m.prof if draft.chosen[n] != m.order[0]),
            "plan_seconds": plan_seconds, "fp32_train_seconds": v.fp32_seconds,
            "plan_over_fp32_run": plan_seconds / max(v.fp32_seconds, 1e-9),
            "data": getattr(data, "name", None)}


def plan(model: nn.Module, data, loss_fn=None, *, menu=DEFAULT_MENU, minimise: str = "memory",
         hardware=None, tolerance: float = 0.01, steps: int = 200, seeds=(0,),
         lr: float = 0.02, momentum: float = 0.9, batch_size: int = 64, probe_batches: int = 2,
         max_repairs: int | None = None, compare_uniform: bool = True, compare_with=None,
         output_fn=None, log=None) -> Plan:
    """The cheapest per-module assignment of ``menu``'s levels (see the package docstring)
    that trains ``model`` on ``data`` (a Dataset: x_train, y_train, x_test, y_test) to within
    ``tolerance`` (a fraction: 0.01 is one accuracy point) of float32's mean test accuracy after
    ``steps`` SGD steps per seed. ``minimise``: ``memory`` (bytes), ``bits`` (moved) or ``time``
    (the roofline estimate on the named ``hardware`` profile of
    :data:`lowprec.analysis.roofline.PROFILES`; given with another budget, the estimate is
    reported beside it). ``compare_with``: uniform levels trained beside the plan besides the
    menu's (default: 16-mixed when fp16 is in the menu). ``log``: called with each line of the
    search as it happens."""
    t_start = time.perf_counter()
    loss_fn = loss_fn or nn.functional.cross_entropy
    cfg = check_settings(menu=menu, minimise=minimise, hardware=hardware, tolerance=tolerance,
                         steps=steps, seeds=seeds, lr=lr, momentum=momentum,
                         batch_size=batch_size, probe_batches=probe_batches,
                         max_repairs=max_repairs, compare_uniform=compare_uniform,
                         compare_with=compare_with, output_fn=output_fn)
    say = SearchLog(log)
    m = measure(model, data, loss_fn, cfg)
    draft = draft_plan(model, loss_fn, m, cfg, say)
    v = verify(model, data, loss_fn, m, cfg, draft, say)
    plan_seconds = time.perf_counter() - t_start
    say(f"plan found in {plan_seconds:.1f} s = {plan_seconds / max(v.fp32_seconds, 1e-9):.1f}x "
        f"one fp32 training run of {steps} steps ({v.fp32_seconds:.1f} s)")
    return Plan(policy=v.policy, overrides=v.overrides, evidence=evidence(m, cfg, draft),
                verification={"runs": v.runs, "attempts": v.attempts}, log=tuple(say.lines),
                meta=plan_meta(m, cfg, draft, v, data, plan_seconds))
