"""The ``lowprec`` command: parses arguments and calls one library function per command.

Exit codes: 0 success; 1 a comparison with failed runs, an uncertified model, or an I/O error
(disk full: one line naming the path); 2 a user's mistake (an unknown format, a bad number, a
run folder in use or stored with another configuration), always one line on stderr; 130 on
Ctrl-C and 143 on SIGTERM (the run folder stays resumable). Tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import math
import re
import signal
import sys

from .. import _names  # the registries' names, for completion: the standard library alone

# Only the standard library (and _names) is imported here, and ``main`` installs its signal
# handling before anything else (rich, the experiments) is loaded; the console script enters
# through lowprec_cmd, which handles a signal while torch and lowprec are still being imported,
# and answers shell completion from build_parser without importing torch: build_parser and
# the completers import nothing else either.

__all__ = ["main", "build_parser"]


def Table(*args, **kwargs):  # noqa: N802 (rich's class, imported on first use)
    from rich.table import Table as _Table

    return _Table(*args, **kwargs)

_MAX_SEED = 2**32 - 1


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C (the same clean stop), with its own exit code."""


def _on_sigterm(signum, frame):
    raise _Terminated()


_MAX_LINE = 400


def _one_line(msg: str) -> str:
    """Whitespace collapsed, a long message cut in the middle: one bounded line."""
    msg = " ".join(str(msg).split())
    if len(msg) > _MAX_LINE:
        msg = msg[:_MAX_LINE - 60] + " ... " + msg[-55:]
    return msg


# plain ASCII decimals only: int() and float() also take "1_000" and non-ASCII digits
_INT_RE = re.compile(r"^[+-]?\d+$", re.ASCII)
_FLOAT_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$|^[+-]?(?:inf|infinity|nan)$",
                       re.ASCII | re.IGNORECASE)


def _int_arg(lo: int, hi: int):
    def parse(text: str) -> int:
        if not _INT_RE.match(text.strip()):
            raise argparse.ArgumentTypeError(f"{_short(text)} is not an integer")
        v = int(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not in [{lo}, {hi}]")
        return v
    parse.__name__ = "integer"
    return parse


def _float_arg(*, positive: bool = False, nonnegative: bool = False):
    def parse(text: str) -> float:
        if not _FLOAT_RE.match(text.strip()):
            raise argparse.ArgumentTypeError(f"{_short(text)} is not a number")
        v = float(text)
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{_short(text)} is not finite")
        if positive and not v > 0:
            raise argparse.ArgumentTypeError(f"{_short(text)} must be > 0")
        if nonnegative and not v >= 0:
            raise argparse.ArgumentTypeError(f"{_short(text)} must be >= 0")
        return v
    parse.__name__ = "number"
    return parse


def _short(text: str, limit: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(text)} chars)"


def _quantize_value(text: str) -> float:
    """A number for ``quantize``: decimal, inf, nan, -0 (ASCII only)."""
    if not _FLOAT_RE.match(text.strip()):
        raise UserError(f"value {_short(text)} is not a number (decimal, inf, nan or -0)")
    return float(text)


_NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$|^-(?:inf|infinity|nan)$",
                              re.ASCII | re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2."""

    #: (path, flags) of a --config file whose flags this parser is parsing
    config_origin: tuple[str, set] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-9", "-inf" and "-nan" for flags (its matcher knows only -1 and
        # -1.5), so "--lr -inf" said "expected one argument" instead of naming the value
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def error(self, message: str):
        origin = ""
        if self.config_origin and any(f in message for f in self.config_origin[1]):
            origin = f" (set in --config {self.config_origin[0]})"
        _error(self.prog, f"{message}{origin} (see {self.prog} --help)")
        raise SystemExit(2)


#: the error lines the running command printed (the --json error document's "error")
_errors: list[str] = []
#: whether the running command printed its JSON document (--json: exactly one on stdout)
_json_printed: list[bool] = [False]
#: whether the running command was asked for JSON (args.json, however it was given)
_json_asked: list[bool] = [False]


def _error(command: str, msg) -> None:
    """One error line on stderr, ``COMMAND: error: MESSAGE``, kept for --json."""
    line = f"{command}: error: {_one_line(msg)}"
    _errors.append(line)
    print(line, file=sys.stderr)


def _user(fn, *args, **kwargs):
    """Call a parser of user input; its ValueError/TypeError becomes a one-line UserError."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from None


