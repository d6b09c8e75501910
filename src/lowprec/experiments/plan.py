"""``plan``: the cheapest per-layer precision that still trains, found, verified by training,
explained.

Data flow (docs/design.md, "Planning"):

1. measure: one float32 step profiles every module owning parameters
   (:func:`lowprec.analysis.plan_scores.module_profile`); each module is judged in each level of
   the menu (:func:`~lowprec.analysis.plan_scores.judge_level`: range against the formats,
   gradient underflow with and without a loss scale, lost updates, and the loss perturbation of
   that module alone in the level on a few batches);
2. assign: each module at the cheapest level it passes under the budget's cost (memory bytes,
   bits moved, or time on a named hardware profile: :mod:`lowprec.analysis.roofline`); the
   optimizer state at the narrowest parameter format of the menu that holds every weight
   gradient; the base policy is the level holding most parameters, every other module an
   override; a loss scale where a level passes only with one; a joint probe of the whole plan
   on the same batches (repaired before training when it fails);
3. verify: the plan, float32 and every uniform level (and 16-mixed beside fp16, or the levels
   of ``compare_with``) train for ``steps`` steps from the same initial weights, seeds and
   batches; the plan is returned only when its mean test accuracy is within ``tolerance`` of
   float32's; otherwise the module most sensitive in its current level (perturbation score)
   is raised one level and the plan is trained again: each repair is logged.

``plan(model, data)`` returns a :class:`lowprec.training.plan.Plan`: ``Precision(plan)``,
``lowprec compare --policies plan:FILE`` and the integrations (which build a Precision) accept
it; :func:`plan_table` and :func:`plan_markdown` give the report ``lowprec plan`` prints.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings

import torch
from torch import nn

from ..analysis.advise import UNDERFLOW_MAX
from ..analysis.common import fp32_twin
from ..analysis.plan_costs import block_refusal, covered, role_bits
from ..analysis.plan_scores import (COSTS, PERTURB_MAX, assign, judge_level, loss_under,
                                    module_cost, module_profile, perturbation)
from ..analysis.roofline import PROFILES, get_profile, runs_as
from ..analysis.ranges import classify
from ..numerics.formats import FP32
from ..numerics.storage import format_bytes
from ..training.backends.choice import BackendChoiceWarning
from ..training.optim import SGD
from ..training.plan import Plan
from ..training.policy import WriteBack, parse_policy
from ..training.precision import Precision

__all__ = ["plan", "cheaper_uniform", "LEVELS", "DEFAULT_MENU", "UNIFORM", "uniform_policy",
           "parse_menu",
           "parse_compare_with", "plan_table", "plan_markdown", "summary_rows",
           "train_and_evaluate"]

#: the levels a module can be put in: parameter storage, compute and gradient formats
#: (optimizer state and the loss scale are the base policy's, for every module)
LEVELS = {
    "fp32": "p=fp32,c=fp32,g=fp32",
    "bf16": "p=bf16,c=bf16,g=bf16",
    "fp16": "p=fp16,c=fp16,g=fp16",
    # fp8 GEMM operands and outputs (e4m3 forward, e5m2 gradients rounded stochastically),
    # weights stored in bf16 and cast at use
    "fp8": "p=bf16,c=e4m3fn,g=e5m2:sr",
    # OCP MX blocks of 32 along the reduction axis (the engine's block formats), bf16 storage
    "mxfp8": "p=bf16,c=mxfp8_e4m3,g=bf16",
    # Gupta et al. (2015): 16-bit fixed point, stochastic rounding of activations and gradients
    "fixed16-sr": "p=q6.10,c=q6.10:sr,g=q6.10:sr",
    # 16-mixed (torch.autocast, Micikevicius et al. 2018): fp32 parameters, fp16 compute of
    # the matmul-like layers only (norms and embeddings in fp32); the loss scale is the
    # plan's (dynamic where a level needs one; the uniform comparator is "16-mixed" itself)
    "mixed16": "p=fp32,c=fp16,g=fp16,s=matmul",
    # NVFP4 (arXiv:2509.25149): every linear layer's three GEMMs on e2m1 in 16-element blocks
    # along the reduction axis with e4m3 scales and an fp32 tensor scale, gradients rounded
    # stochastically; everything else, and the weights' storage, in bf16
    "nvfp4": "p=bf16,c=bf16,g=bf16,sc=nvfp4-sr",
    # OCP MX v1.0 MXFP4: e2m1 in 32-element blocks along the reduction axis, E8M0 scales, for
    # the three GEMMs of every linear layer; bf16 elsewhere
    "mxfp4": "p=bf16,c=bf16,g=bf16,sc=mxfp4",
}
DEFAULT_MENU = ("fp32", "bf16", "fp16", "fp8")
#: the uniform policy a level is compared as, where it is not the level with its own
#: parameter format as optimizer state
UNIFORM = {"mixed16": "16-mixed"}
_SLOTS = {"sgd": 1}  # optimizer state tensors per parameter (SGD with momentum)


def uniform_policy(level: str) -> str:
    """The uniform policy of ``level``: ``16-mixed`` for mixed16, else the level with its
    parameter format as optimizer state."""
    if level in UNIFORM:
        return UNIFORM[level]
    return f"{LEVELS[level]},o={parse_policy(LEVELS[level]).params}"


def parse_menu(menu) -> tuple[str, ...]:
    """``"fp32,bf16,fp16"`` or a sequence of level names -> names (fp32 added: the fallback);
    ValueError naming the accepted levels."""
    names = [m.strip() for m in (menu.split(",") if isinstance(menu, str) else menu)]
    if not names or not all(names):
        raise ValueError(f"menu {str(menu)[:120]!r} holds an empty level; accepted levels: "
                         f"{', '.join(LEVELS)}, separated by single commas")
    for n in names:
        if n not in LEVELS:
            raise ValueError(f"menu level {n!r}; accepted: {', '.join(LEVELS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"menu {','.join(names)} names a level twice")
    if "fp32" not in names:
        names.append("fp32")
    return tuple(names)


def _batches(data, batch_size: int, n: int) -> list:
    x, y = data.x_train, data.y_train
    return [(x[i:i + batch_size], y[i:i + batch_size])
            for i in range(0, min(len(x), n * batch_size), batch_size)]


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


def _why(chosen: str, order: list[str], judged: dict, repaired: str | None = None) -> str:
    """The measurements that decided a module's level: why each cheaper level was refused,
    what the chosen one needs, and the repair that raised it, if one did."""
    parts = [f"{lv}: {judged[lv]['reasons'][0]}" for lv in order[:order.index(chosen)]
             if judged[lv]["reasons"]]
    j = judged[chosen]
    if chosen != "fp32" and not parts:
        parts.append(f"{chosen} passes: no overflow, {100 * j['grad_flush']:.2f}% of gradients "
                     f"flushed, loss moves {100 * (j['perturbation'] or 0):.2f}%")
    if j["needs_loss_scale"]:
        parts.append(f"{100 * j['grad_flush']:.1f}% of gradients flush unscaled: loss scale "
                     f"(~{j['loss_scale']:g})")
    if j["needs_stochastic"]:
        parts.append(f"{100 * j['lost_updates']:.0f}% of updates lost to nearest rounding in "
                     f"{j['formats']['params']}: stochastic write-back")
    if repaired:
        parts.append(f"raised by repair ({repaired})")
    return "; ".join(parts) or "fp32"


def _stats(runs: list[dict]) -> dict:
    accs = [r["accuracy"] for r in runs]
    ok = [a for a in accs if math.isfinite(a)]
    mean = statistics.fmean(ok) if len(ok) == len(accs) and ok else math.nan
    std = statistics.stdev(ok) if len(ok) > 1 and len(ok) == len(accs) else 0.0
    return {"accuracy": accs, "mean": mean, "std": std,
            "seconds": sum(r["seconds"] for r in runs), "skipped": [r["skipped"] for r in runs]}


def parse_compare_with(compare_with, menu: tuple[str, ...],
                       compare_uniform: bool = True) -> tuple[str, ...]:
    """The levels trained uniformly beside the plan besides the menu's: ``compare_with`` (level
    names, ``16-mixed`` for mixed16; a comma-separated string or a sequence); by default
    mixed16 (the ``16-mixed`` policy) when fp16 is in the menu. Levels of the menu are trained
    anyway and dropped here, unless ``compare_uniform`` is false."""
    if compare_with is None:
        names = ["mixed16"] if compare_uniform and "fp16" in menu else []
    else:
        if isinstance(compare_with, str):
            raw = compare_with.split(",")
        elif isinstance(compare_with, (list, tuple)) and all(isinstance(n, str)
                                                            for n in compare_with):
            raw = list(compare_with)
        else:
            raise ValueError(f"compare_with={compare_with!r}; accepted: level names, a "
                             "comma-separated string or a list (16-mixed, "
                             f"{', '.join(LEVELS)})")
        names = [{"16-mixed": "mixed16"}.get(n.strip(), n.strip()) for n in raw if n.strip()]
        for n in names:
            if n not in LEVELS:
                raise ValueError(f"compare_with level {n!r}; accepted: 16-mixed, "
                                 f"{', '.join(LEVELS)}")
    out: list[str] = []
    for n in names:
        # a menu level is trained uniformly anyway, unless compare_uniform=False
        if (n not in menu or not compare_uniform) and n not in out:
            out.append(n)
    return tuple(out)


def _cost_text(c: float, minimise: str) -> str:
    if minimise == "time":
        return f"{c * 1e6:,.3g}"
    return f"{int(c):,}"


def _real(v) -> float:
    """A number of a plan read back from JSON, where non-finite floats are strings."""
    return float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v


def _unit(meta: dict) -> str:
    minimise = meta.get("minimise", "memory")
    if minimise == "time":
        return f"µs/step ({(meta.get('hardware') or {}).get('name', '?')})"
    return "bytes" if minimise == "memory" else "bits"


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


def plan(model: nn.Module, data, loss_fn=None, *, menu=DEFAULT_MENU, minimise: str = "memory",
         hardware=None, tolerance: float = 0.01, steps: int = 200, seeds=(0,),
         lr: float = 0.02, momentum: float = 0.9, batch_size: int = 64, probe_batches: int = 2,
         max_repairs: int | None = None, compare_uniform: bool = True, compare_with=None,
         output_fn=None, log=None) -> Plan:
    """The cheapest per-module assignment of ``menu``'s levels (see the module docstring) that
    trains ``model`` on ``data`` (a Dataset: x_train, y_train, x_test, y_test) to within
    ``tolerance`` (a fraction: 0.01 is one accuracy point) of float32's mean test accuracy after
    ``steps`` SGD steps per seed. ``minimise``: ``memory`` (bytes), ``bits`` (moved) or ``time``
    (the roofline estimate on the named ``hardware`` profile of
    :data:`lowprec.analysis.roofline.PROFILES`; given with another budget, the estimate is
    reported beside it). ``compare_with``: uniform levels trained beside the plan besides the
    menu's (default: 16-mixed when fp16 is in the menu). ``log``: called with each line of the
    search as it happens."""
    t_start = time.perf_counter()
    loss_fn = loss_fn or nn.functional.cross_entropy
    order_names = parse_menu(menu)
    if minimise not in COSTS:
        raise ValueError(f"minimise={minimise!r}; accepted: {', '.join(COSTS)}")
    if hardware is not None:
        profile = get_profile(hardware)
    elif minimise == "time":
        raise ValueError(f"minimise='time' needs hardware=NAME; accepted: "
                         f"{', '.join(PROFILES)}")
    else:
        profile = None
    comparators = parse_compare_with(compare_with, order_names, compare_uniform)
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance={tolerance!r}; accepted: a finite number >= 0 (a fraction "
                         "of accuracy: 0.01 is one point)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}; accepted: an integer >= 1")
    seeds = (seeds,) if isinstance(seeds, int) else tuple(seeds)
    if not seeds:
        raise ValueError("seeds=(); accepted: one or more integer seeds")
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if log is not None:
            log(line)

    levels = {n: parse_policy(LEVELS[n]) for n in order_names + comparators}
    probe = _batches(data, batch_size, probe_batches)
    prof = module_profile(model, probe[0], loss_fn, output_fn=output_fn)
    if not prof:
        raise ValueError("the model has no module owning parameters to plan")
    base_loss = loss_under(model, probe, loss_fn, "32-true", output_fn=output_fn)
    gen = torch.Generator().manual_seed(0)
    costs: dict = {}
    times: dict = {}  # the roofline estimate per module and level (seconds), with hardware
    judged: dict = {}
    for name, p in prof.items():
        costs[name] = {lv: module_cost(p, levels[lv], minimise, hardware=profile)
                       for lv in levels}
        if profile is not None:
            times[name] = {lv: module_cost(p, levels[lv], "time", hardware=profile)
                           for lv in levels}
        judged[name] = {}
        for lv in order_names:
            if levels[lv].is_fp32:
                judged[name][lv] = judge_level(p, levels[lv], lr=lr, perturb=0.0)
                continue
            pert = perturbation(model, probe, loss_fn, name, levels[lv], base_loss=base_loss,
                                output_fn=output_fn)
            judged[name][lv] = judge_level(p, levels[lv], lr=lr, perturb=pert, generator=gen)
    # cheapest first by the model's total cost of each level (the tie-break and repair order)
    # (ties: the later in the menu, which lists levels from widest to narrowest, first)
    order = sorted(order_names, key=lambda lv: (sum(costs[n][lv] for n in prof),
                                                -order_names.index(lv)))
    order.remove("fp32")
    order.append("fp32")
    passes = {n: {lv: judged[n][lv]["ok"] for lv in order} for n in prof}
    chosen = assign({n: {lv: costs[n][lv] for lv in order} for n in prof}, passes, order)

    def hw_note(name: str, lv: str) -> str | None:
        notes = []
        if levels[lv].scaled is not None and not covered(prof[name], levels[lv]):
            notes.append(f"a {prof[name].kind} has no GEMM the {levels[lv].scaled} recipe "
                         f"covers: it runs in {levels[lv].compute}")
        # a format the device has no GEMM for is timed as the next wider one it runs
        if profile is None:
            return "; ".join(notes) or None
        fam = role_bits(prof[name], levels[lv])["family"]
        ran = runs_as(profile, fam)
        if ran != fam:
            notes.append(f"{fam} has no GEMMs on {profile.name}: timed as {ran}")
        return "; ".join(notes) or None

    for name in prof:
        note = hw_note(name, chosen[name])
        say(f"measure {name}: {chosen[name]} ({_why(chosen[name], order, judged[name])}"
            f"{'; ' + note if note else ''})")

    # optimizer state: the narrowest parameter format of the menu that holds the weight
    # gradients (momentum starts as the gradient): none overflows, at most 1% flush, counted
    # over the elements whose update fp32 itself applies (w + lr g != w in float32; where fp32
    # loses the update too, a flushed momentum changes nothing)
    live = []
    for p in prof.values():
        if p.weight_grads.numel() == p.weights.numel():
            g = p.weight_grads
            live.append(g[(p.weights - lr * g) != p.weights])
    grads_all = torch.cat(live) if live else torch.zeros(0)
    state_fmt, state_why = FP32, "fp32"
    candidates = []  # the menu's parameter formats, narrowest first (ties: the levels' order)
    for lv in order:
        if levels[lv].params not in candidates:
            candidates.append(levels[lv].params)
    for fmt in sorted(candidates, key=lambda f: format_bytes(f, 1 << 20)):
        c = classify(grads_all, fmt)
        if c["overflow"] == 0 and c["flush"] <= UNDERFLOW_MAX:
            state_fmt = fmt
            state_why = (f"{fmt}: {100 * c['flush']:.2f}% of weight gradients flush, none "
                         "overflow")
            break
    say(f"optimizer state in {state_why}")

    def build(assignment: dict) -> tuple[str, dict]:
        weight = {}
        for n, lv in assignment.items():
            weight[lv] = weight.get(lv, 0) + prof[n].n_params
        base_lv = max(order, key=lambda lv: (weight.get(lv, 0), -order.index(lv)))
        scale = any(judged[n][lv]["needs_loss_scale"] for n, lv in assignment.items())
        sr = any(judged[n][lv]["needs_stochastic"] for n, lv in assignment.items())
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

    def raise_one(assignment: dict, why: str) -> str | None:
        movable = [n for n, lv in assignment.items() if lv != "fp32"]
        if not movable:
            return None

        def score(n):
            pert = judged[n][assignment[n]]["perturbation"]
            return (math.inf if pert is None else pert, judged[n][assignment[n]]["grad_flush"])

        worst = max(movable, key=score)
        old = assignment[worst]
        up = [lv for lv in order[order.index(old) + 1:]
              if passes[worst][lv] or lv == "fp32"]
        assignment[worst] = up[0]
        repaired[worst] = why
        say(f"repair: {why}; raise {worst} from {old} to {up[0]} (loss moved "
            f"{100 * score(worst)[0]:.2f}% with it alone in {old})")
        return worst

    repaired: dict[str, str] = {}
    budget = max_repairs if max_repairs is not None else len(prof) * len(order)
    repairs = 0
    # joint probe: the whole plan on the probe batches before any training
    while True:
        base, over = build(chosen)
        joint = loss_under(model, probe, loss_fn, base, over, output_fn=output_fn)
        moved = abs(joint - base_loss) / max(abs(base_loss), 1e-12) if math.isfinite(joint) \
            else math.inf
        if moved <= PERTURB_MAX or repairs >= budget:
            say(f"probe: the plan moves the loss {100 * moved:.2f}% on {len(probe)} batches")
            break
        if raise_one(chosen, f"the plan moves the probe loss {100 * moved:.2f}%") is None:
            break
        repairs += 1

    # verification by training
    kw = dict(steps=steps, lr=lr, momentum=momentum, batch_size=batch_size, output_fn=output_fn)
    total_params = sum(p.n_params for p in prof.values())
    state_bytes = format_bytes(state_fmt, total_params) * _SLOTS["sgd"]

    def time_of(assignment: dict, state=state_fmt) -> float | None:
        # the optimizer step reads and writes its state once more
        if profile is None:
            return None
        return (sum(times[n][lv] for n, lv in assignment.items())
                + 2 * format_bytes(state, total_params) * _SLOTS["sgd"] / profile.bandwidth)

    def cost_of(assignment: dict, state=state_fmt) -> float:
        if minimise == "time":
            return time_of(assignment, state)
        c = sum(costs[n][lv] for n, lv in assignment.items())
        if minimise == "memory":
            c += format_bytes(state, total_params) * _SLOTS["sgd"]
        return c

    runs: dict = {}
    ref = [train_and_evaluate(model, data, loss_fn, "32-true", seed=s, **kw) for s in seeds]
    runs["fp32"] = {"policy": "32-true", "overrides": {}, **_stats(ref),
                    "cost": cost_of({n: "fp32" for n in prof}, FP32),
                    "time": time_of({n: "fp32" for n in prof}, FP32)}
    fp32_seconds = runs["fp32"]["seconds"] / len(seeds)
    target = runs["fp32"]["mean"] - tolerance
    say(f"verify: fp32 reaches {100 * runs['fp32']['mean']:.2f}% after {steps} steps "
        f"(seeds {', '.join(map(str, seeds))}); target >= {100 * target:.2f}%")
    uniform = [lv for lv in order if lv != "fp32"] if compare_uniform else []
    for lv in uniform + list(comparators):
        pol = uniform_policy(lv)
        state = parse_policy(pol).optimizer_state
        r = [train_and_evaluate(model, data, loss_fn, pol, seed=s, **kw) for s in seeds]
        # a block-scaled level runs in emulation whatever the shapes; hardware needs whole
        # blocks along each reduction axis
        refused = [n for n in prof if block_refusal(prof[n], levels[lv])]
        runs[f"uniform {lv}"] = {"policy": pol, "overrides": {}, **_stats(r),
                                 "cost": cost_of({n: lv for n in prof}, state),
                                 "time": time_of({n: lv for n in prof}, state),
                                 "block_refused": refused}
        say(f"verify: uniform {lv} ({pol}) reaches "
            f"{100 * runs[f'uniform {lv}']['mean']:.2f}%")
    def dominating_uniform(st: dict, held: bool) -> str | None:
        return cheaper_uniform(runs, [f"uniform {lv}" for lv in uniform], target, st, held)

    attempts = []
    while True:
        base, over = build(chosen)
        r = [train_and_evaluate(model, data, loss_fn, base, over, seed=s, **kw) for s in seeds]
        st = {"policy": base, "overrides": dict(over), **_stats(r), "cost": cost_of(chosen),
              "time": time_of(chosen)}
        attempts.append(st)
        held = math.isfinite(st["mean"]) and st["mean"] >= target
        say(f"verify: plan reaches {100 * st['mean']:.2f}% "
            f"({'within' if held else 'outside'} {100 * tolerance:.2f} points of fp32)")
        if held or repairs >= budget:
            break
        alt = dominating_uniform(st, held)
        if alt is not None:
            say(f"verify: {alt} holds the tolerance at no more cost than this plan: no "
                "further repair")
            break
        if raise_one(chosen, f"the plan reached {100 * st['mean']:.2f}% < "
                             f"{100 * target:.2f}%") is None:
            break
        repairs += 1
    runs["plan"] = attempts[-1]
    accepted = math.isfinite(runs["plan"]["mean"]) and runs["plan"]["mean"] >= target
    alt = dominating_uniform(runs["plan"], accepted)
    if alt is None and not accepted:
        # the plan missed within the repair budget: the cheapest uniform level that held beats
        # falling back to fp32, even when it costs more than the failed plan
        alt = dominating_uniform(runs["fp32"], True)
    if alt is not None:
        # a uniform level of the menu held the tolerance at no more cost (and, at equal cost,
        # higher accuracy), or the plan missed and it is the cheapest level that held: the
        # plan is that level
        lv = alt.removeprefix("uniform ")
        unit = _unit({"minimise": minimise, "hardware": profile and profile.to_json()})
        say(f"verify: {alt} ({100 * runs[alt]['mean']:.2f}%) holds the tolerance at "
            f"{_cost_text(runs[alt]['cost'], minimise)} {unit}, the per-module plan "
            f"({100 * runs['plan']['mean']:.2f}%) at "
            f"{_cost_text(runs['plan']['cost'], minimise)}: the plan is uniform {lv}")
        why_uniform = ("verified at no more cost than the per-module plan" if
                       runs[alt]["cost"] <= runs["plan"]["cost"] else
                       "the cheapest level that held; the per-module plan missed the tolerance")
        repaired = {n: f"uniform {lv} {why_uniform}" for n in prof}
        chosen = {n: lv for n in prof}
        base, over = runs[alt]["policy"], {}
        runs["plan"] = dict(runs[alt], overrides={})
        accepted = True
    elif not accepted:
        # nothing cheaper held: the float32 policy is the plan
        say("no plan held the tolerance within the repair budget: fp32 everywhere")
        chosen = {n: "fp32" for n in prof}
        base, over = "32-true", {}
        runs["plan"] = dict(runs["fp32"], policy=base, overrides={})
    plan_seconds = time.perf_counter() - t_start
    say(f"plan found in {plan_seconds:.1f} s = {plan_seconds / max(fp32_seconds, 1e-9):.1f}x "
        f"one fp32 training run of {steps} steps ({fp32_seconds:.1f} s)")
    evidence = {}
    for n, p in prof.items():
        why = _why(chosen[n], order, judged[n], repaired.get(n))
        note = hw_note(n, chosen[n])
        evidence[n] = {
            "kind": p.kind, "params": p.n_params, "level": chosen[n],
            "formats": dict(judged[n][chosen[n]]["formats"]),
            "cost": costs[n][chosen[n]],
            "why": why + (f"; {note}" if note else ""),
            "levels": {lv: {k: v for k, v in judged[n][lv].items()} | {"cost": costs[n][lv]}
                       for lv in order}}
        if profile is not None:
            evidence[n]["time"] = times[n][chosen[n]]
    uniform_ok = [k for k, v in runs.items() if k.startswith("uniform")
                  and math.isfinite(v["mean"]) and v["mean"] >= target
                  and not v.get("block_refused")]
    best_uniform = min(uniform_ok, key=lambda k: runs[k]["cost"], default=None)
    meta = {"menu": list(order_names), "order": order, "minimise": minimise,
            "hardware": profile.to_json() if profile is not None else None,
            "compare_with": list(comparators),
            "tolerance": tolerance, "steps": steps, "seeds": list(seeds), "lr": lr,
            "momentum": momentum, "batch_size": batch_size, "accepted": accepted,
            "repairs": repairs, "optimizer_state": str(parse_policy(base).optimizer_state),
            "best_uniform": best_uniform, "high": sorted(
                n for n in prof if chosen[n] != order[0]),
            "plan_seconds": plan_seconds, "fp32_train_seconds": fp32_seconds,
            "plan_over_fp32_run": plan_seconds / max(fp32_seconds, 1e-9),
            "data": getattr(data, "name", None)}
    return Plan(policy=base, overrides=over, evidence=evidence,
                verification={"runs": runs, "attempts": attempts}, log=tuple(lines), meta=meta)


def plan_table(p: Plan) -> tuple[list[str], list[list[str]]]:
    """The per-module table: module, kind, parameters, level, formats, cost, why."""
    m = p.meta
    minimise = m.get("minimise", "memory")
    head = ["module", "kind", "params", "level", "p / c / g", _unit(m), "why"]
    rows = []
    for n, e in p.evidence.items():
        f = e["formats"]
        rows.append([n, e["kind"], str(e["params"]), e["level"],
                     f"{f['params']} / {f['compute']} / {f['grads']}",
                     _cost_text(e["cost"], minimise), e["why"]])
    return head, rows


def summary_rows(p: Plan) -> tuple[list[str], list[list[str]]]:
    """The plan against fp32 and each uniform level: accuracy (mean ± std over seeds), its
    difference from fp32, cost and its ratio to fp32's."""
    runs = p.verification.get("runs", {})
    ref = runs.get("fp32", {})
    minimise = p.meta.get("minimise", "memory")
    hw = p.meta.get("hardware") or {}
    extra_time = bool(hw) and minimise != "time"
    head = ["policy", "accuracy %", "Δ vs fp32", _unit(p.meta), "vs fp32", "within tolerance"]
    if extra_time:
        head.append(f"est. µs/step ({hw.get('name')})")
    rows = []
    ref_mean = _real(ref.get("mean", math.nan))
    target = ref_mean - p.meta.get("tolerance", 0.0)
    for key in ["fp32", *[k for k in runs if k.startswith("uniform")], "plan"]:
        r = runs.get(key)
        if r is None:
            continue
        mean, std = _real(r["mean"]), _real(r["std"])
        acc = "diverged" if not isinstance(mean, float) or not math.isfinite(mean) else \
            f"{100 * mean:.2f} ± {100 * std:.2f}"
        delta = "" if not math.isfinite(mean) else f"{100 * (mean - ref_mean):+.2f}"
        ok = "yes" if math.isfinite(mean) and mean >= target else "no"
        if r.get("block_refused"):
            ok += f" (emulated only: {', '.join(r['block_refused'])} not in whole blocks)"
        row = [key, acc, delta, _cost_text(r["cost"], minimise),
               f"{r['cost'] / ref['cost']:.2f}x", ok]
        if extra_time:
            t = r.get("time")
            row.append(f"{t * 1e6:,.3g}" if isinstance(t, (int, float)) else "")
        rows.append(row)
    return head, rows


def plan_markdown(p: Plan) -> str:
    """The report section: the per-module table, the plan against fp32 and the uniform
    policies, the modules that stayed high, the search log."""
    def table(head, rows):
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)

    m = p.meta
    hw = m.get("hardware") or {}
    on = f" on {hw['name']} ({hw.get('description', '')}; roofline estimate)" if hw else ""
    parts = [f"## Precision plan ({m.get('minimise', 'memory')}{on}; tolerance "
             f"{100 * m.get('tolerance', 0):.2f} points; {m.get('steps')} steps; seeds "
             f"{', '.join(map(str, m.get('seeds', [])))})", "",
             f"Base policy `{p.policy}`; {len(p.overrides)} override(s); optimizer state "
             f"{m.get('optimizer_state')}; best uniform policy within tolerance: "
             f"{m.get('best_uniform') or 'none'}.", "", table(*plan_table(p)), "",
             table(*summary_rows(p)), "",
             "Modules above the cheapest level: " + (", ".join(m.get("high") or []) or "none"),
             "", "Search log:", ""] + [f"- {line}" for line in p.log]
    return "\n".join(parts) + "\n"
