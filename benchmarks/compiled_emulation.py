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
        [--layout contiguous|runner] [--device cuda]

``--layout runner`` lays models with 2-d convolutions out channels-last, their inputs too, as
``lowprec compare`` trains them (:func:`lowprec.experiments.models.channels_last`); the default,
``contiguous``, keeps them as built (NCHW), where oneDNN converts some gradients to
channels-last inside the convolutions' backward (a one-channel input, 1x1 kernels: layouts that
are both).

The policies run on the emulated backend (``b=emulated``), whatever ``auto`` would choose here.
On a GPU (``--device cuda``; benchmarks/gpu.py runs it there) the rounding compiles to Triton
and step times come from CUDA events after a synchronize.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
import warnings

import torch
from torch.nn import functional as F

from lowprec import Precision
from lowprec.training.policy import parse_policy
from lowprec.experiments.models import (MLP, LeNet5, TransformerClassifier, build_model,
                                       channels_last)

MODELS = {
    "mlp": (lambda: MLP((1, 28, 28), 10, hidden=(512, 512)), (1, 28, 28)),
    "lenet": (lambda: LeNet5((1, 28, 28), 10), (1, 28, 28)),
    "transformer": (lambda: TransformerClassifier((1, 16, 16), 10, d_model=64, layers=2,
                                                  heads=4), (1, 16, 16)),
    "resnet20": (lambda: build_model("resnet20", (1, 28, 28), 10), (1, 28, 28)),
}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.float().view(torch.int32).long() - b.float().view(torch.int32).long())
               .abs().max().item())


class Variant:
    """One model under one set-up; ``step()`` runs one training step."""

    def __init__(self, name: str, policy: str | None, compiled: bool, batch: int,
                 device: str = "cpu", layout: str = "contiguous") -> None:
        build, shape = MODELS[name]
        torch.manual_seed(0)
        model = build().to(device)
        if layout == "runner":
            channels_last(model)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, *shape, generator=g).to(device)
        self.y = torch.randint(0, 10, (batch,), generator=g).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if policy is not None:  # auto runs 16-bit natively on a GPU (and bf16 on AVX512-BF16)
            policy = dataclasses.replace(parse_policy(policy), backend="emulated")
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
    """How many of the recorded tensors differ in any bit, the largest difference in fp32 ulps,
    and the largest normwise relative difference |u - v| / |u| (ulps mislead where a value
    near zero changes sign)."""
    pairs = [(u, v) for (oa, ga), (ob, gb) in zip(a[:3], b[:3])
             for u, v in [(oa, ob), *zip(ga, gb)]]
    pairs += list(zip(a[3], b[3]))
    diff, worst, rel = 0, 0, 0.0
    for u, v in pairs:
        if not torch.equal(u, v):
            diff += 1
            worst = max(worst, ulps(u, v))
            rel = max(rel, float((u.double() - v.double()).norm() / u.double().norm().clamp_min(
                1e-300)))
    return ("bit-identical" if diff == 0 else
            f"{diff}/{len(pairs)} tensors differ (max {worst} ulps, normwise {rel:.1e})")


def timed(fn, device: str) -> float:
    """Seconds of ``fn()``: CUDA events after a synchronize on a GPU, perf_counter on a CPU."""
    if device == "cpu":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1000


def measure(name: str, pols: list[str], batch: int, steps: int, rounds: int,
            device: str = "cpu", layout: str = "contiguous") -> list[dict]:
    """One row per policy: step times relative to eager fp32 and bits against eager emulation."""
    variants = {("fp32", False): Variant(name, None, False, batch, device, layout),
                ("fp32", True): Variant(name, None, True, batch, device, layout)}
    for pol in pols:
        for c in (False, True):
            variants[(pol, c)] = Variant(name, pol, c, batch, device, layout)
    times: dict = {k: [] for k in variants}
    for _ in range(rounds):  # interleaved: a slow moment of the machine hits all alike
        for k, v in variants.items():
            times[k].append(timed(lambda v=v: [v.step() for _ in range(steps)], device) / steps)
    med = {k: statistics.median(t) for k, t in times.items()}
    base = med[("fp32", False)]
    rows = []
    fp32_bits = compare(variants[("fp32", False)].record, variants[("fp32", True)].record)
    for pol in pols:
        e, c = variants[(pol, False)], variants[(pol, True)]
        rows.append({"model": name, "policy": pol, "batch": batch, "fp32_eager_ms": 1000 * base,
                     "fp32_compiled": med[("fp32", True)] / base,
                     "emulated_eager": med[(pol, False)] / base,
                     "emulated_compiled": med[(pol, True)] / base,
                     "compiled_emulated_vs_compiled_fp32": med[(pol, True)] / med[("fp32", True)],
                     "fp32_compiled_vs_eager_bits": fp32_bits,
                     "bits": compare(e.record, c.record) if c.reason is None else
                     f"eager fallback: {c.reason}"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,lenet,transformer")
    ap.add_argument("--policies", default="16-true,bf16-true,16-mixed",
                    help="comma-separated, or semicolon-separated when a policy has commas")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="steps per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "runner"],
                    help="runner: convolutional models channels-last, as lowprec compare")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    where = (torch.cuda.get_device_name(0) if a.device == "cuda" else
             f"{platform.processor() or platform.machine()}, "
             f"{torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"# {where}, torch {torch.__version__}, batch {a.batch}, layout {a.layout}; "
          "step times / eager fp32's")
    print("| model | policy | fp32 compiled | emulated eager | emulated compiled | "
          "emulated compiled / fp32 compiled | compiled vs eager emulation (3 steps) |")
    print("|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        rows = measure(name, a.policies.split(";" if ";" in a.policies else ","), a.batch,
                       a.steps, a.rounds, a.device, a.layout)
        for r in rows:
            print(f"| {name} | {r['policy']} | {r['fp32_compiled']:.2f}x | "
                  f"{r['emulated_eager']:.2f}x | {r['emulated_compiled']:.2f}x | "
                  f"{r['compiled_emulated_vs_compiled_fp32']:.2f}x | {r['bits']} |")
        print(f"| {name} | fp32 eager ms/step | {rows[0]['fp32_eager_ms']:.1f} | | | | "
              f"fp32 compiled vs eager: {rows[0]['fp32_compiled_vs_eager_bits']} |")


if __name__ == "__main__":
    main()
