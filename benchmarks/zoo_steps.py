"""Step time of every zoo model (tests/zoo) under every policy of the zoo matrix, relative to
32-true, and whether the loss fell in 20 steps. Policies are measured in interleaved rounds
(every policy once per round, the median step time over rounds), so a slow moment of the
machine hits all of them alike; one thread, as the zoo tests run.

    python benchmarks/zoo_steps.py [--rounds 3] [--models bert,resnet]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "zoo")]

from runner import POLICIES, falls, train  # noqa: E402
from zoo import ZOO  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default=",".join(ZOO))
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    models = a.models.split(",")
    times = {(m, p): [] for m in models for p in POLICIES}
    status = {}
    for _ in range(a.rounds):
        for m in models:
            for p in POLICIES:
                try:
                    run = train(ZOO[m], p)
                except Exception as err:  # noqa: BLE001 - reported in the table
                    status[(m, p)] = f"error: {type(err).__name__}"
                    continue
                times[(m, p)].append(run["step_s"])
                status[(m, p)] = "trains" if falls(run["losses"]) else "no fall"
    print("| policy | " + " | ".join(models) + " |")
    print("| --- |" + " --- |" * len(models))
    base = {m: statistics.median(times[(m, "32-true")]) for m in models}
    for p in POLICIES:
        cells = []
        for m in models:
            if not times[(m, p)]:
                cells.append(status[(m, p)])
                continue
            r = statistics.median(times[(m, p)]) / base[m]
            cells.append(f"{r:.1f}x" + ("" if status[(m, p)] == "trains" else " (no fall)"))
        print(f"| `{p}` | " + " | ".join(cells) + " |")
    print("| 32-true ms/step | " + " | ".join(f"{1000 * base[m]:.1f}" for m in models) + " |")


if __name__ == "__main__":
    main()
