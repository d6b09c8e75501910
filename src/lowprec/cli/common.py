"""What every command of the CLI shares: its errors (one line, the exit code), its output
(rich tables, the --json document) and the parsers of numbers typed on the command line.

Only the standard library is imported here (rich on first use): shell completion builds the
parser, which uses :func:`int_arg` and :func:`float_arg`, without importing torch.

Exit codes: 0 success; 1 a comparison with failed runs, an uncertified model, or an I/O error;
2 a :class:`UserError` (one line on stderr); 130 on Ctrl-C, 143 on SIGTERM (:class:`Terminated`);
141 for a closed stdout pipe.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

__all__ = ["FLOAT_RE", "MAX_SEED", "Table", "Terminated", "UserError", "errors", "float_arg",
           "int_arg", "json_asked", "json_error", "json_printed", "json_target", "on_sigterm",
           "one_line", "output_failed", "output_lost", "print_error", "print_json", "short",
           "user_call"]


def Table(*args, **kwargs):  # noqa: N802 (rich's class, imported on first use)
    from rich.table import Table as _Table

    return _Table(*args, **kwargs)


MAX_SEED = 2**32 - 1


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C (the same clean stop), with its own exit code."""


def on_sigterm(signum, frame):
    raise Terminated()


# (room for the longest list of accepted values, the policies' with their spec hint: ~560
# characters with the command's prefix; a cap of 400 cut its middle, the hint with it)
_MAX_LINE = 1000


def one_line(msg: str) -> str:
    """Whitespace collapsed, a long message cut in the middle: one bounded line."""
    msg = " ".join(str(msg).split())
    if len(msg) > _MAX_LINE:
        msg = msg[:_MAX_LINE - 60] + " ... " + msg[-55:]
    return msg


# plain ASCII decimals only: int() and float() also take "1_000" and non-ASCII digits
_INT_RE = re.compile(r"^[+-]?\d+$", re.ASCII)
FLOAT_RE = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$|^[+-]?(?:inf|infinity|nan)$",
                      re.ASCII | re.IGNORECASE)


def int_arg(lo: int, hi: int):
    def parse(text: str) -> int:
        if not _INT_RE.match(text.strip()):
            raise argparse.ArgumentTypeError(f"{short(text)} is not an integer")
        v = int(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{short(text)} is not in [{lo}, {hi}]")
        return v
    parse.__name__ = "integer"
    return parse


def float_arg(*, positive: bool = False, nonnegative: bool = False):
    def parse(text: str) -> float:
        if not FLOAT_RE.match(text.strip()):
            raise argparse.ArgumentTypeError(f"{short(text)} is not a number")
        v = float(text)
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{short(text)} is not finite")
        if positive and not v > 0:
            raise argparse.ArgumentTypeError(f"{short(text)} must be > 0")
        if nonnegative and not v >= 0:
            raise argparse.ArgumentTypeError(f"{short(text)} must be >= 0")
        return v
    parse.__name__ = "number"
    return parse


def short(text: str, limit: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= limit else f"{s[:limit // 2]}...{s[-limit // 2:]} ({len(text)} chars)"


#: the error lines the running command printed (the --json error document's "error")
errors: list[str] = []
#: whether the running command printed its JSON document (--json: exactly one on stdout)
json_printed: list[bool] = [False]
#: whether the running command was asked for JSON (args.json, however it was given)
json_asked: list[bool] = [False]
#: where print_json writes while stdout is redirected to stderr (--json)
json_target: list = [None]


def print_error(command: str, msg) -> None:
    """One error line on stderr, ``COMMAND: error: MESSAGE``, kept for --json."""
    line = f"{command}: error: {one_line(msg)}"
    errors.append(line)
    print(line, file=sys.stderr)


def user_call(fn, *args, **kwargs):
    """Call a parser of user input; its ValueError/TypeError becomes a one-line UserError."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from None


def print_json(obj) -> None:
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

    out = json_target[0] or sys.stdout
    print(json.dumps(clean(obj), indent=2, allow_nan=False), file=out, flush=True)
    json_printed[0] = True


def json_error(line: str, code: int) -> None:
    import json

    print(json.dumps({"error": str(line).strip(), "exit": int(code)}, indent=2),
          file=json_target[0] or sys.stdout, flush=True)
    json_printed[0] = True


def output_failed(err: BaseException) -> bool:
    """The command's output could not be written: a closed pipe (``| head``) or a full
    device (``> /dev/full``), which no command catches as its own I/O."""
    import errno

    if not (isinstance(err, OSError) and err.errno in (errno.EPIPE, errno.ENOSPC, errno.EIO)):
        return False
    # a write to a named file (open, rename, mkdir: a bug if uncaught, its traceback kept)
    # carries the file's name; stdout's writes carry none
    return err.filename is None


def output_lost(err: OSError) -> int:
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
