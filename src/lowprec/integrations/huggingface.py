"""The Hugging Face ``Trainer`` under a lowprec policy: two changed lines in a script.

    from lowprec.integrations.huggingface import LowprecTrainer    # was: from transformers import Trainer

    trainer = LowprecTrainer(policy="p=bf16:stochastic", model=model, args=args,
                             train_dataset=train)                  # was: Trainer(model=..., ...)
    trainer.train()

The model is converted in place when the trainer is built (:meth:`lowprec.Precision.setup`);
the optimizer the Trainer creates (or the one given in ``optimizers=``) is configured or wrapped
(master weights, stochastic or Kahan write-back), and the scheduler keeps driving its rate (the
wrapper shares its parameter groups); the default torch AdamW becomes
:class:`lowprec.optim.AdamW` when the policy keeps 16-bit optimizer state. Loss scaling, the Inf/NaN check and the skipped steps go
through accelerate's own scaler hook: the accelerator's ``scaler`` is a
:class:`lowprec.integrations.GradScaler`, so ``accelerator.backward`` scales the loss and the
accelerated optimizer's ``step`` unscales, checks, steps and updates the scale. Gradient clipping
(``max_grad_norm``) sees unscaled gradients. Leave ``fp16``/``bf16`` in ``TrainingArguments``
off: the policy says what runs in which format.

Saved models and checkpoints look like a native run's: emulated 16-bit weights are written as
fp16/bf16 tensors (fp8 as float8; :meth:`lowprec.Precision.checkpoint_state_dict`) and
config.json names that dtype, so ``from_pretrained`` gives 16-bit tensors; resuming copies them
back into the float32 carriers bit for bit. ``scaler.pt`` holds the loss scale and the
Precision's constant-size state (the per-step trace stays in ``trainer.lowprec.trace``). Each
training log entry also carries the loss scale and the step counts (``lowprec/loss_scale``,
``lowprec/skipped_steps``...; :mod:`lowprec.integrations.metrics`), so TensorBoard, MLflow or any
``report_to`` logger shows them live; ``LowprecTrainer(..., log_metrics=False)`` turns it off.
"""

from __future__ import annotations

import os

import torch
from accelerate.optimizer import AcceleratedOptimizer
from transformers import Trainer

from ..numerics.formats import FP32
from ..training.optim import AdamW
from ..training.policy import Policy
from ..training.precision import Precision
from .gradscaler import GradScaler
from .metrics import step_metrics

__all__ = ["LowprecTrainer"]


class LowprecTrainer(Trainer):
    """``transformers.Trainer`` with a ``policy=`` keyword (a name, a spec, a :class:`Policy`
    or a :class:`lowprec.Precision`); every other argument is the Trainer's."""

    def __init__(self, *args, policy: str | Policy | Precision = "32-true", loss_scale=None,
                 seed: int | None = None, log_metrics: bool = True, **kwargs) -> None:
        self.lowprec = policy if isinstance(policy, Precision) else Precision(
            policy, loss_scale=loss_scale, seed=seed)
        # not self.log_metrics: that is the Trainer's own method (log_metrics(split, metrics))
        self.lowprec_log_metrics = bool(log_metrics)
        model = kwargs.get("model", args[0] if args else None)
        if model is None:
            raise ValueError("LowprecTrainer needs a model (model_init is not supported: the "
                             "policy converts one model in place)")
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None and (getattr(targs, "fp16", False) or getattr(targs, "bf16", False)):
            raise ValueError("TrainingArguments(fp16=True/bf16=True) runs torch.autocast and "
                             "torch's GradScaler on top of the policy; leave them off and name "
                             "the precision in policy=")
        self.lowprec.setup(model)
        super().__init__(*args, **kwargs)
        self.lowprec_scaler = GradScaler(self.lowprec)
        # accelerate routes backward (scale), clipping (unscale_) and the optimizer's step
        # (step, update) through the accelerator's scaler when it has one
        self.accelerator.scaler = self.lowprec_scaler

    def get_optimizer_cls_and_kwargs(self, args, model=None):
        """The Trainer's choice, except that its default torch AdamW (``optim="adamw_torch"``)
        becomes :class:`lowprec.optim.AdamW` when the policy keeps 16-bit optimizer state: torch's
        computes sqrt(v) + eps in the state's dtype, where eps = 1e-8 rounds to 0 in fp16."""
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if cls is torch.optim.AdamW and self.lowprec.policy.optimizer_state != FP32:
            kwargs = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps",
                                                             "weight_decay")}
            cls = AdamW
        return cls, kwargs

    def create_optimizer(self, model=None):
        self.optimizer = self.lowprec.setup_optimizer(super().create_optimizer(model))
        return self.optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (``save_model`` and every checkpoint) with the weights as a
        native run stores them, and config.json's dtype theirs."""
        if state_dict is None:
            state_dict = self.model.state_dict()
        state_dict = self.lowprec.checkpoint_state_dict(state_dict)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        first = next((n for n, p in model.named_parameters() if p.is_floating_point()), None)
        saved = state_dict.get(first) if first is not None else None
        saved = saved.dtype if torch.is_tensor(saved) else None  # save_pretrained empties it
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        config = getattr(model, "config", None)
        if (not self.args.should_save or config is None or saved is None
                or not os.path.isfile(os.path.join(output_dir, "config.json"))
                or saved == getattr(model, "dtype", saved)):
            return
        # save_pretrained wrote the dtype of the model's first parameter (float32 carriers):
        # name the dtype its weights were saved in, as a native run's config does
        before = config.dtype
        config.dtype = str(saved).split(".")[1]
        try:
            config.save_pretrained(output_dir)
        finally:
            config.dtype = before

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The Trainer's log, with the loss scale and step counts added to each training entry
        (not to evaluation or prediction metrics), so every ``report_to`` logger gets them."""
        if self.lowprec_log_metrics and self.lowprec.steps and not any(
                k.startswith(("eval_", "test_", "predict_")) for k in logs):
            logs = {**logs, **step_metrics(self.lowprec)}
        super().log(logs, *args, **kwargs)

    def autocast_smart_context_manager(self, cache_enabled=True):
        return self.lowprec.autocast()

    def _clip_grad_norm(self, model):
        opt = self.optimizer
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        self.lowprec_scaler.unscale_(opt)
        return super()._clip_grad_norm(model)
