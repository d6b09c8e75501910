"""What rounding costs once compiled: the fused decomposition (lowprec.numerics.fused) against
the opaque ``lowprec::quantize`` op and against no rounding at all, in one run.

Models: an MLP 784-512-512-10 at batch 256 whose every layer output (each Linear and each ReLU)
is rounded, forward and backward (a straight-through rounding whose backward rounds the gradient
too), timed per training step (forward, backward, SGD step); the same MLP per forward pass
(no_grad); and one 3x3 convolution (64 -> 64 channels, 32 x 32, batch 32) whose output is
rounded, per forward. Contenders: eager fp32, eager with lowprec.quantize (the C kernel),
compiled fp32, compiled with the decomposition (what ``quantize`` does inside torch.compile),
and compiled with the opaque op (``impl="op"``). Rounds are interleaved and the median is kept,
so a slow moment of the shared machine hits every contender alike; the load (``uptime``) is
printed before and after.

    python benchmarks/fused_rounding.py [--format fp16] [--rounding nearest] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

import lowprec
from lowprec import quantize
from lowprec.numerics.quantize import seed_tensor


class _Round(torch.autograd.Function):
    """Straight-through rounding: values forward, gradients backward, both to ``fmt``."""

    @staticmethod
    def forward(ctx, x, fmt, rounding, impl, seed):
        ctx.spec = (fmt, rounding, impl, seed)
        return quantize(x, fmt, rounding, impl=impl, seed=seed)

    @staticmethod
    def backward(ctx, g):
        fmt, rounding, impl, seed = ctx.spec
        return quantize(g, fmt, rounding, impl=impl, seed=seed), None, None, None, None


class Rounded(nn.Module):
    def __init__(self, inner: nn.Module, fmt: str | None, rounding: str, impl: str, seed):
        super().__init__()
        self.inner, self.spec = inner, (fmt, rounding, impl, seed)

    def forward(self, x):
        y = self.inner(x)
        fmt, rounding, impl, seed = self.spec
        return y if fmt is None else _Round.apply(y, fmt, rounding, impl, seed)


def mlp(fmt, rounding, impl, seed) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)]
    return nn.Sequential(*(Rounded(m, fmt, rounding, impl, seed) for m in layers))


def conv(fmt, rounding, impl, seed) -> nn.Module:
    torch.manual_seed(0)
    return Rounded(nn.Conv2d(64, 64, 3, padding=1), fmt, rounding, impl, seed)


def _load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp16")
    ap.add_argument("--rounding", default="nearest")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"lowprec {lowprec.__version__}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"emulate_precision_casts={torch._inductor.config.emulate_precision_casts}")
    print("before:", _load())
    seed = seed_tensor(torch.Generator().manual_seed(0))
    fmt, rnd = args.format, args.rounding
    contenders = {  # name: (format or None, impl, compiled?)
        "eager fp32": (None, "auto", False),
        "eager + kernel": (fmt, "auto", False),
        "compiled fp32": (None, "auto", True),
        "compiled + fused": (fmt, "auto", True),
        "compiled + opaque op": (fmt, "op", True),
    }
    x_mlp, y_mlp = torch.randn(256, 784), torch.randint(0, 10, (256,))
    x_conv = torch.randn(32, 64, 32, 32)

    def step_fn(model):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x_mlp), y_mlp).backward()
            opt.step()
        return step

    def forward_fn(model, x):
        def fwd():
            with torch.no_grad():
                model(x)
        return fwd

    cases = {"MLP train step": lambda m: step_fn(m), "MLP forward": lambda m: forward_fn(m, x_mlp)}
    fns: dict = {}
    for name, (f, impl, compiled) in contenders.items():
        for case, make in cases.items():
            model = mlp(f, rnd, impl, seed)
            if compiled:
                model = torch.compile(model)
            fns[(case, name)] = make(model)
        model = conv(f, rnd, impl, seed)
        fns[("conv forward", name)] = forward_fn(torch.compile(model) if compiled else model,
                                                 x_conv)
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(args.reps):
                fn()
            times[k].append((time.perf_counter() - t) / args.reps)
    print("after:", _load())
    print(f"\nformat {fmt}, rounding {rnd}; median of {args.rounds} rounds of {args.reps}")
    print("| case | " + " | ".join(contenders) + " |")
    print("|---" * (len(contenders) + 1) + "|")
    for case in (*cases, "conv forward"):
        ms = {n: 1e3 * statistics.median(times[(case, n)]) for n in contenders}
        print(f"| {case} ms | " + " | ".join(f"{ms[n]:.2f}" for n in contenders) + " |")
        base = ms["compiled fp32"]
        print(f"| {case} / compiled fp32 | " + " | ".join(f"{ms[n] / base:.2f}x"
                                                          for n in contenders) + " |")


if __name__ == "__main__":
    main()
