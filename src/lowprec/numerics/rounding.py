"""Rounding modes: an Enum, parsed from short names, with the random-bit budget of stochastic modes.

The five deterministic modes are those of IEEE 754-2019 section 4.3. The two stochastic ones
follow Gupta et al. (2015): a value x between neighbours lo < x < hi rounds up with probability
p = (x - lo) / (hi - lo). ``STOCHASTIC`` draws 32 random bits per element, so p is exact to 2**-32;
``STOCHASTIC_LIMITED`` draws only ``random_bits`` bits (8 by default), as hardware does: the
discarded fraction is truncated to that many bits and added to the random integer, and the carry
decides (p = floor(p * 2**r) / 2**r; Graphcore IPU and AMD MI300 work this way, and gfloat calls
it ``StochasticFastest``).

A :class:`RoundingSpec` is a mode together with its random-bit budget, the unit a policy stores
(``e5m2:sr4`` must keep its 4 bits from the spec through training and back to the spec).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Rounding", "RoundingSpec", "parse_rounding", "DEFAULT_LIMITED_BITS", "check_generator",
           "RoundingRule", "RULES", "round_up", "toward_zero"]

DEFAULT_LIMITED_BITS = 8


def check_generator(generator, name: str = "generator"):
    """``generator`` if it is None or a ``torch.Generator``; TypeError naming the value else
    (a seed given as a number or a string belongs in ``torch.Generator().manual_seed(seed)``)."""
    import torch

    if generator is None or isinstance(generator, torch.Generator):
        return generator
    shown = repr(generator)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    raise TypeError(f"{name}={shown} ({type(generator).__name__}) must be a torch.Generator or "
                    "None, e.g. torch.Generator().manual_seed(0)")


class Rounding(str, Enum):
    NEAREST_EVEN = "nearest"
    NEAREST_AWAY = "nearest_away"
    TOWARD_ZERO = "toward_zero"
    UP = "up"
    DOWN = "down"
    STOCHASTIC = "stochastic"
    STOCHASTIC_LIMITED = "stochastic_limited"

    @property
    def is_stochastic(self) -> bool:
        return self in (Rounding.STOCHASTIC, Rounding.STOCHASTIC_LIMITED)

    @property
    def short(self) -> str:
        """Compact name used in policy specs (``e5m2:sr``)."""
        return _SHORT[self]

    def __str__(self) -> str:
        return self.value


_SHORT = {
    Rounding.NEAREST_EVEN: "rn",
    Rounding.NEAREST_AWAY: "rna",
    Rounding.TOWARD_ZERO: "rz",
    Rounding.UP: "ru",
    Rounding.DOWN: "rd",
    Rounding.STOCHASTIC: "sr",
    Rounding.STOCHASTIC_LIMITED: "srN",
}

_NAMES = {
    "nearest": Rounding.NEAREST_EVEN,
    "nearest_even": Rounding.NEAREST_EVEN,
    "rne": Rounding.NEAREST_EVEN,
    "rn": Rounding.NEAREST_EVEN,
    "nearest_away": Rounding.NEAREST_AWAY,
    "rna": Rounding.NEAREST_AWAY,
    "toward_zero": Rounding.TOWARD_ZERO,
    "truncate": Rounding.TOWARD_ZERO,
    "trunc": Rounding.TOWARD_ZERO,
    "rz": Rounding.TOWARD_ZERO,
    "up": Rounding.UP,
    "ceil": Rounding.UP,
    "ru": Rounding.UP,
    "down": Rounding.DOWN,
    "floor": Rounding.DOWN,
    "rd": Rounding.DOWN,
    "stochastic": Rounding.STOCHASTIC,
    "sr": Rounding.STOCHASTIC,
    "stochastic_limited": Rounding.STOCHASTIC_LIMITED,
}

_LIMITED_RE = re.compile(r"^(?:sr|stochastic_limited|stochastic)(\d+)$")


@dataclass(frozen=True)
class RoundingRule:
    """A mode's integer code and, for a deterministic mode, when it rounds a magnitude up, by
    where the discarded part d of the quantum lies: ``above`` (d > 1/2), ``tie`` (d = 1/2),
    ``below`` (0 < d < 1/2), each "never", "always", "odd" (the kept significand is odd),
    "positive" or "negative" (the value's sign). Stochastic modes draw instead ("random")."""

    code: int
    above: str
    tie: str
    below: str


#: every mode's rule: the one table the torch paths (reference, fused, accumulation and its
#: scalar reference) read through :func:`round_up` and :func:`toward_zero`; ``code`` is what
#: every quantization path takes (params.R_*, the R_* enum of csrc/lp_common.h, whose
#: lp_up32/lp_up64/lp_tz are the C kernel's spelling of the same rules)
RULES = {
    Rounding.NEAREST_EVEN: RoundingRule(0, "always", "odd", "never"),
    Rounding.NEAREST_AWAY: RoundingRule(1, "always", "always", "never"),
    Rounding.TOWARD_ZERO: RoundingRule(2, "never", "never", "never"),
    Rounding.UP: RoundingRule(3, "positive", "positive", "positive"),
    Rounding.DOWN: RoundingRule(4, "negative", "negative", "negative"),
    Rounding.STOCHASTIC: RoundingRule(5, "random", "random", "random"),
    Rounding.STOCHASTIC_LIMITED: RoundingRule(5, "random", "random", "random"),
}
_BY_CODE = {rule.code: rule for rule in RULES.values()}


def _not(v):
    return (not v) if isinstance(v, bool) else ~v


def round_up(mode: "Rounding | int", gt, eq, nonzero, odd, neg):
    """Whether the deterministic ``mode`` (a Rounding or its code) rounds a magnitude up, as a
    bool or a bool tensor; None where it never does (toward zero). ``gt``, ``eq``, ``nonzero``:
    thunks giving d > 1/2, d == 1/2 and d != 0 for the discarded part d of the quantum, ``odd``
    one giving whether the kept significand is odd (each computed only where the rule asks);
    ``neg``: the value's sign (a bool or a bool tensor)."""
    rule = RULES[mode] if isinstance(mode, Rounding) else _BY_CODE[mode]
    if rule.above == "random":
        raise ValueError(f"round_up: {mode} is stochastic (its paths draw)")
    if rule.above == rule.tie == rule.below:  # one condition wherever d is not 0
        parts = ((rule.above, nonzero),)
    else:
        parts = ((rule.above, gt), (rule.tie, eq),
                 (rule.below, lambda: nonzero() & _not(gt() | eq())))
    up = None
    for when, where in parts:
        if when == "never":
            continue
        term = where()
        if when == "odd":
            term = term & odd()
        elif when == "positive":
            term = term & _not(neg)
        elif when == "negative":
            term = term & neg
        up = term if up is None else up | term
    return up


def toward_zero(mode: "Rounding | int", neg):
    """Whether a value beyond the format's largest finite one rounds to that largest finite
    (IEEE 754-2019 section 7.4: the directed modes that round this sign toward zero) rather
    than to the overflow value: where the mode never rounds a magnitude up beyond half a
    quantum. True, False, or ``neg`` / not ``neg`` (bool or bool tensor)."""
    above = (RULES[mode] if isinstance(mode, Rounding) else _BY_CODE[mode]).above
    if above == "never":
        return True
    if above == "positive":
        return neg
    if above == "negative":
        return _not(neg)
    return False


@dataclass(frozen=True)
class RoundingSpec:
    """A rounding mode and its random bits per element (32 for ``STOCHASTIC``, 1..32 for
    ``STOCHASTIC_LIMITED``, 0 for the deterministic modes). ``quantize`` and ``parse_rounding``
    accept it wherever they accept a mode; ``str(spec)`` is its compact name (``sr4``)."""

    mode: Rounding = Rounding.NEAREST_EVEN
    bits: int = 0

    def __post_init__(self) -> None:
        mode, bits = parse_rounding(Rounding(self.mode), self.bits or None)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "bits", bits)

    @classmethod
    def parse(cls, rounding: "str | Rounding | RoundingSpec") -> "RoundingSpec":
        """``"sr4"``, ``"stochastic"``, ``Rounding.UP``... as a spec (a spec is returned as is)."""
        if isinstance(rounding, RoundingSpec):
            return rounding
        return cls(*parse_rounding(rounding))

    @property
    def is_stochastic(self) -> bool:
        return self.mode.is_stochastic

    def __str__(self) -> str:
        if self.mode is Rounding.STOCHASTIC_LIMITED:
            return f"sr{self.bits}"
        return self.mode.value


