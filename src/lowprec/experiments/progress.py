"""Progress of a comparison: rich bars on a terminal, one plain line per epoch and per run
elsewhere, nothing when quiet."""

from __future__ import annotations

import math
import sys

__all__ = ["Progress"]


class Progress:
    """Progress of a comparison: nothing when quiet; on a terminal, rich progress bars (one
    overall, one per run in flight: the local runner has one at a time, the Ray driver one per
    task); otherwise (a pipe, a log file: ``make demo > log``), one plain line per finished
    epoch and per finished run, flushed at once, where rich would draw nothing until the end.
    ``step`` and ``run_done`` without a name act on the run started last."""

    def __init__(self, total_runs: int, quiet: bool, *, plain: bool | None = None) -> None:
        self.quiet = quiet
        self.bars: dict[str, int] = {}
        self.last: str | None = None
        self.total, self.done = total_runs, 0
        self.plain = (not sys.stdout.isatty()) if plain is None else plain
        if quiet or self.plain:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as _Rich, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.p = _Rich(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
        self.overall = self.p.add_task("all runs", total=total_runs)

    @property
    def _bars(self) -> bool:
        return not (self.quiet or self.plain)

    def _line(self, text: str) -> None:
        print(text, flush=True)

    def __enter__(self):
        if self._bars:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bars:
            self.p.__exit__(*exc)

    def start_run(self, name: str, total_steps: int, done_steps: int = 0) -> None:
        self.last = name
        if not self._bars:
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.bars[name] = self.p.add_task(name, total=total_steps, completed=done_steps)

    def step(self, n: int = 1, name: str | None = None) -> None:
        name = self.last if name is None else name
        if self._bars and name in self.bars:
            self.p.advance(self.bars[name], n)

    def epoch_done(self, name: str, epoch: int, epochs: int, *, train_loss=None,
                   test_acc=None, seconds=None) -> None:
        """A finished epoch (1-based): a plain line when not on a terminal."""
        if self.quiet or not self.plain:
            return
        parts = [f"{name}: epoch {epoch}/{epochs}"]
        if train_loss is not None and math.isfinite(train_loss):
            parts.append(f"train loss {train_loss:.4f}")
        if test_acc is not None and math.isfinite(test_acc):
            parts.append(f"test acc {100 * test_acc:.2f}%")
        if seconds is not None:
            parts.append(f"{seconds:.1f} s")
        self._line(", ".join(parts))

    def run_done(self, name: str | None = None) -> None:
        name = self.last if name is None else name
        self.done += 1
        if self.quiet:
            return
        if self.plain:
            self._line(f"all runs: {self.done}/{self.total} done" + (f" ({name})" if name else ""))
            return
        if name in self.bars:
            self.p.remove_task(self.bars.pop(name))
        self.p.advance(self.overall, 1)
