"""``Precision``: one object a training loop uses the same way whatever the regime.

    prec = lowprec.Precision("16-true")
    model, optimizer = prec.setup(model, optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.step(optimizer)        # unscale, check Inf/NaN, skip or step, update the scale

Backends. ``native`` runs real torch dtypes (``model.half()``, ``torch.autocast``); it needs
every format to be fp32, fp16 or bf16. ``emulated`` keeps fp32 tensors and rounds values onto the
policy's grids at every op (:mod:`lowprec.training.emulation`); it accepts any format.
``auto`` picks native where the
hardware runs the dtype fast (any of the three on CUDA; fp32 and bf16 on CPU, where bf16 uses
AMX) and emulation otherwise (fp16 on CPU, whose convolution backward is a slow reference kernel).

Regimes that need more than formats (BinaryNet, dynamic fixed point) plug in through
:class:`lowprec.training.regimes.Regime`: Precision builds those the policy needs and calls their
hooks; it has no branch for any of them.
"""

from __future__ import annotations

import weakref

import contextlib

import torch
from torch import nn

from ..numerics.formats import BF16, FP16, FP32, DynamicFixedFormat, Format
from ..numerics.quantize import quantize_
from ..numerics.storage import storage_dtype
from .emulation import Emulation
from .loss_scale import LossScale, make_loss_scale
from .memory import MemoryLedger, measure_memory
from .optim import FormatOptimizer, PolicyOptimizer
from .policy import Backend, Policy, Scope, WriteBack, parse_policy
from .regimes import GroupKey, Regime, Role, regimes_for

# models a Precision has converted (weak: a model's copy is not in it; a dead model leaves it)
_SET_UP: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

__all__ = ["Precision"]

_NATIVE_FORMATS = (FP32, FP16, BF16)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _can_be_native(policy: Policy) -> bool:
    roles = [policy.params, policy.compute, policy.grads, policy.optimizer_state]
    if policy.master is not None:
        roles.append(policy.master)
    if policy.is_fp32:
        return True
    return all(f in _NATIVE_FORMATS for f in roles) and policy.grads == policy.compute


