"""Helpers shared by the analyses: clean fp32 twins of a model and low-precision copies."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping

import torch
from torch import nn

from ..numerics.formats import Format, parse_format
from ..numerics.rounding import Rounding, RoundingSpec
from ..training.plan import Plan, is_plan_spec, load_plan
from ..training.policy import Backend, Policy, parse_policy
from ..training.precision import Precision
from ..training.tree import batch_size_of, call_model, output_tensor, slice_batch
from ..training.emulation.compiled import CompiledForward

__all__ = ["fp32_twin", "low_precision_copy", "as_batches", "tensor_range", "run_model",
           "parameter_groups", "scaled_policy", "plan_of"]


def static_format(fmt: str | Format, what: str, hint: str = "") -> Format:
    """``fmt`` parsed, if it has a static grid; ValueError for dynamic fixed point, whose
    range (so its largest value, smallest step and eps) is chosen per tensor group while
    training: ``what`` (loss-scale search, range profile, lost updates) has no grid to measure
    against. ``certify`` runs such a format through Precision and accepts it."""
    fmt = parse_format(fmt)
    if fmt.dynamic:
        raise ValueError(f"{what} needs a format with a static grid; {fmt} is dynamic fixed "
                         "point, whose range (and so its largest value and smallest step) is "
                         "chosen per tensor group during training: " + (hint or (
                             f"analyse a static format of the same width (fixed<{fmt.bits},F>), "
                             f"or certify {fmt} (certify accepts it)")))
    return fmt


def scaled_policy(spec) -> Policy | None:
    """The policy ``spec`` names when it is one with scaled GEMMs (a recipe such as
    ``"fp8-tensorwise"``, ``"p=fp32,sc=mxfp4"``, or such a Policy), else None (``spec`` is then
    a format, read by the analysis as before). Analyses given such a policy study the recipe:
    a copy set up under it (certificate, layer errors, first non-finite), the cast GEMM
    operands (ranges, loss scale), the parameter format (lost updates)."""
    if isinstance(spec, Policy):
        return spec if spec.scaled is not None else None
    if not isinstance(spec, str):
        return None
    try:
        parse_format(spec)
        return None  # a format (``mxfp4`` is the OCP format, as ever)
    except (ValueError, TypeError):
        pass
    try:
        pol = parse_policy(spec)
    except (ValueError, TypeError):
        return None
    return pol if pol.scaled is not None else None


def plan_of(spec) -> Plan | None:
    """The per-layer plan ``spec`` names (``"plan:FILE"`` or a :class:`Plan`), else None.
    Analyses given a plan run each module in the format the plan assigns it: a copy set up
    under ``Precision(plan)``, as training runs it (ValueError in one line for a bad file)."""
    if isinstance(spec, Plan):
        return spec
    return load_plan(spec) if is_plan_spec(spec) else None


def run_model(model: nn.Module, inputs, output_fn=None) -> torch.Tensor:
    """``model(inputs)`` (``model(**inputs)`` for a dict of keyword inputs) and the tensor its
    output stands for: ``output_fn(out)``, else a ``ModelOutput``'s or dict's ``logits``, else
    the first tensor of a tuple or dict (see :func:`lowprec.training.tree.output_tensor`)."""
    return output_tensor(call_model(model, inputs), output_fn)


def parameter_groups(name: str, module: nn.Module) -> list[tuple[str, list]]:
    """The parameters ``module`` (called ``name`` in its model) owns, as the analyses report
    them: one group named by the module's path; the root module's own parameters (a ViT's
    ``cls_token`` and ``pos_embed``, the weight and bias of a bare ``nn.Linear``) one group
    each, named by the parameter, since torch names the root module "" (lost updates printed
    "layer  loses 93%"). Each group is a list of (parameter name, parameter)."""
    own = list(module.named_parameters(recurse=False))
    if not own:
        return []
    if name:
        return [(name, own)]
    return [(pname, [(pname, p)]) for pname, p in own]


def _strip_hooks(model: nn.Module) -> nn.Module:
    for m in model.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            d = getattr(m, name, None)
            if d is not None:
                d.clear()
        m.__dict__.pop("_lowprec_saved", None)
        if isinstance(m.__dict__.get("forward"), CompiledForward):
            del m.__dict__["forward"]  # compiled emulation's forward: the twin runs the plain one
    return model


def fp32_twin(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model`` without hooks (a model set up under a 16-bit policy carries
    lowprec's rounding hooks; its twin must not)."""
    return _strip_hooks(copy.deepcopy(model)).float()


