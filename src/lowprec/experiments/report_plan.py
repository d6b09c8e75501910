"""The plan's section of the compare report: for each ``plan:FILE`` policy compared, the
per-module table (format per role, cost, why) and the plan's own verification, read from the
plan each run stored in the results database when it started (``analysis`` kind ``plan``),
not from the file, which may have changed since."""

from __future__ import annotations

import html

from ..training.plan import Plan
from .planner import plan_table, summary_rows
from .render import html_table, md_table
from .results import ResultsDB

__all__ = ["plan_sections"]


def _stored_plans(db: ResultsDB) -> dict[str, Plan]:
    """policy name -> the plan its first run (in run order) stored."""
    stored = db.analyses("plan")
    out: dict[str, Plan] = {}
    for r in db.runs():
        payload = stored.get(r["run_id"])
        if payload is not None and r["policy"] not in out:
            try:
                out[r["policy"]] = Plan.from_json(payload, f"run {r['run_id']}'s plan")
            except (ValueError, TypeError):
                continue  # a stored plan this lowprec cannot read: no section for it
    return out


def plan_sections(db: ResultsDB) -> tuple[list[str], list[str]]:
    """(markdown lines, HTML fragments) of one section per plan compared; empty when none."""
    md: list[str] = []
    parts: list[str] = []
    for policy, p in _stored_plans(db).items():
        m = p.meta
        head, rows = plan_table(p)
        intro = (f"Base policy {p.policy}; {len(p.overrides)} module override(s); budget "
                 f"{m.get('minimise', '?')}; tolerance {100 * m.get('tolerance', 0):.2f} "
                 f"points; modules above the cheapest level: "
                 f"{', '.join(m.get('high') or []) or 'none'}.")
        md += [f"## Precision plan: {policy}", "", intro, "", md_table(head, rows), ""]
        parts += [f"<section class='plan'><h2>Precision plan: {html.escape(policy)}</h2>",
                  f"<p>{html.escape(intro)}</p>", html_table(head, rows, "plan")]
        if p.verification.get("runs"):
            vhead, vrows = summary_rows(p)
            note = (f"When the plan was found: {m.get('steps')} steps, seeds "
                    f"{', '.join(map(str, m.get('seeds', [])))} (the runs above are this "
                    "comparison's).")
            md += [note, "", md_table(vhead, vrows), ""]
            parts += [f"<p class='note'>{html.escape(note)}</p>",
                      html_table(vhead, vrows, "plan-verification")]
        parts.append("</section>")
    return md, parts