def _print_json(obj) -> None:
    """A machine-readable summary on stdout: one JSON document (NaN and Inf as null)."""
    import json

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    out = _json_target[0] or sys.stdout
    print(json.dumps(clean(obj), indent=2, allow_nan=False), file=out, flush=True)
    _json_printed[0] = True


def _fmt_num(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args, console: Console) -> int:
    from ..numerics.formats import NAMED_FORMATS, describe, parse_format

    fmts = ([_user(parse_format, s) for s in args.formats] if args.formats
            else list(NAMED_FORMATS.values()))
    table = Table(title="Number formats", header_style="bold")
    for col in ("format", "bits", "max", "min normal", "min subnormal", "eps", "specials"):
        table.add_column(col, justify="left" if col in ("format", "specials") else "right")
    for f in fmts:
        r = describe(f)
        bits = r["bits"] if isinstance(r["bits"], int) else f"{r['bits']:.2f}"
        table.add_row(r["format"], str(bits), _fmt_num(r["max"]), _fmt_num(r["min_normal"]),
                      _fmt_num(r["min_subnormal"]), _fmt_num(r["eps"]), r["special"])
    console.print(table)
    return 0


def cmd_quantize(args, console: Console) -> int:
    import torch

    from ..numerics.formats import parse_format
    from ..numerics.quantize import quantize
    from ..numerics.rounding import parse_rounding

    fmts = [_user(parse_format, s) for s in args.format]
    mode, _ = _user(parse_rounding, args.rounding)
    values = [_quantize_value(v) for v in args.values]
    x = torch.tensor(values, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    outs = [_user(quantize, x, f, mode, generator=gen) for f in fmts]
    table = Table(title=f"quantize(x, fmt, rounding={mode.value!r})", header_style="bold")
    table.add_column("x (float32)", justify="right")
    for f in fmts:
        table.add_column(str(f), justify="right")
    for i, v in enumerate(x.tolist()):
        table.add_row(f"{v:.9g}", *[f"{o[i].item():.9g}" for o in outs])
    console.print(table)
    return 0


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
    table = Table(title=f"lowprec compare: {run_dir}", header_style="bold")
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
    from ..experiments.runfolder import FolderBusy, RunIOError
    from ..experiments.compare import failed_runs, run_compare

    try:
        out = run_compare(cfg, executor, force_config=force_config, config_text=config_text)
    except (RunError, DatasetNotFound, CorruptDatabase, FolderBusy) as err:
        raise UserError(str(err)) from None
    except RunIOError as err:
        _error(f"lowprec {command}", f"{err}; the database is intact, continue with --resume "
               "once fixed")
        return 1
    except KeyboardInterrupt as err:
        line = f"interrupted: finished runs are stored in {cfg.out}; continue with --resume"
        _errors.append(line)
        print(line, file=sys.stderr)
        return 143 if isinstance(err, _Terminated) else 130
    failed = failed_runs(Path(out), cfg)
    if as_json:
        from ..experiments.report import summary_json

        _print_json({**summary_json(Path(out)),
                     "failed_runs": [{"run": r, "error": e} for r, e in failed]})
    elif not quiet:
        _print_summary(Path(out), console)
    for run_id, reason in failed:
        line = f"lowprec {command}: run {run_id} failed: {_one_line(reason)}"
        _errors.append(line)
        print(line, file=sys.stderr)
    return 1 if failed else 0


def cmd_compare(args, console: Console) -> int:
    cfg = _user(_config_from, args)
    return _run(cfg, console, args.quiet, args.force_config,
                executor=_user(_executor_from, args), as_json=args.json,
                config_text=args.config_text)


def cmd_train(args, console: Console) -> int:
    out = args.out if args.out != "runs/compare" else f"runs/train-{args.policy}-seed{args.seed}"
    args.preset = None
    args.out = out
    cfg = _user(_config_from, args, policies=(args.policy,), seeds=(args.seed,))
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
        raise UserError(f"{_short(args.run_dir)}: {err.strerror or err}") from None
    if several:
        try:  # a comparison over several models: every model's report, then the combined one
            write_all_reports(run_dir)
        except (CorruptDatabase, sqlite3.DatabaseError, ValueError) as err:
            raise UserError(str(err)) from None
        except RunIOError as err:
            _error("lowprec report", err)
            return 1
        if args.json:
            from ..experiments.report import summary_json

            _print_json(summary_json(run_dir))
        else:
            _print_summary(run_dir, console)
        return 0
    if not found:
        raise UserError(f"{_short(args.run_dir)} has no results.db (run lowprec compare "
                        "--out DIR first)")
    try:
        write_report(run_dir)
        if args.json:
            from ..experiments.report import summary_json

            _print_json(summary_json(run_dir))
        else:
            _print_summary(run_dir, console)
    except CorruptDatabase as err:
        raise UserError(str(err)) from None
    except sqlite3.OperationalError as err:
        if "full" in str(err) or "I/O" in str(err):
            _error("lowprec report", f"could not write to {run_dir}: {err}")
            return 1
        raise UserError(f"{run_dir / 'results.db'}: {err}; the file was left untouched"
                        ) from None
    except sqlite3.DatabaseError as err:
        raise UserError(f"{run_dir / 'results.db'}: {err}; the file was left untouched"
                        ) from None
    except RunIOError as err:
        _error("lowprec report", err)
        return 1
    return 0


def cmd_export(args, console: Console) -> int:
    from ..experiments.config import RunError
    from ..experiments.export import export_run
    from ..experiments.results import CorruptDatabase

    from ..experiments.runfolder import RunIOError

    try:
        result = _user(export_run, args.run_dir, args.to, args.out)
    except (RunError, CorruptDatabase) as err:
        raise UserError(str(err)) from None
    except RunIOError as err:  # a full disk: nothing half-written is left
        _error("lowprec export", err)
        return 1
    if args.json:
        _print_json(dict(result))
    else:
        console.print(f"exported {result['runs']} runs as {result['format']} to {result['out']} "
                      f"({len(result['files'])} files)")
    return 0


def _trained_model(args, console: Console):
    """Load --data, build --model and, with --epochs > 0, train it briefly in fp32."""
    from ..experiments.data import DatasetNotFound
    from ..experiments.pretrain import train_fp32, untrained

    try:
        model, data = untrained(args.data, args.model, seed=args.seed)
    except (DatasetNotFound, ValueError) as err:
        raise UserError(str(err)) from None

    def report(epoch: int) -> None:
        if not args.quiet:
            console.print(f"trained {args.model} on {args.data} in fp32: epoch {epoch}/"
                          f"{args.epochs}")

    train_fp32(model, data, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
               seed=args.seed, on_epoch=report)
    return model, data


def cmd_certify(args, console: Console) -> int:
    from ..analysis import certify

    fmt = _user(parse_format_checked, args.format)
    model, data = _trained_model(args, console)
    cert = _user(certify, model, data, fmt, outputs=args.outputs)
    if args.json:
        _print_json({"format": str(fmt), "summary": cert.summary(),
                     "per_class": cert.per_class()})
        return 0 if cert.violations == 0 else 1
    console.print(str(cert))
    s = cert.summary()
    if "accuracy32" in s:
        console.print(f"test accuracy: fp32 {100 * s['accuracy32']:.2f}%, {fmt} "
                      f"{100 * s['accuracy16']:.2f}%")
    table = Table(title="per class", header_style="bold")
    for c in ("class", "inputs", "certified %", "same prediction %", "violations"):
        table.add_column(c, justify="right")
    for r in cert.per_class():
        table.add_row(str(r["class"]), str(r["n"]), f"{100 * r['certified']:.1f}",
                      f"{100 * r['agreement']:.1f}", str(r["violations"]))
    console.print(table)
    return 0 if cert.violations == 0 else 1


def cmd_advise(args, console: Console) -> int:
    from ..analysis import advise

    fmt = _user(parse_format_checked, args.format)
    model, data = _trained_model(args, console)
    adv = _user(advise, model, data, fmt, batches=args.batches, lr=args.lr)
    if args.json:
        _print_json(adv.to_json())
    else:
        console.print(str(adv))
    return 0


def cmd_plan(args, console: Console) -> int:
    from ..experiments.planner import plan, plan_markdown, plan_table, summary_rows

    from ..training.plan import Plan

    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path is not None:  # checked before the search, which takes minutes
            _user(Plan.check_path, path) if flag == "--out" else _user(_check_file_path, path)
    model, data = _trained_model(args, console)
    found = _user(plan, model, data, menu=args.menu, minimise=args.minimise,
                  hardware=args.hardware, compare_with=args.compare_with,
                  tolerance=args.tolerance, steps=args.steps, seeds=tuple(range(args.seeds)),
                  lr=args.lr, batch_size=args.batch_size,
                  log=None if args.quiet or args.json else console.print)
    try:
        found.save(args.out)
        if args.report:
            from pathlib import Path

            Path(args.report).write_text(plan_markdown(found))
    except OSError as err:
        _error("lowprec plan", f"could not write {err.filename or args.out}: "
               f"{err.strerror or err}")
        return 1
    if args.json:
        _print_json(found.to_json())
        return 0 if found.meta.get("accepted") else 1
    for title, (head, rows) in (("per module", plan_table(found)),
                                ("plan against fp32 and uniform policies",
                                 summary_rows(found))):
        table = Table(title=title, header_style="bold")
        for c in head:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    m = found.meta
    console.print(f"base policy {found.policy}; overrides: "
                  f"{', '.join(found.overrides) or 'none'}; kept above the cheapest level: "
                  f"{', '.join(m.get('high') or []) or 'none'}")
    console.print(f"plan written to {args.out} ({m['plan_seconds']:.1f} s, "
                  f"{m['plan_over_fp32_run']:.1f}x one fp32 training run); use it with "
                  f"Precision(Plan.load(...)) or compare --policies plan:{args.out}")
    return 0 if m.get("accepted") else 1


def _check_file_path(text: str):
    """A file to be written: named, not a folder, in an existing writable folder."""
    import os
    from pathlib import Path

    if not text.strip():
        raise ValueError("an output file name is empty")
    path = Path(text)
    if path.is_dir() or text.endswith(os.sep):
        raise ValueError(f"{_short(text)} is a folder: name a file")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"{_short(text)}: the folder {_short(str(path.parent))} does not exist "
                         "or is not writable")
    return path


