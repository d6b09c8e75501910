"""``lowprec plan``: the cheapest per-layer precision that still trains
(:func:`lowprec.experiments.planner.plan`), written as a plan file; parsing and printing only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .analyse import trained_model
from .common import Table, print_error, print_json, short, user_call

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["cmd_plan"]


def cmd_plan(args, console: Console) -> int:
    from ..experiments.planner import plan, plan_markdown, plan_table, summary_rows

    from ..training.plan import Plan

    for flag, path in (("--out", args.out), ("--report", args.report)):
        if path is not None:  # checked before the search, which takes minutes
            check = Plan.check_path if flag == "--out" else _check_file_path
            user_call(check, path)
    model, data = trained_model(args, console)
    found = user_call(plan, model, data, menu=args.menu, minimise=args.minimise,
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
        print_error("lowprec plan", f"could not write {err.filename or args.out}: "
                    f"{err.strerror or err}")
        return 1
    if args.json:
        print_json(found.to_json())
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
                  f"Precision(\"plan:{args.out}\") (or lowprec.Plan.load) or compare --policies "
                  f"plan:{args.out}")
    return 0 if m.get("accepted") else 1


def _check_file_path(text: str):
    """A file to be written: named, not a folder, in an existing writable folder."""
    import os
    from pathlib import Path

    if not text.strip():
        raise ValueError("an output file name is empty")
    path = Path(text)
    if path.is_dir() or text.endswith(os.sep):
        raise ValueError(f"{short(text)} is a folder: name a file")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise ValueError(f"{short(text)}: the folder {short(str(path.parent))} does not exist "
                         "or is not writable")
    return path
