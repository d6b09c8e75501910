"""first_nonfinite reports an Inf/NaN only where fp32 has none at that op and a later op reads
it: not the stale memory of a stochastic-depth mask (timm's DropPath), not a log(0) that fp32
computes too and ``torch.where`` discards (T5's relative-position buckets), not a value
overwritten in place; a genuine fp16 overflow still, with its op and module."""

import pytest
import torch
from torch import nn

from lowprec.analysis import advise, first_nonfinite
from lowprec.experiments.data import Dataset

CE = nn.functional.cross_entropy


class DropPath(nn.Module):
    """timm's drop_path: a per-sample keep mask drawn into an uninitialised buffer."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop_path = DropPath(0.2)

    def forward(self, x):
        return x + self.drop_path(torch.relu(self.fc(x)))


def droppath_model():
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(16, 4))


class Buckets(nn.Module):
    """T5-style: log of relative distances, 0 on the diagonal (log 0 = -inf in fp32 too),
    selected away by torch.where; a learned bias per bucket, then an optional overflow."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.bias = nn.Embedding(8, 4)
        self.scale = scale

    def forward(self, x):
        n = x.shape[0]
        rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().float()
        large = torch.where(rel > 2, torch.log(rel / 2), torch.zeros_like(rel))
        bucket = torch.where(rel > 2, 3 + large.long(), rel.long()).clamp(max=7)
        h = self.fc(x) * self.scale  # scale 7e4: beyond fp16's 65504, finite in fp32
        return h + self.bias(bucket).mean(1)


class GatedLog(nn.Module):
    """log of activations with exact zeros (ReLU), kept only where positive: the gradient of
    the discarded log is 0 * (1 / 0) = NaN in fp32 as well."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.out(torch.where(h > 0, torch.log(h), torch.zeros_like(h)))


class Overwritten(nn.Module):
    """An fp16-only Inf (x * 1e5) that is overwritten in place, or discarded, before use."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.how = how

    def forward(self, x):
        big = x * 1e5  # |x| > 0.66 overflows fp16
        if self.how == "copy_":
            big.copy_(x)
        else:
            big = torch.where(x.abs() > 1e9, big, x)
        return self.fc(big)


def batch(seed: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_droppath_masks_are_not_reported_in_20_seeds():
    """Before: "8 Inf" at new_empty in 19 of 20 runs under 16-true."""
    reports = []
    for seed in range(20):
        torch.manual_seed(seed)
        reports.append(first_nonfinite(droppath_model(), batch(seed), CE, "16-true"))
    assert all(r.clean for r in reports), [str(r.forward) for r in reports if not r.clean]


@pytest.mark.parametrize("policy", ["bf16-true", "16-mixed"])
def test_droppath_is_clean_natively_and_mixed(policy):
    torch.manual_seed(0)
    assert first_nonfinite(droppath_model(), batch(), CE, policy).clean


@pytest.mark.parametrize("policy", ["16-true", "32-true", "bf16-true"])
def test_a_log_of_zero_that_where_discards_is_not_reported(policy):
    torch.manual_seed(0)
    rep = first_nonfinite(Buckets(), batch(), CE, policy)
    assert rep.clean, rep


@pytest.mark.parametrize("policy", ["16-true", "bf16-true"])
def test_a_nan_gradient_fp32_has_too_is_not_reported(policy):
    torch.manual_seed(0)
    model, (x, y) = GatedLog(), batch()
    ref = model.fc.weight
    # fp32 itself: the log's backward gives NaN at the discarded zeros
    h = torch.relu(model.fc(x)).detach().requires_grad_()
    torch.where(h > 0, torch.log(h), torch.zeros_like(h)).sum().backward()
    assert torch.isnan(h.grad).any() and ref is model.fc.weight
    rep = first_nonfinite(model, (x, y), CE, policy)
    assert rep.clean, rep


@pytest.mark.parametrize("how", ["copy_", "where"])
def test_an_fp16_inf_that_nobody_reads_is_not_reported(how):
    torch.manual_seed(0)
    x, y = batch()
    x = x * 3  # most |x| > 0.66: x * 1e5 overflows fp16
    assert torch.isinf((x * 1e5).half()).any()
    assert first_nonfinite(Overwritten(how), (x, y), CE, "16-true").clean


def test_a_genuine_overflow_is_still_reported_after_a_discarded_log():
    """The log's -inf comes first in execution order and is read by nobody; the linear layer's
    7e4 outputs overflow fp16 and reach the loss."""
    torch.manual_seed(0)
    model = Buckets()
    with torch.no_grad():
        model.fc.weight.fill_(3e4)  # |fc(x)| = 3e4 |sum(x)|: beyond 65504 on most rows
    rep = first_nonfinite(model, batch(), CE, "16-true")
    assert rep.forward is not None and (rep.forward.name, rep.forward.kind) == ("fc", "linear")
    assert rep.forward.input_range["inf"] == 0 and rep.forward.output_range["inf"] > 0
    assert first_nonfinite(model, batch(), CE, "32-true").clean
    # the same overflow through an activation scale (a mul in the model's own forward)
    rep = first_nonfinite(Buckets(scale=7e4), batch(), CE, "16-true")
    assert rep.forward is not None and rep.forward.name == "" and rep.forward.kind in (
        "mul", "__mul__"), rep
    assert "<model> (" in str(rep.forward)


def test_an_overflow_in_place_is_reported():
    """x += big: the in-place add's own input is its output, so "produced from finite inputs"
    never held for it; fp32's finite add is the comparison now."""

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(16, 16)

        def forward(self, x):
            h = self.l(x)
            h += 7e4
            return h.sum(1, keepdim=True) * torch.ones(1, 4)

    torch.manual_seed(0)
    rep = first_nonfinite(Res(), batch(), CE, "16-true")
    assert rep.forward is not None and rep.forward.kind in ("add_", "__iadd__"), rep


def _dataset(model, n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return Dataset("toy", x, y, x[:32], y[:32], 4)


def test_advise_does_not_call_droppath_or_buckets_unsafe():
    """Before: "pure fp16: unsafe" for both, from the new_empty buffer and the discarded log."""
    for model in (droppath_model(), Buckets()):
        torch.manual_seed(0)
        adv = advise(model, _dataset(model), "fp16", batches=1, batch_size=8, lr=1.0)
        assert adv.nonfinite.forward is None, adv.nonfinite
        assert not any("overflows" in r for r in adv.reasons), adv.reasons
        assert adv.verdict != "unsafe", adv.reasons
    hot = Buckets(scale=7e4)
    adv = advise(hot, _dataset(hot), "fp16", batches=1, batch_size=8)
    assert adv.verdict == "unsafe" and any("overflows" in r for r in adv.reasons)
