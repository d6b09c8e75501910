"""Lightning precision plugins running a lowprec policy.

    import lightning as L
    from lowprec.integrations.lightning import LowprecPrecision

    trainer = L.Trainer(plugins=[LowprecPrecision("p=bf16:kahan")], max_epochs=2)
    trainer.fit(model, loader)

Lightning's own ``precision=`` takes only its names (``"16-true"``, ``"bf16-mixed"``...) and
refuses a lowprec spec or a plugin object there: a lowprec policy goes in ``plugins=``, or
through :class:`Trainer`, Lightning's Trainer whose ``precision=`` also takes any lowprec
policy name, compact spec, Policy, Precision or plugin
(``Trainer(precision="p=bf16:kahan", max_epochs=2)``).

``LowprecPrecision`` implements ``lightning.pytorch.plugins.precision.Precision``: the module is
converted in place (:meth:`lowprec.Precision.setup`), each optimizer that ``configure_optimizers``
returns is configured or wrapped (master weights, stochastic or Kahan write-back; schedulers keep
working, the wrapper shares their parameter groups), ``training_step`` runs inside the policy's
autocast, the loss is multiplied by the loss scale before ``backward``, the closure runs before
the step, gradients are unscaled before ``on_before_optimizer_step`` and clipping (as Lightning's
``MixedPrecision`` does), a step with Inf/NaN gradients is skipped and the scale backs off; the
Precision's state (loss scale, step counts, generator; constant size, the per-step trace stays
in ``plugin.lowprec.trace``) is saved in checkpoints. After each step the loss scale and the
step counts (optimizer steps taken or skipped, skipped, with Inf/NaN) go to the Trainer's own
loggers, when it has any, as
``lowprec/loss_scale``, ``lowprec/skipped_steps``... (:mod:`lowprec.integrations.metrics`;
``LowprecPrecision(..., log_metrics=False)`` turns it off). Checkpoints hold the weights as a native
run stores them: emulated 16-bit parameters as fp16/bf16 tensors, fp8 as float8
(:meth:`lowprec.Precision.checkpoint_state_dict`; a ``weights_only`` checkpoint, which Lightning
writes without the plugin's hook, keeps the float32 carriers), and 16-bit optimizer state in
its own dtype; loading copies them back into the float32 carriers bit for bit.
``LowprecFabricPrecision`` is the same for ``lightning.fabric.Fabric(plugins=[...])``.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

from ..training.optim import FormatOptimizer
from ..training.policy import Policy
from ..training.precision import Precision
from ..training.tree import cast_floating
from .metrics import step_metrics

__all__ = ["LowprecPrecision", "LowprecFabricPrecision", "Trainer"]

# Lightning's names for the model summary's size estimate; other policies count as 32 bits
_LIGHTNING_NAMES = ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed")


class _Common:
    """What both plugins share: a Precision, module conversion, contexts and state."""

    def _init(self, policy, loss_scale, seed, log_metrics: bool = True) -> None:
        self.lowprec = policy if isinstance(policy, Precision) else Precision(
            policy, loss_scale=loss_scale, seed=seed)
        self.lowprec_log_metrics = bool(log_metrics)
        name = str(self.lowprec.policy)
        self.precision = name if name in _LIGHTNING_NAMES else "32-true"

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.lowprec.model is None:
            self.lowprec.setup(module)
        elif self.lowprec.model is not module:
            raise RuntimeError("this LowprecPrecision is already set up on another model; "
                               "create one per Trainer")
        return module

    @contextmanager
    def forward_context(self):
        with self.lowprec.autocast():
            yield

    def convert_input(self, data):
        return self.lowprec.convert_input(data)

    def convert_output(self, data):
        # outputs handed back to the user as fp32, as Lightning's true-half plugins do
        return cast_floating(data, torch.get_default_dtype())

    def _scale(self, tensor: torch.Tensor) -> torch.Tensor:
        s = self.lowprec.loss_scale.scale
        return tensor if s == 1.0 else tensor.float() * s

    def main_params(self, optimizer):
        # the model's parameters, whose gradients are the ones to clip (not fp32 masters)
        if isinstance(optimizer, FormatOptimizer):
            return list(optimizer.model_params)
        return [p for g in optimizer.param_groups for p in g["params"]]

    def unscale_gradients(self, optimizer) -> None:
        self.lowprec.unscale_(optimizer)

    def state_dict(self) -> dict:
        return self.lowprec.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.lowprec.load_state_dict(state_dict)

    def __repr__(self) -> str:
        # Lightning prints plugins in its messages ("Received both `precision=16-mixed` and
        # `plugins=...`"): the policy, not an address
        return f"{type(self).__name__}({str(self.lowprec.policy)!r})"


class LowprecPrecision(_Common, TrainerPrecision):
    """A lowprec policy as a ``lightning.pytorch`` precision plugin (see the module docstring).
    ``policy``: a name, a spec, a :class:`Policy` or a :class:`lowprec.Precision`."""

    def __init__(self, policy: str | Policy | Precision = "32-true", *, loss_scale=None,
                 seed: int | None = None, log_metrics: bool = True) -> None:
        self._init(policy, loss_scale, seed, log_metrics)

    def connect(self, model, optimizers, lr_schedulers):
        if self.lowprec.model is None:
            self.lowprec.setup(model)
        optimizers = [self.lowprec.setup_optimizer(o) for o in optimizers]
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor, module):
        return super().pre_backward(self._scale(tensor), module)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("LBFGS re-evaluates its closure inside step(): it cannot take a "
                            "skipped or loss-scaled step; use another optimizer")
        closure_result = closure()
        # automatic optimization with a training_step that returned None: no backward ran
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return None
        self.lowprec.unscale_(optimizer)  # hooks and clipping see unscaled gradients
        self._after_closure(model, optimizer)
        self.lowprec.step(optimizer)
        self._log(model)
        return closure_result

    def _log(self, model) -> None:
        """The loss scale and step counts to the Trainer's loggers (``log_metrics=False``: not)."""
        log = getattr(model, "log_dict", None)
        trainer = getattr(model, "_trainer", None)
        if not self.lowprec_log_metrics or log is None or trainer is None or not trainer.loggers:
            return
        try:
            # batch_size given: a training_step(self, dataloader_iter) leaves Lightning none
            log(step_metrics(self.lowprec), on_step=True, on_epoch=False, prog_bar=False,
                logger=True, batch_size=1)
        except MisconfigurationException:
            # a manual step from a hook that may not log per step (on_train_epoch_end...)
            pass

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val,
                                       error_if_nonfinite=False)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The weights as a native run stores them (emulated fp16 as torch.float16...)."""
        if "state_dict" in checkpoint and self.lowprec.model is not None:
            checkpoint["state_dict"] = self.lowprec.checkpoint_state_dict(
                checkpoint["state_dict"])


class LowprecFabricPrecision(_Common, FabricPrecision):
    """A lowprec policy for ``lightning.fabric.Fabric(plugins=[...])``. Fabric gives a precision
    plugin no hook on optimizers: an optimizer the policy must wrap (master weights, stochastic
    or Kahan write-back) is wrapped at its first step, and its model gradients are cleared after
    each step (the user's ``zero_grad`` then reaches only the master copies)."""

    def __init__(self, policy: str | Policy | Precision = "32-true", *, loss_scale=None,
                 seed: int | None = None) -> None:
        self._init(policy, loss_scale, seed)
        self._ready: dict[int, object] = {}

    def pre_backward(self, tensor, module):
        return self._scale(tensor)

    def backward(self, tensor, model, *args, **kwargs) -> None:
        tensor.backward(*args, **kwargs)

    def _configured(self, optimizer):
        out = self._ready.get(id(optimizer))
        if out is None:
            out = self._ready[id(optimizer)] = self.lowprec.setup_optimizer(optimizer)
        return out

    def unscale_gradients(self, optimizer) -> None:
        self.lowprec.unscale_(self._configured(optimizer))

    def main_params(self, optimizer):
        # the wrapper holds the model's parameters; the user's object steps the masters
        return super().main_params(self._configured(optimizer))

    def optimizer_step(self, optimizer, **kwargs):
        opt = self._configured(optimizer)
        stepped = self.lowprec.step(opt)
        if isinstance(opt, FormatOptimizer) and opt.masters is not None:
            for p in opt.model_params:
                p.grad = None
        return stepped


# Lightning's legacy precision values, as its connector reads them
_LIGHTNING_ALIASES = {16: "16-mixed", "16": "16-mixed", 32: "32-true", "32": "32-true",
                      "bf16": "bf16-mixed"}


class Trainer(LightningTrainer):
    """``lightning.pytorch.Trainer`` whose ``precision=`` takes a lowprec policy: a name
    (Lightning's, ``"16-true"``, or lowprec's, ``"16-master"``), a compact spec
    (``"p=bf16:kahan"``), a :class:`Policy`, a :class:`lowprec.Precision` or a
    :class:`LowprecPrecision`; it runs as ``LowprecPrecision`` in ``plugins`` (after any
    plugins given). Every other argument is Lightning's."""

    def __init__(self, *args, precision: str | int | Policy | Precision | LowprecPrecision
                 = "32-true", plugins=None, **kwargs) -> None:
        if not isinstance(precision, LowprecPrecision):
            if isinstance(precision, bool) or not isinstance(precision,
                                                             (str, int, Policy, Precision)):
                raise TypeError(f"precision={precision!r:.60} must be a lowprec policy name or "
                                "spec, a Policy, a lowprec.Precision or a LowprecPrecision")
            precision = LowprecPrecision(_LIGHTNING_ALIASES.get(precision, precision))
        if plugins is None:
            plugins = []
        elif not isinstance(plugins, (list, tuple)):
            plugins = [plugins]
        super().__init__(*args, plugins=[*plugins, precision], **kwargs)
