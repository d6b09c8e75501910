"""Which modules each scaled-GEMM recipe touched, read from the results database (analysis
kind ``recipe_coverage``, stored by the runner from ``Precision.recipe_coverage()``): the
report's section, ``--json``'s ``recipe_coverage`` and the verdict's warning. A recipe covers
``F.linear`` (and, where it says so, ``matmul``/``mm``/``bmm``) and defines no convolution: on a
convolutional network it may cast little or nothing, and the run then measures the compute
format, not the recipe."""

from __future__ import annotations

import html

from .render import html_table, md_table
from .results import ResultsDB

__all__ = ["recipe_coverage", "recipe_sections", "coverage_note"]

_SHOWN = 12  # module names a table cell lists before "and N more"


def recipe_coverage(db: ResultsDB) -> dict[str, dict]:
    """policy -> {recipe: {"touched": [modules], "uncovered": [modules]}} from its first run
    (in run order) that stored one; policies without a recipe are absent."""
    stored = db.analyses("recipe_coverage")
    out: dict[str, dict] = {}
    for r in db.runs():
        payload = stored.get(r["run_id"])
        if payload is not None and r["policy"] not in out and isinstance(
                payload.get("recipes"), dict):
            out[r["policy"]] = payload["recipes"]
    return out


def _names(mods: list[str]) -> str:
    if not mods:
        return "none"
    more = len(mods) - _SHOWN
    return ", ".join(mods[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def coverage_note(policy: str, recipes: dict) -> str | None:
    """One sentence when ``policy``'s recipes cast no module, or left convolutions uncast."""
    touched = sum(len(v.get("touched", ())) for v in recipes.values())
    uncovered = sum(len(v.get("uncovered", ())) for v in recipes.values())
    names = " and ".join(recipes)
    if not touched:
        return (f"{policy}: its scaled-GEMM recipe {names} cast no module of this model (it "
                "covers F.linear, and no recipe defines a convolution): the run trained in the "
                "policy's compute format, not in the recipe's")
    if uncovered:
        return (f"{policy}: its scaled-GEMM recipe {names} cast {touched} module(s) and left "
                f"the convolutions of {uncovered} module(s) uncast (no recipe defines a "
                "convolution)")
    return None


def recipe_sections(db: ResultsDB) -> tuple[list[str], list[str]]:
    """(markdown lines, HTML fragments) of the section; empty when no policy has a recipe."""
    cov = recipe_coverage(db)
    if not cov:
        return [], []
    cols = ["policy", "recipe", "modules cast", "convolutions left uncast"]
    rows = [[policy, recipe, f"{len(v.get('touched', []))}: {_names(v.get('touched', []))}",
             f"{len(v.get('uncovered', []))}: {_names(v.get('uncovered', []))}"]
            for policy, recipes in cov.items() for recipe, v in recipes.items()]
    intro = ("Each scaled-GEMM recipe casts the operands of F.linear (and of matmul, mm and bmm "
             "where it says ops=linear+matmul), as torchao's Float8Linear converts nn.Linear; "
             "no recipe defines a convolution, which then computes in the policy's compute "
             "format. The modules each recipe cast in the run's forwards:")
    notes = [n for p, r in cov.items() if (n := coverage_note(p, r))]
    md = ["## Scaled-GEMM recipes: modules touched", "", intro, "", md_table(cols, rows), ""]
    md += [f"- {n}" for n in notes] + ([""] if notes else [])
    parts = ["<h2>Scaled-GEMM recipes: modules touched</h2>", f"<p>{html.escape(intro)}</p>",
             html_table(cols, rows, "recipes")]
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    return md, parts