def parse_format_checked(spec: str):
    from ..numerics.formats import parse_format

    return parse_format(spec)


def _add_analysis_args(p: argparse.ArgumentParser) -> None:
    _offer_data(p.add_argument("--data", default="mnist",
                               help="dataset (as for compare; default: mnist)"))
    _offer_models(p.add_argument("--model", default="lenet5",
                                 help="model (as for compare; default: lenet5)"), several=False)
    _offer_formats(p.add_argument("--format", default="fp16",
                                  help="the low-precision format (default: fp16)"))
    p.add_argument("--epochs", type=_int_arg(0, 100_000), default=3,
                   help="fp32 training epochs before the analysis (default: 3; 0: untrained)")
    p.add_argument("--lr", type=_float_arg(positive=True), default=0.02,
                   help="learning rate (default: 0.02)")
    p.add_argument("--batch-size", type=_int_arg(1, 2**31), default=32, help="default: 32")
    p.add_argument("--seed", type=_int_arg(0, _MAX_SEED), default=0)
    p.add_argument("--quiet", action="store_true")
    _add_json(p)


_JSON_HELP = ("print a machine-readable summary as JSON on stdout (progress and messages go to "
              "stderr)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=_JSON_HELP)


def _add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="any flag of this command in a TOML file (epochs = 5, policies = "
                   "[\"32-true\", \"bf16-true\"]; or in a [COMMAND] table); flags given here "
                   "win; compare and train keep it as OUT/run.toml")


