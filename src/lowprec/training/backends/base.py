"""The backend interface: how :class:`lowprec.Precision` realises a policy's formats on a model.

``Precision`` keeps the loop (set-up, autocast, scaled backward, the checked step, state); a
backend keeps what depends on how low-precision values are represented. Two are registered:
``native`` (real torch dtypes: ``model.to(torch.bfloat16)``, ``torch.autocast``;
:mod:`.native`) and ``emulated`` (fp32 carriers rounded onto the policy's grids by the
operator-level engine; :mod:`.emulated`). A backend is one module with one
:class:`PrecisionBackend` subclass registered with :func:`register_backend`, as Lightning's
precision plugins are one class per regime; ``Precision`` calls the hooks below and knows no
backend by name. A kind may also register the backend that runs it compiled
(:func:`register_compiled_backend`: the emulated kind's is :mod:`.compiled`), which
``Precision(..., compile=True)`` takes instead (:func:`backend_class`).

| hook | called by ``Precision`` | native | emulated |
|---|---|---|---|
| ``convert_module(model, names)`` | ``setup``, after the regimes' ``prepare`` | cast to the dtype (channels-last bf16 convolutions), input-cast hook, fp32 recurrent fallback | the engine, parameters and buffers rounded onto their formats |
| ``convert_input(x)`` | ``convert_input``, the ledger | cast to the dtype (pure policies) | as is |
| ``autocast()`` | ``autocast`` | ``torch.autocast`` (mixed policies) | the engine active (mixed policies) |
| ``carriers`` | the optimizer's wrapping | False | True: storage formats applied at the write-back |
| ``optimizer_storage()`` | ``setup_optimizer`` | no parameter format (the dtype holds it) | the parameter format, per-module overrides |
| ``grad_formats(params)`` / ``round_grads`` | ``step``, ``unscale_`` | nothing to round | each gradient rounded to its parameter's format |
| ``stored_formats()`` | ``checkpoint_state_dict`` | nothing (tensors are in their dtype) | name -> format of every tensor on a grid |
| ``ledger_compute()`` | ``memory`` | None (dtypes tell) | the compute format |
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ...numerics.formats import FP32, Format
from ...numerics.quantize import quantize_, quantize_counting_
from ..policy import Backend, Policy
from ..regimes import GroupKey, Role

__all__ = ["PrecisionBackend", "register_backend", "register_compiled_backend",
           "backend_class", "compile_ignored", "BACKENDS", "COMPILED_BACKENDS"]


def _no_refinement(fmt: Format, key: GroupKey, x: torch.Tensor) -> Format:
    return fmt


class PrecisionBackend:
    """Hooks of a backend; the defaults are those of a backend that rounds nothing itself.

    Built by ``Precision.setup`` once the backend is chosen, with the policy, the model's device,
    the generator of stochastic rounding, ``resolve(fmt, key, x)`` (the regimes' refinement of a
    format for a group, e.g. dynamic fixed point's current range), the regimes'
    ``engine_options``, the per-module overrides, ``match_cpu_kernels`` and ``target``
    (whose 16-bit kernels an emulation follows where a CPU's and CUDA's differ). Compiling is
    a backend of its own (:func:`register_compiled_backend`), not an argument.
    """

    #: the :class:`~lowprec.training.policy.Backend` value this class implements
    kind: Backend
    #: True when parameters and optimizer state are fp32 carriers of low-precision values: an
    #: optimizer must apply the storage formats at its write-back (lowprec's optimizers
    #: configured, any other wrapped in ``FormatOptimizer``)
    carriers = False
    #: why ``compile=True`` does nothing on this backend, where no compiled backend is
    #: registered for its kind (the warning's parenthesis: :func:`compile_ignored`)
    compile_note = ""

    def __init__(self, policy: Policy, device: torch.device, *,
                 generator: torch.Generator | None = None, resolve=None,
                 engine_options: dict | None = None, overrides: dict | None = None,
                 match_cpu_kernels: bool = False, target: str | None = None) -> None:
        self.policy = policy
        self.target = target
        self.device = device
        self.generator = generator
        self.resolve = resolve if resolve is not None else _no_refinement
        self.engine_options = dict(engine_options or {})
        self.overrides = dict(overrides or {})
        self.match_cpu_kernels = match_cpu_kernels
        self.model: nn.Module | None = None
        self.names: dict[int, str] = {}  # id(parameter) -> its name in the model
        self.handles: list = []  # hooks this backend installed
        #: the emulation engine, for backends that run one (analyses observe its ops)
        self.engine = None

    # -- set-up ------------------------------------------------------------------------------
    def convert_module(self, model: nn.Module, names: dict[int, str], *,
                       compute_replaced: bool = False) -> None:
        """Convert ``model`` in place. ``names``: id(parameter) -> name, taken before the
        regimes prepared the model. ``compute_replaced``: a regime's ``prepare`` made the model
        compute in the policy's compute format itself (no casts or engine then)."""
        self.model = model
        self.names = names

    def convert_input(self, x):
        """Floating inputs as the converted model takes them."""
        return x

    @contextlib.contextmanager
    def autocast(self):
        """The context in which mixed policies (scope ``matmul``) compute matmul layers in the
        compute format; entered by ``Precision.autocast`` only for such policies."""
        yield

    # -- storage -----------------------------------------------------------------------------
    def optimizer_storage(self) -> dict:
        """Keyword arguments of ``configure_storage`` that depend on the backend:
        ``param_format`` (None where the parameter's dtype holds it) and, for parameters stored
        in a format of their own, ``param_formats`` (id -> format)."""
        return {"param_format": None}

    def grad_formats(self, params: list) -> list[Format]:
        """The format each parameter's gradient is stored in at the step, where the backend
        has to put it there (FP32: the gradient is kept as it is)."""
        return [FP32] * len(params)

    def round_grads(self, params: list, formats: list[Format], *, count: bool = False
                    ) -> tuple[int, list]:
        """Round each gradient in place onto its format (from :meth:`grad_formats`), refined
        per group by the regimes. ``count``: a gradient the kernel can round and check in one
        pass (:func:`~lowprec.numerics.quantize.quantize_counting_`) is so rounded and its Inf
        and NaN values counted. Returns the count and the gradients not counted (all of them
        without ``count``), which the caller checks."""
        found, rest = 0, []
        for p, fmt in zip(params, formats):
            n = None
            if fmt != FP32:
                key = GroupKey(Role.PARAM_GRAD, self.names.get(id(p), str(id(p))))
                fmt = self.resolve(fmt, key, p.grad)
                n = quantize_counting_(p.grad, fmt) if count else None
                if n is None:
                    quantize_(p.grad, fmt)
            if n is None:
                rest.append(p.grad)
            else:
                found += n
        return found, rest

    def stored_formats(self) -> dict[str, Format]:
        """Name -> format of each parameter and buffer held on a format's grid in a wider
        dtype (a checkpoint converts those to the format's own dtype); empty where tensors are
        already in their dtype."""
        return {}

    def ledger_compute(self) -> Format | None:
        """The format saved activations count at in the memory ledger where their dtype does
        not tell it (fp32 carriers); None otherwise."""
        return None


BACKENDS: dict[Backend, type[PrecisionBackend]] = {}


def _register(table: dict, cls: type[PrecisionBackend], what: str) -> type[PrecisionBackend]:
    """``cls`` into ``table`` under its ``kind``, checked: one class per kind."""
    if not (isinstance(cls, type) and issubclass(cls, PrecisionBackend)):
        raise TypeError(f"a backend must be a PrecisionBackend subclass, got {cls!r}")
    kind = getattr(cls, "kind", None)
    kind = Backend.parse(kind) if isinstance(kind, str) else None
    if kind is None or kind is Backend.AUTO:
        raise ValueError(f"{cls.__name__}.kind must be a Backend other than auto")
    if table.get(kind, cls) is not cls:
        raise ValueError(f"{what} for {kind} is already registered ({table[kind].__name__})")
    table[kind] = cls
    return cls


def register_backend(cls: type[PrecisionBackend]) -> type[PrecisionBackend]:
    """Register ``cls`` for its ``kind`` (usable as a decorator); one class per kind."""
    return _register(BACKENDS, cls, "a backend")


#: kind -> the backend that runs it compiled (``Precision(..., compile=True)``)
COMPILED_BACKENDS: dict[Backend, type[PrecisionBackend]] = {}


def register_compiled_backend(cls: type[PrecisionBackend]) -> type[PrecisionBackend]:
    """Register ``cls`` as the compiled backend of its ``kind`` (usable as a decorator): the
    class :func:`backend_class` gives with ``compiled=True``; one class per kind."""
    return _register(COMPILED_BACKENDS, cls, "a compiled backend")


def backend_class(kind: Backend, compiled: bool = False) -> type[PrecisionBackend]:
    """The class registered for ``kind`` (with ``compiled``: its compiled backend, where one is
    registered); ValueError naming the registered ones else."""
    try:
        kind = Backend.parse(kind)
        if compiled and kind in COMPILED_BACKENDS:
            return COMPILED_BACKENDS[kind]
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"no backend is registered for {kind}; registered: "
                         f"{', '.join(str(k) for k in BACKENDS)}") from None


def compile_ignored(kind: Backend, policy) -> str | None:
    """What to warn where ``compile=True`` asks for a kind with no compiled backend (None
    where it has one)."""
    kind = Backend.parse(kind)
    if kind in COMPILED_BACKENDS:
        return None
    note = getattr(BACKENDS.get(kind), "compile_note", "")
    compiles = ", ".join(f"{k} policies (b={k})" for k in COMPILED_BACKENDS)
    return (f"compile=True has no effect: policy {policy} runs on the {kind} backend{note}; "
            f"it compiles {compiles}")
