"""The report's recommendation: which policy to use for this model, and why, from the results
database alone.

The rule, stated so that every sentence of the verdict can be checked against the tables:

1. **Candidates** are the policies whose every run finished (none diverged or failed), whose
   test accuracy is within seed noise of 32-true's or above it: Δ >= -tolerance, where the
   tolerance is two standard errors of the difference of the means,
   2 sqrt(s32²/n32 + s²/n), computed from the seeds' spread (at least ``MIN_TOLERANCE``, 0.1
   points: two seeds can agree exactly). With one seed on either side there is no spread to
   measure; ``ONE_SEED_TOLERANCE`` (0.5 points) is assumed and the verdict says so.
2. Among the candidates, 32-true included, the one that **needs the least memory** (the
   ledger's exact bytes of a training step, which do not depend on the machine), and among
   those within 5% of that memory, the **fastest here**, by wall time, where its load was
   comparable with 32-true's (:func:`lowprec.experiments.timing.compare_load`); a time that is
   not comparable counts as 32-true's (under contention neither wall nor CPU time measures the
   policy). Only natively run policies compete on time: an emulated policy's time is the
   emulation's on this CPU (fp32 kernels plus rounding), not what the format costs on hardware
   that has it, so it counts as 32-true's too. Ties go to 32-true, then to a native policy;
   policies still equal on all of that are a **tie**, said so and naming them all, broken by
   a rule that does not depend on the order of ``--policies``: the least memory (exact
   bytes), then the higher mean test accuracy, then the policy name in sorted order.
3. The evidence: accuracy against 32-true with n, memory, time (or why the time ratio is not
   comparable), and the findings of :func:`lowprec.analysis.advise.judge` (certificate,
   loss scale, lost updates) from the analyses stored for that policy's first finished run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..analysis.advise import judge
from .report_recipes import coverage_note, recipe_coverage
from .results import ResultsDB
from .summary import BASELINE, acc_cell

__all__ = ["Verdict", "recommend", "MIN_TOLERANCE", "ONE_SEED_TOLERANCE", "MEMORY_TIE"]

MIN_TOLERANCE = 0.001      # 0.1 points of accuracy
ONE_SEED_TOLERANCE = 0.005  # 0.5 points, assumed where one seed gives no spread
MEMORY_TIE = 0.05           # policies within 5% of the least memory compete on speed


@dataclass
class Verdict:
    """``policy``: the recommended policy (None: nothing to recommend against). ``headline``:
    one sentence; ``evidence``: one sentence per measurement; ``findings``: advise's verdict per
    format for that policy ({"format", "verdict", "reasons", "run"}); ``tied``: the other
    policies rule 2 could not tell from it (empty when none); ``tie_break``: how that tie was
    broken (None when there was none)."""

    policy: str | None
    headline: str
    evidence: list[str] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    tie_break: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _tolerance(base: dict, r: dict) -> tuple[float, str]:
    """(tolerance, how it was obtained) for the accuracy difference of ``r`` to ``base``."""
    if base["acc_n"] >= 2 and r["acc_n"] >= 2:
        se = math.sqrt(base["acc_std"] ** 2 / base["acc_n"] + r["acc_std"] ** 2 / r["acc_n"])
        tol = max(2 * se, MIN_TOLERANCE)
        return tol, (f"seed noise ±{100 * tol:.2f} pts: two standard errors of the difference, "
                     f"from n={base['acc_n']} and n={r['acc_n']} seeds")
    return ONE_SEED_TOLERANCE, (f"one seed gives no spread to measure, so ±"
                                f"{100 * ONE_SEED_TOLERANCE:.1f} pts is assumed; run more "
                                "seeds (--seeds 3) to measure the noise")


def _rank(r: dict) -> tuple[float, int]:
    """What rule 2 compares among policies of (about) the least memory: the wall-time ratio
    where comparable and native (else 1.0, 32-true's), then native before emulated."""
    native = r["backend"] != "emulated"
    if (r["policy"] == BASELINE or not native or r["time_rel"] is None
            or not r["time_comparable"]):
        return 1.0, int(not native)
    return r["time_rel"], 0


def _tie_key(r: dict, base: dict) -> tuple:
    """The order among policies rule 2 ranks equal, independent of the order of --policies:
    32-true first, then the least memory (exact bytes), the higher mean test accuracy, and the
    name."""
    return (r is not base, r["memory_rel"] or 1.0, -r["acc_mean"], r["policy"])


def _tie_reason(best: dict, runner: dict, base: dict) -> tuple[str, str]:
    """Why ``best`` comes before ``runner`` under :func:`_tie_key` (its first differing part):
    (a few words for the headline, the sentence for the evidence)."""
    if best is base:
        return f"ties go to {BASELINE}", f"ties go to {BASELINE}"
    if (best["memory_rel"] or 1.0) != (runner["memory_rel"] or 1.0):
        mb = (lambda r: "-" if not r["memory"] else f"{r['memory'] / 1e6:.2f} MB")
        return "broken by the least memory", (
            f"{best['policy']} needs the least memory of them ({mb(best)} against "
            f"{mb(runner)} for {runner['policy']})")
    if best["acc_mean"] != runner["acc_mean"]:
        return "broken by the higher mean accuracy", (
            f"{best['policy']} has the higher mean test accuracy ({acc_cell(best)} against "
            f"{acc_cell(runner)} for {runner['policy']})")
    return "broken by name order", (
        "nothing measured separates them (the same memory and accuracy): the name that sorts "
        f"first, {best['policy']}")


def _time_sentence(r: dict) -> str:
    emulated = (" (emulated on this CPU: fp32 kernels, every op's output rounded; native "
                "hardware's time differs)" if r["backend"] == "emulated" else "")
    cpu = "" if r["cpu_rel"] is None else f", process CPU time {r['cpu_rel']:.2f}x"
    if r["time_rel"] is None:
        return f"time: not measured against {BASELINE}"
    if not r["time_comparable"]:
        return (f"time: {r['time_rel']:.2f}x {BASELINE}'s wall time per epoch, not "
                f"comparable: {r['load_check'].reason}{cpu}{emulated}")
    load = "" if r["load_check"] is None else f"; {r['load_check'].reason}"
    return f"time: {r['time_rel']:.2f}x {BASELINE}'s per epoch (wall){cpu}{load}{emulated}"


def _findings(db: ResultsDB, policy: str) -> list[dict]:
    """advise's judgement, per format, from the analyses stored for the first finished run of
    ``policy`` (certificate, range profile, lost updates); empty when they did not run."""
    run = next((r for r in db.runs() if r["policy"] == policy and r["status"] == "finished"),
               None)
    if run is None:
        return []
    out = []
    for kind, cert in db.analyses_of(run["run_id"], "certificate"):
        fmt = kind.split(":", 1)[1]
        ranges = db.analysis(run["run_id"], f"ranges:{fmt}") or {}
        lost = db.analysis(run["run_id"], f"lost:{fmt}") or {}
        flushed = subnormal = counted = 0.0
        for role in ("activation_grads", "weight_grads"):
            v = (ranges.get("roles") or {}).get(role)
            if v:
                n = sum(v.get("hist") or ())
                flushed += v["flush"] * n
                subnormal += v.get("subnormal", 0.0) * n
                counted += n
        verdict, reasons = judge(cert["summary"], underflow_at_1=flushed / counted if counted
                                 else 0.0, loss_scale=ranges.get("recommended_scale") or 1.0,
                                 lost=lost.get("layers") or (), lr=lost.get("lr") or 0.0,
                                 subnormal_at_1=subnormal / counted if counted else None)
        out.append({"format": fmt, "verdict": verdict, "reasons": reasons,
                    "run": run["run_id"]})
    return out


def _coverage_note(db: ResultsDB, policy: str) -> str | None:
    """A sentence when ``policy``'s scaled-GEMM recipe cast no module of the model, or left its
    convolutions uncast (from the runs' stored coverage)."""
    recipes = recipe_coverage(db).get(policy)
    return None if recipes is None else coverage_note(policy, recipes)


def recommend(db: ResultsDB, rows: list[dict]) -> Verdict:
    """The verdict of a comparison (``rows``: :func:`lowprec.experiments.summary.summarize`)."""
    base = next((r for r in rows if r["policy"] == BASELINE), None)
    if base is None:
        others = [r["policy"] for r in rows]
        hint = (f"add {BASELINE} to --policies" if len(others) != 1 else
                f"lowprec compare --policies {BASELINE},{others[0]} runs both")
        return Verdict(None, f"No recommendation: this comparison has no {BASELINE} run to "
                       f"measure the other policies against ({hint}).")
    if base["acc_mean"] is None:
        n, failed = base["runs"], base["runs"] - base["finished"] - base["diverged"]
        why = "; ".join([f"{base['diverged']}/{n} runs diverged"] * bool(base["diverged"])
                        + [f"{failed}/{n} runs did not finish"] * (failed > 0)) or \
            "no test accuracy was recorded"
        return Verdict(None, f"No recommendation: {BASELINE}, the baseline the other policies "
                       f"are measured against, has no finished run ({why}); a smaller --lr, "
                       "or the failed runs' errors, say why.")
    candidates, rejected = [base], []
    for r in rows:
        if r is base:
            continue
        if r["acc_mean"] is None or r["finished"] < r["runs"]:
            why = (f"{r['diverged']}/{r['runs']} runs diverged" if r["diverged"] else
                   f"{r['runs'] - r['finished']}/{r['runs']} runs did not finish")
            rejected.append(f"{r['policy']} ({why})")
            continue
        tol, _ = _tolerance(base, r)
        if r["acc_delta"] >= -tol:
            candidates.append(r)
        else:
            rejected.append(f"{r['policy']} (Δ {100 * r['acc_delta']:+.2f} pts, beyond "
                            f"±{100 * tol:.2f})")
    least = min((r["memory_rel"] or 1.0) for r in candidates)
    tied = [r for r in candidates if (r["memory_rel"] or 1.0) <= least * (1 + MEMORY_TIE)]
    # equals under rule 2 are a tie, broken by a rule of their own (never the list's order)
    ranked = sorted(tied, key=lambda r: (_rank(r), _tie_key(r, base)))
    best = ranked[0]
    ties = [r for r in ranked[1:] if _rank(r) == _rank(best)]
    tie_short, tie_break = _tie_reason(best, ties[0], base) if ties else (None, None)

    evidence = []
    if best is base:
        headline = (f"Use {BASELINE}: no lower-precision policy both finished every run and "
                    f"reached {BASELINE}'s test accuracy within seed noise"
                    if len(candidates) == 1 else
                    f"Use {BASELINE}: no policy within seed noise of its accuracy needs less "
                    "memory or time here")
        evidence.append(f"test accuracy (%): {BASELINE} {acc_cell(base)}")
    else:
        tol, how = _tolerance(base, best)
        mem = ("" if best["memory_rel"] is None else
               f" with {best['memory_rel']:.2f}x {BASELINE}'s memory")
        headline = (f"Use {best['policy']}: it reaches {BASELINE}'s test accuracy within seed "
                    f"noise{mem}")
        evidence.append(f"test accuracy (%): {best['policy']} {acc_cell(best)} against "
                        f"{BASELINE}'s {acc_cell(base)}, Δ {100 * best['acc_delta']:+.2f} pts "
                        f"({how})")
        if best["memory"] and base["memory"]:
            evidence.append(f"memory: {best['memory_rel']:.2f}x {BASELINE}'s "
                            f"({best['memory'] / 1e6:.2f} MB against {base['memory'] / 1e6:.2f} "
                            "MB in one training step, the ledger's exact bytes)")
        evidence.append(_time_sentence(best))
        if best["skipped"]:
            evidence.append(f"skipped steps: {best['skipped']:.1f} per run (loss-scale "
                            "overflows, skipped and retried at a lower scale)")
    if ties:
        names = [best["policy"], *(r["policy"] for r in ties)]
        headline += f" (a tie with {', '.join(names[1:])}, {tie_short})"
        evidence.append(f"tie: {' and '.join(names)} are equal under the rule (memory within "
                        f"{100 * MEMORY_TIE:.0f}% of the least, no time ratio that separates "
                        f"them); broken by a rule that does not depend on their order "
                        f"({BASELINE} first, then the least memory, the higher mean accuracy, "
                        f"the name): {tie_break}")
    others = [r["policy"] for r in candidates if r is not best and r is not base]
    if others:
        evidence.append("also within seed noise: " + ", ".join(
            f"{p} ({_brief(next(r for r in rows if r['policy'] == p))})" for p in others))
    if rejected:
        evidence.append("not within seed noise of " + BASELINE + ": " + ", ".join(rejected))
    note = _coverage_note(db, best["policy"])
    if note:
        evidence.append(note)
    return Verdict(best["policy"], headline + ".", evidence, _findings(db, best["policy"]),
                   tied=[r["policy"] for r in ties], tie_break=tie_break)


def _brief(r: dict) -> str:
    mem = "-" if r["memory_rel"] is None else f"{r['memory_rel']:.2f}x"
    time = ("-" if r["time_rel"] is None else
            f"{r['time_rel']:.2f}x" + ("" if r["time_comparable"] else "*"))
    return f"memory {mem}, time {time}"