def _offer(action: argparse.Action, values) -> None:
    """What shell completion (argcomplete, where installed) offers for a flag's value; the
    value itself is still checked where it is used, with the accepted ones named. ``values``:
    the values, or a function of the word typed so far returning them (argcomplete keeps those
    that start with the word). Completion builds the parser without torch (lowprec_cmd): the
    names come from :mod:`lowprec._names`, never from the library's modules."""
    action.completer = ((lambda prefix="", **_: list(values(prefix))) if callable(values)
                        else (lambda **_: list(values)))


def _last_item(text: str) -> tuple[str, str]:
    """``text`` split before its last item: after the last comma outside <...> (dfx<10>)."""
    depth, cut = 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth <= 0:
            cut = i + 1
    return text[:cut], text[cut:]


def _listed(items):
    """A completer of a comma-separated list whose every item ``items(item_typed)`` completes."""
    def complete(prefix: str) -> list[str]:
        head, last = _last_item(prefix)
        return [head + v for v in items(last)]
    return complete


def _paths(typed: str) -> list[str]:
    """The files and folders whose path starts with ``typed`` (folders end in /)."""
    import os

    cut = typed.rfind("/") + 1
    folder, start = typed[:cut], typed[cut:]
    try:
        names = sorted(n for n in os.listdir(folder or ".") if n.startswith(start))
    except OSError:
        return []
    return [folder + n + ("/" if os.path.isdir(folder + n) else "") for n in names]


