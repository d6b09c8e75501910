"""The certificate's section of the compare report, read from the results database."""

from __future__ import annotations

import html
import math
import statistics

from ..analysis.ranges import has_subnormals as format_has_subnormals
from .render import html_table, md_table, png_bytes, subplots
from .results import ResultsDB

__all__ = ["sections", "has_subnormals"]


def _rows(db: ResultsDB, prefix: str = "certificate"):
    """{(policy, format): [payload + run_id per run]} for one kind of analysis."""
    runs = {r["run_id"]: r for r in db.runs()}
    table: dict[tuple[str, str], list[dict]] = {}
    for run_id, r in runs.items():
        for kind, payload in db.analyses_of(run_id, prefix):
            table.setdefault((r["policy"], kind.split(":", 1)[1]), []).append(
                {"run_id": run_id, **payload})
    return table


def _shown(fmt: str) -> str:
    """A certificate's format as the tables show it (a plan:FILE run's is the plan's own)."""
    return "plan (each module in its format)" if fmt == "plan" else fmt


def sections(db: ResultsDB):
    """(markdown lines, html builder, figures) for the certificate; empty when not computed."""
    table = _rows(db)
    if not table:
        return [], (lambda img: []), {}
    cols = ["policy", "format", "certified % (mean over seeds)", "same prediction %",
            "violations"]
    cells = _certificate_cells(table)
    # the scatter and per-class breakdown of one model: the first 32-bit run in fp16 if present
    key = next((k for k in table if k == ("32-true", "fp16")), next(iter(table)))
    item = table[key][0]
    figs = {"certificate.png": _scatter(item, key)}
    layers = _rows(db, "layers")
    ranges = _rows(db, "ranges")
    lost = _rows(db, "lost")
    if layers:
        figs["layer_errors.png"] = _layer_plot(layers)
    if key in ranges:
        figs["gradient_ranges.png"] = _range_plot(ranges[key][0], key)
    pc_cols = ["class", "inputs", "certified %", "same prediction %", "violations"]
    pc = [[str(r["class"]), str(r["n"]), f"{100 * r['certified']:.1f}",
           f"{100 * r['agreement']:.1f}", str(r["violations"])] for r in item["per_class"]]
    title = f"{item['run_id']} in {key[1]}"
    caption = (f"Γ (gap of the two largest fp32 logits) against δ (largest logit change in "
               f"{key[1]}), {title}; above the line Γ = 2δ the prediction is certified.")
    intro = ("The 16-bit certificate (Yun et al. 2023): on input x, with δ the largest change of "
             "any output between the fp32 model and the same weights in the format and Γ the "
             "gap between the two largest fp32 outputs, Γ > 2δ proves both predict the same "
             "class. A violation (certified, yet different predictions) would be a bug.")
    md = ["## The 16-bit certificate", "", intro, "", md_table(cols, cells), "",
          f"![{caption}](report_files/certificate.png)", "", f"*{caption}*", "",
          f"Per class, {title}:", "", md_table(pc_cols, pc), ""]
    le_cap = ("Relative error of each layer's output in the format against fp32, by depth "
              "(first seed of each policy).")
    gr_cap = (f"log2 |gradient| of {title} at loss scale 1 (solid) and at the recommended scale "
              "(dashed), against the format's smallest subnormal, smallest normal and max.")
    lu_cols, lu = _lost_table(lost)
    rg_cols, rg = _range_table(ranges)
    md += _analysis_md(figs, rg_cols, rg, lu_cols, lu, le_cap, gr_cap)

    def build(img):
        out = ["<h2>The 16-bit certificate</h2>", f"<p>{html.escape(intro)}</p>",
               html_table(cols, cells, "certificate"), img("certificate.png", caption),
               f"<p>Per class, {html.escape(title)}:</p>", html_table(pc_cols, pc, "classes")]
        if "layer_errors.png" in figs:
            out += ["<h2>Error propagation</h2>", img("layer_errors.png", le_cap)]
        if rg:
            out += ["<h2>Value ranges against the format</h2>",
                    html_table(rg_cols, rg, "ranges")]
            if "gradient_ranges.png" in figs:
                out.append(img("gradient_ranges.png", gr_cap))
        if lu:
            out += ["<h2>Lost updates</h2>", html_table(lu_cols, lu, "lost")]
        return out

    return md, build, figs


def _certificate_cells(table) -> list[list[str]]:
    """The certificate table's rows: one per (policy, format), means over its seeds."""
    cells = []
    for (policy, fmt), items in table.items():
        s = [it["summary"] for it in items]
        cells.append([policy, _shown(fmt),
                      f"{100 * statistics.fmean(x['certified'] for x in s):.2f}",
                      f"{100 * statistics.fmean(x['agreement'] for x in s):.2f}",
                      str(sum(x["violations"] for x in s))])
    return cells


def _lost_table(lost) -> tuple[list[str], list[list[str]]]:
    """The lost-updates table (columns, rows): the worst layer of each run that has one."""
    lu_cols = ["policy", "parameter format", "lr", "worst layer", "lost: nearest %",
               "stochastic %", "kahan %"]
    lu = []
    for (policy, _fmt), items in lost.items():
        it = items[0]
        worst = max(it["layers"], key=lambda r: r["nearest"], default=None)
        if worst:
            lu.append([policy, it["format"], f"{it['lr']:g}", worst["layer"],
                       f"{100 * worst['nearest']:.1f}", f"{100 * worst['stochastic']:.1f}",
                       f"{100 * worst['kahan']:.1f}"])
    return lu_cols, lu