def parse_rounding(rounding: "str | Rounding | RoundingSpec",
                   random_bits: int | None = None) -> tuple[Rounding, int]:
    """Return ``(mode, random_bits)``.

    ``"sr8"`` (or ``"stochastic_limited"`` with ``random_bits=8``) is stochastic rounding with
    8 random bits; ``"sr"`` uses 32. Deterministic modes return ``random_bits=0``. A
    :class:`RoundingSpec` gives its own mode and bits (``random_bits`` must agree or be None).
    """
    if isinstance(rounding, RoundingSpec):
        if random_bits is not None and random_bits != rounding.bits:
            raise ValueError(f"rounding {rounding} conflicts with random_bits={random_bits}")
        return rounding.mode, rounding.bits
    if isinstance(rounding, Rounding):
        mode = rounding
    elif isinstance(rounding, str):
        key = rounding.strip().lower().replace("-", "_")
        if key in _NAMES:
            mode = _NAMES[key]
        elif m := _LIMITED_RE.match(key):
            mode, bits = Rounding.STOCHASTIC_LIMITED, int(m.group(1))
            if not 1 <= bits <= 32:
                raise ValueError(f"rounding mode {rounding!r}: srN takes N = 1..32 random bits")
            if random_bits is not None and random_bits != bits:
                raise ValueError(f"rounding {rounding!r} conflicts with random_bits={random_bits}")
            random_bits = bits
        else:
            accepted = ", ".join(sorted(_NAMES)) + ", srN (N random bits, 1..32)"
            raise ValueError(f"unknown rounding mode {rounding!r}; accepted: {accepted}")
    else:
        raise TypeError(f"rounding must be a str or lowprec.Rounding, got {rounding!r}")

    if mode is Rounding.STOCHASTIC:
        if random_bits not in (None, 32):
            return parse_rounding(Rounding.STOCHASTIC_LIMITED, random_bits)
        return mode, 32
    if mode is Rounding.STOCHASTIC_LIMITED:
        bits = DEFAULT_LIMITED_BITS if random_bits is None else random_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 32:
            raise ValueError(f"random_bits={bits!r} must be an int in [1, 32]")
        return mode, bits
    if random_bits not in (None, 0):
        raise ValueError(f"random_bits={random_bits} is only meaningful for stochastic rounding")
    return mode, 0
