"""The report: ``report.html`` (self-contained, images embedded) and ``report.md``, built from the
results database alone (``lowprec report RUN_DIR`` rebuilds it at any time).

First the verdict (:mod:`lowprec.experiments.verdict`): which policy to use and why. Then per
policy: test accuracy mean ± std over seeds (the value and n=1 for one seed) and its difference
from 32-true, seconds per epoch, memory relative to 32-true, skipped steps, diverged runs; a
time ratio whose runs saw different load is marked (:mod:`lowprec.experiments.timing`). Plots:
test accuracy per epoch, loss, learning rate and gradient norm per step, the loss-scale trace,
memory by role; a timing table (wall and CPU time, load).
"""

from __future__ import annotations

import base64
import html
import math
import statistics
from pathlib import Path

from .render import html_table, md_table, png_bytes, stacked, subplots
from .results import ResultsDB
from .runfolder import MODELS_FILE, atomic_write_bytes, io_error, read_models_list
from .summary import BASELINE, acc_cell, final_acc, pct, summarize, time_cell
from .timing import LOAD_DIFF_MAX

__all__ = ["write_report", "summary_rows", "flagged_note", "verdict_markdown", "verdict_html", "summary_json"]

_JSON_KEYS = ("policy", "backend", "runs", "finished", "diverged", "failed", "acc_mean",
              "acc_std", "acc_n", "acc_delta", "sec_per_epoch", "cpu_per_epoch", "time_rel",
              "cpu_rel", "time_comparable", "load", "other_cpus", "memory", "memory_rel",
              "skipped", "errors")


def summary_json(run_dir: str | Path) -> dict:
    """A run folder's summary as plain data (``lowprec compare --json``): per policy the
    numbers of the summary table (fractions, not percents; None where not measured), why a
    time ratio is not comparable, and the verdict; a comparison over several models gives one
    such summary per model under "models"."""
    from .report_recipes import recipe_coverage
    from .verdict import recommend

    run_dir = Path(run_dir)
    out = {"run_dir": str(run_dir), "report": {"html": str(run_dir / "report.html"),
                                               "md": str(run_dir / "report.md")}}
    if not (run_dir / "results.db").exists() and (run_dir / MODELS_FILE).exists():
        import json

        models = read_models_list(run_dir)
        out["models"] = {m: summary_json(run_dir / m) for m in models
                         if (run_dir / m / "results.db").exists()}
        return out
    db = ResultsDB(run_dir / "results.db", create=False, readonly=True)
    try:
        rows = summarize(db)
        verdict = recommend(db, rows)
        runs = [{k: r.get(k) for k in ("run_id", "policy", "seed", "status", "diverged_step",
                                       "error")} for r in db.runs()]
        coverage = recipe_coverage(db)
    finally:
        db.close()
    policies = []
    for r in rows:
        item = {k: r[k] for k in _JSON_KEYS}
        item["time_note"] = None if r["load_check"] is None else r["load_check"].reason
        # recipe -> the modules it cast and the convolutions it left alone (None: no recipe)
        item["recipe_coverage"] = coverage.get(r["policy"])
        policies.append(item)
    return {**out, "verdict": verdict.to_json(), "policies": policies, "runs": runs}


def summary_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Column names and formatted cells, shared by the CLI table and both reports."""
    cols = ["policy", "backend", "test acc % (mean ± std)", "Δ vs 32-true (pts)", "s/epoch",
            "time vs 32-true", "memory vs 32-true", "skipped steps/run", "diverged", "failed"]
    out = []
    for r in rows:
        out.append([
            r["policy"], r["backend"], acc_cell(r), pct(r["acc_delta"], signed=True),
            "-" if r["sec_per_epoch"] is None else f"{r['sec_per_epoch']:.2f}",
            time_cell(r),
            "-" if r["memory_rel"] is None else f"{r['memory_rel']:.2f}x",
            f"{r['skipped']:.1f}", f"{r['diverged']}/{r['runs']}", f"{r['failed']}/{r['runs']}"])
    return cols, out


def flagged_note(rows: list[dict]) -> str | None:
    """The footnote of the time column's asterisks (None when nothing is flagged)."""
    flagged = [r for r in rows if not r["time_comparable"]]
    if not flagged:
        return None
    return ("Times marked * are not comparable: " + "; ".join(f"{r['policy']}: {r['load_check'].reason}"
                                             for r in flagged)
            + " (see Timing for the rule)")


