"""Step 1 of the search, measure: one float32 step profiles every module owning parameters,
each module is judged in each level of the menu and costed under the budget; and the words
that say which measurement decided a module's level."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...analysis.plan_costs import covered, role_bits
from ...analysis.plan_scores import (ModuleProfile, judge_level, loss_under, module_cost,
                                     module_profile, perturbation)
from ...analysis.roofline import HardwareProfile, runs_as
from ...training.policy import Policy, parse_policy
from .levels import LEVELS
from .settings import Settings

__all__ = ["Measurements", "probe_batches", "measure", "level_order", "hw_note", "why"]


@dataclass(frozen=True)
class Measurements:
    """What the search knows before any training, per module and level."""

    levels: dict[str, Policy]          # level name -> policy (the menu and the comparators)
    probe: list                        # the probe batches (x, y)
    base_loss: float                   # float32's loss on the probe batches
    prof: dict[str, ModuleProfile]     # module -> its float32 step
    costs: dict[str, dict[str, float]]  # module -> level -> cost under the budget
    times: dict[str, dict[str, float]]  # module -> level -> roofline seconds (with hardware)
    judged: dict[str, dict[str, dict]]  # module -> menu level -> judge_level's verdict
    order: list[str]                   # the menu, cheapest first, fp32 last
    passes: dict[str, dict[str, bool]]  # module -> level -> passes


def probe_batches(data, batch_size: int, n: int) -> list:
    """The first ``n`` training batches of ``data``, in order."""
    x, y = data.x_train, data.y_train
    return [(x[i:i + batch_size], y[i:i + batch_size])
            for i in range(0, min(len(x), n * batch_size), batch_size)]


def level_order(costs: dict, menu: tuple[str, ...]) -> list[str]:
    """The menu cheapest first by the model's total cost of each level (the tie-break and
    repair order); ties: the later in the menu (which lists levels from widest to narrowest)
    first; fp32 last."""
    order = sorted(menu, key=lambda lv: (sum(costs[n][lv] for n in costs), -menu.index(lv)))
    order.remove("fp32")
    order.append("fp32")
    return order


def _judge(model, probe, loss_fn, name: str, p: ModuleProfile, levels: dict, cfg: Settings,
           base_loss: float, gen: torch.Generator) -> dict:
    """Module ``name`` judged in each level of the menu (its loss perturbation alone there)."""
    judged = {}
    for lv in cfg.menu:
        if levels[lv].is_fp32:
            judged[lv] = judge_level(p, levels[lv], lr=cfg.lr, perturb=0.0)
            continue
        pert = perturbation(model, probe, loss_fn, name, levels[lv], base_loss=base_loss,
                            output_fn=cfg.output_fn)
        judged[lv] = judge_level(p, levels[lv], lr=cfg.lr, perturb=pert, generator=gen)
    return judged


def measure(model: nn.Module, data, loss_fn, cfg: Settings) -> Measurements:
    """Profile ``model`` on the probe batches, cost and judge every module in every level."""
    levels = {n: parse_policy(LEVELS[n]) for n in cfg.menu + cfg.comparators}
    probe = probe_batches(data, cfg.batch_size, cfg.probe_batches)
    prof = module_profile(model, probe[0], loss_fn, output_fn=cfg.output_fn)
    if not prof:
        raise ValueError("the model has no module owning parameters to plan")
    base_loss = loss_under(model, probe, loss_fn, "32-true", output_fn=cfg.output_fn)
    gen = torch.Generator().manual_seed(0)
    costs: dict = {}
    times: dict = {}  # the roofline estimate per module and level (seconds), with hardware
    judged: dict = {}
    for name, p in prof.items():
        costs[name] = {lv: module_cost(p, levels[lv], cfg.minimise, hardware=cfg.profile)
                       for lv in levels}
        if cfg.profile is not None:
            times[name] = {lv: module_cost(p, levels[lv], "time", hardware=cfg.profile)
                           for lv in levels}
        judged[name] = _judge(model, probe, loss_fn, name, p, levels, cfg, base_loss, gen)
    order = level_order(costs, cfg.menu)
    passes = {n: {lv: judged[n][lv]["ok"] for lv in order} for n in prof}
    return Measurements(levels=levels, probe=probe, base_loss=base_loss, prof=prof,
                        costs=costs, times=times, judged=judged, order=order, passes=passes)


def hw_note(m: Measurements, profile: HardwareProfile | None, name: str,
            lv: str) -> str | None:
    """What the level cannot do for module ``name`` as given: no GEMM its scaled recipe
    covers, or a format the named device has no GEMM for (timed as the next wider one)."""
    level, p = m.levels[lv], m.prof[name]
    notes = []
    if level.scaled is not None and not covered(p, level):
        notes.append(f"a {p.kind} has no GEMM the {level.scaled} recipe "
                     f"covers: it runs in {level.compute}")
    if profile is None:
        return "; ".join(notes) or None
    fam = role_bits(p, level)["family"]
    ran = runs_as(profile, fam)
    if ran != fam:
        notes.append(f"{fam} has no GEMMs on {profile.name}: timed as {ran}")
    return "; ".join(notes) or None


def why(chosen: str, order: list[str], judged: dict, repaired: str | None = None,
        settled: str | None = None) -> str:
    """The measurements that decided a module's level: why each cheaper level was refused,
    what the chosen one needs, and the repair that raised it, if one did; where the plan
    settled on a uniform level (``settled``: which, and why), that level's reason instead of
    the module's remedies (a loss scale, a stochastic write-back the uniform policy may not
    have: a new user read one the plan did not hold)."""
    parts = [f"{lv}: {judged[lv]['reasons'][0]}" for lv in order[:order.index(chosen)]
             if judged[lv]["reasons"]]
    j = judged[chosen]
    uniform = settled is not None
    if chosen != "fp32" and not parts:
        parts.append(f"{chosen} passes: no overflow, {100 * j['grad_flush']:.2f}% of gradients "
                     f"flushed, loss moves {100 * (j['perturbation'] or 0):.2f}%")
    if j["needs_loss_scale"] and not uniform:
        parts.append(f"{100 * j['grad_flush']:.1f}% of gradients flush unscaled: loss scale "
                     f"(~{j['loss_scale']:g})")
    if j["needs_stochastic"] and not uniform:
        parts.append(f"{100 * j['lost_updates']:.0f}% of updates lost to nearest rounding in "
                     f"{j['formats']['params']}: stochastic write-back")
    if uniform:
        parts.append(f"the plan is {settled}")
    elif repaired:
        parts.append(f"raised by repair ({repaired})")
    return "; ".join(parts) or "fp32"
