"""The ``lowprec`` command: parses arguments and calls one library function per command.

A user's mistake (an unknown format, a bad number) prints one line and exits with code 2;
tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

__all__ = ["main", "build_parser"]


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


def _user(fn, *args):
    """Call a parser of user input; its ValueError/TypeError becomes a one-line UserError."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from None


def _fmt_num(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args, console: Console) -> int:
    from .formats import NAMED_FORMATS, describe, parse_format

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

    from .formats import parse_format
    from .quantize import quantize
    from .rounding import parse_rounding

    fmts = [_user(parse_format, s) for s in args.format]
    mode, _ = _user(parse_rounding, args.rounding)
    try:
        values = [float(v) for v in args.values]
    except ValueError as err:
        raise UserError(f"values must be numbers: {err}") from None
    x = torch.tensor(values, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    table = Table(title=f"quantize(x, fmt, rounding={mode.value!r})", header_style="bold")
    table.add_column("x (float32)", justify="right")
    for f in fmts:
        table.add_column(str(f), justify="right")
    outs = [quantize(x, f, mode, generator=gen) for f in fmts]
    for i, v in enumerate(x.tolist()):
        table.add_row(f"{v:.9g}", *[f"{o[i].item():.9g}" for o in outs])
    console.print(table)
    return 0


def cmd_demo(args, console: Console) -> int:
    """The embedded default job until the experiment runner exists: formats and quantize."""
    cmd_formats(argparse.Namespace(formats=None), console)
    demo = argparse.Namespace(
        values=["0.1", "1.0009765625", "65504", "65519", "65520", "1e-8", "-0", "480", "inf", "nan"],
        format=["fp16", "bf16", "e4m3fn", "e4m3fn-sat", "fp4_e2m1", "q2.14"],
        rounding="nearest", seed=0)
    cmd_quantize(demo, console)
    console.print("65520 overflows fp16 to inf (ties to even, IEEE 754); e4m3fn has no inf: "
                  "480 is NaN without saturation and 448 with it; q2.14 saturates at 2 - 2**-14.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lowprec",
        description="Reduced-precision training on PyTorch: formats, rounding, quantization.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    f = sub.add_parser("formats", help="table of number formats: bits, max, min normal, "
                                       "min subnormal, eps")
    f.add_argument("formats", nargs="*", metavar="FORMAT",
                   help="formats to show (default: every named format), e.g. fp16 e3m4 q4.12")
    f.set_defaults(func=cmd_formats)

    q = sub.add_parser("quantize", help="round numbers to one or more formats")
    q.add_argument("values", nargs="+", metavar="X", help="numbers (inf, nan, -0 accepted)")
    q.add_argument("--format", "-f", action="append", required=True,
                   help="target format (repeatable), e.g. -f fp16 -f e4m3fn")
    q.add_argument("--rounding", "-r", default="nearest",
                   help="nearest, nearest_away, toward_zero, up, down, stochastic, srN")
    q.add_argument("--seed", type=int, default=0, help="seed of stochastic rounding")
    q.set_defaults(func=cmd_quantize)

    d = sub.add_parser("demo", help="the formats table and a quantize demonstration")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    # a pipe or a log file gets wide tables rather than rich's 80-column default
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        return int(args.func(args, console) or 0)
    except UserError as err:
        print(f"lowprec {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
