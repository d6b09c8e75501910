"""``Precision``: one object a training loop uses the same way whatever the regime.

    prec = lowprec.Precision("16-true")
    model, optimizer = prec.setup(model, optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        with prec.autocast():
            loss = loss_fn(model(x), y)
        prec.backward(loss)
        prec.step(optimizer)        # unscale, check Inf/NaN, skip or step, update the scale

Backends (:mod:`lowprec.training.backends`, one plug-in each). ``native`` runs real torch dtypes
(``model.half()``, ``torch.autocast``); it needs every format to be fp32, fp16 or bf16.
``emulated`` keeps fp32 tensors and rounds values onto the policy's grids at every op
(:mod:`lowprec.training.emulation`); it accepts any format. ``auto`` picks native where the
device has fast kernels for the dtype (tensor cores on CUDA; AVX512-BF16 or AMX for bf16 on a
CPU, fp16 on no CPU: :mod:`lowprec.training.hardware`) and emulation
otherwise, and says which once per process and policy (``prec.backend_choice`` holds it).
``match_cpu_kernels=True`` makes emulated 2-D convolutions sum in the order of that reference
kernel where torch runs it (:mod:`lowprec.numerics.summation`; fp16 on a CPU with AVX512-FP16
or AMX-FP16 convolves in oneDNN, which rounds an fp32 sum once, as the engine does) and
matrix products, layer norm, attention without
dropout, recurrent layers, gelu/erf/sqrt and selections by an index tensor run on this CPU's
own 16-bit kernels (:mod:`lowprec.training.emulation.native_gemm`), for pure fp16/bf16 policies
rounded to nearest on CPU tensors: forwards are then bit-exact with ``model.half()`` /
``model.bfloat16()``, and gradients too except through 2-D convolutions, whose backward is
the engine's (tests/training/test_match_cpu_kernels.py: GPT-2 at width 768, LSTM/GRU, Swin;
benchmarks/summation.py gives the cost).
``target`` ("cpu", "cuda"; None, the default: the device of the model's tensors) names whose
16-bit kernels the emulated backend follows where a CPU's and CUDA's round differently
(convolution with a bias, batch norm, layer norm's and softmax's backwards, log_softmax,
the embedding's backward: :mod:`lowprec.training.emulation.engine`); ``prec.kernel_target``
holds the one set up.
``compile=True`` runs an emulated model's forward and backward compiled by Inductor, with
every rounding of the engine in the graph and the eager engine's bits
(:mod:`lowprec.training.emulation.compiled`; eager, with one warning line naming why, where it
cannot).

Regimes that need more than formats (BinaryNet, dynamic fixed point) plug in through
:class:`lowprec.training.regimes.Regime`: Precision builds those the policy needs and calls their
hooks; it has no branch for any of them.
"""

from __future__ import annotations

import copy
import contextlib
import math
import weakref
from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from .caller import warn
from ..numerics.formats import FP32, Format
from ..numerics.rounding import check_generator
from ..numerics.storage import compact, format_of_dtype
from .backends import (BackendChoice, PrecisionBackend, announce, backend_class, choose_backend,
                       compile_ignored)
from .backends.probe import BackendTiming, build_copies, decide, loss_of, time_steps
from .emulation import Emulation
from .emulation.engine import check_target
from .emulation.scaled import coverage_of as scaled_coverage_of
from .hardware import device_facts
from .loss_scale import LossScale, make_loss_scale
from .memory import MemoryLedger, measure_memory
from .optim import SGD, FormatOptimizer, PolicyOptimizer
from .optim.torch_adam import TORCH_ADAMS, OptimizerPrecisionWarning, adam_risks, adam_warning
from .plan import is_plan_spec, load_plan
from .policy import Backend, Policy, Scope, WriteBack, parse_policy
from .regimes import GroupKey, Regime, regimes_for, static_resolve

# models a Precision has converted (weak: a model's copy is not in it; a dead model leaves it)
_SET_UP: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