def _policy_items(typed: str) -> list[str]:
    """One item of --policies (or --policy): a named policy, plan:FILE, or a spec key (p=...)
    and after a format key the named formats."""
    n = _names
    key, eq, _ = typed.partition("=")
    if eq:
        return ([f"{key}={f}" for f in n.FORMAT_NAMES]
                if key.strip().lower() in n.POLICY_FORMAT_KEYS else [])
    if typed.startswith(n.PLAN_PREFIX):
        return [n.PLAN_PREFIX + f for f in _paths(typed[len(n.PLAN_PREFIX):])]
    return [*n.POLICY_NAMES, n.PLAN_PREFIX, *(k + "=" for k in n.POLICY_KEYS)]


def _data_items(typed: str) -> list[str]:
    """--data: a dataset's name, or KIND: and then a path."""
    n = _names
    kind, colon, rest = typed.partition(":")
    if colon:
        return [f"{kind}:{f}" for f in _paths(rest)] if kind in n.DATASET_KINDS else []
    return [*n.DATASET_NAMES, *(k + ":" for k in n.DATASET_KINDS)]


def _offer_data(action: argparse.Action) -> None:
    _offer(action, _data_items)


def _offer_models(action: argparse.Action, *, several: bool) -> None:
    names = _names.MODEL_NAMES
    _offer(action, _listed(lambda _: names) if several else names)


def _offer_formats(action: argparse.Action) -> None:
    _offer(action, _names.FORMAT_NAMES)


