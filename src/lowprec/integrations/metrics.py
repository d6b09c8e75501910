"""What a lowprec policy adds to a training log, for the loggers people already use.

Lightning (:class:`~lowprec.integrations.lightning.LowprecPrecision`) logs these through the
LightningModule's ``log_dict`` after each optimizer step, so they reach every logger the
Trainer has (TensorBoard, CSV, MLflow, W&B) at its ``log_every_n_steps``; the Hugging Face
``LowprecTrainer`` adds them to each training log entry, so they reach every ``report_to``
integration and ``state.log_history``. The per-step trace stays in ``Precision.trace``.
"""

from __future__ import annotations

__all__ = ["PREFIX", "step_metrics"]

PREFIX = "lowprec/"


def step_metrics(precision) -> dict[str, float]:
    """The loss scale now, and the optimizer steps so far: all of them (taken or skipped),
    those skipped for Inf/NaN gradients, and those with Inf/NaN found (found but not skipped
    where the loss scale does not skip, e.g. pure fp32). Plain floats, as loggers want them."""
    return {f"{PREFIX}loss_scale": float(precision.loss_scale.scale),
            f"{PREFIX}steps": float(precision.steps),
            f"{PREFIX}skipped_steps": float(precision.skipped),
            f"{PREFIX}nonfinite_steps": float(precision.nonfinite)}
