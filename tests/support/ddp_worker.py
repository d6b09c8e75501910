"""Run under torchrun: the same training loop for every policy with DistributedDataParallel.

Rank 0 plants an Inf in one gradient at step INJECT (after the all-reduce, so only rank 0
sees it); Precision.step all-reduces the found-Inf flag, so both ranks must skip that step.
Each rank writes its final parameters and loss-scale trace to OUT/rank{r}.pt.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lowprec import POLICIES, Precision
from lowprec.training.optim import SGD

INJECT = 3
STEPS = 6


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AvgPool2d(2), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(8 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 10))


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for name in POLICIES:
        model = small_cnn()
        prec = Precision(name, seed=0, loss_scale="dynamic:init=1024,interval=2")
        model, opt = prec.setup(model, SGD(model.parameters(), lr=0.05, momentum=0.9))
        ddp = DDP(model)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for step in range(STEPS):
            x, y = torch.randn(8, 1, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
            opt.zero_grad()
            with prec.autocast():
                loss = nn.functional.cross_entropy(ddp(x).float(), y)
            prec.backward(loss)
            if step == INJECT and rank == 0:
                with torch.no_grad():
                    last = [p for p in model.parameters() if p.grad is not None][-1]
                    last.grad.view(-1)[0] = float("inf")
            prec.step(opt)
        results[name] = {
            "params": [p.detach().float().clone() for p in model.parameters()],
            "trace": prec.trace,
            "scale": prec.loss_scale.scale,
            "backend": prec.backend,
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
