"""First compiled training step: compiled emulation against compiled fp32, cold caches.

For each model and policy, one fresh process (its own empty Inductor cache, so nothing a
previous measurement compiled is reused) builds the model, runs one training step (forward,
backward, SGD step) and reports the step's wall time, compilation (and lowprec's set-up, a few
milliseconds) included; fp32 is
``torch.compile(model)``, a policy is ``Precision(policy, compile=True)`` on the emulated
backend. Printed: each time and its ratio to compiled fp32's first step of the same model, and
whether the emulated model compiled (or ran eagerly, and why).

    python benchmarks/compile_time.py [--models bert,vit,encoder,resnet,transformer,bncnn]
        [--policies 16-true,bf16-true,16-mixed,q6.10-sr] [--timeout 900]

Models: the zoo's (tests/zoo: bert, vit, encoder, resnet with batch norm and in-place ReLU, ...)
and the compiled-emulation tests' (tests/training/test_compiled_emulation.py: transformer,
bncnn, lenet, mlp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO_NAMES = ("bert", "gpt2", "vit", "resnet", "encoder", "dict-input", "kw-dict-output",
             "tied-lm")


def _child(model: str, policy: str) -> None:
    """One first step in this process; prints one JSON line."""
    import warnings

    import torch
    from torch.nn import functional as F

    sys.path[:0] = [str(ROOT / "tests" / "zoo"), str(ROOT / "tests"),
                    str(ROOT / "tests" / "training")]
    from test_compiled_emulation import MODELS, _batch, _emu

    from lowprec import Precision
    from lowprec.training.tree import call_model, output_tensor

    torch.manual_seed(0)
    if model in ZOO_NAMES:
        from zoo import ZOO

        entry = ZOO[model]
        net, (inputs, targets), loss_fn = entry.build(), entry.batch(), entry.loss
    else:
        build, shape = MODELS[model]
        net, (x, targets) = build(), _batch(shape)
        inputs, loss_fn = x, F.cross_entropy
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    if policy == "fp32":
        fwd = torch.compile(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        loss = loss_fn(output_tensor(call_model(fwd, inputs)), targets)
        loss.backward()
        opt.step()
        reason = None
    else:
        prec = Precision(_emu(policy), compile=True)
        fwd, opt = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
        with prec.autocast():
            loss = loss_fn(output_tensor(call_model(fwd, inputs)), targets)
        prec.backward(loss)
        prec.step(opt)
        reason = getattr(fwd.forward, "reason", "not compiled")
    took = time.perf_counter() - t0
    print(json.dumps({"seconds": took, "reason": reason}))


def _measure(model: str, policy: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="lowprec-compile-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"),
                                                          os.environ.get("PYTHONPATH")) if p))
        try:
            done = subprocess.run([sys.executable, __file__, "--child", model, policy],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"seconds": None, "reason": f"not done in {timeout:.0f} s"}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            return {"seconds": None, "reason": f"failed: {tail[:100]}"}
        return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,vit,encoder,resnet,transformer,bncnn")
    ap.add_argument("--policies", default="16-true,bf16-true,16-mixed,q6.10-sr")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(*a.child)
        return
    import torch

    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"each first step in a fresh process with an empty Inductor cache")
    print("| model | compiled fp32 s | policy | compiled emulation s | / fp32 | compiled? |")
    print("|---|---|---|---|---|---|")
    for model in a.models.split(","):
        base = _measure(model, "fp32", a.timeout)
        for policy in a.policies.split(","):
            r = _measure(model, policy, a.timeout)
            ratio = (f"{r['seconds'] / base['seconds']:.1f}x"
                     if r["seconds"] and base["seconds"] else "-")
            how = "yes" if r["reason"] is None else f"eager: {r['reason']}"
            b = f"{base['seconds']:.1f}" if base["seconds"] else base["reason"]
            s = f"{r['seconds']:.1f}" if r["seconds"] else "-"
            print(f"| {model} | {b} | {policy} | {s} | {ratio} | {how} |", flush=True)


if __name__ == "__main__":
    main()
