"""Issue 36 item 15: a Llama under q6.10-sr has NaN gradients at step 1: RMSNorm's variance
(mean of squares of ~0.02 activations) rounds to 0 on the 2**-10 grid, rsqrt(0) = Inf
(saturated to 32 forward), and rsqrt's backward gives 0 * Inf = NaN. first_nonfinite and
advise name the norm and the values that underflowed; an override keeping the norm's
arithmetic in fp32 (its weights and gradients still on the q6.10 grid) makes step 1 finite."""

import copy

import pytest
import torch
from torch import nn

from lowprec import Precision
from lowprec.analysis import advise, first_nonfinite

transformers = pytest.importorskip("transformers")

ISLAND = {"*norm": "p=q6.10:stochastic,c=fp32,g=q6.10:sr,o=fp32"}


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _batch():
    ids = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids}, ids


def _loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))


def _step_finite(overrides) -> bool:
    """Step 1 of SGD under q6.10-sr: finite gradients, taken (not skipped), finite weights."""
    torch.manual_seed(0)
    prec = Precision("q6.10-sr", seed=0, overrides=overrides)
    model = _llama()
    model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch()
    prec.backward(_loss(model(**prec.convert_input(x)).logits, y))
    grads = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                if p.grad is not None)
    stepped = prec.step(opt)
    return grads and stepped and all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_first_nonfinite_names_the_rms_norm_and_its_zero_variance():
    torch.manual_seed(0)
    rep = first_nonfinite(_llama(), _batch(), _loss, "q6.10-sr")
    b = rep.backward
    assert b is not None and b.kind == "rsqrt" and b.name.endswith("norm"), rep
    assert b.output_range["nan"] > 0 and b.zero_forward_input, b
    assert "exactly 0" in str(b)


def test_the_fp32_norm_island_makes_step_1_finite():
    assert not _step_finite(None)
    assert _step_finite(ISLAND)
    torch.manual_seed(0)
    rep = first_nonfinite(_llama(), _batch(), _loss, "q6.10-sr", overrides=ISLAND)
    assert rep.clean, rep


def test_advise_names_the_norm_and_the_override():
    torch.manual_seed(0)
    x, y = _batch()
    adv = advise(_llama(), (x, y), "q6.10-sr", loss_fn=_loss, batches=1, batch_size=4,
                 output_fn=lambda o: o.logits)
    assert adv.format == "q6.10-sr" and adv.verdict == "unsafe", adv.reasons
    hint = [r for r in adv.reasons if "rsqrt" in r and "overrides=" in r]
    assert hint and "'*norm'" in hint[0], adv.reasons
