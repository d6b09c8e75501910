"""Compiled emulation over the model zoo (tests/zoo): for each model and policy, whether
``Precision(..., compile=True)`` compiled it or fell back (and why), and whether 3 SGD steps
gave eager emulation's bits (outputs, gradients, parameters and floating buffers after the
steps). One thread; a survey, not a timing (each compile takes 10-60 s here).

    python benchmarks/compiled_zoo.py [--models bert,resnet] [--policies 16-true,16-mixed]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "zoo"), str(ROOT / "tests")]

from training.test_compiled_emulation import _train_entry  # noqa: E402 (the test's own loop)
from zoo import ZOO  # noqa: E402


def _flat(model, run) -> list:
    """(outputs per step, gradients per step, parameters) and the model's floating buffers
    (batch norm's running statistics) after the steps, as one list of tensors."""
    outs, grads, params = run
    bufs = [b for _, b in sorted(model.named_buffers()) if b.is_floating_point()]
    return [*outs, *(g for step in grads for g in step), *params, *bufs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--policies", default="16-true,16-mixed")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| model | policy | compiled? | bits vs eager (3 steps) | compile + 3 steps s |")
    print("|---|---|---|---|---|")
    for name in a.models.split(","):
        for policy in a.policies.split(","):
            entry = ZOO[name]
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                try:
                    eager_model, *eager = _train_entry(entry, policy, False)
                    t0 = time.perf_counter()
                    model, *comp = _train_entry(entry, policy, True)
                    took = time.perf_counter() - t0
                except Exception as err:  # noqa: BLE001 (a survey: report and go on)
                    print(f"| {name} | {policy} | error: {' '.join(str(err).split())[:80]} | | |")
                    continue
            reason = getattr(model.forward, "reason", "not set up compiled")
            said = [str(w.message) for w in rec if "runs this model eagerly" in str(w.message)]
            how = "yes" if reason is None else f"eager: {reason}"
            eager, comp = _flat(eager_model, eager), _flat(model, comp)
            differ = sum(not torch.equal(u.float().view(torch.int32), v.float().view(torch.int32))
                         for u, v in zip(eager, comp))
            bits = "identical" if differ == 0 else f"{differ} of {len(eager)} tensors differ"
            assert reason is None or len(said) == 1
            print(f"| {name} | {policy} | {how} | {bits} | {took:.0f} |", flush=True)


if __name__ == "__main__":
    main()
