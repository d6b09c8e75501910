"""Scaled casts: an operand multiplied by a scale before it is rounded to a narrow format.

Below 16 bits nobody trains with bare formats: fp8 and fp4 recipes choose a scale so that the
operand's largest magnitude lands near the format's largest value, round ``x * scale`` to the
element format and divide the scale back out after (or inside) the GEMM. A :class:`ScaledCast`
says how one operand is cast: the element format and the scaling rule.

Rules (``kind``), the amax being the largest |x| of the group that shares a scale:

* ``hp``: no cast at all, the operand stays in high precision (fp32 here);
* ``none``: a bare cast to the element format (scale 1);
* ``tensor``: one scale per tensor from its current amax (torchao ``TENSORWISE``);
* ``delayedN``: one scale per tensor from the largest amax of the N previous casts of the same
  operand (Micikevicius et al. 2022; NVIDIA Transformer Engine; removed from torchao);
* ``axis``: one scale per row along the GEMM's reduction axis (torchao ``AXISWISE``, "rowwise");
* ``RxC``: one scale per tile of R rows by C elements along the reduction axis (``1x128`` for
  activations and gradients, ``128x128`` for weights: DeepSeek-V3, arXiv:2412.19437 3.3.1);
* ``mx``/``mxN``: OCP MX, a power-of-two E8M0 scale per block of N (default 32) elements along
  the reduction axis (OCP Microscaling Formats v1.0, section 6.3);
* ``nvfp4``: NVIDIA's two-level scaling: an fp32 scale per tensor and an e4m3 scale per block of
  16 elements along the reduction axis (arXiv:2509.25149, appendix B).

Amax scales (``tensor``, ``delayed``, ``axis``, tiles) follow torchao's float8 numerics
(``torchao/float8/float8_utils.py``): scale = fp32(max / max(amax, 1e-12)) computed in float64,
the element is round-to-nearest-even(``x * scale``) saturated at the format's max, and the
operand the GEMM sees is that element divided by the scale. The scale rounding ``pow2`` rounds
the scale down to a power of two (torchao's ``round_scales_to_power_of_2``): multiplying and
dividing by it is then exact.

MX scales: ``floor`` (the OCP rule: X = 2**(floor(log2(amax)) - emax_elem)), ``ceil``, ``even``
(amax rounded to the element's mantissa width first) and ``rceil`` (X = 2**ceil(log2(amax /
max_elem)), cuBLAS' rule), the four modes of torchao's ``ScaleCalculationMode``. The exponent is
clamped to E8M0's [-127, 127]; the element is rounded from x * 2**-s, exact in float32, so the
scale is never applied with a rounding; a block holding Inf or NaN becomes NaN (the E8M0 NaN
scale), as :class:`lowprec.numerics.formats.BlockFormat` does.

A cast string: ``hp`` or ``ELEMENT@RULE[:ROUNDING]``, e.g. ``e4m3fn@tensor``,
``e4m3fn@axis:pow2``, ``e5m2@delayed16``, ``e4m3fn@1x128``, ``e4m3fn@mx:rceil``,
``e2m1fn@nvfp4``. Elements always saturate (the scale is meant to keep values in range; a value
beyond it is clamped, as every recipe does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum

import torch

from .formats import FloatFormat, Overflow, Style, parse_format
from .quantize import quantize

__all__ = ["ScaleKind", "ScaleRounding", "ScaledCast", "parse_cast", "scaled_cast", "cast_stats",
           "AmaxHistory", "HP", "E4M3_BLOCK_SCALE"]

# torchao's guard against a zero amax (float8_utils.EPS)
_AMAX_EPS = 1e-12
_E8M0_MIN, _E8M0_MAX = -127, 127
#: the e4m3 format of NVFP4's block scales (saturating: the scale is clamped to 448 first)
E4M3_BLOCK_SCALE = FloatFormat(4, 3, Style.FN, overflow=Overflow.SATURATE)
_E2M1_MAX = 6.0


class ScaleKind(str, Enum):
    """Which elements share a scale (see the module docstring)."""

    HP = "hp"
    NONE = "none"
    TENSOR = "tensor"
    DELAYED = "delayed"
    AXIS = "axis"
    TILE = "tile"
    MX = "mx"
    NVFP4 = "nvfp4"

    def __str__(self) -> str:
        return self.value


class ScaleRounding(str, Enum):
    """How a scale is rounded: ``exact`` or ``pow2`` (down to a power of two) for amax scales;
    ``floor``, ``ceil``, ``even``, ``rceil`` for MX's E8M0 exponent."""

    EXACT = "exact"
    POW2 = "pow2"
    FLOOR = "floor"
    CEIL = "ceil"
    EVEN = "even"
    RCEIL = "rceil"

    def __str__(self) -> str:
        return self.value


