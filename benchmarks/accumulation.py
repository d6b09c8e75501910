"""What an emulated GEMM accumulator costs: the compiled kernel of
``lowprec.numerics.accumulation.gemm_acc`` (every product and partial sum rounded onto the
accumulator format) against torch's fp32 ``mm`` (oneDNN) and the scalar float64 reference, in
one run. Rounds are interleaved and the median is kept, so a slow moment of the machine hits
every contender alike. The reference is timed on a slice of rows and scaled up. Operands of fp16
values (at most 12 significant bits) let the kernel round to nearest on float32 lanes.

    python benchmarks/accumulation.py [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import lowprec
from lowprec.numerics import kernel
from lowprec.numerics.accumulation import gemm_acc
from lowprec.numerics.accumulation_reference import gemm_acc_reference
from lowprec.numerics.quantize import quantize

CASES = [  # (accumulator, M, N, K, operand values: any float32, or fp16 values)
    ("fp16:chunk128", 256, 256, 128, "fp32"),
    ("fp16:chunk128", 256, 256, 1024, "fp32"),
    ("fp16:chunk128", 256, 256, 128, "fp16"),
    ("fp16:chunk128", 256, 256, 1024, "fp16"),
    ("fp16:chunk128:sr", 256, 256, 128, "fp32"),
    ("fp32", 256, 256, 128, "fp32"),
    ("e8m13:chunk128", 256, 256, 1024, "fp32"),
    ("bf16:pairwise", 256, 256, 128, "fp32"),
    ("q8.12:chunk128", 256, 256, 128, "fp32"),
]
REF_ROWS = 2  # rows of the output the scalar reference computes (it is ~1e6 times slower)


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernel.gemm_acc_available():
        raise SystemExit("the compiled accumulation kernel is not built (setup.py build_ext)")
    print(f"lowprec {lowprec.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print("| accumulator | M x N x K | operands | kernel ms | oneDNN fp32 mm ms | kernel / mm | "
          "float64 reference ms (scaled) | reference / kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec, m, n, k, values in CASES:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(1, m, k, generator=g), torch.randn(1, k, n, generator=g)
        if values != "fp32":  # operands on a 16-bit grid: the kernel's float32 lanes apply
            a, b = quantize(a, values), quantize(b, values)
        a2, b2 = a[0], b[0]
        ker, mm = [], []
        for _ in range(args.rounds):
            ker.append(_time(lambda: gemm_acc(a, b, spec, seed=(1, 2)), 3))
            mm.append(_time(lambda: torch.mm(a2, b2), 20))
        t0 = time.perf_counter()
        gemm_acc_reference(a[:, :REF_ROWS], b, spec, (1, 2))
        ref = (time.perf_counter() - t0) * m / REF_ROWS
        tk, tm = statistics.median(ker), statistics.median(mm)
        print(f"| `{spec}` | {m} x {n} x {k} | {values} | {tk * 1e3:.2f} | {tm * 1e3:.3f} | {tk / tm:.0f}x | "
              f"{ref * 1e3:.0f} | {ref / tk:.0f}x |")


if __name__ == "__main__":
    main()