def _add_run_args(p: argparse.ArgumentParser, *, compare: bool) -> None:
    DEFAULT_POLICIES, PRESETS = _names.DEFAULT_POLICIES, _names.PRESET_NAMES
    _offer_data(p.add_argument("--data", default=None, help="mnist, digits, mnist1d, "
                               "fashion-mnist[:DIR], idx:DIR, cifar10:DIR, module:function "
                               "(default: mnist, 5,000 real digits)"))
    _offer_models(p.add_argument("--model", default=None, help="mlp, lenet5, resnet20, vgg, "
                                 "cnn1d, transformer, mobilenet, module:function (default: "
                                 "lenet5); compare takes several, comma-separated: one "
                                 "comparison per model in OUT/MODEL"), several=compare)
    if compare:
        _offer(p.add_argument("--policies", default=None,
                              help="comma-separated names or specs (default: "
                                   f"{','.join(DEFAULT_POLICIES)})"),
               _listed(_policy_items))
        p.add_argument("--seeds", type=_int_arg(1, 10_000), default=None,
                       help="seeds per policy (default: 3)")
        _offer(p.add_argument("--preset", default=None, help="an experiment of the literature: "
                       + ", ".join(PRESETS) + " (policies, model and optimizer; flags override)"),
               PRESETS)
        g = p.add_argument_group("where the runs execute")
        _offer(g.add_argument("--executor", default=None, help="local (default: one run after "
                       "another in this process) or ray (each run a Ray task; pip install "
                       "'lowprec[ray]')"), ("local", "ray"))
        g.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: "
                       "start a local instance); --out must be on storage every node mounts")
        g.add_argument("--ray-num-cpus", type=int, default=None,
                       help="CPUs of the local Ray instance (default: every CPU)")
        g.add_argument("--cpus-per-run", type=float, default=None,
                       help="CPUs Ray reserves for each run (default: --threads, at most a "
                       "node's CPUs); the run computes with --threads threads either way")
        g.add_argument("--gpus-per-run", type=float, default=None,
                       help="GPUs Ray reserves for each run (default: 0)")
        g.add_argument("--max-retries", type=int, default=None,
                       help="times Ray runs again a run whose worker died (default: 3)")
    p.add_argument("--epochs", type=_int_arg(1, 100_000), default=None, help="default: 15")
    p.add_argument("--batch-size", type=_int_arg(1, 2**31), default=None, help="default: 32")
    p.add_argument("--lr", type=_float_arg(positive=True), default=None, help="default: 0.02")
    _offer(p.add_argument("--optimizer", default=None, help="sgd (momentum 0.9, default) or adam"),
           ("sgd", "adam"))
    p.add_argument("--momentum", type=_float_arg(nonnegative=True), default=None,
                   help=argparse.SUPPRESS)
    _offer(p.add_argument("--schedule", default=None, help="learning-rate schedule: cosine "
                          "(default) or constant"), ("cosine", "constant"))
    p.add_argument("--weight-decay", type=_float_arg(nonnegative=True), default=None,
                   help="default: 5e-4")
    p.add_argument("--train-subset", type=_int_arg(1, 2**31), default=None,
                   help="train on the first N training examples only")
    p.add_argument("--threads", type=_int_arg(1, 1024), default=None,
                   help="torch threads of every run, wherever it runs (default: torch's "
                   "default here, stored for --resume): part of the numbers, as a float sum "
                   "split over other threads rounds differently")
    p.add_argument("--compile", action="store_const", const=True, default=None,
                   help="run the emulated policies compiled (Precision(compile=True): the "
                   "same bits as eager emulation; eager, with a line saying why, where a model "
                   "or policy cannot compile); fp32 and other native runs stay eager")
    p.add_argument("--out", default="runs/compare", help="run folder (default: runs/compare)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run folder: finished runs are kept, flags not "
                   "given take the stored values, flags that differ (policies, seeds and "
                   "--preset included) are refused with the list of differences")
    p.add_argument("--force-config", action="store_true",
                   help="with --resume: continue with the flags given even where they differ "
                   "from the stored configuration (recorded in the database); other "
                   "policies or seeds add runs, and unfinished runs no longer asked for are "
                   "marked 'not requested'")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary")
    _add_json(p)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lowprec",
        description="Reduced-precision training on PyTorch: formats, rounding, quantization.")
    from .. import __version__

    p.add_argument("--version", action="version", version=f"lowprec {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    f = sub.add_parser("formats", help="table of number formats: bits, max, min normal, "
                                       "min subnormal, eps")
    _offer_formats(f.add_argument("formats", nargs="*", metavar="FORMAT",
                                  help="formats to show (default: every named format), e.g. "
                                       "fp16 e3m4 q4.12"))
    f.set_defaults(func=cmd_formats)

    q = sub.add_parser("quantize", help="round numbers to one or more formats")
    _offer(q.add_argument("values", nargs="+", metavar="X",
                          help="numbers (inf, nan, -0 accepted)"), ())
    _offer_formats(q.add_argument("--format", "-f", action="append", required=True,
                                  help="target format (repeatable), e.g. -f fp16 -f e4m3fn"))
    _offer(q.add_argument("--rounding", "-r", default="nearest",
                          help="nearest, nearest_away, toward_zero, up, down, stochastic, srN"),
           _names.ROUNDING_NAMES)
    q.add_argument("--seed", type=_int_arg(0, _MAX_SEED), default=0,
                   help="seed of stochastic rounding")
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser("compare", help="train every policy x seed, store results, write the "
                       "report, print a summary (the default job: real MNIST digits, LeNet-5)")
    _add_run_args(c, compare=True)
    c.set_defaults(func=cmd_compare)

    t = sub.add_parser("train", help="one policy, one seed (what compare runs)")
    _offer(t.add_argument("--policy", default="32-true", help="a policy name or spec"),
           _listed(_policy_items))  # a spec has commas (p=fp32,c=bf16)
    t.add_argument("--seed", type=_int_arg(0, _MAX_SEED), default=0)
    _add_run_args(t, compare=False)
    t.set_defaults(func=cmd_train)

    ce = sub.add_parser("certify", help="the 16-bit certificate, input by input: does the model "
                        "in FORMAT provably predict what it predicts in fp32?")
    _add_analysis_args(ce)
    ce.add_argument("--outputs", default="logits", help="logits (default) or probs")
    ce.set_defaults(func=cmd_certify)

    ad = sub.add_parser("advise", help="can this model train and run in FORMAT, and what must "
                        "be done? (certificate, loss scale, ranges, lost updates, first Inf/NaN)")
    _add_analysis_args(ad)
    ad.add_argument("--batches", type=_int_arg(1, 100_000), default=4,
                    help="batches analysed (default: 4)")
    ad.set_defaults(func=cmd_advise)

    pl = sub.add_parser("plan", help="the cheapest per-layer precision that still trains: "
                        "measured per module, assigned under a budget, verified by training")
    _offer_data(pl.add_argument("--data", default="digits",
                                help="dataset (as for compare; default: digits)"))
    _offer_models(pl.add_argument("--model", default="mlp",
                                  help="model (as for compare; default: mlp)"), several=False)
    _offer(pl.add_argument("--menu", default="fp32,bf16,fp16,fp8",
                           help="levels a module may take, widest first (fp32 bf16 fp16 mixed16 "
                                "fp8 mxfp8 nvfp4 mxfp4 fixed16-sr; default: fp32,bf16,fp16,fp8)"),
           _listed(lambda _: _names.PLAN_LEVELS))
    _offer(pl.add_argument("--minimise", default="memory",
                           help="what the plan minimises: memory bytes, bits moved, or time "
                                "estimated on --hardware (default: memory)"),
           ("memory", "bits", "time"))
    _offer(pl.add_argument("--hardware", default=None,
                           help="named hardware profile for --minimise time (h100-sxm, a100, "
                                "b200, rtx4090, cpu-avx2, cpu-amx); with another budget the "
                                "time estimate is shown beside it"),
           ("h100-sxm", "a100", "b200", "rtx4090", "cpu-avx2", "cpu-amx"))
    pl.add_argument("--compare-with", default=None,
                    help="uniform levels also trained beside the plan, comma-separated "
                         "(default: 16-mixed when fp16 is in the menu)")
    pl.add_argument("--tolerance", type=_float_arg(nonnegative=True), default=0.01,
                    help="accuracy the plan may lose against fp32, a fraction (default: 0.01)")
    pl.add_argument("--steps", type=_int_arg(1, 10_000_000), default=200,
                    help="training steps of each verification run (default: 200)")
    pl.add_argument("--seeds", type=_int_arg(1, 100), default=1,
                    help="verification seeds per policy (default: 1)")
    pl.add_argument("--epochs", type=_int_arg(0, 100_000), default=0,
                    help="fp32 epochs before planning (default: 0: plan from the initial "
                         "weights)")
    pl.add_argument("--lr", type=_float_arg(positive=True), default=0.02,
                    help="learning rate (default: 0.02)")
    pl.add_argument("--batch-size", type=_int_arg(1, 2**31), default=64, help="default: 64")
    pl.add_argument("--seed", type=_int_arg(0, _MAX_SEED), default=0,
                    help="seed of the initial weights")
    pl.add_argument("--out", default="plan.json", help="the plan file (default: plan.json)")
    pl.add_argument("--report", default=None, help="also write the report section (Markdown)")
    pl.add_argument("--quiet", action="store_true", help="no search log")
    _add_json(pl)
    pl.set_defaults(func=cmd_plan)

    ex = sub.add_parser("export", help="a run folder's results as csv, parquet, TensorBoard "
                        "event files or an MLflow file store (offline)")
    ex.add_argument("run_dir", help="the folder holding results.db")
    _offer(ex.add_argument("--to", default=None, metavar="FORMAT",
                           help="csv, parquet, tensorboard or mlflow"),
           ("csv", "parquet", "tensorboard", "mlflow"))
    ex.add_argument("--out", default=None,
                    help="a new or empty folder (default: RUN_DIR/export/FORMAT)")
    ex.add_argument("--json", action="store_true",
                    help="print what was written as JSON on stdout")
    ex.set_defaults(func=cmd_export)

    r = sub.add_parser("report", help="rebuild report.html and report.md from a run folder")
    r.add_argument("run_dir", help="the folder holding results.db")
    _add_json(r)
    r.set_defaults(func=cmd_report)
    p.commands = dict(sub.choices)
    for command in p.commands.values():
        _add_config(command)
    return p


