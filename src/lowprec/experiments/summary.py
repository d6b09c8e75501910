"""The summary of a comparison: one row per policy (accuracy over the seeds, time, memory,
ratios to the 32-true baseline) read from a results database, and the cells every table shows
(the CLI's, both reports', the multi-model table, the verdict's evidence)."""

from __future__ import annotations

import statistics

from .results import ResultsDB
from .timing import compare_load

__all__ = ["BASELINE", "summarize", "final_acc", "pct", "acc_cell", "time_cell"]

BASELINE = "32-true"


def final_acc(epochs: list[dict]) -> float | None:
    for e in reversed(epochs):
        if e["test_acc"] is not None:
            return e["test_acc"]
    return None


def _weighted(epochs: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the epochs that recorded it, weighted by their wall time."""
    pairs = [(e[key], e["seconds"]) for e in epochs if e.get(key) is not None and e["seconds"]]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def summarize(db: ResultsDB) -> list[dict]:
    """One dict per policy, in the order the policies were first run: accuracy over the
    finished runs (mean, sample standard deviation, n), time per epoch (wall and process CPU),
    the load the runs saw, memory, and ratios to 32-true; ``load_check`` says whether the time
    ratio compares like with like (:func:`lowprec.experiments.timing.compare_load`)."""
    by_policy: dict[str, list[dict]] = {}
    for r in db.runs():
        by_policy.setdefault(r["policy"], []).append(r)
    base_mem = None
    rows = []
    for policy, runs in by_policy.items():
        accs, all_epochs, mems, skipped = [], [], [], []
        for r in runs:
            ep = db.epochs(r["run_id"])
            if r["status"] == "finished":
                a = final_acc(ep)
                if a is not None:
                    accs.append(a)
            all_epochs += [e for e in ep if e["seconds"]]
            skipped.append(sum(e["skipped"] for e in ep))
            m = db.memory(r["run_id"])
            if m:
                mems.append(m)
        secs = [e["seconds"] for e in all_epochs]
        cpus = [e["cpu_seconds"] for e in all_epochs if e.get("cpu_seconds") is not None]
        mem_total = mems[0]["total"] if mems else None
        if policy == BASELINE:
            base_mem = mem_total
        rows.append({
            "policy": policy,
            "backend": runs[0].get("backend") or "",
            "runs": len(runs),
            "finished": sum(r["status"] == "finished" for r in runs),
            "diverged": sum(r["status"] == "diverged" for r in runs),
            "failed": sum(r["status"] == "failed" for r in runs),
            "acc_mean": statistics.fmean(accs) if accs else None,
            "acc_std": statistics.stdev(accs) if len(accs) > 1 else None,
            "acc_n": len(accs),
            "sec_per_epoch": statistics.fmean(secs) if secs else None,
            "cpu_per_epoch": statistics.fmean(cpus) if cpus else None,
            "load": _weighted(all_epochs, "load"),
            "other_cpus": _weighted(all_epochs, "other_cpus"),
            "cpus": runs[0]["hardware"].get("cpus"),
            "threads": (runs[0]["config"].get("threads")
                        or runs[0]["hardware"].get("torch_threads")),
            "memory": mem_total,
            "memory_parts": mems[0] if mems else None,
            "skipped": statistics.fmean(skipped) if skipped else 0.0,
            "errors": [r["error"] for r in runs if r.get("error")],
        })
    base = next((r for r in rows if r["policy"] == BASELINE), None)
    for r in rows:
        r["acc_delta"] = (r["acc_mean"] - base["acc_mean"]) if (
            base and base["acc_mean"] is not None and r["acc_mean"] is not None) else None
        r["memory_rel"] = (r["memory"] / base_mem) if (base_mem and r["memory"]) else None
        r["time_rel"] = (r["sec_per_epoch"] / base["sec_per_epoch"]) if (
            base and base["sec_per_epoch"] and r["sec_per_epoch"]) else None
        r["cpu_rel"] = (r["cpu_per_epoch"] / base["cpu_per_epoch"]) if (
            base and base["cpu_per_epoch"] and r["cpu_per_epoch"]) else None
        r["load_check"] = (compare_load(base, r, other_name=r["policy"])
                           if base and r is not base and r["time_rel"] is not None else None)
        r["time_comparable"] = r["load_check"] is None or r["load_check"].comparable
    return rows


def pct(v, signed=False):
    if v is None:
        return "-"
    return f"{100 * v:+.2f}" if signed else f"{100 * v:.2f}"


def acc_cell(r: dict) -> str:
    """Accuracy of a summary row in percent: mean ± sample standard deviation over the seeds,
    or the one value and n=1 (one seed has no spread to show)."""
    if r["acc_mean"] is None:
        return "-"
    if r["acc_n"] < 2 or r["acc_std"] is None:
        return f"{pct(r['acc_mean'])} (n=1)"
    return f"{pct(r['acc_mean'])} ± {pct(r['acc_std'])}"


def time_cell(r: dict) -> str:
    """The time ratio to 32-true; an asterisk where the runs saw different load."""
    if r["time_rel"] is None:
        return "-"
    return f"{r['time_rel']:.2f}x" + ("" if r["time_comparable"] else "*")