class Precision:
    """Apply a :class:`Policy` to a model and optimizer; see the module docstring."""

    def __init__(self, policy: str | Policy = "32-true", *, loss_scale: str | LossScale | None = None,
                 generator: torch.Generator | None = None, seed: int | None = None,
                 overrides: dict | None = None) -> None:
        self.policy = parse_policy(policy)
        # glob on module names -> policy or format; ops inside a matching module follow it
        # (emulated backend only)
        self.overrides = dict(overrides or {})
        self.loss_scale = make_loss_scale(loss_scale if loss_scale is not None
                                          else self.policy.loss_scale)
        if generator is None and seed is not None:
            generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        # the regimes this policy needs, chosen by the registry (lowprec.training.regimes)
        self.regimes: list[Regime] = regimes_for(self.policy, generator)
        self.backend: Backend | None = None
        self.device: torch.device | None = None
        self.emulation: Emulation | None = None
        self.optimizer = None
        self.model: nn.Module | None = None
        self._names: dict[int, str] = {}
        self.steps = 0
        self.skipped = 0
        self.nonfinite = 0
        self.trace: list[dict] = []
        self._handles: list = []

    # -- regimes -----------------------------------------------------------------------------
    def _resolve(self, fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
        """The static format a group rounds with now (each regime may refine it)."""
        for regime in self.regimes:
            fmt = regime.resolve(fmt, key, x)
        return fmt

    def _engine_options(self) -> dict:
        options: dict = {}
        for regime in self.regimes:
            options.update(regime.engine_options())
        return options

    # -- set-up ------------------------------------------------------------------------------
    def resolve_backend(self, device: torch.device) -> Backend:
        pol = self.policy
        if pol.backend is Backend.NATIVE:
            if not _can_be_native(pol):
                raise ValueError(
                    f"policy {pol} cannot run natively: native needs fp32/fp16/bf16 formats with "
                    "gradients in the compute format; use backend=emulated")
            return Backend.NATIVE
        if pol.backend is Backend.EMULATED or not _can_be_native(pol):
            return Backend.EMULATED if not pol.is_fp32 else Backend.NATIVE
        lowp = {f for f in (pol.params, pol.compute, pol.grads) if f != FP32}
        if device.type == "cuda" or lowp <= {BF16}:
            return Backend.NATIVE
        return Backend.EMULATED

    def setup(self, model: nn.Module, optimizer=None):
        """Convert ``model`` (in place) and wrap or configure ``optimizer``; returns both."""
        if self.model is not None:
            raise RuntimeError("this Precision is already set up; create one per model")
        if model in _SET_UP:
            raise RuntimeError("this model is already set up by another Precision (their "
                               "roundings would stack); build a fresh model per Precision")
        _SET_UP.add(model)
        pol = self.policy
        self.device = _device_of(model)
        self.backend = self.resolve_backend(self.device)
        if self.overrides and self.backend is Backend.NATIVE:
            if pol.backend is Backend.NATIVE:
                raise ValueError("per-module overrides need backend=emulated (or auto)")
            self.backend = Backend.EMULATED
        self.model = model
        self._names = {id(p): n for n, p in model.named_parameters()}
        added: list = []
        for regime in self.regimes:
            added += regime.prepare(model)
        if any(regime.replaces_compute for regime in self.regimes):
            # the prepared model computes in the policy's compute format itself: no hooks
            self.emulation = None
        elif self.backend is Backend.NATIVE:
            if pol.scope is Scope.ALL and pol.params != FP32:
                dtype = storage_dtype(pol.params)
                model.to(dtype)
                # oneDNN runs bf16 convolutions with its AMX/AVX-512 kernels on channels-last
                # (NHWC) tensors; NCHW bf16 takes a slower reordering path on CPU
                fmt = (torch.channels_last if dtype == torch.bfloat16 and self.device.type ==
                       "cpu" and any(isinstance(m, nn.Conv2d) for m in model.modules())
                       else None)
                if fmt is not None:
                    model.to(memory_format=fmt)

                def cast(a):
                    if not (torch.is_tensor(a) and a.is_floating_point()):
                        return a
                    a = a.to(dtype)
                    return a.contiguous(memory_format=fmt) if fmt is not None and a.dim() == 4 \
                        else a

                self._handles.append(model.register_forward_pre_hook(
                    lambda m, args: tuple(cast(a) for a in args)))
        else:
            self.emulation = Emulation(model, pol, self.generator, active=pol.scope is Scope.ALL,
                                       overrides=self.overrides, **self._engine_options())
            self._store_emulated(model)
        if optimizer is not None:
            for regime in self.regimes:
                regime.configure_optimizer(optimizer, added)
            optimizer = self._setup_optimizer(optimizer)
        self.optimizer = optimizer
        return model, optimizer

    @torch.no_grad()
    def _store_emulated(self, model: nn.Module) -> None:
        """Parameters (and, for pure policies, floating buffers such as BatchNorm's running
        statistics, which ``model.half()`` would convert too) on their storage format's grid."""
        em = self.emulation
        for name, p in model.named_parameters():
            fmt = em.param_format(name)
            if fmt != FP32:
                quantize_(p.data, self._resolve(fmt, GroupKey(Role.PARAM, name), p.data))
        for name, b in model.named_buffers():
            fmt = em.param_format(name)
            if (b.is_floating_point() and fmt != FP32 and em.rule_of(name).scope == "all"
                    and not isinstance(fmt, DynamicFixedFormat)):
                quantize_(b, fmt)
        em.mark_storage(model)

    def _setup_optimizer(self, optimizer):
        pol = self.policy
        emulated = self.backend is Backend.EMULATED
        pfmt = pol.params if emulated else None
        options = dict(self._engine_options(), names=self._names)
        kwargs = dict(param_format=pfmt, state_format=pol.optimizer_state,
                      master_format=pol.master, update=pol.update, generator=self.generator,
                      **options)
        if isinstance(optimizer, PolicyOptimizer):
            optimizer.configure_storage(**kwargs)
            return optimizer
        lowp_storage = pol.params != FP32 or pol.optimizer_state != FP32
        # a stochastic or Kahan write-back needs the whole fp32 update, which a torch optimizer
        # stepping 16-bit tensors itself would already have rounded to nearest
        needs_wrap = (pol.master is not None or pol.update is not WriteBack.NEAREST
                      or (emulated and lowp_storage))
        if needs_wrap:
            wrapped = FormatOptimizer(optimizer, **{k: v for k, v in kwargs.items()
                                                    if k not in options})
            wrapped.configure_storage(**kwargs)
            return wrapped
        return optimizer

    def convert_input(self, x):
        """Cast floating tensors to the model's storage dtype (pure native policies)."""
        if (self.backend is Backend.NATIVE and self.policy.scope is Scope.ALL
                and self.policy.params != FP32):
            dtype = storage_dtype(self.policy.params)
            if torch.is_tensor(x) and x.is_floating_point():
                return x.to(dtype)
        return x

    # -- the loop ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self):
        """Mixed policies compute matmul layers in the compute format inside this context."""
        pol = self.policy
        if pol.scope is not Scope.MATMUL or pol.compute == FP32:
            yield
            return
        if self.backend is Backend.NATIVE:
            with torch.autocast(device_type=self.device.type, dtype=storage_dtype(pol.compute)):
                yield
            return
        em = self.emulation
        if em is None:  # a regime's prepared model computes its own precision
            yield
            return
        prev, em.active = em.active, True
        try:
            yield
        finally:
            em.active = prev

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``(loss * scale).backward()``, the product taken in fp32."""
        if self.loss_scale.scale == 1.0:
            loss.backward(**kwargs)
        else:
            (loss.float() * self.loss_scale.scale).backward(**kwargs)

    @staticmethod
    def _params_with_grads(optimizer) -> list[torch.Tensor]:
        if isinstance(optimizer, PolicyOptimizer):
            return optimizer.params_for_check()
        return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    @staticmethod
    def _check(grads, found: torch.Tensor, inv_scale: float) -> None:
        """Add 1 to ``found`` if any gradient holds Inf/NaN (torch's fused check), multiplying
        the gradients by ``inv_scale`` on the way (1: check only)."""
        groups: dict = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), gs in groups.items():
            f = torch.zeros(1, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(
                gs, f, torch.full((1,), inv_scale, device=dev))
            found += f.to(found.device)

    @torch.no_grad()
    def step(self, optimizer=None) -> bool:
        """Unscale, check every gradient for Inf/NaN in one fused pass (all-reduced across
        ranks), skip or step, update the loss scale and the trace. Returns True if it stepped."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None:
            raise ValueError("step() needs an optimizer (pass it, or give one to setup())")
        params = self._params_with_grads(optimizer)
        grads = [p.grad for p in params]
        scale = self.loss_scale.scale
        takes_scale = isinstance(optimizer, PolicyOptimizer)
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, device=device)
        em = self.emulation
        pfmts = [em.param_format(self._names.get(id(p), "")) if em is not None
                 else self.policy.params for p in params]
        rounds = self.backend is Backend.EMULATED and any(f != FP32 for f in pfmts)
        if rounds and not all(getattr(f, "has_inf", False) for f in pfmts if f != FP32):
            # a saturating format would turn an Inf into its max: look before rounding too
            self._check(grads, found, 1.0)
        if rounds:
            # the gradients as parameter-format storage would hold them
            for p, fmt in zip(params, pfmts):
                if fmt != FP32:
                    key = GroupKey(Role.PARAM_GRAD, self._names.get(id(p), str(id(p))))
                    quantize_(p.grad, self._resolve(fmt, key, p.grad))
        self._check(grads, found, 1.0 if takes_scale else 1.0 / scale)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        found_inf = bool(found.item() > 0)
        skip = found_inf and self.loss_scale.skips_nonfinite
        if not skip:
            if takes_scale and scale != 1.0:
                optimizer.step(grad_scale=1.0 / scale)
            else:
                optimizer.step()
            for regime in self.regimes:
                regime.after_step(self.model)
        self.trace.append({"step": self.steps, "scale": scale, "found_inf": found_inf,
                           "skipped": skip})
        self.steps += 1
        self.skipped += int(skip)
        self.nonfinite += int(found_inf)
        self.loss_scale.update(found_inf)
        return not skip

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "policy": self.policy.spec,
            "loss_scale": self.loss_scale.state_dict(),
            "steps": self.steps,
            "skipped": self.skipped,
            "nonfinite": self.nonfinite,
            "trace": list(self.trace),
            "generator": None if self.generator is None else self.generator.get_state(),
            "regimes": {r.name: r.state_dict() for r in self.regimes},
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"a Precision state must be a dict from state_dict(), got "
                            f"{type(state).__name__}")
        missing = [k for k in ("loss_scale", "steps", "skipped", "trace") if k not in state]
        if missing:
            raise ValueError(f"not a Precision state_dict: missing {', '.join(missing)} (keys "
                             f"given: {', '.join(map(str, list(state)[:8]))})")
        if state.get("policy") is not None and parse_policy(state["policy"]) != self.policy:
            raise ValueError(f"state is for policy {state['policy']!r}, this Precision has "
                             f"{self.policy.spec!r}")
        self.loss_scale.load_state_dict(state["loss_scale"])
        self.steps, self.skipped = int(state["steps"]), int(state["skipped"])
        self.nonfinite = int(state.get("nonfinite", 0))
        self.trace = list(state["trace"])
        if state.get("generator") is not None and self.generator is not None:
            self.generator.set_state(state["generator"])
        saved = state.get("regimes", {})
        for regime in self.regimes:
            if regime.name in saved:
                regime.load_state_dict(saved[regime.name])

    # -- measurement -------------------------------------------------------------------------
    def memory(self, model: nn.Module | None = None, batch=None, loss_fn=None) -> MemoryLedger:
        """Exact bytes of one training step by role (params, grads, optimizer state, master
        weights, activations saved for backward)."""
        model = model if model is not None else self.model
        if model is None or batch is None or loss_fn is None:
            raise ValueError("memory() needs a model (or setup() first), a batch and a loss_fn")
        inputs, targets = batch
        compute = self.policy.compute if self.backend is Backend.EMULATED else None
        return measure_memory(model, (self.convert_input(inputs), targets), loss_fn,
                              param_format=self.policy.params, optimizer=self.optimizer,
                              compute=compute, autocast=self.autocast)

    def __repr__(self) -> str:
        return f"Precision({self.policy}, backend={self.backend}, loss_scale={self.loss_scale})"