_AMAX_KINDS = (ScaleKind.TENSOR, ScaleKind.DELAYED, ScaleKind.AXIS, ScaleKind.TILE)
_MX_MODES = (ScaleRounding.FLOOR, ScaleRounding.CEIL, ScaleRounding.EVEN, ScaleRounding.RCEIL)


@dataclass(frozen=True)
class ScaledCast:
    """How one GEMM operand is cast: ``element`` format, scaling ``kind``, ``tile`` (rows, cols
    along the reduction axis) for tiles and blocks, ``history`` for delayed scaling, and the
    scale's ``rounding``. ``ScaledCast(ScaleKind.HP)`` keeps the operand in high precision."""

    kind: ScaleKind = ScaleKind.TENSOR
    element: FloatFormat | None = None
    rounding: ScaleRounding | None = None
    tile: tuple[int, int] | None = None
    history: int | None = None
    stochastic: bool = False  # the element rounded stochastically (NVFP4's gradients)

    def __post_init__(self) -> None:
        kind = ScaleKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"stochastic={self.stochastic!r} must be True or False")
        if kind is ScaleKind.HP:
            if self.element is not None or self.rounding is not None or self.tile is not None \
                    or self.history is not None or self.stochastic:
                raise ValueError("an 'hp' operand takes no element, rounding, tile, history or "
                                 "stochastic rounding")
            return
        el = parse_format(self.element) if self.element is not None else None
        if not isinstance(el, FloatFormat):
            raise ValueError(f"a scaled cast needs a float element format (e4m3fn, e5m2, "
                             f"e2m1fn...), got {self.element!r}")
        # the scale keeps values in range; beyond it the element saturates (every recipe clamps)
        object.__setattr__(self, "element", replace(el, overflow=Overflow.SATURATE))
        default = ScaleRounding.FLOOR if kind is ScaleKind.MX else ScaleRounding.EXACT
        rnd = ScaleRounding(self.rounding) if self.rounding is not None else default
        if kind is ScaleKind.MX and rnd not in _MX_MODES:
            raise ValueError(f"an MX scale rounds with floor, ceil, even or rceil, not {rnd}")
        if kind in _AMAX_KINDS and rnd not in (ScaleRounding.EXACT, ScaleRounding.POW2):
            raise ValueError(f"a {kind} scale rounds exact or pow2, not {rnd}")
        if kind in (ScaleKind.NONE, ScaleKind.NVFP4) and rnd is not ScaleRounding.EXACT:
            raise ValueError(f"a {kind} cast takes no scale rounding, got {rnd}")
        object.__setattr__(self, "rounding", rnd)
        if kind is ScaleKind.MX:
            tile = self.tile if self.tile is not None else (1, 32)
        elif kind is ScaleKind.NVFP4:
            tile = (1, 16)
        else:
            tile = self.tile
        if kind in (ScaleKind.TILE, ScaleKind.MX, ScaleKind.NVFP4):
            if (not isinstance(tile, tuple) or len(tile) != 2
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                               for n in tile)):
                raise ValueError(f"tile={tile!r} must be (rows, cols), two integers >= 1")
            if kind is ScaleKind.MX and tile[0] != 1:
                raise ValueError("MX blocks are one row of elements along the reduction axis")
        elif tile is not None:
            raise ValueError(f"a {kind} scale takes no tile")
        object.__setattr__(self, "tile", tile)
        if kind is ScaleKind.DELAYED:
            if isinstance(self.history, bool) or not isinstance(self.history, int) \
                    or not 1 <= self.history <= 1024:
                raise ValueError(f"history={self.history!r}: delayed scaling keeps 1 to 1024 "
                                 "amaxes")
        elif self.history is not None:
            raise ValueError(f"a {kind} scale keeps no history")
        if kind in (ScaleKind.MX, ScaleKind.NVFP4) and el.bits > 8:
            raise ValueError(f"{kind} scales an element of at most 8 bits (e4m3fn, e5m2, e3m2fn, "
                             f"e2m3fn, e2m1fn), got {el}")

    @property
    def is_hp(self) -> bool:
        return self.kind is ScaleKind.HP

    def __str__(self) -> str:
        if self.kind is ScaleKind.HP:
            return "hp"
        el = replace(self.element, overflow=None)
        el_name = str(el) if parse_format(str(el)) == el else str(self.element)
        if self.kind is ScaleKind.DELAYED:
            rule = f"delayed{self.history}"
        elif self.kind is ScaleKind.TILE:
            rule = f"{self.tile[0]}x{self.tile[1]}"
        elif self.kind is ScaleKind.MX:
            rule = "mx" if self.tile[1] == 32 else f"mx{self.tile[1]}"
        else:
            rule = self.kind.value
        default = ScaleRounding.FLOOR if self.kind is ScaleKind.MX else ScaleRounding.EXACT
        suffix = "" if self.rounding is default else f":{self.rounding}"
        sr = ":sr" if self.stochastic else ""
        return f"{el_name}{sr}@{rule}{suffix}"


