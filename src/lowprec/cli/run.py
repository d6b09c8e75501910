"""The commands over a run folder: ``compare`` and ``train`` (the flags assembled into a
config, :func:`lowprec.experiments.compare.run_compare`, the summary printed), ``report``
(the report rebuilt from results.db) and ``export``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .common import (Table, Terminated, UserError, errors, one_line, print_error, print_json,
                     short, user_call)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cmd_compare", "cmd_export", "cmd_report", "cmd_train"]


def _print_models_summary(run_dir, console: Console) -> None:
    from ..experiments.multi import model_tables

    for model, cols, cells, line in model_tables(run_dir):
        table = Table(title=f"{model}: {line}", header_style="bold")
        for c in cols:
            table.add_column(c, justify="left" if c == "policy" else "right")
        for row in cells:
            table.add_row(*row)
        console.print(table)
    console.print(f"report: {run_dir / 'report.html'} and {run_dir / 'report.md'}")


def _print_summary(run_dir, console: Console) -> None:
    from ..experiments.report import summary_rows
    from ..experiments.runfolder import MODELS_FILE
    from ..experiments.summary import summarize
    from ..experiments.results import ResultsDB

    if not (run_dir / "results.db").exists() and (run_dir / MODELS_FILE).exists():
        return _print_models_summary(run_dir, console)

    from ..experiments.report import flagged_note
    from ..experiments.verdict import recommend

    db = ResultsDB(run_dir / "results.db", create=False, readonly=True)
    try:
        rows = summarize(db)
        cols, cells = summary_rows(rows)
        verdict = recommend(db, rows)
    finally:
        db.close()
    table = Table(title=f"results in {run_dir}", header_style="bold")
    for c in cols:
        table.add_column(c, justify="left" if c in ("policy", "backend") else "right")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    note = flagged_note(rows)
    if note:
        console.print(note, markup=False)
    console.print(f"verdict: {verdict.headline}", markup=False)
    console.print(f"report: {run_dir / 'report.html'} and {run_dir / 'report.md'}")


def _config_from(args, **overrides):
    """CompareConfig from the flags (:func:`lowprec.experiments.assembly.assemble_config`)."""
    from ..experiments.assembly import SETTINGS, assemble_config

    return assemble_config(out=args.out, resume=args.resume, quiet=args.quiet,
                           preset=getattr(args, "preset", None),
                           policies=getattr(args, "policies", None),
                           seeds=getattr(args, "seeds", None), overrides=overrides,
                           **{k: getattr(args, k, None) for k in SETTINGS})


def _executor_from(args):
    """The executor of --executor and its flags (None: the local one)."""
    from ..experiments.executors import make_executor

    name = getattr(args, "executor", None)
    return make_executor("local" if name is None else name,  # an empty name is refused
                         address=getattr(args, "ray_address", None),
                         num_cpus=getattr(args, "ray_num_cpus", None),
                         cpus_per_run=getattr(args, "cpus_per_run", None),
                         gpus_per_run=getattr(args, "gpus_per_run", None),
                         max_retries=getattr(args, "max_retries", None))


def _run(cfg, console: Console, quiet: bool, force_config: bool = False,
         command: str = "compare", executor=None, *, as_json: bool = False,
         config_text: str | None = None) -> int:
    from pathlib import Path

    from ..experiments.data import DatasetNotFound
    from ..experiments.results import CorruptDatabase
    from ..experiments.config import RunError
    from ..experiments.runfolder import FolderBusy, RunIOError, holds_results
    from ..experiments.compare import failed_runs, run_compare

    if cfg.resume and _empty_or_missing(Path(cfg.out)):  # (make demo's first run, on
        # purpose; a folder of other files, or a bad path, is run_compare's one-line refusal)
        # (what it starts named: a resume of a folder whose start was interrupted before
        # anything was stored runs these flags', the defaults where none are given)
        n, s, e = len(cfg.policies), len(cfg.seeds), cfg.epochs
        print(f"lowprec {command}: nothing stored in {cfg.out} yet: starting it: {cfg.model} on "
              f"{cfg.data}, {n} polic{'y' if n == 1 else 'ies'} x {s} seed{'s' * (s != 1)}, "
              f"{e} epoch{'s' * (e != 1)} (--resume continues a folder that holds results)",
              file=sys.stderr)
    try:
        out = run_compare(cfg, executor, force_config=force_config, config_text=config_text)
    except (RunError, DatasetNotFound, CorruptDatabase, FolderBusy) as err:
        raise UserError(str(err)) from None
    except RunIOError as err:
        print_error(f"lowprec {command}", f"{err}; the database is intact, continue with "
                    "--resume once fixed")
        return 1
    except KeyboardInterrupt as err:
        line = (f"interrupted: finished runs are stored in {cfg.out}; continue with --resume"
                if holds_results(Path(cfg.out)) else
                f"interrupted before anything was stored in {cfg.out}")
        errors.append(line)
        print(line, file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    failed = failed_runs(Path(out), cfg)
    if as_json:
        from ..experiments.report import summary_json

        print_json({**summary_json(Path(out)),
                    "failed_runs": [{"run": r, "error": e} for r, e in failed]})
    elif not quiet:
        _print_summary(Path(out), console)
    for run_id, reason in failed:
        line = f"lowprec {command}: run {run_id} failed: {one_line(reason)}"
        errors.append(line)
        print(line, file=sys.stderr)
    return 1 if failed else 0


def _empty_or_missing(folder) -> bool:
    """Whether ``folder`` does not exist or is empty (False where it cannot be read)."""
    try:
        return not folder.exists() or not any(folder.iterdir())
    except OSError:
        return False


def cmd_compare(args, console: Console) -> int:
    cfg = user_call(_config_from, args)
    return _run(cfg, console, args.quiet, args.force_config,
                executor=user_call(_executor_from, args), as_json=args.json,
                config_text=args.config_text)


def cmd_train(args, console: Console) -> int:
    out = args.out if args.out != "runs/compare" else f"runs/train-{args.policy}-seed{args.seed}"
    args.preset = None
    args.out = out
    cfg = user_call(_config_from, args, policies=(args.policy,), seeds=(args.seed,))
    return _run(cfg, console, args.quiet, args.force_config, "train", as_json=args.json,
                config_text=args.config_text)


def cmd_report(args, console: Console) -> int:
    from pathlib import Path

    import sqlite3

    from ..experiments.report import write_report
    from ..experiments.results import CorruptDatabase
    from ..experiments.runfolder import RunIOError

    from ..experiments.multi import write_all_reports
    from ..experiments.runfolder import MODELS_FILE

    run_dir = Path(args.run_dir)
    try:
        found = (run_dir / "results.db").is_file()
        several = not found and (run_dir / MODELS_FILE).is_file()
    except OSError as err:  # a name too long for the file system...
        raise UserError(f"{short(args.run_dir)}: {err.strerror or err}") from None
    if several:
        try:  # a comparison over several models: every model's report, then the combined one
            write_all_reports(run_dir)
        except (CorruptDatabase, sqlite3.DatabaseError, ValueError) as err:
            raise UserError(str(err)) from None
        except RunIOError as err:
            print_error("lowprec report", err)
            return 1
        if args.json:
            from ..experiments.report import summary_json

            print_json(summary_json(run_dir))
        else:
            _print_summary(run_dir, console)
        return 0
    if not found:
        raise UserError(f"{short(args.run_dir)} has no results.db (run lowprec compare "
                        "--out DIR first)")
    try:
        write_report(run_dir)
        if args.json:
            from ..experiments.report import summary_json

            print_json(summary_json(run_dir))
        else:
            _print_summary(run_dir, console)
    except CorruptDatabase as err:
        raise UserError(str(err)) from None
    except sqlite3.OperationalError as err:
        if "full" in str(err) or "I/O" in str(err):
            print_error("lowprec report", f"could not write to {run_dir}: {err}")
            return 1
        raise UserError(f"{run_dir / 'results.db'}: {err}; the file was left untouched"
                        ) from None
    except sqlite3.DatabaseError as err:
        raise UserError(f"{run_dir / 'results.db'}: {err}; the file was left untouched"
                        ) from None
    except RunIOError as err:
        print_error("lowprec report", err)
        return 1
    return 0


def cmd_export(args, console: Console) -> int:
    from ..experiments.config import RunError
    from ..experiments.export import export_run
    from ..experiments.results import CorruptDatabase

    from ..experiments.runfolder import RunIOError

    try:
        result = user_call(export_run, args.run_dir, args.to, args.out)
    except (RunError, CorruptDatabase) as err:
        raise UserError(str(err)) from None
    except RunIOError as err:  # a full disk: nothing half-written is left
        print_error("lowprec export", err)
        return 1
    if args.json:
        print_json(dict(result))
    else:
        console.print(f"exported {result['runs']} runs as {result['format']} to {result['out']} "
                      f"({len(result['files'])} files)")
    return 0
