"""A model trained briefly in fp32 on a data set, for the analyses that ask a question about a
trained network (``lowprec certify``, ``lowprec advise``)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .data import Dataset, load_checked_dataset
from .models import build_checked_model

__all__ = ["untrained", "train_fp32"]


def untrained(data: str, model: str, *, seed: int) -> tuple[nn.Module, Dataset]:
    """Load ``data`` and build ``model`` for it, its weights drawn from ``seed``. DatasetNotFound
    or ValueError for a bad data or model spec."""
    torch.manual_seed(seed)
    dataset = load_checked_dataset(data)
    return build_checked_model(model, dataset), dataset


def train_fp32(net: nn.Module, dataset: Dataset, *, epochs: int, lr: float, batch_size: int,
               seed: int, on_epoch: Callable[[int], None] | None = None) -> nn.Module:
    """Train ``net`` in place ``epochs`` epochs in fp32 (SGD, momentum 0.9, cross-entropy; the
    order of each epoch from (seed, epoch)); ``on_epoch(n)`` after the n-th (1-based)."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    n = len(dataset.x_train)
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(net(dataset.x_train[idx]),
                                        dataset.y_train[idx]).backward()
            opt.step()
        if on_epoch is not None:
            on_epoch(epoch + 1)
    return net
