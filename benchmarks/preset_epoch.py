"""Size a preset's epochs: seconds per full-data epoch of every model x policy, predicted from a
few timed steps, plus the per-run costs (test-set evaluation after each epoch, the analyses at
the end), and the predicted duration of the whole preset.

Each (model, policy) is built as the runner builds it; ``--steps`` training steps of batch
``--batch`` are timed after one warm-up step, the evaluation and the fp16 certificate on
``--eval`` test images. Wall-clock and process CPU seconds are both printed: on a machine
shared with other jobs the CPU seconds divided by the threads used are the better estimate
of an idle machine's wall time.

    PYTHONPATH=src python benchmarks/preset_epoch.py --preset yun2023 [--steps 3] \
        [--threads 1] [--anchor 60]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

import torch
from torch import nn

from lowprec.analysis.certify import certify
from lowprec.experiments.config import PRESETS, CompareConfig, split_models
from lowprec.experiments.data import load_dataset
from lowprec.experiments.models import build_model, channels_last
from lowprec.experiments.run_analyses import analyse_run, certificate_formats
from lowprec.experiments.runner import evaluate
from lowprec.experiments.system import tune_cpu_allocator
from lowprec.training.optim import SGD
from lowprec.training.precision import Precision


class _Null:
    """Where analyse_run's records go: nowhere."""

    def record_analysis(self, *args) -> None:
        pass


def clock():
    return time.perf_counter(), time.process_time()


def since(t):
    return time.perf_counter() - t[0], time.process_time() - t[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="yun2023")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eval", type=int, default=1000)
    ap.add_argument("--models", default=None, help="comma-separated (default: the preset's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--anchor", type=float, default=None,
                    help="scale every time so that the first model x policy's epoch takes this "
                         "many seconds (a time measured on an idle machine): on a shared "
                         "machine the ratios are the reliable part")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tune_cpu_allocator()
    cfg = CompareConfig(**PRESETS[args.preset])
    data = load_dataset(cfg.data, quiet=True)
    n, n_test = len(data.x_train), len(data.x_test)
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    threads = torch.get_num_threads()
    print(f"{args.preset}: {data}; batch {cfg.batch_size}, {steps_per_epoch} steps/epoch; "
          f"torch {torch.__version__}, {threads} threads")
    print(f"{'model':<12} {'policy':<10} {'s/step':>8} {'cpu/step':>8} {'epoch s':>8} "
          f"{'eval s':>7} {'analysis s':>10}  (epoch, eval, analysis: full data, CPU s/threads)")
    total_epoch = total_fixed = 0.0
    per_model = {}
    scale = None
    for model_name in split_models(args.models or cfg.model):
        for policy in cfg.policies:
            torch.manual_seed(0)
            model = build_model(model_name, data.input_shape, data.num_classes)
            channels_last(model)  # as the runner lays a convolutional model out
            opt = SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                      weight_decay=cfg.weight_decay)
            prec = Precision(policy, seed=0)
            model, opt = prec.setup(model, opt)
            model.train()

            def step(i):
                xb = data.x_train[i * cfg.batch_size:(i + 1) * cfg.batch_size]
                yb = data.y_train[i * cfg.batch_size:(i + 1) * cfg.batch_size]
                opt.zero_grad()
                with prec.autocast():
                    loss = nn.functional.cross_entropy(model(xb).float(), yb)
                prec.backward(loss)
                prec.step(opt)

            step(0)  # warm-up: kernels chosen, buffers allocated
            t = clock()
            for i in range(1, args.steps + 1):
                step(i)
            wall, cpu = since(t)
            t = clock()
            evaluate(model, prec, data.x_test[:args.eval], data.y_test[:args.eval])
            ev_wall, ev_cpu = since(t)
            t = clock()
            for fmt in certificate_formats(prec.policy):
                certify(model, (data.x_test[:args.eval], data.y_test[:args.eval]), fmt)
            ce_wall, ce_cpu = since(t)
            # all of analyse_run on the same test images: the rest (layer errors, ranges, lost
            # updates) works on fixed batches of 256 and does not grow with the test set
            small = replace(data, x_test=data.x_test[:args.eval], y_test=data.y_test[:args.eval])
            t = clock()
            analyse_run(_Null(), "bench", model, prec, small, data.x_train, data.y_train, cfg)
            rest_cpu = max(0.0, since(t)[1] - ce_cpu)
            epoch = cpu / threads / args.steps * steps_per_epoch
            if scale is None:
                scale = args.anchor / epoch if args.anchor else 1.0
            epoch *= scale
            ev = ev_cpu / threads * n_test / args.eval * scale
            an = (ce_cpu * n_test / args.eval + rest_cpu) / threads * scale
            total_epoch += epoch + ev
            total_fixed += an
            per_model.setdefault(model_name, [0.0, 0.0])
            per_model[model_name][0] += epoch + ev
            per_model[model_name][1] += an
            print(f"{model_name:<12} {str(policy):<10} {wall / args.steps:8.3f} "
                  f"{cpu / args.steps:8.3f} {epoch:8.1f} {ev:7.1f} {an:10.1f}", flush=True)
    seeds = len(cfg.seeds)
    if args.anchor:
        print(f"(every time scaled by {scale:.3f}: the first epoch anchored at {args.anchor} s)")
    print(f"\nper seed, one epoch of every model x policy (with its evaluation): "
          f"{total_epoch:.0f} s; the analyses of every run: {total_fixed:.0f} s")
    for m, (e, a) in per_model.items():
        print(f"  {m:<12} epoch+eval {e:6.0f} s, analyses {a:5.0f} s (all policies, one seed)")
    for epochs in (1, 2, 3, 4, 5):
        pred = seeds * (epochs * total_epoch + total_fixed)
        print(f"{seeds} seeds x {epochs} epochs: {pred / 60:.0f} min")


if __name__ == "__main__":
    main()
