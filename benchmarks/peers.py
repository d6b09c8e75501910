"""lowprec beside its peers: the cost of one training step and the bits of one cast, in one run.

Two questions, measured side by side in the same process (ratios, not absolute times):

1. **Layer-boundary rounding**, the arrangement QPyTorch's examples use: a quantizer after every
   leaf module (forward output in the format, its gradient rounded in backward) and the weights
   rounded after every optimizer step. The same model and batch under each peer's quantizer:
   torch's own casts (``x.half().float()`` in an autograd function), QPyTorch
   (``qtorch.quant.Quantizer`` + ``float_quantize`` / ``fixed_point_quantize``), pychop
   (``ChopSTE``: forward only, its backward is straight through) and lowprec
   (``lowprec.Quantizer`` + ``quantize_``). Then lowprec's op-level emulation
   (``Precision(policy)``: every op's output rounded, not only the layers'), which is what
   lowprec's results are computed with, and fp32. Ratios are step time / fp32 step time.
2. **torchao's emulated float8 training** (``convert_to_float8_training(..., emulate=True)``, the
   tensorwise recipe) beside lowprec's ``fp8-tensorwise`` policy, which gives the same bits
   (tests/training/test_scaled.py), on the MLP.

It also prints, for each peer's fp16 and bf16 cast, the fraction of elements equal to torch's
own cast (``x.half()``/``x.bfloat16()``) over a vector that covers normals, subnormals, ties and
overflow: speed means little if the bits differ.

    python benchmarks/peers.py [--rounds 3] [--batch 256] [--threads N]

QPyTorch compiles its C++ extension at first import (about a minute; cached afterwards).
"""

from __future__ import annotations

import argparse
import copy
import platform
import time

import torch
from torch import nn

import lowprec
from lowprec.experiments.models import build_model


# -- the peers' quantizers -------------------------------------------------------------------------
class _TorchCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).float()

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).float(), None


def torch_peer(fmt: str):
    """torch's own casts: fp16/bf16 only, nearest only."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(fmt)
    if dtype is None:
        return None
    return (lambda x: _TorchCast.apply(x, dtype)), (lambda p: p.copy_(p.to(dtype).float()))


def qtorch_peer(fmt: str):
    try:
        from qtorch import FixedPoint, FloatingPoint
        from qtorch.quant import Quantizer, fixed_point_quantize, float_quantize
    except Exception:  # noqa: BLE001 - not installed, or its extension did not build
        return None
    if fmt in ("fp16", "bf16"):
        exp, man = (5, 10) if fmt == "fp16" else (8, 7)
        num = FloatingPoint(exp=exp, man=man)
        q = Quantizer(forward_number=num, backward_number=num,
                      forward_rounding="nearest", backward_rounding="nearest")
        return q, (lambda p: p.copy_(float_quantize(p, exp, man, "nearest")))
    num = FixedPoint(wl=16, fl=10)  # q6.10, stochastic
    q = Quantizer(forward_number=num, backward_number=num,
                  forward_rounding="stochastic", backward_rounding="stochastic")
    return q, (lambda p: p.copy_(fixed_point_quantize(p, 16, 10, rounding="stochastic")))


def pychop_peer(fmt: str):
    try:
        import pychop
        from pychop import ChopSTE
    except Exception:  # noqa: BLE001
        return None
    if fmt not in ("fp16", "bf16"):
        return None  # its fixed-point STE takes other parameters; not compared
    pychop.backend("torch")
    exp, sig = (5, 10) if fmt == "fp16" else (8, 7)
    q = ChopSTE(exp_bits=exp, sig_bits=sig, rmode=1)
    return q, (lambda p: p.copy_(q(p)))


def lowprec_peer(fmt: str):
    spec, rounding = {"fp16": ("fp16", "nearest"), "bf16": ("bf16", "nearest"),
                      "q6.10-sr": ("q6.10", "stochastic")}[fmt]
    q = lowprec.Quantizer(forward=spec, backward=spec, rounding=rounding)
    return q, (lambda p: lowprec.quantize_(p, spec, rounding))


PEERS = {"torch cast": torch_peer, "qtorch": qtorch_peer, "pychop": pychop_peer,
         "lowprec.Quantizer": lowprec_peer}
POLICY = {"fp16": "p=fp16,c=fp16,g=fp16,b=emulated", "bf16": "p=bf16,c=bf16,g=bf16,b=emulated", "q6.10-sr": "q6.10-sr"}


# -- one step ---------------------------------------------------------------------------------------
def with_layer_quantizers(model: nn.Module, q) -> nn.Module:
    """A quantizer after every leaf module's output (QPyTorch's examples insert Quantizer
    modules between layers; a forward hook that returns a value does the same)."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(lambda mod, args, out: q(out) if torch.is_tensor(out) else out)
    return model


def step_fn(model, opt, x, y, *, prec=None, wq=None):
    def step():
        ctx = prec.autocast() if prec is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            loss = nn.functional.cross_entropy(model(x), y)
        if prec is not None:
            prec.backward(loss)
            prec.step(opt)
        else:
            loss.backward()
            opt.step()
            if wq is not None:
                with torch.no_grad():
                    for p in model.parameters():
                        wq(p)
        opt.zero_grad(set_to_none=True)
    return step


