"""Compiled emulation over the model zoo (tests/zoo): for each model and policy, whether
``Precision(..., compile=True)`` compiled it or fell back (and why), and whether 3 SGD steps
gave eager emulation's bits (outputs, gradients, parameters after the steps). One thread; a
survey, not a timing (each compile takes 10-60 s here).

    python benchmarks/compiled_zoo.py [--models bert,resnet] [--policies 16-true,16-mixed]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / "zoo")]

from zoo import ZOO  # noqa: E402

from lowprec import Precision  # noqa: E402
from lowprec.training.tree import call_model, output_tensor  # noqa: E402


def run(entry, policy: str, compile: bool, steps: int = 3):
    torch.manual_seed(0)
    model = entry.build()
    inputs, targets = entry.batch()
    prec = Precision(policy, compile=compile)
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    seen = []
    for _ in range(steps):
        opt.zero_grad()
        with prec.autocast():
            out = output_tensor(call_model(model, inputs))
            loss = entry.loss(out, targets)
        prec.backward(loss)
        seen.append(out.detach().clone())
        seen += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        prec.step(opt)
    seen += [p.detach().clone() for p in model.parameters()]
    return model, seen


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
                    _, eager = run(entry, policy, False)
                    t0 = time.perf_counter()
                    model, comp = run(entry, policy, True)
                    took = time.perf_counter() - t0
                except Exception as err:  # noqa: BLE001 (a survey: report and go on)
                    print(f"| {name} | {policy} | error: {' '.join(str(err).split())[:80]} | | |")
                    continue
            reason = getattr(model.forward, "reason", "not set up compiled")
            said = [str(w.message) for w in rec if "runs this model eagerly" in str(w.message)]
            how = "yes" if reason is None else f"eager: {reason}"
            differ = sum(not torch.equal(u.float().view(torch.int32), v.float().view(torch.int32))
                         for u, v in zip(eager, comp))
            bits = "identical" if differ == 0 else f"{differ} of {len(eager)} tensors differ"
            assert reason is None or len(said) == 1
            print(f"| {name} | {policy} | {how} | {bits} | {took:.0f} |", flush=True)


if __name__ == "__main__":
    main()
