"""``lowprec formats`` and ``lowprec quantize``: the number formats' table, and numbers rounded
to them (:func:`lowprec.numerics.quantize.quantize`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import FLOAT_RE, Table, UserError, short, user_call

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cmd_formats", "cmd_quantize"]


def _fmt_num(v: float) -> str:
    return f"{v:.6g}"


def cmd_formats(args, console: Console) -> int:
    from ..numerics.formats import NAMED_FORMATS, describe, parse_format

    fmts = ([user_call(parse_format, s) for s in args.formats] if args.formats
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

    fmts = [user_call(parse_format, s) for s in args.format]
    mode, _ = user_call(parse_rounding, args.rounding)
    values = [_quantize_value(v) for v in args.values]
    x = torch.tensor(values, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed)
    outs = [user_call(quantize, x, f, mode, generator=gen) for f in fmts]
    table = Table(title=f"quantize(x, fmt, rounding={mode.value!r})", header_style="bold")
    table.add_column("x (float32)", justify="right")
    for f in fmts:
        table.add_column(str(f), justify="right")
    for i, v in enumerate(x.tolist()):
        table.add_row(f"{v:.9g}", *[f"{o[i].item():.9g}" for o in outs])
    console.print(table)
    return 0


def _quantize_value(text: str) -> float:
    """A number for ``quantize``: decimal, inf, nan, -0 (ASCII only)."""
    if not FLOAT_RE.match(text.strip()):
        raise UserError(f"value {short(text)} is not a number (decimal, inf, nan or -0)")
    return float(text)