def best_time(fn, rounds: int, inner: int) -> float:
    fn()
    fn()  # warm-up: allocations, lazy initialisation, oneDNN primitive caches
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def layer_table(args) -> None:
    shapes = {"mlp": ((1, 28, 28), 10), "lenet5": ((1, 28, 28), 10), "transformer": ((1, 28, 28), 10)}
    print(f"\n## Layer-boundary rounding, batch {args.batch}: step time / fp32 step time")
    print("| model | format | " + " | ".join(PEERS) + " | lowprec op-level | fp32 s/step |")
    print("|---|---|" + "---|" * (len(PEERS) + 2))
    for name in args.models:
        shape, classes = shapes[name]
        torch.manual_seed(0)
        base = build_model(name, shape, classes)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, *shape, generator=g)
        y = torch.randint(0, classes, (args.batch,), generator=g)
        for fmt in args.formats:
            steps = {}
            m = copy.deepcopy(base)
            steps["fp32"] = step_fn(m, torch.optim.SGD(m.parameters(), lr=0.01), x, y)
            for peer, make in PEERS.items():
                made = make(fmt)
                if made is None:
                    continue
                q, wq = made
                m = with_layer_quantizers(base, q)
                steps[peer] = step_fn(m, torch.optim.SGD(m.parameters(), lr=0.01), x, y, wq=wq)
            prec = lowprec.Precision(POLICY[fmt])
            m = copy.deepcopy(base)
            m, opt = prec.setup(m, torch.optim.SGD(m.parameters(), lr=0.01))
            steps["op-level"] = step_fn(m, opt, x, y, prec=prec)
            # interleave the rounds so that a change of machine load hits every column alike
            times = {k: float("inf") for k in steps}
            for _ in range(args.rounds):
                for k, fn in steps.items():
                    times[k] = min(times[k], best_time(fn, 1, args.inner))
            ref = times["fp32"]
            cells = [f"{times[p] / ref:.2f}x" if p in times else "n/a" for p in PEERS]
            print(f"| {name} | {fmt} | " + " | ".join(cells)
                  + f" | {times['op-level'] / ref:.2f}x | {ref:.4f} |", flush=True)


def torchao_table(args) -> None:
    try:
        import dataclasses

        from torchao import float8
    except Exception as e:  # noqa: BLE001
        print(f"\n(torchao not importable: {e}; float8 row skipped)")
        return
    print(f"\n## Emulated fp8 training (tensorwise recipe), MLP, batch {args.batch}")
    torch.manual_seed(0)
    base = build_model("mlp", (1, 28, 28), 10)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    ref = copy.deepcopy(base)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("tensorwise"),
                                 emulate=True)
    float8.convert_to_float8_training(ref, config=config)
    prec = lowprec.Precision("fp8-tensorwise")
    ours = copy.deepcopy(base)
    ours, opt_ours = prec.setup(ours, torch.optim.SGD(ours.parameters(), lr=0.01))
    f32 = copy.deepcopy(base)
    steps = {"fp32": step_fn(f32, torch.optim.SGD(f32.parameters(), lr=0.01), x, y),
             "torchao emulate=True": step_fn(ref, torch.optim.SGD(ref.parameters(), lr=0.01), x, y),
             "lowprec fp8-tensorwise": step_fn(ours, opt_ours, x, y, prec=prec)}
    times = {k: float("inf") for k in steps}
    for _ in range(args.rounds):
        for k, fn in steps.items():
            times[k] = min(times[k], best_time(fn, 1, args.inner))
    print("| path | s/step | / fp32 | / torchao |")
    print("|---|---|---|---|")
    for k, t in times.items():
        print(f"| {k} | {t:.4f} | {t / times['fp32']:.2f}x | {t / times['torchao emulate=True']:.2f}x |")


def bits_table() -> None:
    """Fraction of elements each peer's cast gives as torch's own cast does."""
    torch.manual_seed(0)
    parts = [torch.randn(1 << 16) * 10 ** torch.empty(1 << 16).uniform_(-8, 6)]
    ulp16 = 2.0 ** -24
    k = torch.arange(1, 2048, dtype=torch.float32)
    parts += [k * ulp16, (k + 0.5) * ulp16, -(k + 0.5) * ulp16,          # fp16 subnormals, ties
              torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -1e6, 3.4e38])]  # fp16 overflow
    x = torch.cat(parts)
    print("\n## Bits: fraction of elements equal to torch's own cast "
          f"({x.numel()} values: normals over 14 decades, fp16 subnormals and their ties, overflow)")
    print("| peer | fp16 | bf16 |")
    print("|---|---|---|")
    ref = {"fp16": x.half().float(), "bf16": x.bfloat16().float()}
    for peer, make in PEERS.items():
        cells = []
        for fmt in ("fp16", "bf16"):
            made = make(fmt)
            if made is None:
                cells.append("n/a")
                continue
            q, _ = made
            with torch.no_grad():
                out = q(x.clone())
            same = (out == ref[fmt]) | (out.isnan() & ref[fmt].isnan())
            cells.append(f"{same.float().mean().item() * 100:.2f}%")
        print(f"| {peer} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner", type=int, default=3, help="steps per timed round")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--models", default="mlp,lenet5,transformer")
    ap.add_argument("--formats", default="fp16,bf16,q6.10-sr")
    ap.add_argument("--skip-torchao", action="store_true")
    args = ap.parse_args()
    args.models = args.models.split(",")
    args.formats = args.formats.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    print(f"# peers: {cpu}, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    bits_table()
    layer_table(args)
    if not args.skip_torchao:
        torchao_table(args)


if __name__ == "__main__":
    main()
