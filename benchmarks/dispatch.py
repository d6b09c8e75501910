"""The emulation's per-op cost where the arithmetic is small: a training step of a small
LeNet-style CNN at batch 8 on one thread, where Python dispatch (the engine's mode, its op
table, the output roundings) is most of the step. Prints microseconds per step of 32-true and
each policy given, and their ratio, measured in interleaved rounds (median over rounds).

    python benchmarks/dispatch.py [--policies 16-true,16-mixed] [--rounds 7] [--steps 100]

To compare two trees, run this file with ``PYTHONPATH=OTHER/src`` and then without, alternately.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import lowprec
from lowprec.training.hardware import device_facts


def _runner(policy: str):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                            torch.nn.Flatten(), torch.nn.Linear(6 * 12 * 12, 32),
                            torch.nn.ReLU(), torch.nn.Linear(32, 10))
    prec = lowprec.Precision(policy)
    m, opt = prec.setup(m, torch.optim.SGD(m.parameters(), lr=0.01))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def step():
        opt.zero_grad(set_to_none=True)
        with prec.autocast():
            loss = torch.nn.functional.cross_entropy(m(x), y)
        prec.backward(loss)
        prec.step(opt)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="16-true,16-mixed")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    policies = ["32-true"] + [p for p in args.policies.split(",") if p != "32-true"]
    steps = {p: _runner(p) for p in policies}
    for step in steps.values():
        for _ in range(20):
            step()
    times: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(args.rounds):
        for p, step in steps.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[p].append((time.perf_counter() - t) / args.steps * 1e6)
    cpu = device_facts("cpu")
    print(f"lowprec {lowprec.__file__}; CPU {cpu.name} ({cpu.capability}: "
          f"{' '.join(sorted(cpu.features)) or 'no 16-bit features'}), 1 thread")
    base = statistics.median(times["32-true"])
    for p in policies:
        med = statistics.median(times[p])
        print(f"{p:10} {med:8.0f} us/step  {med / base:5.2f}x 32-true")


if __name__ == "__main__":
    main()