def _range_table(ranges) -> tuple[list[str], list[list[str]]]:
    """The value-ranges table (columns, rows): one row per (policy, format, role)."""
    rg_cols = ["policy", "format", "role", "overflow %", "flush to zero %", "subnormal %"]
    rg = []
    for (policy, fmt), items in ranges.items():
        sub = has_subnormals(fmt)
        for role, v in items[0]["roles"].items():
            rg.append([policy, fmt, role.replace("_", " "), f"{100 * v['overflow']:.3f}",
                       f"{100 * v['flush']:.2f}",
                       f"{100 * v['subnormal']:.2f}" if sub else "-"])
    return rg_cols, rg


def has_subnormals(fmt: str) -> bool:
    """Whether the format named ``fmt`` has subnormal values (fixed point and -nosub formats:
    none, their table cell "-"); True for a name that is not one format (a recipe's label)."""
    try:
        return format_has_subnormals(fmt)
    except (ValueError, TypeError, AttributeError):
        return True


def _analysis_md(figs: dict, rg_cols, rg, lu_cols, lu, le_cap: str, gr_cap: str) -> list[str]:
    """The markdown after the certificate: error propagation, value ranges, lost updates."""
    md: list[str] = []
    if "layer_errors.png" in figs:
        md += ["## Error propagation", "", f"![{le_cap}](report_files/layer_errors.png)", "",
               f"*{le_cap}*", ""]
    if rg:
        md += ["## Value ranges against the format", "", md_table(rg_cols, rg), ""]
        if "gradient_ranges.png" in figs:
            md += [f"![{gr_cap}](report_files/gradient_ranges.png)", "", f"*{gr_cap}*", ""]
    if lu:
        md += ["## Lost updates", "", "Fraction of parameter elements whose first update "
               "rounds away (w + Δw == w in the parameter format), worst layer of each run.", "",
               md_table(lu_cols, lu), ""]
    return md


def _layer_plot(layers) -> bytes:
    fig, ax = subplots(figsize=(7, 3.8))
    for (policy, fmt), items in layers.items():
        rows = items[0]["layers"]
        xs = [r["depth"] for r in rows if r["rel_error"] == r["rel_error"]]
        ys = [max(r["rel_error"], 1e-12) for r in rows if r["rel_error"] == r["rel_error"]]
        ax.plot(xs, ys, marker="o", ms=3, label=f"{policy} in {fmt}")
    ax.set_yscale("log")
    ax.set_xlabel("layer (depth, in execution order)")
    ax.set_ylabel("relative error vs fp32")
    ax.set_title("Error propagation through the layers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png_bytes(fig)


def _range_plot(item: dict, key) -> bytes:
    from ..numerics.formats import parse_format
    from ..analysis.ranges import BINS

    fmt = parse_format(item["format"])
    fig, ax = subplots(figsize=(7, 3.8))
    hist = [0] * (len(BINS) - 1)
    for role in ("activation_grads", "weight_grads"):
        h = item["roles"].get(role, {}).get("hist") or []
        hist = [a + b for a, b in zip(hist, h)] if h else hist
    xs = BINS[:-1]
    shift = int(round(math.log2(item.get("recommended_scale") or 1.0)))
    ax.step(xs, hist, where="post", label="gradients, scale 1")
    if shift:
        ax.step(xs + shift, hist, where="post", ls="--",
                label=f"gradients x {2.0 ** shift:g}")
    for value, name, color in [(fmt.min_subnormal, "min subnormal", "red"),
                               (fmt.min_normal, "min normal", "orange"),
                               (fmt.max, "max", "green")]:
        ax.axvline(math.log2(value), color=color, ls=":", label=f"{name} 2^{math.log2(value):.0f}")
    nz = [i for i, v in enumerate(hist) if v]
    if nz:
        ax.set_xlim(xs[nz[0]] - 4, max(xs[nz[-1]] + shift + 4, math.log2(fmt.max) + 2))
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("count")
    ax.set_title(f"Gradient magnitudes: {key[0]} against {key[1]}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return png_bytes(fig)


def _scatter(item: dict, key) -> bytes:
    import numpy as np

    d = np.asarray(item["delta"], dtype=float)
    g = np.asarray(item["gamma"], dtype=float)
    agree = np.asarray(item["agree"], dtype=bool)
    tiny = 1e-12
    fig, ax = subplots(figsize=(6, 4.2))
    ax.scatter(np.maximum(d[agree], tiny), np.maximum(g[agree], tiny), s=6, alpha=0.5,
               label="same prediction")
    if (~agree).any():
        ax.scatter(np.maximum(d[~agree], tiny), np.maximum(g[~agree], tiny), s=14, color="red",
                   marker="x", label="different prediction")
    lo = max(min(d[d > 0].min() if (d > 0).any() else 1e-6, 1e-6), tiny)
    hi = max(d.max(), g.max(), 1.0) * 2
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, 2 * xs, "k--", label="Γ = 2δ")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("δ = max |M16(x) - M32(x)|")
    ax.set_ylabel("Γ = top-1 - top-2 of M32(x)")
    ax.set_title(f"Certificate: {key[0]} in {key[1]}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return png_bytes(fig)
