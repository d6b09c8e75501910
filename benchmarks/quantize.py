"""Throughput of quantize on a 16M-element float32 tensor, side by side in one run.

Prints elements/s of x.clone(), x.half().float(), lowprec's kernel and plain-torch paths for
fp16, bf16, e4m3fn and fixed<16,14> with nearest and stochastic rounding, and QPyTorch's
float_quantize / fixed_point_quantize when qtorch imports; each as a ratio to clone(). Checks that
the kernel's bits equal the plain-torch path's bits for every row.

    python benchmarks/quantize.py [--n 16777216] [--repeat 5] [--inner 1]

``--inner K`` times K calls at a time (best of ``--repeat``): for sizes that fit in a cache,
such as an LSTM step's gates (``--n 131072 --inner 200``), where one call is a few
microseconds.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import lowprec
from lowprec.numerics import kernel as _kernel, quantize


def best_rate(fn, n: int, repeat: int, inner: int = 1) -> float:
    fn()  # warm-up (page faults of the first allocation, lazy init)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--inner", type=int, default=1, help="calls per timing (small sizes)")
    ap.add_argument("--skip-torch-path", action="store_true", help="skip the slow reference path")
    args = ap.parse_args()
    n = args.n
    torch.manual_seed(0)
    x = torch.randn(n) * 3

    print(f"lowprec {lowprec.__version__}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"kernel built: {_kernel.available()}, n = {n:,} float32, best of {args.repeat} x "
          f"{args.inner} calls")
    rows = []
    clone = best_rate(lambda: x.clone(), n, args.repeat, args.inner)
    rows.append(("x.clone()", clone, ""))
    rows.append(("x.half().float()", best_rate(lambda: x.half().float(), n, args.repeat, args.inner), ""))
    rows.append(("x.bfloat16().float()", best_rate(lambda: x.bfloat16().float(), n, args.repeat, args.inner), ""))

    for spec in ["fp16", "bf16", "e4m3fn", "fixed<16,14>"]:
        for mode in ["nearest", "stochastic"]:
            def run(impl, spec=spec, mode=mode):
                g = torch.Generator().manual_seed(1)
                return quantize(x, spec, mode, generator=g, impl=impl)

            same = ""
            if not args.skip_torch_path:
                a, b = run("kernel" if _kernel.available() else "torch"), run("torch")
                same = "bits == torch path" if torch.equal(a.view(torch.int32),
                                                           b.view(torch.int32)) else "BITS DIFFER"
            if _kernel.available():
                rows.append((f"lowprec {spec} {mode} (kernel)",
                             best_rate(lambda: run("kernel"), n, args.repeat, args.inner), same))
            if not args.skip_torch_path:
                rows.append((f"lowprec {spec} {mode} (torch path)",
                             best_rate(lambda: run("torch"), n, max(1, args.repeat // 2)), ""))

    try:
        from qtorch.quant import fixed_point_quantize, float_quantize

        for mode in ["nearest", "stochastic"]:
            rows.append((f"qtorch float_quantize e5m10 {mode}",
                         best_rate(lambda: float_quantize(x, 5, 10, rounding=mode), n, args.repeat, args.inner),
                         ""))
            rows.append((f"qtorch fixed_point_quantize <16,14> {mode}",
                         best_rate(lambda: fixed_point_quantize(x, 16, 14, rounding=mode), n,
                                   args.repeat), ""))
    except Exception as err:  # optional peer, not a dependency
        rows.append((f"qtorch: not measured ({type(err).__name__}: {str(err)[:60]})", 0.0, ""))

    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'M elem/s':>9}  {'/ clone':>7}  check")
    for name, rate, note in rows:
        if rate:
            print(f"{name:<{width}}  {rate / 1e6:9.1f}  {rate / clone:7.2f}  {note}")
        else:
            print(name)


if __name__ == "__main__":
    main()
