"""Precision policies: which format each role uses, as data.

A :class:`Policy` names the format of parameters (and their gradients, which PyTorch stores in
the parameter's dtype), of the forward computation, of the gradients flowing backward through
activations, of the optimizer state and of optional master weights; how values are rounded;
how parameters are written back after an update; the loss-scaling rule; and the backend.

Compact specs, one ``key=value`` per role, a format optionally followed by ``:rounding``::

    p=fp16,c=fp16,g=fp16,o=fp32,m=fp32,ls=dynamic     # Apex O2, "16-master"
    p=bf16:kahan                                        # pure bf16, Kahan-compensated updates
    p=fp32,c=e4m3fn,g=e5m2:sr,s=matmul                  # fp8 matmuls, stochastic fp8 gradients

Keys: ``p`` params (``:nearest|stochastic|kahan`` is the write-back), ``c`` compute (``:mode``
rounds activations), ``g`` activation gradients (``:mode``), ``o`` optimizer state, ``m`` master
weights (``none``), ``ls`` loss scale (below), ``b`` backend (``auto``, ``native``, ``emulated``), ``s`` scope of the compute
format (``all`` layers, or ``matmul`` layers only as torch.autocast does), ``sc`` scaled GEMMs: a
recipe casting each operand of the forward and both backward GEMMs with its own scaling
(``fp8-rowwise``, ``mxfp8``...; see :mod:`lowprec.training.scaling`), emulated; ``acc`` the GEMM
accumulator of linear, matmul, conv2d and attention, forward and backward
(``acc=fp16:chunk128:sr``; see :mod:`lowprec.numerics.accumulation`), emulated.

Loss scale ``ls=``: ``none``; ``static:S`` with S > 0 finite; ``dynamic``; or ``dynamic:`` with
options separated by ``;`` (or by ``,``: an option key after ``ls=`` continues it), each checked
when the policy is parsed: ``init`` > 0 (finite), ``growth`` > 1, ``backoff`` in (0, 1),
``interval`` an integer >= 1, ``min``/``max`` with 0 < min <= init <= max (defaults 1 and
2**24, widened to hold init), each option once. Each key of the policy is given once too::

    p=fp16,ls=dynamic:init=1024;growth=4;interval=500
    p=fp16,ls=dynamic:init=1024,growth=4                # the same policy
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum

from ..numerics.accumulation import Accumulator, parse_accumulator
from ..numerics.formats import FP32, FloatFormat, Format, parse_format
from ..numerics.rounding import Rounding, RoundingSpec, parse_rounding
from .loss_scale import DYNAMIC_OPTIONS, loss_scale_spec, parse_loss_scale
from .scaling import RECIPES, GemmScaling, parse_scaling

__all__ = ["Policy", "parse_policy", "policy_or_format", "POLICIES", "register_policy", "UPDATE_MODES", "split_top",
           "WriteBack", "Backend", "Scope"]


class _Choice(str, Enum):
    """A closed set of names: compares equal to its string value (``WriteBack.KAHAN ==
    "kahan"``), prints as it, and parses with a one-line error naming the accepted values."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value):
        if isinstance(value, cls):
            return value
        key = value.strip().lower() if isinstance(value, str) else value
        try:
            return cls(key)
        except ValueError:
            accepted = ", ".join(m.value for m in cls)
            raise ValueError(f"{cls._label()}={value!r}; accepted: {accepted}") from None

    @classmethod
    def _label(cls) -> str:
        return cls.__name__.lower()