def _apply_config(parser: argparse.ArgumentParser, args, argv: list[str]):
    """Parse again with the --config file's flags before the command line's (which win)."""
    from ..experiments.configfile import config_tokens, read_config_file

    table, text = _user(read_config_file, args.config)
    sub = parser.commands[args.command]
    tokens = _user(config_tokens, table, sub, args.command, args.config,
                   tuple(parser.commands))
    at = argv.index(args.command) + 1
    sub.config_origin = (args.config, {t for t in tokens if t.startswith("--")})
    try:
        args = parser.parse_args(argv[:at] + tokens + argv[at:])
    finally:
        sub.config_origin = None
    args.config_text = text
    return args


def _main_command(args, console) -> int:
    from ..experiments.system import tune_cpu_allocator

    tune_cpu_allocator()  # the application's choice, not the library's (experiments/system)
    return int(args.func(args, console) or 0)


#: where _print_json writes while stdout is redirected to stderr (--json)
_json_target: list = [None]


def main(argv: list[str] | None = None) -> int:
    """Run one command; with --json, a failing command too prints exactly one JSON document
    on stdout, ``{"error": LINE, "exit": CODE}`` (its error lines also go to stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    _errors.clear()
    _json_printed[0] = False
    _json_asked[0] = False
    # before the parse (a usage error): --json on the command line; after it: args.json,
    # which --config (json = true) or an abbreviation (--js) may have set
    in_argv = "--json" in argv[:argv.index("--")] if "--" in argv else "--json" in argv
    try:
        try:
            code = _main(argv)
        except BaseException as err:  # a bug (traceback kept) or an exit from deep inside
            as_json = in_argv or _json_asked[0]
            if as_json and not _json_printed[0] and not _output_failed(err):
                code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) \
                    else 1
                _json_error(_errors[-1] if _errors else f"{type(err).__name__}: {err}", code)
            raise
        if (in_argv or _json_asked[0]) and code != 0 and not _json_printed[0]:
            _json_error(_errors[-1] if _errors else f"exit code {code}", code)
        sys.stdout.flush()  # a full device or a closed pipe shows here, not at exit
        return code
    except OSError as err:
        if not _output_failed(err):
            raise
        return _output_lost(err)


def _output_failed(err: BaseException) -> bool:
    """The command's output could not be written: a closed pipe (``| head``) or a full
    device (``> /dev/full``), which no command catches as its own I/O."""
    import errno

    if not (isinstance(err, OSError) and err.errno in (errno.EPIPE, errno.ENOSPC, errno.EIO)):
        return False
    # a write to a named file (open, rename, mkdir: a bug if uncaught, its traceback kept)
    # carries the file's name; stdout's writes carry none
    return err.filename is None


def _output_lost(err: OSError) -> int:
    """One line for a stdout that cannot be written (none for a closed pipe, as other tools
    do), stdout pointed at /dev/null so that Python's flush at exit finds nothing to write."""
    import errno
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    if err.errno == errno.EPIPE:
        return 141  # as a shell reports SIGPIPE
    print(f"lowprec: error: cannot write the output: {err.strerror or err}", file=sys.stderr)
    return 1