def low_precision_copy(model: nn.Module, fmt: str | Format | Policy,
                       backend: str | Backend = Backend.EMULATED,
                       rounding: str | Rounding | RoundingSpec = "nearest"
                       ) -> tuple[nn.Module, Precision]:
    """The same weights rounded to ``fmt`` and run in it: every layer's output and weight on the
    format's grid (pure ``fmt``), as a 16-bit network computes. A policy with scaled GEMMs
    (:func:`scaled_policy`) gives a copy set up under that policy; a plan (:func:`plan_of`) a
    copy set up under ``Precision(plan)``: each module in the formats the plan gives it (the
    plan's per-module overrides need the emulated backend, whatever ``backend`` says). Run the
    copy inside ``prec.autocast()``, as training does (a mixed policy rounds only there)."""
    plan = plan_of(fmt)
    pol = plan if plan is not None else scaled_policy(fmt)
    if pol is not None:
        twin = fp32_twin(model)
        prec = Precision(pol)
        twin, _ = prec.setup(twin)
        return twin, prec
    fmt = parse_format(fmt)
    twin = fp32_twin(model)
    # the rounding applies to the forward values; gradients (unused here) round to nearest
    prec = Precision(Policy(params=fmt, compute=fmt, grads=fmt, optimizer_state=fmt,
                            rounding=rounding, backend=backend))
    twin, _ = prec.setup(twin)
    return twin, prec


def as_batches(data, batch_size: int = 1000):
    """Yield (x, y-or-None) batches from a data set with a test split (``x_test``, ``y_test``,
    as :class:`lowprec.experiments.data.Dataset`), an (x, y) pair, a tensor or any iterable of
    (x, y). ``x`` may be a tensor, a dict of keyword inputs or a tuple of positional inputs
    (see :func:`lowprec.training.tree.call_model`)."""
    if hasattr(data, "x_test") and hasattr(data, "y_test"):
        data = (data.x_test, data.y_test)
    if torch.is_tensor(data):
        data = (data, None)
    if isinstance(data, Mapping):  # keyword inputs without labels
        data = (data, None)
    if isinstance(data, (tuple, list)) and len(data) == 2 and (
            torch.is_tensor(data[0]) or isinstance(data[0], Mapping)
            or (type(data) is tuple and type(data[0]) is tuple
                and (data[1] is None or torch.is_tensor(data[1])))):
        x, y = data
        for i in range(0, batch_size_of(x), batch_size):
            yield (slice_batch(x, i, i + batch_size),
                   None if y is None else y[i:i + batch_size])
        return
    for item in data:
        if isinstance(item, (tuple, list)):
            yield item[0], item[1]
        else:
            yield item, None


def tensor_range(t: torch.Tensor) -> dict:
    """min/max of |finite values| and the counts of Inf and NaN."""
    t = t.detach().float()
    finite = t[torch.isfinite(t)].abs()
    return {
        "min_abs": float(finite.min()) if finite.numel() else None,
        "max_abs": float(finite.max()) if finite.numel() else None,
        "inf": int(torch.isinf(t).sum()),
        "nan": int(torch.isnan(t).sum()),
        "numel": int(t.numel()),
    }


@contextlib.contextmanager
def untouched(model: nn.Module):
    """Run a measuring forward and backward pass on the caller's model and leave it as it was:
    its gradients set aside, cleared for the block and put back afterwards; its buffers
    (a BatchNorm's running statistics and batch count, which a forward in train mode moves)
    copied and restored in place."""
    saved = {p: p.grad for p in model.parameters()}
    buffers = []  # (module, name, the caller's tensor, its values): by name, so that a buffer
    # the pass rebinds (``self.seen = self.seen + n``) gets the caller's tensor back; a lazy
    # module's uninitialised buffer has no values to keep (its first forward makes them)
    with torch.no_grad():
        for m in model.modules():
            for name, b in m._buffers.items():
                if b is not None and not nn.parameter.is_lazy(b):
                    buffers.append((m, name, b, b.clone()))
    try:
        for p in model.parameters():
            p.grad = None
        yield
    finally:
        for p, g in saved.items():
            p.grad = g
        for m, name, b, old in buffers:
            m._buffers[name] = b
            # (a buffer made under inference_mode is written back in it)
            with torch.inference_mode() if b.is_inference() else torch.no_grad():
                b.copy_(old)
