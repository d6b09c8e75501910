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


class Recorder(transformers.TrainerCallback):
    """What the Trainer hands its loggers (TensorBoard, MLflow...: every report_to callback
    gets the same ``logs``)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


@pytest.mark.parametrize("on", [True, False])
def test_loss_scale_and_skipped_steps_reach_the_trainers_loggers(tmp_path, on):
    """Each training log entry carries the scale the next step will use and the running step
    counts, the Precision trace's numbers at that step; none with log_metrics=False."""
    rec = Recorder()
    trainer, _, _ = train("16-master", tmp_path, loss_scale="dynamic:init=1073741824",
                          callbacks=[rec], log_metrics=on)
    trace = trainer.lowprec.trace
    entries = [(step, logs) for step, logs in rec.logs if "loss" in logs]
    assert len(entries) == 5  # 20 steps, logging_steps=4
    for step, logs in entries:
        if not on:
            assert not any(k.startswith("lowprec/") for k in logs)
            continue
        scale = trace[step]["scale"] if step < len(trace) else trainer.lowprec.loss_scale.scale
        assert logs["lowprec/loss_scale"] == scale
        assert logs["lowprec/skipped_steps"] == sum(e["skipped"] for e in trace[:step])
        assert logs["lowprec/steps"] == step
    if on:
        assert entries[0][1]["lowprec/skipped_steps"] >= 1
    # the Trainer's own log_metrics (example scripts call it) is still a method
    trainer.log_metrics("train", {"loss": 1.0})


def test_fp16_training_arguments_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True,
                                          report_to=[])
    with pytest.raises(ValueError, match="policy="):
        LowprecTrainer(policy="bf16-true", model=tiny_bert(), args=args, train_dataset=Toy())


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=16, num_train_epochs=1,
                learning_rate=5e-3, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, max_grad_norm=1.0, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


def test_saved_model_is_fp16_like_a_native_runs(tmp_path):
    """save_model under emulated 16-true writes what native fp16 parameters write: fp16
    safetensors half the fp32 size, config.json naming float16; from_pretrained gives fp16
    tensors holding the trained values. Measured here (tiny BERT): fp32 94,560 B, native
    (b=native) 49,428 B, emulated 16-true 49,428 B (was 94,560 B)."""
    sizes, models = {}, {}
    for name, policy in (("fp32", "32-true"), ("native", "p=fp16,c=fp16,g=fp16,o=fp16,b=native"),
                         ("emulated", "16-true")):
        model = tiny_bert()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = LowprecTrainer(policy=policy, model=model, args=_args(tmp_path / name),
                                     train_dataset=Toy())
            trainer.train()
            trainer.save_model(str(tmp_path / name / "final"))
        sizes[name] = (tmp_path / name / "final" / "model.safetensors").stat().st_size
        models[name] = model
    assert sizes["emulated"] == sizes["native"] and sizes["emulated"] < 0.55 * sizes["fp32"]
    config = (tmp_path / "emulated" / "final" / "config.json").read_text()
    assert '"dtype": "float16"' in config
    assert models["emulated"].config.dtype != "float16"  # the live model's config untouched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.BertForSequenceClassification.from_pretrained(
            str(tmp_path / "emulated" / "final"))
    trained = dict(models["emulated"].named_parameters())
    for name, p in back.named_parameters():
        assert p.dtype == torch.float16 and torch.equal(p.float(), trained[name]), name


def test_resumes_from_a_16_bit_checkpoint_bit_for_bit(tmp_path):
    """checkpoint-4 holds fp16 weights and fp16 AdamW state; a trainer resumed from it ends
    where the uninterrupted run ends, every bit; scaler.pt does not grow with the steps."""
    kw = dict(num_train_epochs=2, save_strategy="steps", save_steps=4)
    runs = {}
    for name in ("straight", "resumed"):
        model = tiny_bert()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = LowprecTrainer(policy="16-true", model=model,
                                     args=_args(tmp_path / name, **kw), train_dataset=Toy(),
                                     loss_scale="dynamic:init=1024;interval=2")
            trainer.train(resume_from_checkpoint=None if name == "straight"
                          else str(tmp_path / "straight" / "checkpoint-4"))
        runs[name] = (model, trainer)
    ck = tmp_path / "straight" / "checkpoint-4"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(ck / "model.safetensors")).values()} == {
        torch.float16}
    opt_state = torch.load(ck / "optimizer.pt", weights_only=True)["state"]
    assert {v.dtype for s in opt_state.values() for k, v in s.items() if k != "step"} == {
        torch.float16}
    scaler = torch.load(ck / "scaler.pt", weights_only=True)
    assert "trace" not in scaler["lowprec"]
    assert (ck / "scaler.pt").stat().st_size == (
        tmp_path / "straight" / "checkpoint-8" / "scaler.pt").stat().st_size
    (a, ta), (b, tb) = runs["straight"], runs["resumed"]
    assert tb.lowprec.steps == ta.lowprec.steps == 8
    assert tb.lowprec.loss_scale.scale == ta.lowprec.loss_scale.scale
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
