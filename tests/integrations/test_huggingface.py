"""LowprecTrainer: the Hugging Face Trainer under a policy, on a tiny random-init BERT built
from its config (nothing downloaded). The loss falls, the weights lie on the policy's grid, a
dynamic loss scale backs off through accelerate's scaler hook, and clipping sees unscaled
gradients."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lowprec import quantize  # noqa: E402
from lowprec.integrations.huggingface import LowprecTrainer  # noqa: E402
from lowprec.training.optim import AdamW  # noqa: E402


class Toy(torch.utils.data.Dataset):
    """The label says whether the first token id is above half the vocabulary."""

    def __init__(self, n=64, length=12, vocab=100):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, length), generator=g)
        self.labels = (self.ids[:, 0] > vocab // 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def train(policy, tmp_path, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, num_train_epochs=5,
        learning_rate=5e-3, logging_steps=4, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, max_grad_norm=1.0, seed=0)
    model = tiny_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = LowprecTrainer(policy=policy, model=model, args=args, train_dataset=Toy(),
                                 **kw)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, model, losses


@pytest.mark.parametrize("policy,grid", [("16-true", "fp16"), ("bf16-true", "bf16"),
                                         ("p=bf16:stochastic", "bf16")])
def test_tiny_bert_fine_tunes_under_policy(policy, grid, tmp_path):
    trainer, model, losses = train(policy, tmp_path)
    assert len(losses) == 5 and all(map(lambda v: v == v, losses))
    assert losses[-1] < 0.7 * losses[0], losses
    for name, p in model.named_parameters():
        assert torch.equal(p.float(), quantize(p.float(), grid)), name
    assert trainer.lowprec.steps == 20
    inner = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    if policy == "16-true":  # 16-bit state: lowprec's AdamW, not torch's (eps underflows)
        assert isinstance(inner, AdamW)


def test_dynamic_loss_scale_goes_through_accelerate(tmp_path):
    # 2**30 overflows fp16 gradients: the first steps are skipped and the scale halves
    trainer, model, losses = train("16-master", tmp_path, loss_scale="dynamic:init=1073741824")
    prec = trainer.lowprec
    assert prec.skipped >= 1 and prec.loss_scale.scale <= 2.0**30 / 2**prec.skipped
    assert prec.trace[0]["skipped"] and prec.trace[0]["scale"] == 2.0**30
    assert trainer.optimizer.step_was_skipped is False  # accelerate saw the last step taken
    assert prec.steps == 20 and losses[-1] < losses[0]
    for p in model.parameters():
        assert torch.equal(p, quantize(p, "fp16"))


def test_fp16_training_arguments_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True,
                                          report_to=[])
    with pytest.raises(ValueError, match="policy="):
        LowprecTrainer(policy="bf16-true", model=tiny_bert(), args=args, train_dataset=Toy())
