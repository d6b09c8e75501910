"""The report: ``report.html`` (self-contained, images embedded) and ``report.md``, built from the
results database alone (``lowprec report RUN_DIR`` rebuilds it at any time).

Per policy: test accuracy mean ± std over seeds and its difference from 32-true, seconds per
epoch, memory relative to 32-true, skipped steps, diverged runs. Plots: test accuracy per epoch,
the loss-scale trace, memory by role.
"""

from __future__ import annotations

import base64
import html
import math
import statistics
from pathlib import Path

from .render import html_table, md_table, png_bytes, subplots
from .results import ResultsDB
from .runfolder import atomic_write_bytes, io_error

__all__ = ["summarize", "write_report", "summary_rows"]

BASELINE = "32-true"


def _final_acc(epochs: list[dict]) -> float | None:
    for e in reversed(epochs):
        if e["test_acc"] is not None:
            return e["test_acc"]
    return None


def summarize(db: ResultsDB) -> list[dict]:
    """One dict per policy, in the order the policies were first run."""
    by_policy: dict[str, list[dict]] = {}
    for r in db.runs():
        by_policy.setdefault(r["policy"], []).append(r)
    base_mem = None
    rows = []
    for policy, runs in by_policy.items():
        accs, secs, mems, skipped = [], [], [], []
        for r in runs:
            ep = db.epochs(r["run_id"])
            if r["status"] == "finished":
                a = _final_acc(ep)
                if a is not None:
                    accs.append(a)
            secs += [e["seconds"] for e in ep if e["seconds"]]
            skipped.append(sum(e["skipped"] for e in ep))
            m = db.memory(r["run_id"])
            if m:
                mems.append(m)
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
            "acc_std": statistics.stdev(accs) if len(accs) > 1 else (0.0 if accs else None),
            "sec_per_epoch": statistics.fmean(secs) if secs else None,
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
    return rows


def _pct(v, signed=False):
    if v is None:
        return "-"
    return f"{100 * v:+.2f}" if signed else f"{100 * v:.2f}"


def summary_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Column names and formatted cells, shared by the CLI table and both reports."""
    cols = ["policy", "backend", "test acc % (mean ± std)", "Δ vs 32-true (pts)", "s/epoch",
            "time vs 32-true", "memory vs 32-true", "skipped steps/run", "diverged", "failed"]
    out = []
    for r in rows:
        acc = "-" if r["acc_mean"] is None else f"{_pct(r['acc_mean'])} ± {_pct(r['acc_std'])}"
        out.append([
            r["policy"], r["backend"], acc, _pct(r["acc_delta"], signed=True),
            "-" if r["sec_per_epoch"] is None else f"{r['sec_per_epoch']:.2f}",
            "-" if r["time_rel"] is None else f"{r['time_rel']:.2f}x",
            "-" if r["memory_rel"] is None else f"{r['memory_rel']:.2f}x",
            f"{r['skipped']:.1f}", f"{r['diverged']}/{r['runs']}", f"{r['failed']}/{r['runs']}"])
    return cols, out


# -- plots -----------------------------------------------------------------------------------

def _figures(db: ResultsDB, rows: list[dict]) -> dict[str, bytes]:
    figs: dict[str, bytes] = {}
    policies = [r["policy"] for r in rows]
    runs = db.runs()

    # test accuracy per epoch: mean over seeds, band from min to max
    fig, ax = subplots(figsize=(7, 4))
    for policy in policies:
        curves = []
        for r in runs:
            if r["policy"] == policy:
                accs = [e["test_acc"] for e in db.epochs(r["run_id"])]
                if accs:
                    curves.append(accs)
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
        line, = ax.plot(xs, mean, marker="o", ms=3, label=policy)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Test accuracy per epoch (mean over seeds, band: min-max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figs["accuracy.png"] = png_bytes(fig)

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
    return (f"data {c.get('data')}, model {c.get('model')}, {c.get('epochs')} epochs, batch "
            f"{c.get('batch_size')}, {c.get('optimizer')} lr {c.get('lr')}, seeds "
            f"{c.get('seeds')}; lowprec {v.get('lowprec')}, torch {v.get('torch')}; "
            f"{hw.get('processor')}, {hw.get('cpus')} CPUs"
            + (f", git {runs[0]['git'][:10]}" if runs[0].get("git") else ""))


def _runs_table(db: ResultsDB) -> tuple[list[str], list[list[str]]]:
    cols = ["run", "status", "final test acc %", "diverged at step", "note"]
    out = []
    for r in db.runs():
        a = _final_acc(db.epochs(r["run_id"]))
        out.append([r["run_id"], r["status"], _pct(a), "-" if r["diverged_step"] is None else
                    str(r["diverged_step"]), (r.get("error") or "")[:160]])
    return cols, out


_CAPTIONS = {
    "accuracy.png": "Test accuracy per epoch for each policy.",
    "loss_scale.png": "Loss scale per optimizer step (dynamic loss scaling), skipped steps marked.",
    "memory.png": "Bytes of one training step by role, from the memory ledger.",
}


def write_report(run_dir: str | Path, db: ResultsDB | None = None) -> tuple[Path, Path]:
    """Write report.md (+ PNGs in report_files/) and a self-contained report.html."""
    run_dir = Path(run_dir)
    own = db is None
    if own:
        db = ResultsDB(run_dir / "results.db", create=False)
    try:
        rows = summarize(db)
        cols, cells = summary_rows(rows)
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
    md = [f"# {title}", "", config, "", "## Summary", "", md_table(cols, cells), ""]
    for name, caption in _CAPTIONS.items():
        md += [f"![{caption}](report_files/{name})", "", f"*{caption}*", ""]
    md += extra_md
    md += ["## Runs", "", md_table(rcols, rcells), ""]
    md_path = run_dir / "report.md"
    _atomic_write(md_path, "\n".join(md).encode())

    def img(name, caption):
        b64 = base64.b64encode(figs[name]).decode()
        return (f'<figure><img src="data:image/png;base64,{b64}" alt="{html.escape(caption)}">'
                f"<figcaption>{html.escape(caption)}</figcaption></figure>")

    body = [f"<h1>{title}</h1>", f"<p class='config'>{html.escape(config)}</p>",
            "<h2>Summary</h2>", html_table(cols, cells, "summary")]
    body += [img(n, c) for n, c in _CAPTIONS.items()]
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
figcaption {{ color: #555; font-size: 13px; }} .config {{ color: #555; }}
</style></head><body>
{''.join(body)}
</body></html>
"""
    html_path = run_dir / "report.html"
    _atomic_write(html_path, page.encode())
    return md_path, html_path


def _extra_sections(db: ResultsDB):
    """Sections from the analyses stored in the database (the 16-bit certificate)."""
    from .report_sections import sections

    return sections(db)