HP = ScaledCast(ScaleKind.HP)

_RULE_RE = re.compile(r"^(?:(none|tensor|axis|nvfp4)|delayed(\d+)|(\d+)x(\d+)|mx(\d+)?)$")


def parse_cast(spec: str | ScaledCast) -> ScaledCast:
    """``hp`` or ``ELEMENT[:sr]@RULE[:ROUNDING]`` (see the module docstring; ``:sr`` after the
    element rounds it stochastically); casts pass through."""
    if isinstance(spec, ScaledCast):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a scaled cast is a string such as 'e4m3fn@tensor', got {spec!r}")
    s = spec.strip().lower()
    if s == "hp":
        return HP
    el, at, rule = s.partition("@")
    if not at:
        raise ValueError(f"scaled cast {spec!r}: expected 'hp' or ELEMENT@RULE[:ROUNDING] "
                         "(e4m3fn@tensor, e4m3fn@axis:pow2, e5m2@delayed16, e4m3fn@1x128, "
                         "e4m3fn@mx:rceil, e2m1fn@nvfp4)")
    el, _, el_rnd = el.partition(":")
    if el_rnd not in ("", "sr", "stochastic"):
        raise ValueError(f"scaled cast {spec!r}: element rounding {el_rnd!r}; accepted: sr "
                         "(stochastic; nearest-even when absent)")
    rule, _, rnd = rule.partition(":")
    m = _RULE_RE.match(rule)
    if not m:
        raise ValueError(f"scaled cast {spec!r}: rule {rule!r} is not none, tensor, delayedN, "
                         "axis, RxC, mx[N] or nvfp4")
    kwargs: dict = {"stochastic": bool(el_rnd)}
    if m.group(1):
        kwargs["kind"] = ScaleKind(m.group(1))
    elif m.group(2):
        kwargs.update(kind=ScaleKind.DELAYED, history=int(m.group(2)))
    elif m.group(3):
        kwargs.update(kind=ScaleKind.TILE, tile=(int(m.group(3)), int(m.group(4))))
    else:
        kwargs.update(kind=ScaleKind.MX, tile=(1, int(m.group(5) or 32)))
    if rnd:
        try:
            kwargs["rounding"] = ScaleRounding(rnd)
        except ValueError:
            accepted = ", ".join(r.value for r in ScaleRounding)
            raise ValueError(f"scaled cast {spec!r}: rounding {rnd!r}; accepted: {accepted}"
                             ) from None
    try:
        fmt = parse_format(el)
        return ScaledCast(element=fmt, **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"scaled cast {spec!r}: {err}") from None


