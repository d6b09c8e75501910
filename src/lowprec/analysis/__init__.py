"""Why a regime fails or works: the 16-bit certificate, layer-wise errors, range profiles,
lost updates, the first non-finite layer, and ``advise`` that puts them together."""

from .advise import Advice, advise
from .certify import Certificate, certificate_from_outputs, certify
from .layers import LayerError, layer_errors
from .nonfinite import Finding, NonFiniteReport, first_nonfinite
from .ranges import RangeProfile, RoleStats, classify, overflow_threshold, range_profile
from .updates import LostUpdates, lost_fractions, lost_updates

__all__ = [
    "Advice", "advise",
    "Certificate", "certificate_from_outputs", "certify",
    "LayerError", "layer_errors",
    "Finding", "NonFiniteReport", "first_nonfinite",
    "RangeProfile", "RoleStats", "classify", "overflow_threshold", "range_profile",
    "LostUpdates", "lost_fractions", "lost_updates",
]