__all__ = ["Precision", "time_backends"]


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _check_optimizer_type(optimizer, what: str) -> None:
    """An optimizer is anything with torch's ``param_groups`` (a list of dicts); TypeError
    naming what was given otherwise (not an AttributeError from deep inside)."""
    if not isinstance(getattr(optimizer, "param_groups", None), list):
        raise TypeError(f"{what} takes an optimizer (torch.optim.Optimizer or lowprec's), got "
                        f"{type(optimizer).__name__}")


def _count_of(state: dict, key: str) -> int:
    """``state[key]`` (0 when absent) as an integer >= 0; ValueError else."""
    v = state.get(key, 0)
    if torch.is_tensor(v) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0 or v != int(v):
        raise ValueError(f"Precision state: {key}={v!r:.40} must be an integer >= 0")
    return int(v)


class Precision:
    """Apply a :class:`Policy` to a model and optimizer; see the module docstring."""

    def __init__(self, policy: str | Policy = "32-true", *, loss_scale: str | LossScale | None = None,
                 generator: torch.Generator | None = None, seed: int | None = None,
                 overrides: dict | None = None, match_cpu_kernels: bool = False,
                 compile: bool = False, target: str | None = None) -> None:
        # a per-layer plan (lowprec.training.plan: a Plan, or "plan:FILE"; anything with
        # .policy and .overrides) is its base policy with its per-module overrides
        if is_plan_spec(policy):
            policy = load_plan(policy)
        if not isinstance(policy, (str, Policy)) and hasattr(policy, "overrides") \
                and hasattr(policy, "policy"):
            if overrides is not None:
                raise ValueError("a plan carries its own overrides: give the plan or "
                                 "overrides=, not both")
            policy, overrides = policy.policy, dict(policy.overrides)
        self.policy = parse_policy(policy)
        # emulated backend: conv2d summed in the order of torch's reference CPU 16-bit kernel
        # (lowprec.numerics.summation), products, layer norm, attention, RNNs... on this CPU's
        # own 16-bit kernels (emulation.native_gemm); see the module docstring
        self.match_cpu_kernels = bool(match_cpu_kernels)
        # emulated backend: whose 16-bit kernels the ops that differ between a CPU and CUDA
        # follow; None: the model's device (resolved by setup into kernel_target)
        self.target = check_target(target, self.match_cpu_kernels)
        self.kernel_target: str | None = None
        # emulated backend: the model's forward and backward compiled by Inductor with every
        # rounding of the engine in the graph (lowprec.training.emulation.compiled)
        if not isinstance(compile, bool):
            raise TypeError(f"compile={compile!r:.40} ({type(compile).__name__}); accepted: "
                            "True or False")
        self.compile = compile
        # glob on module names -> policy or format; ops inside a matching module follow it
        # (emulated backend only)
        if overrides is not None and not isinstance(overrides, dict):
            raise TypeError(f"overrides={overrides!r:.40} ({type(overrides).__name__}) must be a "
                            "dict of module-name glob -> policy or format")
        self.overrides = dict(overrides or {})
        self.loss_scale = make_loss_scale(loss_scale if loss_scale is not None
                                          else self.policy.loss_scale)
        check_generator(generator)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed={seed!r:.40} ({type(seed).__name__}) must be an int")
        if generator is not None and seed is not None:
            raise ValueError("give a generator or a seed, not both (the seed would be ignored)")
        if generator is None and seed is not None:
            try:
                generator = torch.Generator().manual_seed(seed)
            except RuntimeError as err:  # a negative seed or one beyond 2**64 - 1
                raise ValueError(f"seed={seed} is out of range: {' '.join(str(err).split())}"
                                 ) from None
        self.generator = generator
        # the regimes this policy needs, chosen by the registry (lowprec.training.regimes)
        self.regimes: list[Regime] = regimes_for(self.policy, generator)
        self.backend: Backend | None = None  # the kind, once setup chose it
        self.backend_choice: BackendChoice | None = None  # the kind and why
        self.device: torch.device | None = None
        self._backend: PrecisionBackend | None = None  # the plug-in (lowprec.training.backends)
        self.optimizer = None
        self.model: nn.Module | None = None
        self.steps = 0
        self.skipped = 0
        self.nonfinite = 0
        self.trace: list[dict] = []
        self._added: list = []  # parameters the regimes added to the model
        self._optimizers: dict[int, object] = {}  # id -> optimizer setup configured or returned
        self._given: dict[int, object] = {}  # id of an optimizer setup wrapped -> the wrapper
        self._adam_checked: "weakref.WeakSet" = weakref.WeakSet()  # optimizers past a first step
        self._unscaled: dict[int, bool] = {}  # id of an optimizer unscale_() ran on -> found_inf

    # -- regimes -----------------------------------------------------------------------------
    def _resolve(self, fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
        """The static format a group rounds with now (each regime may refine it)."""
        for regime in self.regimes:
            fmt = regime.resolve(fmt, key, x)
        return static_resolve(fmt, key, x)  # a dynamic format no regime resolved: refused

    def _engine_options(self) -> dict:
        options: dict = {}
        for regime in self.regimes:
            options.update(regime.engine_options())
        return options

    @property
    def emulation(self) -> Emulation | None:
        """The emulation engine the model runs under (None on the native backend)."""
        return None if self._backend is None else self._backend.engine

    def recipe_coverage(self) -> dict | None:
        """Which modules a scaled-GEMM recipe (``sc=``) cast in the forwards run so far, and
        which ran convolutions it does not define (:class:`lowprec.training.emulation.scaled.
        CoverageLog`); None when no rule carries a recipe or the model is not set up."""
        return scaled_coverage_of(self.emulation) if self.emulation is not None else None

    # -- set-up ------------------------------------------------------------------------------
    def choose_backend(self, device: torch.device | str) -> BackendChoice:
        """The backend this Precision runs on ``device`` and why (``b=auto``: by the device's
        facts, :mod:`lowprec.training.backends.choice`); ValueError where the policy forces
        one it cannot have."""
        return choose_backend(self.policy, device_facts(device), overrides=bool(self.overrides))

    def resolve_backend(self, device: torch.device | str) -> Backend:
        """The backend this Precision runs on ``device`` (see :meth:`choose_backend`)."""
        return self.choose_backend(device).backend

    def setup(self, model: nn.Module, optimizer=None, *, example=None,
              choice: BackendChoice | None = None):
        """Convert ``model`` (in place) and wrap or configure ``optimizer``; returns both.

        ``example``: the forward's input for a sample batch (a tensor, or a tuple of the
        forward's positional arguments; not an (inputs, targets) pair). Where ``auto`` would
        run natively by the device's facts, a few training steps of copies of the model are
        then timed under both backends and native is kept unless clearly slower
        (:mod:`lowprec.training.backends.probe`; :attr:`backend_choice` says what was measured).
        The timing can differ between calls: to reproduce a run, store
        :attr:`backend_choice` and give it back as ``choice`` (a choice made before, checked
        against the policy)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"setup() takes a torch.nn.Module, got {type(model).__name__}")
        if self.model is not None:
            raise RuntimeError("this Precision is already set up; create one per model")
        if model in _SET_UP:
            raise RuntimeError("this model is already set up by another Precision (their "
                               "roundings would stack); build a fresh model per Precision")
        if choice is not None and example is not None:
            raise ValueError("give example= (time the backends) or choice= (a choice made "
                             "before), not both")
        device = _device_of(model)
        facts = device_facts(device)
        if choice is not None:
            choice = self._check_choice(choice, facts)
        else:
            choice = choose_backend(self.policy, facts, overrides=bool(self.overrides))
            if example is not None and choice.automatic and choice.backend is Backend.NATIVE:
                choice = decide(choice, time_backends(model, self.policy, example,
                                                      compile=self.compile))
        _SET_UP.add(model)
        self.device = device
        announce(self.policy, choice, facts)  # once per process and policy
        self.backend_choice, self.backend = choice, choice.backend
        self.kernel_target = self.target or (
            "cuda" if torch.device(device).type == "cuda" and not self.match_cpu_kernels
            else "cpu")
        # compile=True: the kind's compiled backend, where it has one (emulated: Inductor)
        self._backend = backend_class(choice.backend, compiled=self.compile)(
            self.policy, self.device, generator=self.generator, resolve=self._resolve,
            engine_options=self._engine_options(), overrides=self.overrides,
            match_cpu_kernels=self.match_cpu_kernels, target=self.kernel_target)
        self.model = model
        names = {id(p): n for n, p in model.named_parameters()}
        added: list = []
        for regime in self.regimes:
            added += regime.prepare(model)
        # a regime's prepared model may compute in the policy's compute format itself: then
        # the backend installs no casts or engine
        replaced = any(r.replaces_compute for r in self.regimes)
        self._backend.convert_module(model, names, compute_replaced=replaced)
        if self.compile and not replaced and \
                (why := compile_ignored(choice.backend, self.policy)) is not None:
            warn(why)
        self._added = added
        if optimizer is not None:
            optimizer = self.setup_optimizer(optimizer)
        self.optimizer = optimizer
        return model, optimizer

    def _check_choice(self, choice: BackendChoice, facts) -> BackendChoice:
        """A choice made before (stored with a run), if this Precision can run it."""
        if not isinstance(choice, BackendChoice):
            raise TypeError(f"choice={choice!r:.40} ({type(choice).__name__}) must be a "
                            "BackendChoice (Precision.backend_choice of an earlier set-up)")
        own = choose_backend(self.policy, facts, overrides=bool(self.overrides))
        if choice.backend is own.backend:
            return choice
        if not own.automatic:  # the policy, its formats or the overrides decide
            raise ValueError(f"choice={choice.backend} conflicts with this Precision: it runs "
                             f"{own.backend} ({own.reason})")
        return choice

    def setup_optimizer(self, optimizer):
        """Configure or wrap one more optimizer of the model ``setup`` converted (a second
        optimizer, one created after ``setup``); returns the object to step."""
        _check_optimizer_type(optimizer, "setup_optimizer()")
        if self.model is None:
            raise RuntimeError("setup_optimizer() needs setup(model) first")
        if id(optimizer) in self._optimizers:  # already configured, or a wrapper it returned
            return optimizer
        if id(optimizer) in self._given:
            return self._given[id(optimizer)]
        known = {id(p) for g in optimizer.param_groups for p in g["params"]}
        added = [p for p in self._added if id(p) not in known]  # built on model.parameters()
        for regime in self.regimes:
            regime.configure_optimizer(optimizer, added)
        out = self._setup_optimizer(optimizer)
        self._optimizers[id(out)] = out
        if out is not optimizer:
            self._given[id(optimizer)] = out
        return out

    def _needs_wrap(self) -> bool:
        pol = self.policy
        lowp_storage = pol.params != FP32 or pol.optimizer_state != FP32
        # a stochastic or Kahan write-back needs the whole fp32 update, which a torch optimizer
        # stepping 16-bit tensors itself would already have rounded to nearest
        return (pol.master is not None or pol.update is not WriteBack.NEAREST
                or (self._backend is not None and self._backend.carriers
                    and lowp_storage))

    def _check_torch_adam(self, optimizer, scale: float) -> None:
        """At an optimizer's first step: a torch Adam (AdamW, NAdam, RAdam), wrapped or not,
        whose eps or second moment will be lost in the formats it actually runs in (the dtype
        of its state, the state format the wrapper rounds it to, its gradients now) gets one
        warning saying what happens and what to use (:mod:`.optim.torch_adam`)."""
        if optimizer in self._adam_checked:
            return
        self._adam_checked.add(optimizer)
        wrapper = optimizer if isinstance(optimizer, FormatOptimizer) else None
        adam = wrapper.optimizer if wrapper is not None else optimizer
        if not isinstance(adam, TORCH_ADAMS):
            return
        model_of = {}  # the wrapped optimizer steps fp32 masters: the model's gradients
        if wrapper is not None and wrapper.masters is not None:
            model_of = {id(m): p for m, p in zip(wrapper.masters, wrapper.model_params)}

        def entries():
            for group in adam.param_groups:
                for s in group["params"]:
                    if s.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                        continue
                    p = model_of.get(id(s), s)
                    state = format_of_dtype(s.dtype)  # torch's state: zeros_like(param)
                    if wrapper is not None and wrapper.masters is None:
                        sf = wrapper.storage.sformat(p)  # rounded to it after each step
                        state = sf if sf != FP32 else state
                    # the fused kernel computes in fp32; the for-each and single-tensor paths
                    # in the state's dtype
                    arith = FP32 if group.get("fused") else format_of_dtype(s.dtype)
                    g = None if p.grad is None else p.grad.float() / scale
                    yield group["eps"], group["betas"], arith, state, g

        risks = adam_risks(entries())
        if risks:
            warn(adam_warning(type(adam).__name__, self.policy, risks),
                 OptimizerPrecisionWarning)

    def _setup_optimizer(self, optimizer):
        pol = self.policy
        storage = self._backend.optimizer_storage()  # param_format (, param_formats)
        options = dict(self._engine_options(), names=self._backend.names, resolve=self._resolve,
                       **{k: v for k, v in storage.items() if k != "param_format"})
        kwargs = dict(param_format=storage["param_format"], state_format=pol.optimizer_state,
                      master_format=pol.master, update=pol.update, generator=self.generator,
                      **options)
        if isinstance(optimizer, PolicyOptimizer):
            optimizer.configure_storage(**kwargs)
            return optimizer
        if self._needs_wrap():
            wrapped = FormatOptimizer(optimizer, **{k: v for k, v in kwargs.items()
                                                    if k not in options})
            wrapped.configure_storage(**kwargs)
            return wrapped
        if pol.optimizer_state != pol.params and not self._backend.carriers:
            # native: torch creates a plain optimizer's state in its parameters' dtype
            warn(
                f"{type(optimizer).__name__} keeps its state in the parameters' dtype "
                f"({pol.params}) under the native backend, not in o={pol.optimizer_state}: use "
                "lowprec.training.optim's SGD or Adam, master weights (m=), or b=emulated",
                OptimizerPrecisionWarning)
        return optimizer

    def convert_input(self, x):
        """Cast floating tensors to the model's storage dtype (pure native policies)."""
        return x if self._backend is None else self._backend.convert_input(x)

    # -- the loop ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self):
        """Mixed policies compute matmul layers in the compute format inside this context."""
        pol = self.policy
        if pol.scope is not Scope.MATMUL or pol.compute == FP32:
            yield
            return
        if self._backend is None:  # before setup: nothing to compute in
            yield
            return
        with self._backend.autocast():
            yield

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``(loss * scale).backward()``, the product taken in fp32."""
        if not torch.is_tensor(loss):
            raise TypeError(f"backward() takes the loss tensor, got {type(loss).__name__}")
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
        for (dev, dtype), gs in groups.items():
            f = torch.zeros(1, device=dev)
            if dev.type == "cpu" or dtype in (torch.float16, torch.float32, torch.float64):
                torch._amp_foreach_non_finite_check_and_unscale_(
                    gs, f, torch.full((1,), inv_scale, device=dev))
            else:  # CUDA's fused check has no bfloat16 kernel (torch 2.11): the same in ops
                Precision._check_unfused(gs, f, inv_scale)
            found += f.to(found.device)

    @staticmethod
    def _check_unfused(grads, found: torch.Tensor, inv_scale: float) -> None:
        """:meth:`_check` in plain torch ops, for the dtypes and devices that have no fused
        kernel: the same flag and, as the fused kernel computes it, each gradient multiplied
        by ``inv_scale`` in float32 and rounded once to its dtype."""
        for g in grads:
            found += (~torch.isfinite(g)).any().float()
        if inv_scale != 1.0:
            s = torch.tensor(inv_scale, dtype=torch.float32, device=grads[0].device)
            for g in grads:
                g.copy_(g.float() * s)

    def _found_inf(self, params, scale_by: float) -> bool:
        """Round the gradients as parameter-format storage holds them (emulated 16-bit
        parameters), check them all for Inf/NaN in one fused pass (all-reduced across ranks),
        multiplying them by ``scale_by`` on the way."""
        grads = [p.grad for p in params]
        found = torch.zeros(1, device=grads[0].device)
        # FP32: kept as they are (always before setup: the GradScaler facade's own loops)
        pfmts = ([FP32] * len(params) if self._backend is None
                 else self._backend.grad_formats(params))
        rounds = any(f != FP32 for f in pfmts)
        if rounds and not all(getattr(f, "has_inf", False) for f in pfmts if f != FP32):
            # a saturating format would turn an Inf into its max: look before rounding too
            self._check(grads, found, 1.0)
        unchecked = grads
        if rounds:
            # the gradients as parameter-format storage would hold them; those the kernel
            # rounds and counts in one pass (no unscaling to do) need no second pass
            counted, unchecked = self._backend.round_grads(params, pfmts, count=scale_by == 1.0)
            found += counted
        self._check(unchecked, found, scale_by)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        return bool(found.item() > 0)

    def _grads_of(self, optimizer, what: str):
        optimizer = optimizer if optimizer is not None else self.optimizer
        if optimizer is None:
            raise ValueError(f"{what}() needs an optimizer (pass it, or give one to setup())")
        _check_optimizer_type(optimizer, f"{what}()")
        self._check_optimizer(optimizer)
        return optimizer, self._params_with_grads(optimizer)

    @torch.no_grad()
    def unscale_(self, optimizer=None) -> bool:
        """Divide ``optimizer``'s gradients by the loss scale in place and check them for
        Inf/NaN, as ``torch.amp.GradScaler.unscale_`` does, so that they can be clipped before
        ``step``; once per step (a second call raises, like torch's). The division is done in the
        gradients' dtype: fp32 carriers (emulation) keep every value, native fp16 gradients
        flush values below 2**-24 (without ``unscale_``, ``step`` unscales inside lowprec's
        optimizers in fp32). Returns whether an Inf/NaN was found."""
        optimizer, params = self._grads_of(optimizer, "unscale_")
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last step()")
        found_inf = bool(params) and self._found_inf(params, 1.0 / self.loss_scale.scale)
        self._unscaled[id(optimizer)] = found_inf
        return found_inf

    @torch.no_grad()
    def step(self, optimizer=None, *, update: bool = True) -> bool:
        """Unscale, check every gradient for Inf/NaN in one fused pass (all-reduced across
        ranks), skip or step, update the loss scale (unless ``update=False``: the GradScaler
        facade updates once after all optimizers) and the trace. Returns True if it stepped."""
        optimizer, params = self._grads_of(optimizer, "step")
        unscaled = self._unscaled.pop(id(optimizer), None)
        if not params:
            warn("step() found no gradients: call prec.backward(loss) first; nothing was "
                 "stepped and the step was not counted")
            return False
        scale = self.loss_scale.scale
        takes_scale = isinstance(optimizer, PolicyOptimizer) and unscaled is None
        if unscaled is None:
            found_inf = self._found_inf(params, 1.0 if takes_scale else 1.0 / scale)
        else:
            found_inf = unscaled
        skip = found_inf and self.loss_scale.skips_nonfinite
        if not skip:
            self._check_torch_adam(optimizer, scale if takes_scale else 1.0)
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
        if update:
            self.loss_scale.update(found_inf)
        return not skip

    def _check_optimizer(self, optimizer) -> None:
        """An optimizer ``setup`` never saw would step 16-bit weights off the format's grid
        (or skip master weights) silently: refuse it where setup would have changed it."""
        if optimizer is self.optimizer or id(optimizer) in self._optimizers:
            return
        if id(optimizer) in self._given:
            raise ValueError(
                f"step() got the {type(optimizer).__name__} given to setup(), which wrapped it: "
                "step the optimizer that setup() returned")
        if isinstance(optimizer, PolicyOptimizer) or self._needs_wrap():
            raise ValueError(
                f"step() got a {type(optimizer).__name__} that setup() never saw; under policy "
                f"{self.policy} it must be configured: opt = prec.setup_optimizer(opt) (or pass "
                "it to setup)")

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What resuming needs, of constant size: the loss scale, the step counts, the
        generator, the regimes' state. The generator is the one of ``seed=`` or ``generator=``;
        without one (None here) stochastic rounding draws from torch's global generator, as
        dropout does, whose state (``torch.get_rng_state()``) an exact resume restores too.
        The per-step trace is not in it (it would grow with the
        run, in every checkpoint): it stays in ``self.trace``, and the experiment runner stores
        it in results.db as each epoch ends."""
        return {
            "policy": self.policy.spec,
            "loss_scale": self.loss_scale.state_dict(),
            "steps": self.steps,
            "skipped": self.skipped,
            "nonfinite": self.nonfinite,
            "generator": None if self.generator is None else self.generator.get_state(),
            "regimes": {r.name: r.state_dict() for r in self.regimes},
        }

    def checkpoint_state_dict(self, state_dict: dict | None = None) -> dict:
        """``state_dict`` (default: the set-up model's ``state_dict()``) as a native run stores
        it: each tensor the emulation keeps on a format's grid in float32 is converted to that
        format's own torch dtype (:func:`lowprec.numerics.storage.compact`: fp16 and bf16, fp8
        in torch's float8 dtypes) when every bit survives; formats torch has no dtype for stay
        float32. An emulated 16-true model is saved as ``torch.float16``, half the bytes, like
        ``model.half()``'s; ``model.load_state_dict`` copies the values back into the float32
        carriers exactly. Keys are the model's own names; a tensor under several keys (tied
        weights) stays one shared tensor; other entries are returned as they are."""
        if state_dict is None:
            if self.model is None:
                raise RuntimeError("checkpoint_state_dict() needs setup(model) first, or a "
                                   "state_dict")
            state_dict = self.model.state_dict()
        elif not isinstance(state_dict, Mapping):
            raise TypeError(f"checkpoint_state_dict() takes a state_dict (a mapping of names to "
                            f"tensors, model.state_dict()), not a {type(state_dict).__name__}; "
                            "with no argument it converts the set-up model's")
        formats = {} if self._backend is None else self._backend.stored_formats()
        out = copy.copy(state_dict)  # an OrderedDict keeps its _metadata (versions)
        done: dict = {}  # one converted tensor per source view: shared tensors stay shared
        for key, t in state_dict.items():
            fmt = formats.get(key)
            if fmt is None or not torch.is_tensor(t):
                continue
            view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                    tuple(t.stride()), t.dtype, fmt)
            if view not in done:
                done[view] = compact(t, fmt)
            out[key] = done[view]
        return out

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"a Precision state must be a dict from state_dict(), got "
                            f"{type(state).__name__}")
        # "trace": in the states of lowprec before the trace left them (still read)
        missing = [k for k in ("loss_scale", "steps", "skipped") if k not in state]
        if missing:
            raise ValueError(f"not a Precision state_dict: missing {', '.join(missing)} (keys "
                             f"given: {', '.join(map(str, list(state)[:8]))})")
        if state.get("policy") is not None and parse_policy(state["policy"]) != self.policy:
            raise ValueError(f"state is for policy {state['policy']!r}, this Precision has "
                             f"{self.policy.spec!r}")
        # everything is checked on copies first: a bad field changes nothing (a NaN, zero or
        # negative loss scale would otherwise skip or corrupt every later step silently)
        counts = {k: _count_of(state, k) for k in ("steps", "skipped", "nonfinite")}
        for k in ("skipped", "nonfinite"):
            if counts[k] > counts["steps"]:
                raise ValueError(f"Precision state: {k}={counts[k]} exceeds steps="
                                 f"{counts['steps']}")
        if not isinstance(state.get("trace", []), (list, tuple)):
            raise ValueError(f"Precision state: trace must be a list, got "
                             f"{type(state['trace']).__name__}")
        copy.deepcopy(self.loss_scale).load_state_dict(state["loss_scale"])
        gen_state = state.get("generator")
        if gen_state is not None and self.generator is not None:
            try:
                torch.Generator(device=self.generator.device).set_state(gen_state)
            except (TypeError, RuntimeError) as err:
                raise ValueError(f"Precision state: generator is not a generator state "
                                 f"({' '.join(str(err).split())[:120]})") from None
        saved = state.get("regimes") or {}
        if not isinstance(saved, dict):
            raise ValueError(f"Precision state: regimes must be a dict, got "
                             f"{type(saved).__name__}")
        # a regime checks its own state before it changes anything (one regime per policy
        # in practice): loaded first, so that its refusal leaves the rest untouched too
        for regime in self.regimes:
            if regime.name in saved:
                regime.load_state_dict(saved[regime.name])
        self.loss_scale.load_state_dict(state["loss_scale"])
        self.steps, self.skipped, self.nonfinite = (counts["steps"], counts["skipped"],
                                                    counts["nonfinite"])
        if "trace" in state:  # an older state carried the trace: kept in memory as it was
            self.trace = list(state["trace"])
        if gen_state is not None and self.generator is not None:
            self.generator.set_state(gen_state)

    # -- measurement -------------------------------------------------------------------------
    def memory(self, model: nn.Module | None = None, batch=None, loss_fn=None) -> MemoryLedger:
        """Exact bytes of one training step by role (params, grads, optimizer state, master
        weights, activations saved for backward)."""
        model = model if model is not None else self.model
        if model is None or batch is None or loss_fn is None:
            raise ValueError("memory() needs a model (or setup() first), a batch and a loss_fn")
        inputs, targets = batch
        compute = None if self._backend is None else self._backend.ledger_compute()
        # parameters under a per-module override (or a plan) counted in their own format
        own = None if self._backend is None or model is not self.model else \
            self._backend.optimizer_storage().get("param_formats")
        return measure_memory(model, (self.convert_input(inputs), targets), loss_fn,
                              param_format=self.policy.params, optimizer=self.optimizer,
                              compute=compute, autocast=self.autocast, param_formats=own)

    def __repr__(self) -> str:
        # per-module overrides (a plan's) too: a plan read as its base policy alone looked
        # like that policy everywhere
        listed = ", ".join(f"{k!r}: {str(v)!r}" for k, v in self.overrides.items())
        over = f", overrides={{{listed}}}" if self.overrides else ""
        return (f"Precision({self.policy}{over}, backend={self.backend}, "
                f"loss_scale={self.loss_scale})")


