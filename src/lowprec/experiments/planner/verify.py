"""Step 3 of the search, verify by training: float32, every uniform level and the plan train
from the same weights, seeds and batches; the plan is repaired until it holds the tolerance,
and replaced by a uniform level (or float32) that holds it at no more cost."""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...analysis.common import fp32_twin
from ...analysis.plan_costs import block_refusal
from ...numerics.formats import FP32, Format
from ...numerics.storage import format_bytes
from ...training.backends.choice import BackendChoiceWarning
from ...training.optim import SGD
from ...training.policy import parse_policy
from ...training.precision import Precision
from .assign import Draft, build, raise_one
from .levels import SLOTS, uniform_policy
from .measure import Measurements
from .report import cost_text, unit
from .settings import Settings

__all__ = ["train_and_evaluate", "run_stats", "cheaper_uniform", "plan_time", "plan_cost",
           "Verified", "train_references", "train_plan", "settle", "verify"]


@torch.no_grad()
def _accuracy(model, prec, x, y, output_fn=None) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), 1000):
        with prec.autocast():
            out = model(prec.convert_input(x[i:i + 1000]))
        out = out if output_fn is None else output_fn(out)
        correct += int((out.float().argmax(dim=1) == y[i:i + 1000]).sum())
    return correct / max(1, len(x))


