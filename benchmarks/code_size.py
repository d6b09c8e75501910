"""The house's size, for issue 38's counts: functions over 80 lines, the longest functions and
the largest modules (Python and C) under src/lowprec. A function's length runs from its ``def``
to its last line (``ast``'s ``end_lineno``), docstring included.

    python benchmarks/code_size.py [--top 15]
"""

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "lowprec"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    fns, mods = [], []
    for p in sorted(ROOT.rglob("*.py")):
        text = p.read_text()
        mods.append((len(text.splitlines()), p.relative_to(ROOT.parent)))
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fns.append((n.end_lineno - n.lineno + 1, f"{p.relative_to(ROOT.parent)}:{n.name}"))
    for p in sorted(ROOT.rglob("*.[ch]")):
        mods.append((len(p.read_text().splitlines()), p.relative_to(ROOT.parent)))
    fns.sort(reverse=True)
    mods.sort(reverse=True)
    print(f"functions over 80 lines: {sum(1 for f in fns if f[0] > 80)}")
    for n, name in fns[:args.top]:
        print(f"{n:5d}  {name}")
    print("largest modules:")
    for n, name in mods[:args.top // 2]:
        print(f"{n:5d}  {name}")


if __name__ == "__main__":
    main()
