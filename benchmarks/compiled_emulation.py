"""Compiled emulation (``Precision(..., compile=True)``) against eager emulation: step time
and bit identity.

For each model and policy: the median training-step time (forward, backward, SGD step) of
fp32 eager, fp32 under ``torch.compile``, eager emulation and compiled emulation, relative to
fp32 eager; and, over the first 3 steps, how many outputs, fp32 gradients and parameters
(after the steps) of the compiled run differ from the eager emulated run's bits, with the
largest difference in fp32 ulps. One thread; compile time is left out of the step times.

    python benchmarks/compiled_emulation.py [--models mlp,lenet,transformer]
        [--policies 16-true,bf16-true,16-mixed] [--batch 64] [--steps 20]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
from torch.nn import functional as F

from lowprec import Precision
from lowprec.experiments.models import MLP, LeNet5, TransformerClassifier

MODELS = {
    "mlp": (lambda: MLP((1, 28, 28), 10, hidden=(512, 512)), (1, 28, 28)),
    "lenet": (lambda: LeNet5((1, 28, 28), 10), (1, 28, 28)),
    "transformer": (lambda: TransformerClassifier((1, 16, 16), 10, d_model=64, layers=2,
                                                  heads=4), (1, 16, 16)),
}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float().view(torch.int32).long() - b.float().view(torch.int32).long())
               .abs().max().item())


def run(name: str, policy: str | None, compiled: bool, batch: int, steps: int):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if policy is None:  # fp32
        prec = Precision("32-true")
        model, opt = prec.setup(model, opt)
        fwd = torch.compile(model) if compiled else model
    else:
        prec = Precision(policy, compile=compiled)
        model, opt = prec.setup(model, opt)
        fwd = model
    times, record = [], []
    for s in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        with prec.autocast():
            out = fwd(x)
            loss = F.cross_entropy(out, y)
        prec.backward(loss)
        if s < 3:
            record.append((out.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        prec.step(opt)
        if s == 2:
            record.append([p.detach().clone() for p in model.parameters()])
        times.append(time.perf_counter() - t)
    reason = getattr(model.forward, "reason", None)
    return statistics.median(times[3:]), record, reason


def compare(a, b) -> str:
    diff, total, worst = 0, 0, 0
    for (oa, ga), (ob, gb) in zip(a[:3], b[:3]):
        for u, v in [(oa, ob), *zip(ga, gb)]:
            total += 1
            if not torch.equal(u, v):
                diff += 1
                worst = max(worst, ulps(u, v))
    for u, v in zip(a[3], b[3]):
        total += 1
        if not torch.equal(u, v):
            diff += 1
            worst = max(worst, ulps(u, v))
    return "bit-identical" if diff == 0 else f"{diff}/{total} tensors differ (max {worst} ulps)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,lenet,transformer")
    ap.add_argument("--policies", default="16-true,bf16-true,16-mixed")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"# {platform.processor() or platform.machine()}, "
          f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 1 thread, "
          f"batch {a.batch}")
    print("| model | policy | fp32 compiled | emulated eager | emulated compiled | "
          "compiled vs eager emulation (3 steps) |")
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        base, _, _ = run(name, None, False, a.batch, a.steps)
        fp32c, _, _ = run(name, None, True, a.batch, a.steps)
        for pol in a.policies.split(","):
            te, re, _ = run(name, pol, False, a.batch, a.steps)
            tc, rc, why = run(name, pol, True, a.batch, a.steps)
            note = compare(re, rc) if why is None else f"eager fallback: {why}"
            print(f"| {name} | {pol} | {fp32c / base:.2f}x | {te / base:.2f}x | "
                  f"{tc / base:.2f}x | {note} |")
        print(f"| {name} | fp32 eager ms/step | {1000 * base:.1f} | | | |")


if __name__ == "__main__":
    main()