def time_backends(model: nn.Module | Callable[[], nn.Module], policy: str | Policy, example, *,
                  target=None, loss_fn=None, rounds: int = 3, compile: bool = False
                  ) -> BackendTiming:
    """Seconds per training step of ``model`` (a module, deep-copied, or a function building
    one) under ``policy`` natively and emulated (``compile``: the emulated model compiled), each
    copy set up by its own :class:`Precision` with lowprec's SGD: ``example`` is the forward's
    input (a tensor, or a tuple of its positional arguments) and the loss ``loss_fn(output,
    target)`` (default: the mean square of the output). Nothing of the caller's changes: copies are
    trained and torch's random state is restored (:func:`lowprec.training.backends.probe.
    time_steps`). What ``Precision.setup(model, example=...)`` decides ``auto`` by."""
    policy = parse_policy(policy)
    args = example if isinstance(example, tuple) else (example,)
    cuda = sorted({a.device.index or 0 for a in args if torch.is_tensor(a) and a.is_cuda})

    def make_step(net: nn.Module, pol: Policy):
        prec = Precision(pol, seed=0, compile=compile and pol.backend is Backend.EMULATED)
        net, opt = prec.setup(net, SGD(net.parameters(), lr=1e-6))
        net.train()

        def step() -> None:
            opt.zero_grad()
            with prec.autocast():
                loss = loss_of(net(*args), target, loss_fn)
            prec.backward(loss)
            prec.step(opt)
        return step

    return time_steps(build_copies(model), policy, make_step, rounds=rounds,
                      device_sync=torch.cuda.synchronize if cuda else (lambda: None),
                      devices=tuple(cuda))