class WriteBack(_Choice):
    """How an optimizer writes an fp32 result onto the parameter format (see
    :mod:`lowprec.training.optim.writeback`)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"
    KAHAN = "kahan"

    @classmethod
    def _label(cls) -> str:
        return "update"


class Backend(_Choice):
    """``native`` torch dtypes, ``emulated`` rounding on fp32 carriers, or ``auto``."""

    AUTO = "auto"
    NATIVE = "native"
    EMULATED = "emulated"


class Scope(_Choice):
    """Which layers compute in the compute format: ``all``, or ``matmul`` as torch.autocast."""

    ALL = "all"
    MATMUL = "matmul"


UPDATE_MODES = tuple(m.value for m in WriteBack)


def _check_loss_scale(spec: str) -> str:
    """The canonical form of a valid ``ls=`` value (see the module docstring); ValueError else."""
    return loss_scale_spec(*parse_loss_scale(spec))


def _join_loss_scale_options(items: list[str]) -> list[str]:
    """``ls=dynamic:init=1024,growth=4`` split on commas: a piece whose key is a dynamic
    loss-scale option (no policy key is one) continues the ``ls`` piece before it."""
    out: list[str] = []
    for item in items:
        key = item.partition("=")[0].strip().lower()
        prev = out[-1].partition("=")[0].strip().lower() if out else ""
        if key in DYNAMIC_OPTIONS and prev in ("ls", "loss_scale") and ":" in out[-1]:
            out[-1] += ";" + item.strip()
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class Policy:
    params: Format = FP32
    compute: Format = FP32
    grads: Format = FP32
    optimizer_state: Format = FP32
    master: Format | None = None
    rounding: RoundingSpec = RoundingSpec()
    grad_rounding: RoundingSpec = RoundingSpec()
    update: WriteBack = WriteBack.NEAREST
    loss_scale: str = "none"
    backend: Backend = Backend.AUTO
    scope: Scope = Scope.ALL
    scaled: GemmScaling | None = None
    accumulator: Accumulator | None = None
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for role in ("params", "compute", "grads", "optimizer_state"):
            object.__setattr__(self, role, parse_format(getattr(self, role)))
        if self.master is not None:
            object.__setattr__(self, "master", parse_format(self.master))
        # the rounding keeps its random bits (``sr4`` trains with 4 and prints as sr4)
        object.__setattr__(self, "rounding", RoundingSpec.parse(self.rounding))
        object.__setattr__(self, "grad_rounding", RoundingSpec.parse(self.grad_rounding))
        object.__setattr__(self, "update", WriteBack.parse(self.update))
        object.__setattr__(self, "backend", Backend.parse(self.backend))
        object.__setattr__(self, "scope", Scope.parse(self.scope))
        object.__setattr__(self, "loss_scale", _check_loss_scale(self.loss_scale))
        object.__setattr__(self, "scaled", parse_scaling(self.scaled))
        if self.accumulator is not None:
            object.__setattr__(self, "accumulator", parse_accumulator(self.accumulator))

    @property
    def is_fp32(self) -> bool:
        return all(f == FP32 for f in (self.params, self.compute, self.grads,
                                       self.optimizer_state)) and self.master is None \
            and self.scaled is None and self.accumulator is None

    @property
    def spec(self) -> str:
        """The canonical compact spec; ``parse_policy(p.spec) == p``."""
        def fr(fmt, mode: RoundingSpec) -> str:
            return f"{fmt}" if mode == RoundingSpec() else f"{fmt}:{mode}"

        parts = [f"p={self.params}" + ("" if self.update == "nearest" else f":{self.update}"),
                 f"c={fr(self.compute, self.rounding)}",
                 f"g={fr(self.grads, self.grad_rounding)}",
                 f"o={self.optimizer_state}",
                 f"m={self.master if self.master is not None else 'none'}",
                 f"ls={self.loss_scale}", f"b={self.backend}", f"s={self.scope}"]
        if self.scaled is not None:
            parts.append(f"sc={self.scaled}")
        if self.accumulator is not None:
            parts.append(f"acc={self.accumulator}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.name or self.spec

    def with_(self, **changes) -> "Policy":
        """A copy with some fields changed (the name is dropped unless given)."""
        changes.setdefault("name", None)
        return replace(self, **changes)


def split_top(spec: str) -> list[str]:
    """Split on commas outside <...> (formats such as fixed<16,14> contain commas)."""
    out, depth, cur = [], 0, []
    for ch in spec:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


_KEYS = {
    "p": "params", "params": "params",
    "c": "compute", "compute": "compute",
    "g": "grads", "grads": "grads",
    "o": "optimizer_state", "opt": "optimizer_state", "optimizer_state": "optimizer_state",
    "m": "master", "master": "master",
    "ls": "loss_scale", "loss_scale": "loss_scale",
    "b": "backend", "backend": "backend",
    "s": "scope", "scope": "scope",
    "r": "rounding", "rounding": "rounding",
    "u": "update", "update": "update",
    "sc": "scaled", "scaled": "scaled",
    "acc": "accumulator", "accumulator": "accumulator",
}

POLICIES: dict[str, Policy] = {}


def register_policy(name: str, spec: str | Policy) -> Policy:
    """Add a named policy (later issues register the literature's regimes here)."""
    pol = spec if isinstance(spec, Policy) else _parse_spec(spec)
    pol = replace(pol, name=name)
    POLICIES[name] = pol
    return pol


def _bad_policy(spec, why: str = "") -> ValueError:
    names = ", ".join(POLICIES)
    reason = f" ({why})" if why else ""
    return ValueError(f"unknown policy {spec!r}{reason}; valid names: {names}; or a fixed-point "
                      "regime qIL.FL-sr|-rn or fixed<WL,FL>-sr|-rn (e.g. 'q6.10-sr'); or a spec "
                      "such as 'p=fp16,c=fp16,g=fp16,m=fp32' with keys p c g o m ls b s sc acc; "
                      "or a format such as 'bf16' or 'e4m3fn' (every role in it)")


def _parse_spec(spec: str) -> Policy:
    kv, seen = _split_spec(spec)
    kwargs = _role_formats(kv)
    params, compute = kwargs.get("params", FP32), kwargs["compute"]
    _refuse_given_twice(kv, seen, kwargs)
    for key in ("loss_scale", "backend", "scope", "update"):
        if key in kv:
            kwargs[key] = kv[key].lower()
    if "scaled" in kv:
        kwargs["scaled"] = parse_scaling(kv["scaled"])
    if "accumulator" in kv:
        kwargs["accumulator"] = parse_accumulator(kv["accumulator"])
    if "rounding" in kv:
        kwargs["rounding"] = kv["rounding"]
        kwargs.setdefault("grad_rounding", kv["rounding"])
    if "scope" not in kv:
        # a wider parameter format than the compute format means mixed precision: only the
        # matmul-like layers run in the compute format, as under torch.autocast
        wider = (isinstance(params, FloatFormat) and isinstance(compute, FloatFormat)
                 and params == FP32 and compute != FP32)
        kwargs["scope"] = Scope.MATMUL if wider else Scope.ALL
    return Policy(**kwargs)


def _split_spec(spec: str) -> tuple[dict[str, str], dict[str, str]]:
    """A spec's items as {role: value} and {role: the key as written}; each role given once."""
    kv: dict[str, str] = {}
    seen: dict[str, str] = {}  # role -> the key as written
    for item in _join_loss_scale_options(split_top(spec)):
        if "=" not in item:
            raise _bad_policy(spec, f"{item!r} is not key=value")
        key, val = (s.strip() for s in item.split("=", 1))
        if key.lower() not in _KEYS:
            raise _bad_policy(spec, f"unknown key {key!r}")
        role = _KEYS[key.lower()]
        if role in kv:
            # p=fp16,p=bf16 (or p=... and params=...): which one was meant is a guess
            raise ValueError(f"{role} given twice ({seen[role]}={kv[role]!r} and {key}={val!r}); "
                             "give each key once")
        kv[role], seen[role] = val, key
    if not kv:
        raise _bad_policy(spec)
    return kv, seen


def _fmt_and_mode(value: str):
    """``"e5m2:sr"`` -> (format, mode or None); formats themselves never contain ':'."""
    f, _, mode = value.partition(":")
    return parse_format(f), (mode or None)


def _role_formats(kv: dict[str, str]) -> dict:
    """Policy's keyword arguments for the formats of the roles (and the modes written on them)."""
    kwargs: dict = {}
    if "params" in kv:
        f, mode = _fmt_and_mode(kv["params"])
        kwargs["params"] = f
        if mode:
            kwargs["update"] = _write_back(kv["params"], mode)
    params = kwargs.get("params", FP32)
    if "compute" in kv:
        kwargs["compute"], mode = _fmt_and_mode(kv["compute"])
        if mode:
            kwargs["rounding"] = mode
    compute = kwargs.get("compute", params)
    kwargs.setdefault("compute", compute)
    if "grads" in kv:
        kwargs["grads"], mode = _fmt_and_mode(kv["grads"])
        if mode:
            kwargs["grad_rounding"] = mode
    kwargs.setdefault("grads", compute)
    kwargs["optimizer_state"] = (parse_format(kv["optimizer_state"]) if "optimizer_state" in kv
                                 else params)
    if "master" in kv:
        kwargs["master"] = None if kv["master"].lower() in ("none", "") else parse_format(
            kv["master"])
    return kwargs


def _write_back(value: str, mode: str):
    """The write-back that ``p=fmt:mode`` names (``value`` is the p= value, for the error)."""
    # p=fmt:kahan names the write-back; a rounding mode (p=fmt:sr) picks the stochastic
    # or nearest write-back
    if mode.lower() in UPDATE_MODES:
        return mode.lower()
    wmode, _ = parse_rounding(mode)
    if wmode is Rounding.STOCHASTIC_LIMITED:
        # the write-back draws 32 bits; accepting srN here would drop the N
        raise ValueError(f"p={value!r}: the write-back takes nearest, "
                         f"stochastic (32 random bits) or kahan, not {mode!r}")
    return WriteBack.STOCHASTIC if wmode.is_stochastic else WriteBack.NEAREST


def _refuse_given_twice(kv: dict[str, str], seen: dict[str, str], kwargs: dict) -> None:
    """ValueError for one setting given twice in two ways (a p=/c=/g= suffix and its own key)."""
    # one setting given twice in two ways: p=fp16:kahan with u=nearest, c=fp16:sr with r=...
    if "update" in kv and "update" in kwargs:
        raise ValueError(f"the write-back is given twice (p={kv['params']!r} and "
                         f"{seen['update']}={kv['update']!r}); give it once")
    for role, key in (("compute", "c"), ("grads", "g")):
        if "rounding" in kv and role in kv and ":" in kv[role]:
            raise ValueError(f"the {role} rounding is given twice ({seen[role]}={kv[role]!r} and "
                             f"{seen['rounding']}={kv['rounding']!r}); give it once")


_FIXED_POLICY_RE = re.compile(r"^(?:fixed<(\d+),(\d+)>|q(-?\d+)\.(\d+))-(sr|rn)$")


def _fixed_policy(name: str, m: re.Match) -> Policy:
    """Gupta et al. (2015): weights, activations and gradients in one <IL, FL> fixed-point format,
    products accumulated in fp32 and rounded once at each layer's output, saturating; rounding
    to nearest (``-rn``) or stochastic (``-sr``), also for the weight update. Momentum stays fp32.
    ``fixed<WL,FL>-sr`` gives the word length, ``qIL.FL-sr`` the integer bits."""
    if m.group(1) is not None:
        word, frac = int(m.group(1)), int(m.group(2))
        fmt = f"q{word - frac}.{frac}"
    else:
        fmt = f"q{m.group(3)}.{m.group(4)}"
    if m.group(5) == "sr":
        spec = f"p={fmt}:stochastic,c={fmt}:sr,g={fmt}:sr,o=fp32"
    else:
        spec = f"p={fmt},c={fmt},g={fmt},o=fp32"
    return replace(_parse_spec(spec), name=name)


def policy_or_format(spec: str | Policy) -> Policy | Format:
    """The one grammar of a policy argument (``--policies``, ``Precision(policy)``, the
    ``overrides=`` of a module): a Policy (returned as is), a named policy (``"16-true"``), a
    fixed-point regime (``"q6.10-sr"``), a compact spec (``"p=fp32,c=bf16"``), or else a bare
    format (``"bf16"``, ``"e4m3fn"``), returned as the format: every role in it
    (:func:`parse_policy` makes it a policy; an override keeps its base's rounding)."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        try:
            return parse_format(spec)  # a format object
        except TypeError:
            raise TypeError(f"a policy must be a name, a spec string, a format or a Policy, got "
                            f"{spec!r}") from None
    key = spec.strip()
    if key in POLICIES:
        return POLICIES[key]
    if m := _FIXED_POLICY_RE.match(key.lower()):
        return _fixed_policy(key, m)
    head, _, rest = key.partition(",")
    if head.strip() in POLICIES and rest.strip().lower().startswith(("acc=", "accumulator=")):
        # a named policy with a GEMM accumulator: "16-true,acc=fp16:chunk128"
        return replace(POLICIES[head.strip()], name=None,
                       accumulator=parse_accumulator(rest.partition("=")[2]))
    if "=" not in key:
        try:
            return parse_format(key)
        except (ValueError, TypeError):
            raise _bad_policy(spec) from None
    try:
        return _parse_spec(key)
    except ValueError as err:
        if str(err).startswith("unknown policy"):
            raise
        raise ValueError(f"policy {spec!r}: {err}") from None


def parse_policy(spec: str | Policy) -> Policy:
    """A named policy (``"16-true"``), a compact spec, a bare format (``"e4m3fn"``: the policy
    with every role in that format, named as given), or a Policy (returned as is); the grammar
    of :func:`policy_or_format`."""
    found = policy_or_format(spec)
    if isinstance(found, Policy):
        return found
    return replace(_parse_spec(f"p={found}"), name=spec.strip() if isinstance(spec, str) else None)


# Lightning's names where it has them; Apex O2 is "16-master".
register_policy("32-true", "p=fp32")
register_policy("16-true", "p=fp16,c=fp16,g=fp16,o=fp16")
register_policy("bf16-true", "p=bf16,c=bf16,g=bf16,o=bf16")
register_policy("16-mixed", "p=fp32,c=fp16,g=fp16,o=fp32,ls=dynamic,s=matmul")
register_policy("bf16-mixed", "p=fp32,c=bf16,g=bf16,o=fp32,s=matmul")
register_policy("16-master", "p=fp16,c=fp16,g=fp16,o=fp32,m=fp32,ls=dynamic")

# The regimes of the literature (see docs/design.md and the presets of lowprec compare).
register_policy("fixed16-sr", parse_policy("q6.10-sr"))
register_policy("fixed16-rn", parse_policy("q6.10-rn"))
# Courbariaux, Bengio and David (2014): 10-bit propagations, 12-bit parameter updates, each group
# with its own dynamic range; and static fixed point of the same widths for comparison
register_policy("dfxp-10-12", "p=dfxp<12>,c=dfxp<10>,g=dfxp<10>,o=dfxp<12>")
register_policy("fixed-10-12", "p=q2.10,c=q4.6,g=q4.6,o=q2.10")
# BinaryNet (Courbariaux, Hubara et al. 2016): binary weights and activations, fp32 latent weights
register_policy("binary", "p=fp32,c=binary,g=fp32,o=fp32,s=matmul")
register_policy("binary-stochastic", "p=fp32,c=binary:sr,g=fp32,o=fp32,s=matmul")
# OCP MX v1.0: weights and activations of every matmul in blocks of 32 along the reduction axis
for _mx in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8"):
    register_policy(_mx, f"p=fp32,c={_mx},g=fp32,o=fp32,s=matmul")
# Scaled GEMMs (lowprec.training.scaling): every linear layer's forward GEMM and both backward
# GEMMs with each operand cast under its own scaling; everything else in fp32. "mxfp4" is taken
# by the OCP MX policy above (forward operands of every matmul-like op, convolutions included),
# so that recipe is reached as "p=fp32,sc=mxfp4".
for _name in RECIPES:
    if _name not in POLICIES:
        register_policy(_name, f"p=fp32,sc={_name}")
