"""Backends of :class:`lowprec.Precision` as plug-ins: ``native`` (torch dtypes) and
``emulated`` (the operator-level engine), one module each, and ``compiled`` (the emulated kind
run compiled by Inductor: ``Precision(..., compile=True)``); :mod:`.base` holds the interface
and the registries, :mod:`.choice` the choice between them (``auto``: by the device's facts),
:mod:`.probe` that choice checked by timing the model's own steps."""

from . import base, choice, compiled, emulated, native, probe
from .base import (BACKENDS, COMPILED_BACKENDS, PrecisionBackend, backend_class,
                   compile_ignored, register_backend, register_compiled_backend)
from .choice import (BackendChoice, BackendChoiceWarning, announce, can_be_native,
                     choose_backend)
from .compiled import CompiledEmulatedBackend
from .emulated import EmulatedBackend
from .native import NativeBackend
from .probe import BackendTiming

__all__ = ["base", "choice", "compiled", "emulated", "native", "BACKENDS", "COMPILED_BACKENDS",
           "PrecisionBackend", "backend_class", "compile_ignored", "register_backend",
           "register_compiled_backend", "CompiledEmulatedBackend", "BackendChoice",
           "BackendChoiceWarning", "announce", "can_be_native", "choose_backend",
           "EmulatedBackend", "NativeBackend", "probe", "BackendTiming"]
