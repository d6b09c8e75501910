"""The plan explained: the per-module table, the plan against float32 and the uniform
policies, and the markdown section ``lowprec plan --report`` writes; read from a
:class:`~lowprec.training.plan.Plan` (found now or loaded from a file)."""

from __future__ import annotations

import math

from ...training.plan import Plan

__all__ = ["plan_table", "summary_rows", "plan_markdown", "cost_text", "unit"]


def cost_text(c: float, minimise: str) -> str:
    """A cost as the budget's table shows it: microseconds, or whole bytes or bits."""
    if minimise == "time":
        return f"{c * 1e6:,.3g}"
    return f"{int(c):,}"


def _real(v) -> float:
    """A number of a plan read back from JSON, where non-finite floats are strings."""
    return float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v


def unit(meta: dict) -> str:
    """The unit of a plan's costs, from its ``meta``."""
    minimise = meta.get("minimise", "memory")
    if minimise == "time":
        return f"µs/step ({(meta.get('hardware') or {}).get('name', '?')})"
    return "bytes" if minimise == "memory" else "bits"


def plan_table(p: Plan) -> tuple[list[str], list[list[str]]]:
    """The per-module table: module, kind, parameters, level, formats, cost, why."""
    m = p.meta
    minimise = m.get("minimise", "memory")
    head = ["module", "kind", "params", "level", "p / c / g", unit(m), "why"]
    rows = []
    for n, e in p.evidence.items():
        f = e["formats"]
        rows.append([n, e["kind"], str(e["params"]), e["level"],
                     f"{f['params']} / {f['compute']} / {f['grads']}",
                     cost_text(e["cost"], minimise), e["why"]])
    return head, rows


def summary_rows(p: Plan) -> tuple[list[str], list[list[str]]]:
    """The plan against fp32 and each uniform level: accuracy (mean ± std over seeds), its
    difference from fp32, cost and its ratio to fp32's."""
    runs = p.verification.get("runs", {})
    ref = runs.get("fp32", {})
    minimise = p.meta.get("minimise", "memory")
    hw = p.meta.get("hardware") or {}
    extra_time = bool(hw) and minimise != "time"
    head = ["policy", "accuracy %", "Δ vs fp32", unit(p.meta), "vs fp32", "within tolerance"]
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
        accs = r.get("accuracy")
        n = len(accs) if isinstance(accs, list) else None  # (one seed: no deviation to show)
        acc = "diverged" if not isinstance(mean, float) or not math.isfinite(mean) else \
            f"{100 * mean:.2f} (n=1)" if n == 1 else f"{100 * mean:.2f} ± {100 * std:.2f}"
        delta = "" if not math.isfinite(mean) else f"{100 * (mean - ref_mean):+.2f}"
        ok = "yes" if math.isfinite(mean) and mean >= target else "no"
        if r.get("block_refused"):
            ok += f" (emulated only: {', '.join(r['block_refused'])} not in whole blocks)"
        row = [key, acc, delta, cost_text(r["cost"], minimise),
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
