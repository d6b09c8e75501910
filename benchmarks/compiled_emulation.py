"""Compiled emulation (``Precision(..., compile=True)``) against eager emulation: step time
and bit identity.

For each model and policy: the median training-step time (forward, backward, SGD step) of
fp32 eager, fp32 under ``torch.compile``, eager emulation and compiled emulation, relative to
fp32 eager; and, over the first 3 steps, how many outputs, fp32 gradients and parameters
(after the steps) of the compiled run differ from the eager emulated run's bits, with the
largest difference in fp32 ulps. One thread; compile time is left out of the step times
(interleaved rounds, the median per variant).

    python benchmarks/compiled_emulation.py [--models mlp,lenet,transformer]
        [--policies 16-true,bf16-true,16-mixed] [--batch 64] [--steps 5] [--rounds 5]
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


class Variant:
    """One model under one set-up; ``step()`` runs one training step."""

    def __init__(self, name: str, policy: str | None, compiled: bool, batch: int) -> None:
        build, shape = MODELS[name]
        torch.manual_seed(0)
        model = build()
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, *shape, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.prec = Precision("32-true" if policy is None else policy,
                              compile=compiled and policy is not None)
        self.model, self.opt = self.prec.setup(model, opt)
        # fp32: torch.compile of the model itself
        self.fwd = torch.compile(self.model) if compiled and policy is None else self.model
        # outputs and gradients of the first 3 steps, parameters after them
        self.record = []
        for s in range(3):
            out = self.step()
            self.record.append((out, [p.grad.clone() for p in self.model.parameters()]))
        self.record.append([p.detach().clone() for p in self.model.parameters()])
        self.reason = getattr(self.model.forward, "reason", None)

    def step(self) -> torch.Tensor:
        self.opt.zero_grad()
        with self.prec.autocast():
            out = self.fwd(self.x)
            loss = F.cross_entropy(out, self.y)
        self.prec.backward(loss)
        keep = out.detach().clone()
        self.prec.step(self.opt)
        return keep


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
    ap.add_argument("--steps", type=int, default=5, help="steps per timing round")
    ap.add_argument("--rounds", type=int, default=5)
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
        pols = a.policies.split(",")
        variants = {("fp32", False): Variant(name, None, False, a.batch),
                    ("fp32", True): Variant(name, None, True, a.batch)}
        for pol in pols:
            for c in (False, True):
                variants[(pol, c)] = Variant(name, pol, c, a.batch)
        times: dict = {k: [] for k in variants}
        for _ in range(a.rounds):  # interleaved: a slow moment of the machine hits all alike
            for k, v in variants.items():
                t = time.perf_counter()
                for _ in range(a.steps):
                    v.step()
                times[k].append((time.perf_counter() - t) / a.steps)
        med = {k: statistics.median(t) for k, t in times.items()}
        base = med[("fp32", False)]
        for pol in pols:
            e, c = variants[(pol, False)], variants[(pol, True)]
            note = compare(e.record, c.record) if c.reason is None else \
                f"eager fallback: {c.reason}"
            print(f"| {name} | {pol} | {med[('fp32', True)] / base:.2f}x | "
                  f"{med[(pol, False)] / base:.2f}x | {med[(pol, True)] / base:.2f}x | {note} |")
        print(f"| {name} | fp32 eager ms/step | {1000 * base:.1f} | | | |")


if __name__ == "__main__":
    main()
