"""The planner's arguments, checked once (menu, budget, hardware, comparators, tolerance,
steps, seeds, training hyper-parameters), and the search log every step writes to."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ...analysis.plan_scores import COSTS
from ...analysis.roofline import PROFILES, HardwareProfile, get_profile
from .levels import parse_compare_with, parse_menu

__all__ = ["Settings", "check_settings", "SearchLog"]


@dataclass(frozen=True)
class Settings:
    """What one search was asked for, validated (see :func:`lowprec.experiments.planner.plan`)."""

    menu: tuple[str, ...]          # the menu's levels as given, fp32 added
    minimise: str                  # memory, bits or time
    profile: HardwareProfile | None
    comparators: tuple[str, ...]   # levels trained uniformly beside the menu's
    tolerance: float
    steps: int
    seeds: tuple[int, ...]
    lr: float
    momentum: float
    batch_size: int
    probe_batches: int
    max_repairs: int | None
    compare_uniform: bool
    output_fn: Callable | None

    def train_kwargs(self) -> dict:
        """The keyword arguments of every verification run."""
        return dict(steps=self.steps, lr=self.lr, momentum=self.momentum,
                    batch_size=self.batch_size, output_fn=self.output_fn)


def check_settings(*, menu, minimise, hardware, tolerance, steps, seeds, lr, momentum,
                   batch_size, probe_batches, max_repairs, compare_uniform, compare_with,
                   output_fn) -> Settings:
    """The arguments of :func:`~lowprec.experiments.planner.plan` checked in order; a
    ValueError naming what is accepted."""
    order_names = parse_menu(menu)
    if minimise not in COSTS:
        raise ValueError(f"minimise={minimise!r}; accepted: {', '.join(COSTS)}")
    if hardware is not None:
        profile = get_profile(hardware)
    elif minimise == "time":
        raise ValueError(f"minimise='time' needs hardware=NAME; accepted: "
                         f"{', '.join(PROFILES)}")
    else:
        profile = None
    comparators = parse_compare_with(compare_with, order_names, compare_uniform)
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance={tolerance!r}; accepted: a finite number >= 0 (a fraction "
                         "of accuracy: 0.01 is one point)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}; accepted: an integer >= 1")
    seeds = (seeds,) if isinstance(seeds, int) else tuple(seeds)
    if not seeds:
        raise ValueError("seeds=(); accepted: one or more integer seeds")
    return Settings(menu=order_names, minimise=minimise, profile=profile,
                    comparators=comparators, tolerance=tolerance, steps=steps, seeds=seeds,
                    lr=lr, momentum=momentum, batch_size=batch_size,
                    probe_batches=probe_batches, max_repairs=max_repairs,
                    compare_uniform=compare_uniform, output_fn=output_fn)


class SearchLog:
    """The search's lines, kept for the plan and passed to ``log`` as they happen."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self.lines: list[str] = []
        self._log = log

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self._log is not None:
            self._log(line)
