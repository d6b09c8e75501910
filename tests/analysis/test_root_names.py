"""Parameters the root module owns (a ViT's pos_embed, a bare nn.Linear's weight) are reported
under their own names, never torch's "" for the root ("layer  loses 93%" before)."""

import torch
from torch import nn

from lowprec.analysis import advise, lost_updates, range_profile
from lowprec.experiments.data import Dataset

CE = nn.functional.cross_entropy


class RootParams(nn.Module):
    """A learned position embedding held by the model itself, as timm's ViT holds pos_embed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos_embed = nn.Parameter(100 + torch.rand(6))  # bf16 spacing 0.5 there
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(x + self.pos_embed)


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return Dataset("toy", x, y, x[:32], y[:32], 4)


def test_lost_updates_and_ranges_name_root_parameters():
    data = _data()
    batch = (data.x_train, data.y_train)
    rows = lost_updates(RootParams(), batch, CE, "bf16", lr=0.1)
    assert [r.layer for r in rows] == ["pos_embed", "head"]
    assert rows[0].nearest == 1.0 and rows[1].nearest < 0.5
    prof = range_profile(RootParams(), batch, CE, "bf16")
    assert {s.layer for s in prof.role("weights")} == {"pos_embed", "head"}
    assert {s.layer for s in prof.role("weight_grads")} == {"pos_embed", "head"}
    assert all(s.layer for s in prof.stats)
    # a bare layer as the model: its parameters, one row each
    bare = lost_updates(nn.Linear(6, 4), batch, CE, "bf16", lr=0.1)
    assert [r.layer for r in bare] == ["weight", "bias"]
    lin = nn.Linear(6, 4)
    opt = torch.optim.Adam(lin.parameters())
    CE(lin(data.x_train), data.y_train).backward()
    opt.step()
    prof = range_profile(lin, batch, CE, "bf16", optimizer=opt)
    assert {s.layer for s in prof.role("optimizer_state")} == {"weight", "bias"}


def test_advise_names_the_root_parameter_that_loses_its_updates():
    adv = advise(RootParams(), _data(), "bf16", batches=1, batch_size=32, lr=0.1)
    lost = [r for r in adv.reasons if "loses" in r]
    assert lost and lost[0].startswith("layer pos_embed loses 100%"), adv.reasons
    assert "layer  " not in str(adv)
