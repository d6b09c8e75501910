"""Fidelity table of the recurrent models of tests/training/test_fidelity.py.

Usage: PYTHONPATH=src:tests python benchmarks/fidelity_recurrent.py
Per model (the same fp16-rounded weights and input in every run, as the test): forward and
gradient ratio ||emulated - native fp16|| / ||fp32 - native fp16|| (0: identical to native,
1: no closer than fp32), and error ||emulated - float64|| / ||native fp16 - float64||.
"""
import sys

import torch

sys.path.insert(0, "tests")
from training.test_fidelity import RECURRENT, _x, fidelity  # noqa: E402


def main():
    print(f"{'model':28s} {'fwd ratio':>9s} {'grad ratio':>10s} {'fwd error':>9s} "
          f"{'grad error':>10s}")
    for name, make in RECURRENT.items():
        torch.manual_seed(0)
        r = fidelity(make(), _x(4, 10, 12))
        print(f"{name:28s} {r['forward'][0]:9.3f} {r['grads'][0]:10.3f} {r['forward'][1]:9.3f} "
              f"{r['grads'][1]:10.3f}")


if __name__ == "__main__":
    main()
