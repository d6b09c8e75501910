"""first_nonfinite reports where Inf/NaN is produced, not a -inf a model writes on purpose."""

import torch
from torch import nn

from lowprec.analysis import first_nonfinite


class Masked(nn.Module):
    """Attention-style scores with a -inf padding mask, then an optional overflow."""

    def __init__(self, blow_up: bool) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.blow_up = blow_up

    def forward(self, x):
        scores = self.l(x)
        mask = torch.zeros_like(scores).masked_fill(torch.arange(4) == 3, float("-inf"))
        p = torch.softmax(scores + mask, dim=-1)
        if self.blow_up:
            p = p * 1e5 * x.abs().sum() * 1e4  # beyond fp16's 65504, from finite inputs
        return p


def _batch():
    torch.manual_seed(0)
    return torch.randn(8, 4) + 3, torch.randint(0, 4, (8,))


def _loss(out, y):
    return out.sum()


def test_an_intentional_minus_inf_mask_is_not_an_overflow():
    for policy in ("32-true", "bf16-true", "16-true"):
        assert first_nonfinite(Masked(False), _batch(), _loss, policy).clean, policy


def test_an_overflow_after_the_mask_is_still_found():
    rep = first_nonfinite(Masked(True), _batch(), _loss, "16-true")
    assert not rep.clean
    assert rep.forward is not None and rep.forward.kind in ("mul", "__mul__"), rep
