"""A comparison over several architectures: one ordinary comparison per model, in a sub-folder
of the run folder (``OUT/resnet20/results.db`` ...), and a combined report with one table per
architecture (``OUT/report.md``, ``OUT/report.html``).

Each sub-folder is a complete run folder (``lowprec report OUT/vgg`` rebuilds its report,
``--resume`` continues it); ``OUT/models.json`` lists the models in order.
"""

from __future__ import annotations

import html
import json
import statistics
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from ..training.plan import is_plan_spec
from ..training.policy import parse_policy
from .config import CompareConfig, RunError, split_models
from .render import html_table, md_table
from .report import write_report
from .results import ResultsDB
from .run_analyses import certificate_formats
from .runner import (check_inputs, check_resume, record_config_file, refuse_foreign,
                     refuse_nested, run_model)
from .runfolder import (MODELS_FILE, FolderLock, atomic_write_bytes, read_models_list,
                        remove_stale_temps)
from .summary import BASELINE, acc_cell, summarize, time_cell

__all__ = ["run_models", "write_models_report", "write_all_reports", "model_tables"]


def run_models(cfg: CompareConfig, executor=None, *, force_config: bool = False,
               config_text: str | None = None) -> Path:
    """Run the comparison of ``cfg`` once per model of ``cfg.model`` (comma-separated), each
    into ``OUT/MODEL``, then write the combined report. Returns OUT."""
    models = split_models(cfg.model)
    out = Path(cfg.out)
    listing = out / MODELS_FILE
    try:
        stored = json.loads(listing.read_text()) if listing.is_file() else {}
        listed = [str(m) for m in stored.get("models", [])]
        # models a forced resume dropped: their folders stay lowprec's (never deleted)
        dropped = [str(m) for m in stored.get("dropped", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        listed, dropped = [], []
    check_inputs(cfg, models)  # before any folder is made
    refuse_foreign(out, models=True, model_names={*models, *listed, *dropped})
    refuse_nested(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"output folder {out} is not writable ({err.strerror or err})") from None
    with FolderLock(out, "lowprec compare"):
        # every refusal before the first write: models.json, run.toml and the models' folders
        if listing.exists() and not cfg.resume:
            raise RunError(f"{out} already holds a comparison: continue it with --resume, or "
                           "choose another --out")
        if listing.exists() and list(models) != [str(m) for m in listed] and not force_config:
            raise RunError(f"--resume with another configuration (model: stored "
                           f"{','.join(map(str, listed))!r}, given {','.join(models)!r}): drop "
                           "--model to continue as stored, or add --force-config")
        for model in models:
            check_resume(out / model, replace(cfg, model=model, out=str(out / model)),
                         force_config)
        remove_stale_temps(out)
        dropped = sorted({*listed, *dropped} - set(models))
        atomic_write_bytes(listing, json.dumps(
            {"models": list(models), **({"dropped": dropped} if dropped else {})}).encode(),
            "the list of models")
        record_config_file(out, config_text)
        session = getattr(executor, "connected", None)  # one Ray instance for every model
        with session() if session else nullcontext():
            for model in models:
                run_model(replace(cfg, model=model, out=str(out / model)), executor,
                          force_config=force_config, config_text=config_text)
        write_models_report(out)
    return out


def _certified(db: ResultsDB) -> dict[str, tuple[str, float]]:
    """Per policy: the certified fraction of its first certificate format (fp16 for a 32-bit
    run: may this model run in 16 bits?), mean over the seeds."""
    fracs: dict[str, list[float]] = {}
    fmt_of: dict[str, str] = {}
    for r in db.runs():
        # a plan:FILE run is certified module by module, as the plan runs it ("plan")
        fmts = certificate_formats(r["policy"] if is_plan_spec(r["policy"])
                                   else parse_policy(r["policy"]))
        if not fmts:
            continue
        payload = db.analysis(r["run_id"], f"certificate:{fmts[0]}")
        if payload:
            fmt_of[r["policy"]] = fmts[0]
            fracs.setdefault(r["policy"], []).append(payload["summary"]["certified"])
    return {p: (fmt_of[p], statistics.fmean(v)) for p, v in fracs.items()}


def model_tables(out: str | Path) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(model, columns, rows, config line) per model of a multi-model run folder."""
    out = Path(out)
    models = read_models_list(out)
    cols = ["policy", "test acc % (mean ± std)", f"Δ vs {BASELINE} (pts)",
            "certified % (format)", f"time vs {BASELINE}", f"memory vs {BASELINE}", "s/epoch",
            "diverged", "failed"]
    tables = []
    for model in models:
        path = out / model / "results.db"
        if not path.exists():
            tables.append((model, cols, [], "not run yet"))
            continue
        db = ResultsDB(path, create=False, readonly=True)
        try:
            rows, cert = summarize(db), _certified(db)
            runs = db.runs()
            c = runs[0]["config"] if runs else {}
        finally:
            db.close()
        cells = []
        for r in rows:
            fmt, frac = cert.get(r["policy"], ("", None))
            cells.append([
                r["policy"],
                acc_cell(r),
                "-" if r["acc_delta"] is None else f"{100 * r['acc_delta']:+.2f}",
                "-" if frac is None else f"{100 * frac:.2f} ({fmt})",
                time_cell(r),
                "-" if r["memory_rel"] is None else f"{r['memory_rel']:.2f}x",
                "-" if r["sec_per_epoch"] is None else f"{r['sec_per_epoch']:.1f}",
                f"{r['diverged']}/{r['runs']}", f"{r['failed']}/{r['runs']}"])
        e = c.get("epochs")
        line = (f"{c.get('data')}, {e} epoch{'' if e == 1 else 's'}, batch {c.get('batch_size')}, "
                f"{c.get('optimizer')} lr {c.get('lr')} momentum {c.get('momentum')} weight "
                f"decay {c.get('weight_decay')}, {c.get('schedule')} schedule, seeds "
                f"{c.get('seeds')}") if c else ""
        tables.append((model, cols, cells, line))
    return tables


def _atomic_write(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode(), f"the report file {path.name}")


def write_models_report(out: str | Path) -> tuple[Path, Path]:
    """OUT/report.md and OUT/report.html: one table per architecture, linking each model's own
    report."""
    out = Path(out)
    tables = model_tables(out)
    title = "lowprec comparison across architectures"
    md = [f"# {title}", ""]
    body = [f"<h1>{title}</h1>"]
    for model, cols, cells, line in tables:
        md += [f"## {model}", "", line, "", md_table(cols, cells), "",
               f"Full report: [{model}/report.md]({model}/report.md)", ""]
        body += [f"<h2>{html.escape(model)}</h2>", f"<p class='config'>{html.escape(line)}</p>",
                 html_table(cols, cells, "summary"),
                 f"<p><a href='{html.escape(model)}/report.html'>full report of "
                 f"{html.escape(model)}</a></p>"]
    md_path, html_path = out / "report.md", out / "report.html"
    _atomic_write(md_path, "\n".join(md))
    _atomic_write(html_path, f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 14px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f0f0f0; }} td:first-child, th:first-child {{ text-align: left; }}
.config {{ color: #555; }}
</style></head><body>
{''.join(body)}
</body></html>
""")
    return md_path, html_path


def write_all_reports(out: str | Path) -> None:
    """Rebuild every model's report of a multi-model run folder, then the combined one."""
    out = Path(out)
    for sub in sorted(p.parent for p in out.glob("*/results.db")):
        write_report(sub)
    write_models_report(out)