def train_and_evaluate(model: nn.Module, data, loss_fn, policy, overrides=None, *, steps: int,
                       seed: int, lr: float, momentum: float = 0.9, batch_size: int = 64,
                       output_fn=None) -> dict:
    """Train a copy of ``model`` (its initial weights as given) under ``policy`` and
    ``overrides`` for ``steps`` SGD steps on batches drawn by ``seed``; the test accuracy
    (nan when the weights are no longer finite), the last training losses and the seconds."""
    torch.manual_seed(seed)
    twin = fp32_twin(model).train()
    prec = Precision(policy, overrides=overrides or None, seed=seed)
    opt = SGD(twin.parameters(), lr=lr, momentum=momentum)
    with warnings.catch_warnings():  # which backend runs is in the plan's evidence
        warnings.simplefilter("ignore", BackendChoiceWarning)
        twin, opt = prec.setup(twin, opt)
    gen = torch.Generator().manual_seed(seed)
    n = len(data.x_train)
    perm, pos, losses = torch.randperm(n, generator=gen), 0, []
    t0 = time.perf_counter()
    for _ in range(steps):
        if pos + batch_size > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + batch_size]
        pos += batch_size
        opt.zero_grad()
        with prec.autocast():
            out = twin(prec.convert_input(data.x_train[idx]))
            out = out if output_fn is None else output_fn(out)
            loss = loss_fn(out.float(), data.y_train[idx])
        prec.backward(loss)
        prec.step(opt)
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    finite = all(torch.isfinite(p).all() for p in twin.parameters())
    acc = _accuracy(twin, prec, data.x_test, data.y_test, output_fn) if finite else math.nan
    tail = [v for v in losses[-max(1, steps // 10):]]
    return {"accuracy": acc, "final_loss": sum(tail) / len(tail) if tail else math.nan,
            "skipped": prec.skipped, "seconds": seconds}


def run_stats(runs: list[dict]) -> dict:
    """One policy's runs over the seeds: accuracies, their mean and deviation (nan when a run
    diverged), seconds in all, skipped steps per run."""
    accs = [r["accuracy"] for r in runs]
    ok = [a for a in accs if math.isfinite(a)]
    mean = statistics.fmean(ok) if len(ok) == len(accs) and ok else math.nan
    std = statistics.stdev(ok) if len(ok) > 1 and len(ok) == len(accs) else 0.0
    return {"accuracy": accs, "mean": mean, "std": std,
            "seconds": sum(r["seconds"] for r in runs), "skipped": [r["skipped"] for r in runs]}


def cheaper_uniform(runs: dict, keys, target: float, st: dict, held: bool) -> str | None:
    """The run among ``keys`` (uniform levels of the menu) that makes the plan ``st`` pointless:
    it held the tolerance (accuracy >= ``target``, whole blocks where its level has blocks) and
    costs less than ``st``, or as much while ``st`` did not hold or is less accurate. The
    cheapest such run (then the most accurate), or None."""
    ok = [k for k in keys if math.isfinite(runs[k]["mean"]) and runs[k]["mean"] >= target
          and not runs[k].get("block_refused")]
    better = [k for k in ok if runs[k]["cost"] < st["cost"] or (
        runs[k]["cost"] <= st["cost"] and (not held or runs[k]["mean"] > st["mean"]))]
    return min(better, key=lambda k: (runs[k]["cost"], -runs[k]["mean"]), default=None)


def plan_time(m: Measurements, cfg: Settings, assignment: dict, state: Format) -> float | None:
    """The roofline seconds of one step under ``assignment`` (None without hardware): each
    module's, and the optimizer step reading and writing its state once more."""
    if cfg.profile is None:
        return None
    total_params = sum(p.n_params for p in m.prof.values())
    return (sum(m.times[n][lv] for n, lv in assignment.items())
            + 2 * format_bytes(state, total_params) * SLOTS["sgd"] / cfg.profile.bandwidth)


def plan_cost(m: Measurements, cfg: Settings, assignment: dict, state: Format) -> float:
    """The budget's cost of ``assignment`` with the optimizer state in ``state`` (held in
    memory: counted in the memory budget)."""
    if cfg.minimise == "time":
        return plan_time(m, cfg, assignment, state)
    c = sum(m.costs[n][lv] for n, lv in assignment.items())
    if cfg.minimise == "memory":
        total_params = sum(p.n_params for p in m.prof.values())
        c += format_bytes(state, total_params) * SLOTS["sgd"]
    return c


@dataclass
class Verified:
    """The verification's runs (fp32, ``uniform LEVEL``, ``plan``), the plan's attempts, the
    accuracy to reach, and the policy and overrides the search settled on."""

    runs: dict
    attempts: list
    target: float
    fp32_seconds: float
    uniform: list[str]          # the menu's levels trained uniformly
    policy: str = ""
    overrides: dict | None = None
    accepted: bool = False

    def dominating_uniform(self, st: dict, held: bool) -> str | None:
        """:func:`cheaper_uniform` over the menu's uniform runs."""
        return cheaper_uniform(self.runs, [f"uniform {lv}" for lv in self.uniform],
                               self.target, st, held)


def train_references(model: nn.Module, data, loss_fn, m: Measurements, cfg: Settings,
                     say: Callable[[str], None]) -> Verified:
    """float32, then every uniform level of the menu (and the comparators), on every seed."""
    kw = cfg.train_kwargs()
    runs: dict = {}
    all32 = {n: "fp32" for n in m.prof}
    ref = [train_and_evaluate(model, data, loss_fn, "32-true", seed=s, **kw) for s in cfg.seeds]
    runs["fp32"] = {"policy": "32-true", "overrides": {}, **run_stats(ref),
                    "cost": plan_cost(m, cfg, all32, FP32), "time": plan_time(m, cfg, all32, FP32)}
    fp32_seconds = runs["fp32"]["seconds"] / len(cfg.seeds)
    target = runs["fp32"]["mean"] - cfg.tolerance
    say(f"verify: fp32 reaches {100 * runs['fp32']['mean']:.2f}% after {cfg.steps} steps "
        f"(seeds {', '.join(map(str, cfg.seeds))}); target >= {100 * target:.2f}%")
    uniform = [lv for lv in m.order if lv != "fp32"] if cfg.compare_uniform else []
    for lv in uniform + list(cfg.comparators):
        pol = uniform_policy(lv)
        state = parse_policy(pol).optimizer_state
        r = [train_and_evaluate(model, data, loss_fn, pol, seed=s, **kw) for s in cfg.seeds]
        # a block-scaled level runs in emulation whatever the shapes; hardware needs whole
        # blocks along each reduction axis
        refused = [n for n in m.prof if block_refusal(m.prof[n], m.levels[lv])]
        every = {n: lv for n in m.prof}
        runs[f"uniform {lv}"] = {"policy": pol, "overrides": {}, **run_stats(r),
                                 "cost": plan_cost(m, cfg, every, state),
                                 "time": plan_time(m, cfg, every, state),
                                 "block_refused": refused}
        say(f"verify: uniform {lv} ({pol}) {_reaches(runs[f'uniform {lv}']['mean'])}")
    return Verified(runs=runs, attempts=[], target=target, fp32_seconds=fp32_seconds,
                    uniform=uniform)


def _reaches(mean: float) -> str:
    """What the log says of a verification run's mean accuracy (a non-finite one: diverged,
    as the plan's table says)."""
    return f"reaches {100 * mean:.2f}%" if math.isfinite(mean) else "diverged"


def train_plan(model: nn.Module, data, loss_fn, m: Measurements, cfg: Settings, draft: Draft,
               v: Verified, say: Callable[[str], None]) -> None:
    """Train the plan on every seed; while it misses the target, nothing uniform makes it
    pointless and the repair budget lasts, raise one module and train again."""
    kw = cfg.train_kwargs()
    while True:
        base, over = build(m, draft.chosen, draft.state_fmt)
        r = [train_and_evaluate(model, data, loss_fn, base, over, seed=s, **kw)
             for s in cfg.seeds]
        st = {"policy": base, "overrides": dict(over), **run_stats(r),
              "cost": plan_cost(m, cfg, draft.chosen, draft.state_fmt),
              "time": plan_time(m, cfg, draft.chosen, draft.state_fmt)}
        v.attempts.append(st)
        v.policy, v.overrides = base, over
        held = math.isfinite(st["mean"]) and st["mean"] >= v.target
        say(f"verify: plan {_reaches(st['mean'])} "
            f"({'within' if held else 'outside'} {100 * cfg.tolerance:.2f} points of fp32)")
        if held or draft.repairs >= draft.budget:
            break
        alt = v.dominating_uniform(st, held)
        if alt is not None:
            say(f"verify: {alt} holds the tolerance at no more cost than this plan: no "
                "further repair")
            break
        if raise_one(m, draft, f"the plan reached {100 * st['mean']:.2f}% < "
                               f"{100 * v.target:.2f}%", say) is None:
            break
        draft.repairs += 1


def settle(m: Measurements, cfg: Settings, draft: Draft, v: Verified,
           say: Callable[[str], None]) -> None:
    """The plan is the last attempt; or a uniform level of the menu that held the tolerance at
    no more cost (at equal cost, more accurately), or the cheapest that held when the plan
    missed; or, when nothing held, float32 everywhere. ``draft`` and ``v`` say which."""
    runs = v.runs
    runs["plan"] = v.attempts[-1]
    v.accepted = math.isfinite(runs["plan"]["mean"]) and runs["plan"]["mean"] >= v.target
    alt = v.dominating_uniform(runs["plan"], v.accepted)
    if alt is None and not v.accepted:
        # the plan missed within the repair budget: the cheapest uniform level that held beats
        # falling back to fp32, even when it costs more than the failed plan
        alt = v.dominating_uniform(runs["fp32"], True)
    if alt is not None:
        lv = alt.removeprefix("uniform ")
        u = unit({"minimise": cfg.minimise, "hardware": cfg.profile and cfg.profile.to_json()})
        say(f"verify: {alt} ({100 * runs[alt]['mean']:.2f}%) holds the tolerance at "
            f"{cost_text(runs[alt]['cost'], cfg.minimise)} {u}, the per-module plan "
            f"({100 * runs['plan']['mean']:.2f}%) at "
            f"{cost_text(runs['plan']['cost'], cfg.minimise)}: the plan is uniform {lv}")
        why_uniform = ("verified at no more cost than the per-module plan" if
                       runs[alt]["cost"] <= runs["plan"]["cost"] else
                       "the cheapest level that held; the per-module plan missed the tolerance")
        draft.settled, draft.repaired = f"uniform {lv} {why_uniform}", {}
        draft.chosen = {n: lv for n in m.prof}
        v.policy, v.overrides = runs[alt]["policy"], {}
        runs["plan"] = dict(runs[alt], overrides={})
        v.accepted = True
    elif not v.accepted:
        say("no plan held the tolerance within the repair budget: fp32 everywhere")
        draft.chosen = {n: "fp32" for n in m.prof}
        v.policy, v.overrides = "32-true", {}
        runs["plan"] = dict(runs["fp32"], policy="32-true", overrides={})


def verify(model: nn.Module, data, loss_fn, m: Measurements, cfg: Settings, draft: Draft,
           say: Callable[[str], None]) -> Verified:
    """The whole verification: references, the plan with its repairs, the settled plan."""
    v = train_references(model, data, loss_fn, m, cfg, say)
    train_plan(model, data, loss_fn, m, cfg, draft, v, say)
    settle(m, cfg, draft, v, say)
    return v
