"""Models that ship for the planning evidence: small, and each failing a uniform 16-bit policy
for one stated reason (``lowprec plan --model lowprec.experiments.demo_models:raw_input_mlp``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["RawInputMLP", "raw_input_mlp"]


class RawInputMLP(nn.Module):
    """An MLP whose first layer sees inputs at the scale of raw sensor counts: its weights
    start at ``gain / sqrt(d)`` (``gain`` = 2**15 folds a count scale into the layer), so its
    pre-activations have a standard deviation near ``gain`` and a few percent of them lie
    beyond fp16's largest value, 65504; a LayerNorm right after brings them back to O(1), and
    the rest is an ordinary MLP (``width`` features in, ``hidden`` wide). Pure fp16 overflows in ``inp`` (and in ``norm``, whose input
    that is); bf16's range holds it; every other layer trains in fp16."""

    def __init__(self, input_shape, num_classes, hidden: int = 256, width: int = 64,
                 gain: float = 2.0 ** 15):
        super().__init__()
        d = math.prod(input_shape)
        self.flat = nn.Flatten()
        self.inp = nn.Linear(d, width)
        with torch.no_grad():
            self.inp.weight.normal_(0.0, gain / math.sqrt(d))
        self.norm = nn.LayerNorm(width)
        self.act = nn.ReLU()
        self.fc = nn.Linear(width, hidden)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        h = self.act(self.norm(self.inp(self.flat(x))))
        return self.head(self.act2(self.fc(h)))


def raw_input_mlp(input_shape, num_classes) -> nn.Module:
    """:class:`RawInputMLP` (the ``module:function`` form ``--model`` takes)."""
    return RawInputMLP(input_shape, num_classes)
