"""The ``lowprec`` command: parses arguments and calls one library function per command.

Exit codes: 0 success; 1 a comparison with failed runs, an uncertified model, or an I/O error
(disk full: one line naming the path); 2 a user's mistake (an unknown format, a bad number, a
run folder in use or stored with another configuration), always one line on stderr; 130 on
Ctrl-C and 143 on SIGTERM (the run folder stays resumable). Tracebacks are kept for bugs.

The package: :mod:`.parser` (the arguments, --config), :mod:`.common` (errors, exit codes,
output and --json), :mod:`.completion` (what a TAB offers), and one module per group of
commands: :mod:`.run` (compare, train, report, export), :mod:`.analyse` (certify, advise),
:mod:`.plan`, :mod:`.formats` (formats, quantize). Here: :func:`main`, which runs one command.
"""

from __future__ import annotations

import signal
import sys
import warnings

# Only the standard library (and _names) is imported by this package at import time, and
# ``main`` installs its signal handling before anything else (rich, the experiments) is loaded;
# the console script enters through lowprec_cmd, which handles a signal while torch and lowprec
# are still being imported, and answers shell completion from build_parser without importing
# torch: build_parser, the completers and the commands' modules import nothing else either.
from .common import (Terminated, UserError, errors, json_asked, json_error, json_printed,
                     json_target, on_sigterm, output_failed, output_lost, print_error)
from .parser import apply_config, build_parser, check_flags

# the names lowprec.cli offered when it was one module, still there (tests patch cmd_formats)
from .analyse import cmd_advise, cmd_certify  # noqa: F401
from .common import Table  # noqa: F401
from .formats import cmd_formats, cmd_quantize  # noqa: F401
from .plan import cmd_plan  # noqa: F401
from .run import cmd_compare, cmd_export, cmd_report, cmd_train  # noqa: F401

__all__ = ["main", "build_parser"]

_Terminated = Terminated  # tests stop a run with it


def main(argv: list[str] | None = None) -> int:
    """Run one command; with --json, a failing command too prints exactly one JSON document
    on stdout, ``{"error": LINE, "exit": CODE}`` (its error lines also go to stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    errors.clear()
    json_printed[0] = False
    json_asked[0] = False
    # before the parse (a usage error): --json on the command line; after it: args.json,
    # which --config (json = true) or an abbreviation (--js) may have set
    in_argv = "--json" in argv[:argv.index("--")] if "--" in argv else "--json" in argv
    try:
        try:
            code = _main(argv)
        except BaseException as err:  # a bug (traceback kept) or an exit from deep inside
            as_json = in_argv or json_asked[0]
            if as_json and not json_printed[0] and not output_failed(err):
                code = err.code if isinstance(err, SystemExit) and isinstance(err.code, int) \
                    else 1
                json_error(errors[-1] if errors else f"{type(err).__name__}: {err}", code)
            raise
        if (in_argv or json_asked[0]) and code != 0 and not json_printed[0]:
            json_error(errors[-1] if errors else f"exit code {code}", code)
        sys.stdout.flush()  # a full device or a closed pipe shows here, not at exit
        return code
    except OSError as err:
        if not output_failed(err):
            raise
        return output_lost(err)


def _main(argv: list[str]) -> int:
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)  # SIGTERM stops like Ctrl-C
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
                args = apply_config(parser, args, argv)
        except SystemExit as exc:  # --help, --version (0) or a one-line usage error (2)
            return int(exc.code or 0)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if not hasattr(args, "config_text"):
            args.config_text = None
        command = f"lowprec {args.command}"
        json_asked[0] = bool(getattr(args, "json", False))
        check_flags(args)
        from rich.console import Console

        if getattr(args, "json", False):
            # stdout holds the JSON document alone: tables, progress and notes go to stderr
            console = Console(stderr=True) if sys.stderr.isatty() else \
                Console(stderr=True, width=160, soft_wrap=True)
            from contextlib import redirect_stdout

            json_target[0] = sys.stdout
            try:
                with redirect_stdout(sys.stderr):
                    return _main_command(args, console, command)
            finally:
                json_target[0] = None
        # a pipe or a log file gets wide tables rather than rich's 80-column default, and
        # its lines of text whole (soft wrap: a reason is not cut at column 160)
        console = Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True)
        return _main_command(args, console, command)
    except UserError as err:
        print_error(command, err)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM outside a run (start-up, analysis)
        errors.append(f"{command}: interrupted")
        print(f"{command}: interrupted", file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_command(args, console, command: str) -> int:
    from ..experiments.system import tune_cpu_allocator

    tune_cpu_allocator()  # the application's choice, not the library's (experiments/system)
    # the format, not showwarning: a caller recording warnings (pytest.warns,
    # catch_warnings(record=True)) still gets them; put back after (main() called from Python)
    previous = warnings.formatwarning
    warnings.formatwarning = _one_line_warnings(command)
    try:
        return int(args.func(args, console) or 0)
    finally:
        warnings.formatwarning = previous


def _one_line_warnings(command: str):
    """``warnings.formatwarning`` for a command: one line, ``lowprec CMD: Category:
    message``, instead of Python's file and line and the source line that warned (the
    console script's own, for a warning raised inside lowprec: training/caller.py)."""
    def fmt(message, category, filename, lineno, line=None) -> str:
        text = " ".join(str(message).split())
        text = text[len("lowprec: "):] if text.startswith("lowprec: ") else text
        return f"{command}: {category.__name__}: {text}\n"
    return fmt
