"""What ``match_cpu_kernels=True`` costs: one convolution, forward and forward + backward, side
by side in one run: oneDNN's fp32 convolution (the default emulation), lowprec's reference-order
convolution (``lowprec.numerics.summation.conv2d``, bit-exact with native fp16 on CPUs without
AVX512-FP16), and torch's native fp16 convolution (the kernel it reproduces). Rounds are
interleaved and the median is kept, so a slow moment of the machine hits all three alike.

    python benchmarks/summation.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import lowprec
from lowprec.numerics import kernel, summation

SHAPES = {  # name: (batch, in channels, out channels, size, kernel, stride)
    "ResNet-20 stage 1 (3x3, 16 ch, 32x32)": (64, 16, 16, 32, 3, 1),
    "ResNet-20 stage 3 (3x3, 64 ch, 8x8)": (64, 64, 64, 8, 3, 1),
    "LeNet-5 conv2 (5x5, 6->16, 14x14)": (256, 6, 16, 14, 5, 1),
}


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"lowprec {lowprec.__version__}, torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, compiled kernel: {kernel.available()}")
    for name, (n, cin, cout, size, k, stride) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, cin, size, size, generator=g).half()
        w = (torch.randn(cout, cin, k, k, generator=g) * 0.2).half()
        pad = k // 2
        xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
        xh, wh = x.clone().requires_grad_(), w.clone().requires_grad_()

        def fwd_bwd(conv, a, b):
            def run():
                y = conv(a, b, None, stride, pad)
                torch.autograd.grad(y, (a, b), torch.ones_like(y))
            return run

        cases = {
            "oneDNN fp32": (lambda: F.conv2d(xf, wf, None, stride, pad), fwd_bwd(F.conv2d, xf, wf)),
            "reference order": (lambda: summation.conv2d(xf, wf, None, stride, pad),
                                fwd_bwd(summation.conv2d, xf, wf)),
            "native fp16": (lambda: F.conv2d(xh, wh, None, stride, pad), fwd_bwd(F.conv2d, xh, wh)),
        }
        same = torch.equal(summation.conv2d(xf, wf, None, stride, pad).half(),
                           F.conv2d(x, w, None, stride, pad))
        times = {c: ([], []) for c in cases}
        for _ in range(args.rounds):
            for c, (f, fb) in cases.items():
                times[c][0].append(_time(f, 3))
                times[c][1].append(_time(fb, 1))
        base = [statistics.median(t) for t in times["oneDNN fp32"]]
        print(f"\n{name}, batch {n}: reference order bit-exact with native fp16: {same}")
        print(f"{'convolution':<16} {'fwd ms':>8} {'x fp32':>7} {'fwd+bwd ms':>11} {'x fp32':>7}")
        for c, (tf, tb) in times.items():
            mf, mb = statistics.median(tf), statistics.median(tb)
            print(f"{c:<16} {1000 * mf:8.2f} {mf / base[0]:7.2f} {1000 * mb:11.2f} "
                  f"{mb / base[1]:7.2f}")


if __name__ == "__main__":
    main()