class AmaxHistory:
    """The amaxes of the previous casts of each operand, for delayed scaling: a 1-d float32
    tensor of at most ``history`` values per key (a module's operand), newest last."""

    def __init__(self) -> None:
        self.amaxes: dict[str, torch.Tensor] = {}

    def scale_amax(self, key: str, current: torch.Tensor) -> torch.Tensor:
        """The amax the scale is computed from: the largest of the stored ones, or ``current``
        when nothing is stored yet (the first cast)."""
        past = self.amaxes.get(key)
        if past is None or past.numel() == 0:
            return current
        return past.max().to(current.device)

    def push(self, key: str, current: torch.Tensor, history: int) -> None:
        past = self.amaxes.get(key)
        cur = current.detach().reshape(1).float().cpu()
        self.amaxes[key] = cur if past is None else torch.cat([past, cur])[-history:]

    def state_dict(self) -> dict:
        return {k: v.tolist() for k, v in self.amaxes.items()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not all(
                isinstance(k, str) and isinstance(v, (list, tuple)) for k, v in state.items()):
            raise ValueError(f"an amax history state is a dict of key -> list of floats, got "
                             f"{state!r:.80}")
        self.amaxes = {k: torch.tensor([float(a) for a in v], dtype=torch.float32)
                       for k, v in state.items()}


# -- helpers ---------------------------------------------------------------------------------
def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, for integer e in [-149, 127] (built from the bit pattern:
    subnormal powers included, so no libm rounding is involved)."""
    e = e.to(torch.int32)
    normal = torch.bitwise_left_shift((e + 127).clamp(min=1), 23)
    sub = torch.bitwise_left_shift(torch.ones_like(e), (e + 149).clamp(0, 22))
    return torch.where(e >= -126, normal, sub).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) exactly for finite a > 0 (subnormals included), as int32."""
    _, e = torch.frexp(a)
    return e.to(torch.int32) - 1


def _ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """ceil(log2(a)) exactly for finite a > 0, as int32."""
    m, e = torch.frexp(a)
    return e.to(torch.int32) - (m == 0.5).to(torch.int32)


def _oriented(x: torch.Tensor, axis: int) -> torch.Tensor:
    """A view of ``x`` whose last dimension is the reduction axis (``axis`` is -1 or -2)."""
    return x if axis in (-1, x.dim() - 1) else x.transpose(-1, -2)


def _tile_amax(v: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The amax of each (rows, cols) tile of the last two dims of ``v`` (cols along the last
    dim), broadcast back to ``v``'s shape; partial tiles at the edges are tiles of their own."""
    tr, tc = tile
    a = v.abs()
    if a.dim() == 1:
        a = a.unsqueeze(0)
    *batch, rows, cols = a.shape
    pr, pc = -rows % tr, -cols % tc
    if pr or pc:  # zeros never raise an amax (NaN still does: amax propagates it)
        a = torch.nn.functional.pad(a, (0, pc, 0, pr))
    nr, nc = (rows + pr) // tr, (cols + pc) // tc
    t = a.reshape(*batch, nr, tr, nc, tc).amax(dim=(-3, -1), keepdim=True)
    full = t.expand(*batch, nr, tr, nc, tc).reshape(*batch, nr * tr, nc * tc)
    return full[..., :rows, :cols].reshape(v.shape)


def _amax(x: torch.Tensor, cast: ScaledCast, axis: int) -> torch.Tensor:
    """The amax each element is scaled by: a 0-d tensor (per tensor), a keepdim row amax
    (axis), or one value per element (tiles and blocks)."""
    if cast.kind in (ScaleKind.TENSOR, ScaleKind.DELAYED):
        return torch.max(torch.abs(x))  # torchao's tensor_to_amax
    if cast.kind is ScaleKind.AXIS:
        return torch.amax(torch.abs(x), dim=axis, keepdim=True)
    return _oriented(_tile_amax(_oriented(x, axis), cast.tile), axis)


def _like(y: torch.Tensor, fmt, rounding: str = "nearest", generator=None) -> torch.Tensor:
    """quantize(y) laid out as ``y`` is (a transposed operand stays transposed), so that the
    GEMM reading it runs the same kernel as on torchao's tensors."""
    if y.is_contiguous() or y.dim() < 2:
        return quantize(y, fmt, rounding, generator=generator)
    yt = y.transpose(-1, -2)
    if yt.is_contiguous():
        return quantize(yt, fmt, rounding, generator=generator).transpose(-1, -2)
    return torch.empty_like(y).copy_(quantize(y, fmt, rounding, generator=generator))


def _amax_scale(amax: torch.Tensor, fmax: float, pow2: bool) -> torch.Tensor:
    """torchao's ``amax_to_scale``: fp32(max / max(amax, 1e-12)) in float64; with ``pow2``,
    ``exp2(floor(log2(scale)))`` in float32 as torchao computes it. (The float32 log2 of a
    scale just below a power of two can round up to that power's exponent: the scale is then
    that power, a hair above max / amax, and the largest element saturates. Reproduced, so
    that the bits equal torchao's.)"""
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=_AMAX_EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _mx_exponent(amax: torch.Tensor, cast: ScaledCast) -> torch.Tensor:
    """The E8M0 scale exponent of each block (int32, clamped to [-127, 127])."""
    el = cast.element
    mode = cast.rounding
    pos = amax > 0
    safe = torch.where(pos & torch.isfinite(amax), amax, torch.ones_like(amax))
    if mode is ScaleRounding.RCEIL:
        # cuBLAS: X = 2**ceil(log2(amax / max_elem)), the quotient rounded in float32
        d = safe / el.max
        dpos = d > 0
        s = torch.where(dpos, _ceil_log2(torch.where(dpos, d, torch.ones_like(d))),
                        torch.full_like(d, _E8M0_MIN, dtype=torch.int32))
    else:
        if mode is ScaleRounding.FLOOR:
            lg = _floor_log2(safe)
        elif mode is ScaleRounding.CEIL:
            lg = _ceil_log2(safe)
        else:  # EVEN: amax rounded half-up at the element's mantissa width, then floor
            # (torchao's bit operation: add half a unit at man_bits, keep sign and exponent)
            bits = safe.view(torch.int32) + (1 << (22 - el.man_bits))
            lg = torch.bitwise_right_shift(bits, 23).bitwise_and(0xFF) - 127
            sub = safe < 2.0 ** -126  # a subnormal amax: its true binade
            lg = torch.where(sub, _floor_log2(safe), lg)
        s = lg - el.emax
    s = s.clamp(_E8M0_MIN, _E8M0_MAX)
    return torch.where(pos, s, torch.full_like(s, _E8M0_MIN))


def scaled_cast(x: torch.Tensor, cast: ScaledCast | str, axis: int = -1, *,
                history: AmaxHistory | None = None, key: str = "",
                stats: dict | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) cast as ``cast`` says and brought back to its scale: the values a GEMM
    computes with in an emulated scaled recipe. ``axis`` is the GEMM's reduction axis (-1 or
    -2: per-row scales, tiles and blocks run along it). Delayed scaling reads and extends
    ``history[key]``. The result has ``x``'s shape and layout; no autograd history. A dict
    given as ``stats`` receives the counts of :func:`cast_stats`. A stochastic cast draws its
    random bits from ``generator`` (torch's default generator when None).
    """
    cast = parse_cast(cast)
    if cast.kind is ScaleKind.HP:
        return x
    if x.dtype != torch.float32:
        raise TypeError(f"scaled_cast takes a float32 tensor, got {x.dtype}")
    ax = axis - x.dim() if axis >= 0 else axis
    if ax not in (-1, -2) or ax < -max(x.dim(), 1):
        raise ValueError(f"axis={axis}: the reduction axis of a GEMM operand is its last or "
                         f"second-to-last ({x.dim()}-d operand)")
    axis = ax
    with torch.no_grad():
        if x.numel() == 0:
            return x.clone()
        ys, back = _scaled(x, cast, axis, history, key)
        q = _like(ys, cast.element, "stochastic" if cast.stochastic else "nearest", generator)
        y = back(q)
        if y.stride() != x.stride():  # per-element scales may have given another layout
            y = torch.empty_like(x).copy_(y)
        if stats is not None:
            stats.update(cast_stats(x, ys, q, y, cast.element))
        return y


def _scaled(x: torch.Tensor, cast: ScaledCast, axis: int, history, key: str):
    """(x on the element's scale, the function bringing a rounded element back)."""
    el = cast.element
    if cast.kind is ScaleKind.NONE:
        return x, lambda q: q
    if cast.kind is ScaleKind.MX:
        return _mx_scaled(x, cast, axis)
    if cast.kind is ScaleKind.NVFP4:
        return _nvfp4_scaled(x, cast, axis)
    amax = _amax(x, cast, axis)
    used = amax
    if cast.kind is ScaleKind.DELAYED:
        if history is None:
            raise ValueError("delayed scaling needs an AmaxHistory (Precision keeps one)")
        used = history.scale_amax(key, amax)
        history.push(key, amax, cast.history)
    scale = _amax_scale(used, el.max, cast.rounding is ScaleRounding.POW2)
    # torchao: bits = saturate(x * scale) rounded to nearest-even; the GEMM reads bits / scale
    return x * scale, lambda q: q / scale


def _mx_scaled(x: torch.Tensor, cast: ScaledCast, axis: int):
    amax = _amax(x, cast, axis)
    s = _mx_exponent(amax, cast)
    bad = ~torch.isfinite(amax)  # a block holding Inf or NaN: the E8M0 NaN scale
    # elements rounded from x * 2**-s, exact in float32 (a product below 2**-126 lies far
    # below the element's smallest subnormal and rounds to zero either way)

    def back(q):
        y = q * _pow2(s)
        return torch.where(bad, torch.full_like(y, float("nan")), y)

    return x * _pow2(-s), back


def _nvfp4_scaled(x: torch.Tensor, cast: ScaledCast, axis: int):
    """Two-level NVFP4 as torchao's ``nvfp4_quantize`` with a per-tensor scale computes it:
    tensor scale ts = amax / (448 * 6); block scale amax_b / 6 / ts rounded to e4m3 after a
    clamp to [2**-6, 448]; x * ((1 / ts) / block) rounded to e2m1 (saturating); the GEMM reads
    the element times (ts * block), each product rounded in float32."""
    el = cast.element
    amax_t = torch.max(torch.abs(x))
    ts = amax_t.to(torch.float32) / (E4M3_BLOCK_SCALE.max * el.max)
    if float(amax_t) == 0.0:
        # torchao divides 0 by 0 here and returns NaN for an all-zero tensor (a dead layer's
        # gradient); the values are all zero
        return x * 0.0, lambda q: q
    amax_b = _amax(x, cast, axis)
    block = (amax_b / el.max) / ts
    block8 = quantize(torch.clamp(block, min=E4M3_BLOCK_SCALE.min_normal,
                                  max=E4M3_BLOCK_SCALE.max), E4M3_BLOCK_SCALE)
    recip = (1.0 / ts) / block8
    # torchao clamps to +-6 before its e2m1 cast; the saturating element does the same
    return x * recip, lambda q: q * (ts * block8)


def cast_stats(x: torch.Tensor, scaled: torch.Tensor, q: torch.Tensor, y: torch.Tensor,
               element: FloatFormat) -> dict:
    """What a cast did: ``n`` values, of the nonzero finite ones the fraction ``flushed`` to
    zero, ``subnormal`` (an element below its smallest normal) and ``saturated`` (beyond the
    element's max after scaling), the ``amax`` and smallest nonzero |x|, non-finite outputs."""
    a = x.detach().abs()
    live = (a > 0) & torch.isfinite(a)
    n = int(live.sum())
    qa = q.abs()
    frac = (lambda m: int((m & live).sum()) / n) if n else (lambda m: 0.0)
    return {"n": int(x.numel()), "nonzero": n,
            "flushed": frac(qa == 0),
            "subnormal": frac((qa > 0) & (qa < element.min_normal)),
            "saturated": frac(scaled.abs() > element.max),
            "amax": float(a[live].max()) if n else 0.0,
            "amin": float(a[live].min()) if n else 0.0,
            "nonfinite": int((~torch.isfinite(y)).sum())}