def _json_error(line: str, code: int) -> None:
    import json

    print(json.dumps({"error": str(line).strip(), "exit": int(code)}, indent=2),
          file=_json_target[0] or sys.stdout, flush=True)
    _json_printed[0] = True


def _main(argv: list[str]) -> int:
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)  # SIGTERM stops like Ctrl-C
    except ValueError:
        pass  # not the main thread: leave signals alone
    command = "lowprec"
    try:
        parser = build_parser()  # imports the library: a signal here is handled below
        try:  # shell completion, where argcomplete is installed (the completion extra)
            import argcomplete
        except ImportError:
            pass
        else:
            argcomplete.autocomplete(parser)  # exits here only when the shell asks
        try:
            args = parser.parse_args(argv)
            if getattr(args, "config", None) is not None:
                command = f"lowprec {args.command}"
                args = _apply_config(parser, args, argv)
        except SystemExit as exc:  # --help, --version (0) or a one-line usage error (2)
            return int(exc.code or 0)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if not hasattr(args, "config_text"):
            args.config_text = None
        command = f"lowprec {args.command}"
        _json_asked[0] = bool(getattr(args, "json", False))
        _check_flags(args)
        from rich.console import Console

        if getattr(args, "json", False):
            # stdout holds the JSON document alone: tables, progress and notes go to stderr
            console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
            from contextlib import redirect_stdout

            _json_target[0] = sys.stdout
            try:
                with redirect_stdout(sys.stderr):
                    return _main_command(args, console)
            finally:
                _json_target[0] = None
        # a pipe or a log file gets wide tables rather than rich's 80-column default
        console = Console() if sys.stdout.isatty() else Console(width=160)
        return _main_command(args, console)
    except UserError as err:
        _error(command, err)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM outside a run (start-up, analysis)
        _errors.append(f"{command}: interrupted")
        print(f"{command}: interrupted", file=sys.stderr)
        return 143 if isinstance(err, _Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _check_flags(args) -> None:
    """Flags that parse but mean nothing together, and values argparse cannot refuse alone
    (after --config's flags are applied, which may give the required ones)."""
    if getattr(args, "force_config", False) and not getattr(args, "resume", False):
        raise UserError("--force-config applies only with --resume (it continues a stored "
                        "comparison with other flags); add --resume, or drop --force-config")
    if getattr(args, "command", None) == "export" and args.to is None:
        raise UserError("--to is required: csv, parquet, tensorboard or mlflow (on the "
                        "command line or as to = \"csv\" in --config)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
