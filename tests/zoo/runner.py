"""The documented training loop on a zoo entry, and the policies and optimizers of the matrix."""

from __future__ import annotations

import time

import torch

import lowprec
from lowprec import Precision
from lowprec.training.tree import call_model, output_tensor

# every named policy, and the extra specs
EXTRA = ["p=bf16:kahan", "p=bf16:stochastic", "p=fp32,c=e4m3fn,g=e5m2:sr,s=matmul", "q6.10-sr"]
POLICIES = list(lowprec.POLICIES) + EXTRA

OPTIMIZERS = {
    "lowprec-adam": lambda ps, lr: lowprec.optim.Adam(ps, lr=lr),
    "lowprec-sgd": lambda ps, lr: lowprec.optim.SGD(ps, lr=10 * lr, momentum=0.9),
    "torch-sgd": lambda ps, lr: torch.optim.SGD(ps, lr=10 * lr, momentum=0.9),
    "torch-adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr),
    "torch-adamw": lambda ps, lr: torch.optim.AdamW(ps, lr=lr),
    "torch-adamw-foreach": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, foreach=True),
    "torch-adamw-fused": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, fused=True),
}


def recipe(policy: str) -> tuple[str, float]:
    """The optimizer and learning-rate multiplier each regime's paper trains with: fixed point
    (Gupta et al. 2015) and dynamic fixed point (Courbariaux et al. 2014) use SGD with momentum
    -- Adam's second moment stored in a 10- or 12-bit fixed-point format flushes to zero, and
    its first step then multiplied the loss of the BERT entry by 7 (measured: 1.10 -> 7.3);
    BinaryNet (Courbariaux, Hubara et al. 2016) uses Adam at a large rate (latent weights live in
    [-1, 1]: at 1e-2 a stochastic binary ViT does not move in 20 steps, at 1e-1 it does)."""
    pol = lowprec.parse_policy(policy)
    name = type(pol.compute).__name__
    if name in ("FixedFormat", "DynamicFixedFormat"):
        return "lowprec-sgd", 1.0
    if name == "BinaryFormat":
        return "lowprec-adam", 10.0
    return "lowprec-adam", 1.0


def falls(losses: list[float]) -> bool:
    """Finite, and the mean of the last five losses below the mean of the first five (the
    stochastic regimes make single losses noisy)."""
    finite = all(v == v and abs(v) != float("inf") for v in losses)
    return finite and sum(losses[-5:]) < sum(losses[:5])


def train(entry, policy: str, optimizer: str | None = None, steps: int = 20, *,
          scheduler=None, seed: int = 0) -> dict:
    """The README's loop, ``steps`` times on the entry's fixed batch; returns the losses and
    the mean step time (seconds)."""
    default, mult = recipe(policy)
    model = entry.build()
    inputs, targets = entry.batch()
    opt = OPTIMIZERS[optimizer or default](model.parameters(), entry.lr * mult)
    prec = Precision(policy, seed=seed)
    model, opt = prec.setup(model, opt)
    sched = scheduler(opt) if scheduler is not None else None
    model.train()
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        with prec.autocast():
            out = call_model(model, prec.convert_input(inputs))
            loss = entry.loss(output_tensor(out), targets)
        prec.backward(loss)
        prec.step(opt)
        if sched is not None:
            sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"losses": losses, "step_s": sum(times[2:]) / max(1, len(times) - 2),
            "prec": prec, "model": model, "opt": opt}