# -- plots -----------------------------------------------------------------------------------

def _figures(db: ResultsDB, rows: list[dict]) -> dict[str, bytes]:
    figs: dict[str, bytes] = {}
    policies = [r["policy"] for r in rows]
    runs = db.runs()

    figs["accuracy.png"] = _accuracy_plot(db, rows, runs)
    figs["steps.png"] = _steps_plot(db, policies, runs)

    # loss-scale trace of the first seed of each policy that scales the loss
    fig, ax = subplots(figsize=(7, 3.5))
    plotted = False
    for policy in policies:
        r = next((r for r in runs if r["policy"] == policy), None)
        if r is None:
            continue
        tr = db.trace(r["run_id"])
        if not tr or all(t["scale"] == 1.0 for t in tr):
            continue
        ax.step([t["step"] for t in tr], [t["scale"] for t in tr], where="post", label=policy)
        sk = [t for t in tr if t["skipped"]]
        if sk:
            ax.scatter([t["step"] for t in sk], [t["scale"] for t in sk], marker="x", s=18,
                       color="red", zorder=3)
        plotted = True
    ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss-scale trace (x: skipped steps, Inf/NaN gradients)")
    ax.grid(alpha=0.3)
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no policy in this comparison scales the loss", ha="center",
                va="center", transform=ax.transAxes)
    figs["loss_scale.png"] = png_bytes(fig)

    # memory by role
    fig, ax = subplots(figsize=(7, 3.8))
    roles = ["params", "grads", "optimizer_state", "master", "activations"]
    bottoms = [0.0] * len(rows)
    for role in roles:
        vals = [(r["memory_parts"] or {}).get(role, 0) / 1e6 for r in rows]
        ax.bar(policies, vals, bottom=bottoms, label=role.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_ylabel("MB in one training step")
    ax.set_title("Memory ledger by role")
    ax.legend(fontsize=8)
    for label in ax.get_xticklabels():
        label.set_rotation(20)
        label.set_ha("right")
    figs["memory.png"] = png_bytes(fig)
    return figs


def _accuracy_plot(db: ResultsDB, rows: list[dict], runs: list[dict]) -> bytes:
    """Test accuracy per epoch (mean over seeds, band from min to max); after one epoch, a
    point per policy with its seeds' range instead of curves of one point each."""
    curves_of: dict[str, list[list]] = {}
    for r in runs:
        accs = [e["test_acc"] for e in db.epochs(r["run_id"])]
        if accs:
            curves_of.setdefault(r["policy"], []).append(accs)
    longest = max((len(c) for cs in curves_of.values() for c in cs), default=0)
    if longest <= 1:
        fig, ax = subplots(figsize=(7, 3.6))
        names, means, lo, hi = [], [], [], []
        for row in rows:
            vals = [c[0] for c in curves_of.get(row["policy"], []) if c and c[0] is not None]
            if not vals:
                continue
            names.append(row["policy"])
            means.append(100 * statistics.fmean(vals))
            lo.append(means[-1] - 100 * min(vals))
            hi.append(100 * max(vals) - means[-1])
        ax.errorbar(range(len(names)), means, yerr=[lo, hi], fmt="o", capsize=4)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("Test accuracy after one epoch (mean over seeds, bars: min-max)")
        ax.grid(alpha=0.3)
        return png_bytes(fig)
    fig, ax = subplots(figsize=(7, 4))
    for row in rows:
        curves = curves_of.get(row["policy"])
        if not curves:
            continue
        length = max(len(c) for c in curves)
        xs = list(range(1, length + 1))
        mean, lo, hi = [], [], []
        for i in range(length):
            vals = [c[i] for c in curves if i < len(c) and c[i] is not None]
            mean.append(100 * statistics.fmean(vals) if vals else math.nan)
            lo.append(100 * min(vals) if vals else math.nan)
            hi.append(100 * max(vals) if vals else math.nan)
        line, = ax.plot(xs, mean, marker="o", ms=3, label=row["policy"])
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy per epoch (mean over seeds, band: min-max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png_bytes(fig)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps, skipping non-finite values (NaN where none)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        finite = [a for a in acc if a is not None and math.isfinite(a)]
        out.append(statistics.fmean(finite) if finite else math.nan)
    return out


def _steps_plot(db: ResultsDB, policies: list[str], runs: list[dict]) -> bytes:
    """Per optimizer step: training loss and gradient norm (mean over seeds, trailing mean over
    a tenth of an epoch) and the learning rate."""
    fig, (ax_loss, ax_lr, ax_gn) = stacked(3, figsize=(7, 7))
    plotted = False
    for policy in policies:
        per_run = [db.steps(r["run_id"]) for r in runs if r["policy"] == policy]
        per_run = [s for s in per_run if s]
        if not per_run:
            continue
        plotted = True
        length = max(len(s) for s in per_run)
        per_epoch = max(1, sum(1 for s in per_run[0] if s["epoch"] == per_run[0][0]["epoch"]))
        window = max(1, per_epoch // 10)

        def mean_of(key):
            vals = []
            for i in range(length):
                xs = [s[i][key] for s in per_run if i < len(s) and s[i][key] is not None
                      and math.isfinite(s[i][key])]
                vals.append(statistics.fmean(xs) if xs else math.nan)
            return vals

        steps = list(range(length))
        line, = ax_loss.plot(steps, _smooth(mean_of("loss"), window), lw=1, label=policy)
        ax_gn.plot(steps, _smooth(mean_of("grad_norm"), window), lw=1, color=line.get_color())
        ax_lr.plot(steps, [s["lr"] for s in max(per_run, key=len)], lw=1,
                   color=line.get_color())
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("Per optimizer step (mean over seeds, trailing mean over 1/10 epoch)")
    ax_lr.set_ylabel("learning rate")
    ax_gn.set_ylabel("gradient norm")
    ax_gn.set_yscale("log")
    ax_gn.set_xlabel("optimizer step")
    for ax in (ax_loss, ax_lr, ax_gn):
        ax.grid(alpha=0.3)
    if plotted:
        ax_loss.legend(fontsize=8)
    else:
        ax_loss.text(0.5, 0.5, "no per-step metrics recorded (a database of an older lowprec)",
                     ha="center", va="center", transform=ax_loss.transAxes)
    return png_bytes(fig)


def _timing_table(rows: list[dict], db: ResultsDB) -> tuple[list[str], list[list[str]], str]:
    """Wall and CPU time, the load the runs saw, and whether each time ratio is comparable;
    a sentence on runs that ran side by side."""
    from .timing import overlapping_runs

    cols = ["policy", "s/epoch (wall)", "CPU s/epoch", "cores used (CPU/wall)",
            "load average", "other processes (cores)", "time vs 32-true", "CPU time vs 32-true",
            "time ratio"]
    cells = []
    for r in rows:
        num = (lambda v, f: "-" if v is None else format(v, f))
        used = (r["cpu_per_epoch"] / r["sec_per_epoch"]
                if r["cpu_per_epoch"] is not None and r["sec_per_epoch"] else None)
        check = r["load_check"]
        verdict = ("baseline" if r["policy"] == BASELINE else "-" if check is None else
                   "comparable" if check.comparable else "NOT comparable")
        cells.append([r["policy"], num(r["sec_per_epoch"], ".2f"), num(r["cpu_per_epoch"], ".2f"),
                      num(used, ".2f"), num(r["load"], ".2f"), num(r["other_cpus"], ".2f"),
                      time_cell(r), "-" if r["cpu_rel"] is None else f"{r['cpu_rel']:.2f}x",
                      verdict])
    spans = {}
    for run in db.runs():
        ep = [e for e in db.epochs(run["run_id"]) if e.get("ended") is not None]
        if ep:
            spans[run["run_id"]] = (min(e["ended"] - e["seconds"] for e in ep),
                                    max(e["ended"] for e in ep))
    side = overlapping_runs(spans)
    note = (f"{len(side)} of {len(spans)} runs trained while another run of this comparison "
            "trained (Ray tasks side by side): where they shared a node they shared its CPUs, "
            "and the other-processes column counts each for the other." if side else
            "The runs trained one after another.")
    return cols, cells, note


# -- writing ---------------------------------------------------------------------------------

def _atomic_write(path: Path, data: bytes) -> None:
    atomic_write_bytes(path, data, f"the report file {path.name}")


def _config_line(db: ResultsDB) -> str:
    runs = db.runs()
    if not runs:
        return ""
    c = runs[0]["config"]
    v = runs[0]["versions"]
    hw = runs[0]["hardware"]
    epochs = c.get("epochs")
    return (f"data {c.get('data')}, model {c.get('model')}, {epochs} "
            f"epoch{'' if epochs == 1 else 's'}, batch "
            f"{c.get('batch_size')}, {c.get('optimizer')} lr {c.get('lr')}, seeds "
            f"{c.get('seeds')}; lowprec {v.get('lowprec')}, torch {v.get('torch')}; "
            f"{hw.get('processor')}, {hw.get('cpus')} CPUs"
            + (f", git {runs[0]['git'][:10]}" if runs[0].get("git") else ""))


def _runs_table(db: ResultsDB) -> tuple[list[str], list[list[str]]]:
    cols = ["run", "status", "final test acc %", "diverged at step", "note"]
    out = []
    for r in db.runs():
        a = final_acc(db.epochs(r["run_id"]))
        out.append([r["run_id"], r["status"], pct(a), "-" if r["diverged_step"] is None else
                    str(r["diverged_step"]), (r.get("error") or "")[:160]])
    return cols, out


_CAPTIONS = {
    "accuracy.png": "Test accuracy per epoch for each policy.",
    "steps.png": "Training loss, learning rate and gradient norm per optimizer step.",
    "loss_scale.png": "Loss scale per optimizer step (dynamic loss scaling), skipped steps marked.",
    "memory.png": "Bytes of one training step by role, from the memory ledger.",
}
_TIMING_INTRO = ("Wall time measures the machine as much as the policy when other work shares "
                 "its CPUs. Each epoch records its wall time, the training process's CPU time, "
                 "the 1-minute load average and the cores other processes kept busy meanwhile "
                 "(/proc/stat). A time ratio is NOT comparable (marked *, and not used by the "
                 "verdict) when, during either policy's epochs, other processes took more than "
                 f"{LOAD_DIFF_MAX:g} core of the cores the runs' threads needed, or when the two "
                 f"policies' other load differs by more than {LOAD_DIFF_MAX:g} core (the load "
                 "averages stand in where that was not measured).")


def write_report(run_dir: str | Path, db: ResultsDB | None = None) -> tuple[Path, Path]:
    """Write report.md (+ PNGs in report_files/) and a self-contained report.html; the verdict
    (:func:`lowprec.experiments.verdict.recommend`) comes first."""
    from .verdict import recommend

    run_dir = Path(run_dir)
    own = db is None
    if own:  # read only: a report is written beside the database, never into it
        db = ResultsDB(run_dir / "results.db", create=False, readonly=True)
    try:
        rows = summarize(db)
        verdict = recommend(db, rows)
        cols, cells = summary_rows(rows)
        footnote = flagged_note(rows)
        tcols, tcells, tnote = _timing_table(rows, db)
        rcols, rcells = _runs_table(db)
        figs = _figures(db, rows)
        extra_md, extra_html, extra_figs = _extra_sections(db)
        figs.update(extra_figs)
        config = _config_line(db)
    finally:
        if own:
            db.close()
    files = run_dir / "report_files"
    try:
        files.mkdir(exist_ok=True)
    except OSError as err:
        raise io_error(files, "the report folder", err) from None
    for name, data in figs.items():
        _atomic_write(files / name, data)
    title = "lowprec comparison"
    md = [f"# {title}", "", config, "", *verdict_markdown(verdict), "## Summary", "",
          md_table(cols, cells), ""]
    if footnote:
        md += [footnote, ""]
    for name, caption in _CAPTIONS.items():
        md += [f"![{caption}](report_files/{name})", "", f"*{caption}*", ""]
    md += ["## Timing", "", _TIMING_INTRO, "", md_table(tcols, tcells), "", tnote, ""]
    md += extra_md
    md += ["## Runs", "", md_table(rcols, rcells), ""]
    md_path = run_dir / "report.md"
    _atomic_write(md_path, "\n".join(md).encode())

    def img(name, caption):
        b64 = base64.b64encode(figs[name]).decode()
        return (f'<figure><img src="data:image/png;base64,{b64}" alt="{html.escape(caption)}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>")

    body = [f"<h1>{title}</h1>", f"<p class='config'>{html.escape(config)}</p>",
            verdict_html(verdict), "<h2>Summary</h2>", html_table(cols, cells, "summary")]
    if footnote:
        body.append(f"<p class='note'>{html.escape(footnote)}</p>")
    body += [img(n, c) for n, c in _CAPTIONS.items()]
    body += ["<h2>Timing</h2>", f"<p>{html.escape(_TIMING_INTRO)}</p>",
             html_table(tcols, tcells, "timing"), f"<p class='note'>{html.escape(tnote)}</p>"]
    body += extra_html(img)
    body += ["<h2>Runs</h2>", html_table(rcols, rcells, "runs")]
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f0f0f0; }}
td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #555; font-size: 13px; }} .config, .note {{ color: #555; }}
#verdict {{ border-left: 4px solid #2a7; background: #f4fbf7; padding: 0.5em 1em; }}
#verdict .headline {{ font-size: 1.15em; font-weight: 600; }}
</style></head><body>
{''.join(body)}
</body></html>
"""
    html_path = run_dir / "report.html"
    _atomic_write(html_path, page.encode())
    return md_path, html_path


def verdict_markdown(v) -> list[str]:
    """The verdict's section of report.md."""
    out = ["## Verdict", "", f"**{v.headline}**", ""]
    out += [f"- {e}" for e in v.evidence]
    for f in v.findings:
        out.append(f"- lowprec advise's findings for {f['format']} ({f['run']}): "
                   f"**{f['verdict']}**: " + "; ".join(f["reasons"]))
    return out + [""]


def verdict_html(v) -> str:
    """The verdict's section of report.html (``id="verdict"``)."""
    items = [f"<li>{html.escape(e)}</li>" for e in v.evidence]
    items += [f"<li>lowprec advise's findings for {html.escape(f['format'])} "
              f"({html.escape(f['run'])}): <strong>{html.escape(f['verdict'])}</strong>: "
              f"{html.escape('; '.join(f['reasons']))}</li>" for f in v.findings]
    return (f"<section id='verdict'><h2>Verdict</h2><p class='headline'>"
            f"{html.escape(v.headline)}</p><ul>{''.join(items)}</ul></section>")


def _extra_sections(db: ResultsDB):
    """Sections from the analyses stored in the database (the 16-bit certificate; the
    per-module table of each plan:FILE policy compared; the modules each scaled-GEMM recipe
    touched)."""
    from .report_plan import plan_sections
    from .report_recipes import recipe_sections
    from .report_sections import sections

    md, build, figs = sections(db)
    plan_md, plan_html = plan_sections(db)
    rec_md, rec_html = recipe_sections(db)
    return (md + plan_md + rec_md, (lambda img: build(img) + plan_html + rec_html), figs)
