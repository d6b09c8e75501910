"""Backends of :class:`lowprec.Precision` as plug-ins: ``native`` (torch dtypes) and
``emulated`` (the operator-level engine), one module each; :mod:`.base` holds the interface and
the registry, :mod:`.choice` the choice between them (``auto``: by the device's facts),
:mod:`.probe` that choice checked by timing the model's own steps."""

from . import base, choice, emulated, native, probe
from .base import BACKENDS, PrecisionBackend, backend_class, register_backend
from .choice import (BackendChoice, BackendChoiceWarning, announce, can_be_native,
                     choose_backend)
from .emulated import EmulatedBackend
from .native import NativeBackend
from .probe import BackendTiming

__all__ = ["base", "choice", "emulated", "native", "BACKENDS", "PrecisionBackend",
           "backend_class", "register_backend", "BackendChoice", "BackendChoiceWarning",
           "announce", "can_be_native", "choose_backend", "EmulatedBackend", "NativeBackend",
           "probe", "BackendTiming"]
