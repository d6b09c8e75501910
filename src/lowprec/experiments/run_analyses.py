"""The analyses of a finished run, stored for the report: the certificate, layer-wise errors,
the range profile and lost updates, in each format the run is certified in. A ``plan:FILE``
run is certified module by module, as the plan runs it (kind ``certificate:plan``), never in
a uniform format the plan does not run."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..analysis import fp32_twin, layer_errors, lost_updates, range_profile
from ..analysis.certify import certify
from ..numerics.formats import FP32, BinaryFormat, parse_format
from ..training.plan import Plan, is_plan_spec
from ..training.policy import parse_policy
from ..training.precision import Precision
from .checkpoints import policy_of
from .config import CompareConfig
from .data import Dataset
from .results import ResultsDB

__all__ = ["certificate_formats", "analyse_run", "PLAN_CERTIFICATE"]

#: the "format" a plan:FILE run is certified in: each module in the formats the plan gives it
PLAN_CERTIFICATE = "plan"


def certificate_formats(policy) -> list[str]:
    """The formats a trained run is certified in: its compute format, or fp16 and bf16 for a
    32-bit run (the paper's question: may this fp32 model run in 16 bits?); for a per-layer
    plan (``"plan:FILE"``, a Plan) :data:`PLAN_CERTIFICATE`, the plan module by module.
    ``policy``: a Policy, a policy spec or a plan."""
    if isinstance(policy, Plan) or is_plan_spec(policy):
        return [PLAN_CERTIFICATE]
    if isinstance(policy, str):
        policy = parse_policy(policy)
    if isinstance(policy.compute, BinaryFormat):
        return []  # a binarized network has no float twin to compare with
    if policy.compute == FP32 or policy.compute.dynamic:
        return ["fp16", "bf16"]
    return [str(policy.compute)]


def analyse_run(db: ResultsDB, run_id: str, model: nn.Module, prec: Precision, data: Dataset,
                x_train: torch.Tensor, y_train: torch.Tensor, cfg: CompareConfig) -> None:
    """Store the analyses of a trained run for the report: the certificate, layer-wise errors,
    the range profile and lost updates, in each format of :func:`certificate_formats`."""
    if is_plan_spec(policy_of(run_id)):  # from the run id: the worker's db has no rows
        # the plan as this run trained it: its base policy and per-module overrides
        plan = Plan(policy=prec.policy.spec, overrides=dict(prec.overrides))
        cert = certify(model, (data.x_test, data.y_test), plan)
        db.record_analysis(run_id, f"certificate:{PLAN_CERTIFICATE}", cert.to_payload())
        errs = layer_errors(model, data.x_test[:256], plan)
        db.record_analysis(run_id, f"layers:{PLAN_CERTIFICATE}",
                           {"layers": [asdict(e) for e in errs]})
        # the range profile and lost updates measure against one format's grid; a plan has
        # one per module, so they are not stored for it
        return
    ce = nn.functional.cross_entropy
    batch = (x_train[:256].clone(), y_train[:256].clone())
    for fmt in certificate_formats(prec.policy):
        cert = certify(model, (data.x_test, data.y_test), fmt)
        db.record_analysis(run_id, f"certificate:{fmt}", cert.to_payload())
        errs = layer_errors(model, data.x_test[:256], fmt)
        db.record_analysis(run_id, f"layers:{fmt}", {"layers": [asdict(e) for e in errs]})
        twin = fp32_twin(model)  # fp32 gradients, measured against the format
        prof = range_profile(twin, batch, ce, fmt)
        db.record_analysis(run_id, f"ranges:{fmt}", _compact_profile(prof))
        pfmt = prec.policy.params if prec.policy.params != FP32 else parse_format(fmt)
        lost = lost_updates(twin, batch, ce, pfmt, lr=cfg.lr,
                            optimizer="adam" if cfg.optimizer == "adam" else "sgd")
        db.record_analysis(run_id, f"lost:{fmt}", {"format": str(pfmt), "lr": cfg.lr,
                                                   "layers": [asdict(r) for r in lost]})


def _compact_profile(prof) -> dict:
    """Per role: the histogram summed over layers and the weighted fractions."""
    out = {"format": prof.format, "roles": {}, "recommended_scale": prof.gradient_scale()}
    for role in ("weights", "activations", "activation_grads", "weight_grads"):
        rows = prof.role(role)
        if not rows:
            continue
        hist = None
        for r in rows:
            if r.hist:
                hist = r.hist if hist is None else [a + b for a, b in zip(hist, r.hist)]
        out["roles"][role] = {k: prof.fraction(role, k) for k in ("overflow", "flush",
                                                                  "subnormal")}
        out["roles"][role]["hist"] = hist or []
    return out
