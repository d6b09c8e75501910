"""Issue 36 item 13: T5's ``log(0)`` (relative-position buckets: the log flows through a
division and a product into ``.long()``, and ``torch.where`` discards it) is not the first
non-finite op under 32-true, where training is finite; a value that does reach the loss still
is. ``advise`` takes an (inputs, targets) pair, keyword inputs included."""

import pytest
import torch
from torch import nn

from lowprec.analysis import advise, first_nonfinite

transformers = pytest.importorskip("transformers")


def _t5():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                num_decoder_layers=1, num_heads=4, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def _batch():
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "decoder_input_ids": ids[:, :5]}, ids[:, :5]


def _loss(out, y):
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("policy", ["32-true", "16-true"])
def test_t5_log_of_zero_is_not_reported(policy):
    """Before: 32-true named encoder.block.0.layer.0.SelfAttention (log), 8 Inf."""
    rep = first_nonfinite(_t5(), _batch(), _loss, policy)
    assert rep.forward is None, rep.forward


class Chained(nn.Module):
    """log(0) flowing through two ops into the output (not discarded): fp32's own -inf, which
    32-true (nothing to compare with) reports at the log; and a copy that .long() ends."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.keep = keep

    def forward(self, x):
        z = torch.log(torch.relu(self.fc(x)) * 0) / 2 * 3  # -inf everywhere
        if self.keep:
            return self.fc(x) + z.clamp(min=-1e30) + z
        return self.fc(x) + z.long().clamp(min=0).float()


def test_a_log_of_zero_that_reaches_the_loss_is_still_reported_under_32_true():
    x, y = torch.randn(8, 4), torch.randint(0, 4, (8,))
    rep = first_nonfinite(Chained(True), (x, y), nn.functional.cross_entropy, "32-true")
    assert rep.forward is not None and rep.forward.kind == "log", rep.forward
    rep = first_nonfinite(Chained(False), (x, y), nn.functional.cross_entropy, "32-true")
    assert rep.forward is None, rep.forward


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids, *, scale):
        return self.fc(self.emb(ids).mean(1) * scale)


def test_advise_takes_an_inputs_targets_pair_with_keyword_inputs():
    """Before: AttributeError 'tuple' object has no attribute 'x_train'."""
    g = torch.Generator().manual_seed(0)
    x = {"ids": torch.randint(0, 20, (16, 5), generator=g), "scale": torch.ones(16, 1)}
    y = torch.randint(0, 3, (16,), generator=g)
    torch.manual_seed(0)
    adv = advise(Keyword(), (x, y), "fp16", batches=1, batch_size=8)
    assert adv.verdict in ("safe", "needs care", "unsafe") and adv.certificate.summary()["n"] == 16
    with pytest.raises(ValueError, match="pair"):
        advise(Keyword(), (x, y, y), "fp16")
    with pytest.raises(TypeError, match="Dataset"):
        advise(Keyword(), x, "fp16")
