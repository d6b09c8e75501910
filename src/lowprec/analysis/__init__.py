"""Why a regime fails or works: the 16-bit certificate, layer-wise errors, range profiles,
lost updates, the first non-finite operation, the loss scale a model needs, and ``advise`` that
puts them together. Each analysis takes a model and data and returns plain dataclasses."""

from .advise import Advice, advise
from .certify import Certificate, certificate_from_outputs, certify
from .common import fp32_twin, low_precision_copy
from .layers import LayerError, layer_errors
from .nonfinite import Finding, NonFiniteReport, first_nonfinite
from .ranges import RangeProfile, RoleStats, classify, overflow_threshold, range_profile
from .scaling import LossScaleChoice, find_loss_scale
from .updates import LostUpdates, lost_fractions, lost_updates

__all__ = [
    "Advice", "advise",
    "Certificate", "certificate_from_outputs", "certify",
    "fp32_twin", "low_precision_copy",
    "LayerError", "layer_errors",
    "Finding", "NonFiniteReport", "first_nonfinite",
    "RangeProfile", "RoleStats", "classify", "overflow_threshold", "range_profile",
    "LossScaleChoice", "find_loss_scale",
    "LostUpdates", "lost_fractions", "lost_updates",
]
