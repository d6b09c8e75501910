"""The GEMM accumulator as a number format: products and partial sums rounded in a chosen order.

A matrix product ``C = A @ B`` computes each output as a sum of K products. Hardware keeps that
sum in an *accumulator* of some precision: fp32 on most tensor cores, fp16 on older ones and in
some CPU kernels, about 14 significant bits on the fp8 tensor cores of Hopper (so DeepSeek-V3 and
torchao "promote" partial sums to fp32 every 128 terms), a saturating integer in fixed-point
hardware. :class:`Accumulator` names such an accumulator and :func:`matmul_acc` computes a GEMM
with it, exactly:

* **what is rounded where**: every product ``a_ik * b_kj`` is computed exactly (float64 holds the
  product of two float32 values) and rounded once onto the accumulator format; every addition of
  two accumulator values is computed in float64 and rounded once onto it. Nothing else is
  rounded, except the promotions of the chunked order (below). The result is a float32 tensor
  whose values lie on the accumulator's (or the wide accumulator's) grid.
* **order** (:class:`Order`): ``seq`` (sequential: ``acc = p_0``, then ``acc = R(acc + p_l)``),
  ``pairwise`` (a tree of adjacent pairs, level by level; an odd last element moves up
  unchanged), ``chunkK`` (sequential inside chunks of K terms, each chunk's sum then added into
  a wide accumulator, fp32 unless named, ``chunk128@fp32``: ``W = chunk_0``, ``W = RN(W +
  chunk_c)``, as in Wang et al. 2018 ("chunk-based accumulation") and the fp8 "promote every 128"
  recipe). Promotions always round to nearest even, as an fp32 adder does.
* **rounding**: any :class:`~lowprec.numerics.rounding.Rounding` (``rn`` default, ``sr``,
  ``srN``, ``rz``...), applied to products and accumulator additions. Stochastic rounding draws
  32 random bits (or N) per rounding from a counter-based hash of (seed, output element index,
  step): product l is step l, the addition bringing in term l (sequential, chunked) is step
  K + l - 1, the pairwise additions are steps K, K+1, ... in level order. So the result depends
  only on the seed, never on threads or on the path.

Spec string (``str(acc)`` prints it back): ``FORMAT[:ORDER][:ROUNDING]``, defaults ``seq`` and
``rn`` left out::

    fp32                   # plain fp32 accumulation in sequential order
    fp16:chunk128:sr       # fp16 accumulator, promoted into fp32 every 128 terms, stochastic
    e8m13:chunk128         # the ~14-bit fp8 tensor-core accumulator, promoted every 128
    bf16:pairwise
    q12.12:chunk64         # fixed point <12, 12>, saturating at +-2048

Three paths give the same bits: the compiled kernel (``lp_gemm_acc`` in ``csrc/accumulate.c``,
float32 CPU tensors), a plain-torch path (any device; float64 arithmetic vectorised over the
outputs) and, for the tests only, the scalar Python reference of :mod:`.accumulation_reference`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

from . import kernel as _kernel
from .formats import FP32, FixedFormat, FloatFormat, parse_format
from .params import ROUNDING_CODES, random_mask
from .quantize import draw_seed
from .rounding import Rounding, RoundingSpec, check_generator, round_up, toward_zero

__all__ = ["Order", "Accumulator", "parse_accumulator", "matmul_acc", "gemm_acc", "round_f64",
           "acc_random_words", "FormatLimits", "limits_of"]

Impl = Literal["auto", "kernel", "torch"]


class Order(str, Enum):
    SEQUENTIAL = "seq"
    PAIRWISE = "pairwise"
    CHUNKED = "chunk"

    def __str__(self) -> str:
        return self.value


_ORDER_NAMES = {"seq": Order.SEQUENTIAL, "sequential": Order.SEQUENTIAL,
                "pairwise": Order.PAIRWISE, "tree": Order.PAIRWISE}
_CHUNK_RE = re.compile(r"^chunk(?:ed)?(\d+)(?:@(.+))?$")
_ACCEPTED = ("FORMAT[:ORDER][:ROUNDING] with FORMAT a float (fp32, fp16, bf16, e8m13...) or "
             "fixed-point (q8.8...) format, ORDER seq, pairwise or chunkK[@WIDE] (e.g. chunk128, "
             "chunk128@fp32) and ROUNDING rn, sr, srN, rz, ru, rd, rna")


def _bad(spec, why: str) -> ValueError:
    return ValueError(f"accumulator {spec!r}: {why}; accepted: {_ACCEPTED}")


@dataclass(frozen=True)
class Accumulator:
    """A GEMM accumulator: its format, its order of summation and its rounding.

    ``chunk`` is the number of terms per chunk (``order=CHUNKED`` only) and ``wide`` the format
    the chunks are promoted into (fp32 by default).
    """

    fmt: FloatFormat | FixedFormat = FP32
    order: Order = Order.SEQUENTIAL
    chunk: int | None = None
    wide: FloatFormat | FixedFormat = FP32
    rounding: RoundingSpec = RoundingSpec()

    def __post_init__(self) -> None:
        for name in ("fmt", "wide"):
            f = parse_format(getattr(self, name))
            if not isinstance(f, (FloatFormat, FixedFormat)):
                raise ValueError(f"accumulator {name}={f}: an accumulator is a float or "
                                 "fixed-point format (one value per output, no block scale)")
            object.__setattr__(self, name, f)
        try:
            order = Order(self.order) if not isinstance(self.order, Order) else self.order
        except ValueError:
            raise ValueError(f"accumulator order={self.order!r}; accepted: seq, pairwise, "
                             "chunk") from None
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "rounding", RoundingSpec.parse(self.rounding))
        if order is Order.CHUNKED:
            if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) \
                    or not 1 <= self.chunk < 2**31:
                raise ValueError(f"accumulator chunk={self.chunk!r} must be an int in [1, 2**31) "
                                 "for the chunked order")
        elif self.chunk is not None:
            raise ValueError(f"accumulator chunk={self.chunk!r} needs order='chunk', "
                             f"not {order.value!r}")
        if order is not Order.CHUNKED and self.wide != FP32:
            raise ValueError(f"accumulator wide={self.wide}: only the chunked order promotes "
                             "into a wide accumulator")

    @classmethod
    def parse(cls, spec: "str | Accumulator") -> "Accumulator":
        return parse_accumulator(spec)

    @property
    def order_spec(self) -> str:
        if self.order is not Order.CHUNKED:
            return self.order.value
        return f"chunk{self.chunk}" + ("" if self.wide == FP32 else f"@{self.wide}")

    def __str__(self) -> str:
        parts = [str(self.fmt)]
        if self.order is not Order.SEQUENTIAL:
            parts.append(self.order_spec)
        if self.rounding != RoundingSpec():
            parts.append(self.rounding.mode.short if self.rounding.mode is not
                         Rounding.STOCHASTIC_LIMITED else str(self.rounding))
        return ":".join(parts)


def parse_accumulator(spec: "str | Accumulator") -> Accumulator:
    """``"fp16:chunk128:sr"`` -> :class:`Accumulator` (see the module docstring); an
    Accumulator passes through. ValueError naming the bad part and the accepted forms."""
    if isinstance(spec, Accumulator):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"an accumulator spec must be a str or an Accumulator, got {spec!r}")
    text = spec.strip().lower()
    fmt_text, *rest = text.split(":")
    try:
        fmt = parse_format(fmt_text)
    except ValueError as err:
        raise _bad(spec, f"format {fmt_text!r} is not valid ({str(err).split(';')[0]})") from None
    kwargs: dict = {}
    for part in rest:
        if part in _ORDER_NAMES or _CHUNK_RE.match(part):
            if "order" in kwargs:
                raise _bad(spec, f"two orders ({kwargs['order']} and {part})")
            if m := _CHUNK_RE.match(part):
                kwargs["order"], kwargs["chunk"] = Order.CHUNKED, int(m.group(1))
                if m.group(2):
                    try:
                        kwargs["wide"] = parse_format(m.group(2))
                    except ValueError:
                        raise _bad(spec, f"wide format {m.group(2)!r} is not valid") from None
            else:
                kwargs["order"] = _ORDER_NAMES[part]
            continue
        if "rounding" in kwargs:
            raise _bad(spec, f"two roundings or an unknown part ({kwargs['rounding']} and "
                             f"{part!r})")
        try:
            kwargs["rounding"] = RoundingSpec.parse(part)
        except ValueError:
            raise _bad(spec, f"{part!r} is neither an order nor a rounding mode") from None
    try:
        return Accumulator(fmt, **kwargs)
    except (TypeError, ValueError) as err:
        raise _bad(spec, str(err)) from None


# -- the format as numbers (shared by the kernel binding, the torch path and the reference) ----
@dataclass(frozen=True)
class FormatLimits:
    man: int          # mantissa bits (0 for fixed point)
    emin: int         # exponent of the smallest normal (huge for fixed point: never normal)
    qsub: int         # quantum exponent below the normal range (fixed point: -FL)
    overflow: int     # 0 Inf, 1 NaN, 2 saturate
    signed_zero: bool
    maxpos: float
    maxneg: float     # magnitude of the most negative value


_FIXED_EMIN = 1 << 20


def limits_of(fmt: FloatFormat | FixedFormat) -> FormatLimits:
    if isinstance(fmt, FloatFormat):
        return FormatLimits(fmt.man_bits, fmt.emin,
                            fmt.emin - fmt.man_bits if fmt.subnormals else fmt.emin,
                            {"inf": 0, "nan": 1, "saturate": 2}[fmt.overflow.value],
                            fmt.has_negative_zero, fmt.max, fmt.max)
    return FormatLimits(0, _FIXED_EMIN, -fmt.frac_bits, 2, False, fmt.max, abs(fmt.min))


# -- the plain-torch path --------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """lowbias32 (the kernel's hash) on int64 tensors or Python ints."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & _M32
        return x ^ (x >> 16)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _step_key(step: int) -> int:
    return _mix32((step + 0x9E3779B9) & _M32)


def acc_random_words(elements: torch.Tensor, seed: tuple[int, int]) -> torch.Tensor:
    """The per-output base words (int64 tensor of the output element indices -> int64)."""
    lo, hi = elements & _M32, elements >> 32
    return _mix32((_mix32(lo ^ seed[0]) + (seed[1] ^ _mix32(hi))) & _M32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64, exactly (e an int64 tensor within the normal range)."""
    return ((e + 1023) << 52).view(torch.float64)


def round_f64(x: torch.Tensor, lim: FormatLimits, mode: Rounding, rmask: int,
              r: torch.Tensor | None) -> torch.Tensor:
    """float64 values rounded onto the format (the kernel's round_f64, here by float64
    arithmetic: x = y * 2**qe with y = k + f, k an integer, f in [0, 1), all exact)."""
    a = x.abs()
    neg = torch.signbit(x)
    _, ex = torch.frexp(a)  # a = m * 2**ex, m in [0.5, 1): exponent ex - 1
    e = ex.to(torch.int64) - 1
    qe = torch.where(e >= lim.emin, e - lim.man, torch.full_like(e, lim.qsub))
    y = a * _pow2(-qe)
    k = torch.floor(y)
    f = y - k
    if not mode.is_stochastic:  # the mode's rule (rounding.RULES)
        up = round_up(mode, lambda: f > 0.5, lambda: f == 0.5, lambda: f != 0,
                      lambda: torch.remainder(k, 2) == 1, neg)
        up = torch.zeros_like(neg) if up is None else up
    else:  # carry out of floor(f * 2**32) + r, both cut to the random bits
        t = torch.floor(f * 2.0**32).to(torch.int64)
        up = ((t & rmask) + (r & rmask)) >= 2**32
    v = (k + up.to(k.dtype)) * _pow2(qe)
    limv = torch.where(neg, lim.maxneg, lim.maxpos).to(x.dtype)
    tz = toward_zero(mode, neg)
    tz = torch.full_like(neg, tz) if isinstance(tz, bool) else tz
    special = limv if lim.overflow == 2 else torch.full_like(x, math.inf if lim.overflow == 0
                                                              else math.nan)
    v = torch.where(v > limv, torch.where(tz, limv, special), v)
    v = torch.where(torch.isinf(a), special, v)
    v = torch.where(neg, -v, v)
    if not lim.signed_zero:
        v = torch.where(v == 0, torch.zeros_like(v), v)
    return torch.where(torch.isnan(x), x, v)


def _torch_gemm(a: torch.Tensor, b: torch.Tensor, acc: Accumulator, seed) -> torch.Tensor:
    """a: (batch, M, K), b: (batch, K, N) float32 -> (batch, M, N) float32, same bits as the
    kernel; float64 arithmetic vectorised over the outputs, one step per term."""
    bt, m, kk = a.shape
    n = b.shape[2]
    lim, wl = limits_of(acc.fmt), limits_of(acc.wide)
    mode, rmask = acc.rounding.mode, random_mask(acc.rounding.bits)
    a64, b64 = a.double(), b.double()
    sr = mode.is_stochastic
    base = None
    if sr:
        idx = torch.arange(bt * m * n, dtype=torch.int64, device=a.device).view(bt, m, n)
        base = acc_random_words(idx, seed)

    def rnd(v, step):
        r = _mix32(base ^ _step_key(step)) if sr else None
        return round_f64(v, lim, mode, rmask, r)

    def prod(l):
        return rnd(a64[:, :, l, None] * b64[:, None, l, :], l)

    if acc.order is Order.PAIRWISE:
        level = [prod(l) for l in range(kk)]
        step = kk
        while len(level) > 1:
            nxt = []
            for i in range(len(level) // 2):
                nxt.append(rnd(level[2 * i] + level[2 * i + 1], step))
                step += 1
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        return level[0].float()
    chunk = acc.chunk if acc.order is Order.CHUNKED else kk
    wide = None
    for c0 in range(0, kk, chunk):
        s = prod(c0)
        for l in range(c0 + 1, min(c0 + chunk, kk)):
            s = rnd(s + prod(l), kk + l - 1)
        wide = s if wide is None else round_f64(wide + s, wl, Rounding.NEAREST_EVEN, 0, None)
    return wide.float()


# -- entry points ----------------------------------------------------------------------------
def gemm_acc(a: torch.Tensor, b: torch.Tensor, acc: "str | Accumulator", *,
             generator: torch.Generator | None = None, seed: tuple[int, int] | None = None,
             impl: Impl = "auto") -> torch.Tensor:
    """The batched GEMM with a rounded accumulator, no autograd: ``a`` (batch, M, K) and ``b``
    (batch, K, N) of one floating dtype, values taken in float32; returns float32
    (batch, M, N). ``seed`` (two 32-bit keys) or ``generator`` seed stochastic rounding."""
    acc = parse_accumulator(acc)
    check_generator(generator)
    if impl not in ("auto", "kernel", "torch"):
        raise ValueError(f"impl={impl!r}; accepted: auto, kernel, torch")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"gemm_acc: shapes {tuple(a.shape)} and {tuple(b.shape)} are not "
                         "(batch, M, K) and (batch, K, N)")
    a, b = a.detach().float(), b.detach().float()
    bt, m, kk = a.shape
    n = b.shape[2]
    if acc.rounding.is_stochastic:
        seed = draw_seed(generator) if seed is None else (int(seed[0]), int(seed[1]))
    else:
        seed = (0, 0)
    if kk == 0 or a.numel() == 0 or b.numel() == 0:
        return a.new_zeros(bt, m, n)
    ok = a.device.type == "cpu" and _kernel.gemm_acc_available()
    if impl == "kernel" and not ok:
        raise RuntimeError(f"the compiled accumulation kernel is not available (device "
                           f"{a.device}, kernel loaded: {_kernel.gemm_acc_available()})")
    if impl == "torch" or not ok:
        return _torch_gemm(a, b, acc, seed)
    b = b.contiguous()
    out = a.new_empty(bt, m, n)
    order = {Order.SEQUENTIAL: 0, Order.PAIRWISE: 1, Order.CHUNKED: 2}[acc.order]
    _kernel.gemm_acc(a, b, out, order, acc.chunk or 0, limits_of(acc.fmt), limits_of(acc.wide),
                     ROUNDING_CODES[acc.rounding.mode], random_mask(acc.rounding.bits), seed)
    return out


class _MatmulAcc(torch.autograd.Function):
    """Forward and both backward GEMMs accumulate in the accumulator. A 2-d ``b`` (a weight)
    gets its gradient from one GEMM over batch and rows; gradients of other broadcast batch
    dimensions are summed afterwards in fp32."""

    @staticmethod
    def forward(ctx, a, b, acc, generator, impl):
        ctx.save_for_backward(a, b)
        ctx.acc, ctx.generator, ctx.impl = acc, generator, impl
        return _bmm(a, b, acc, generator, impl).to(torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _bmm(g, b.transpose(-1, -2), ctx.acc, ctx.generator, ctx.impl)
            ga = _unbroadcast(ga, a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            if b.dim() == 2 and a.dim() > 2:
                # a weight shared by every batch element: one GEMM whose reduction runs over
                # batch and rows together (as linear's weight gradient does), all accumulated
                with torch._C.DisableTorchFunction():
                    a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
                gb = _bmm(a2.t(), g2, ctx.acc, ctx.generator, ctx.impl).to(b.dtype)
            else:
                gb = _bmm(a.transpose(-1, -2), g, ctx.acc, ctx.generator, ctx.impl)
                gb = _unbroadcast(gb, b.shape).to(b.dtype)
        return ga, gb, None, None, None


def _unbroadcast(g: torch.Tensor, shape) -> torch.Tensor:
    while g.dim() > len(shape):
        g = g.sum(0)
    for i, s in enumerate(shape):
        if s == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


def _bmm(a, b, acc, generator, impl):
    """matmul semantics for a, b of at least 2 dims (batch dims broadcast); no torch-function
    mode sees the reshapes (the emulation engine rounds only the result)."""
    with torch._C.DisableTorchFunction():
        return _bmm_plain(a, b, acc, generator, impl)


def _bmm_plain(a, b, acc, generator, impl):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, kk, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = a.expand(*batch, m, kk).reshape(-1, m, kk)
    b3 = b.expand(*batch, kk, n).reshape(-1, kk, n)
    return gemm_acc(a3, b3, acc, generator=generator, impl=impl).reshape(*batch, m, n)


def matmul_acc(a: torch.Tensor, b: torch.Tensor, acc: "str | Accumulator", *,
               generator: torch.Generator | None = None, impl: Impl = "auto") -> torch.Tensor:
    """``torch.matmul(a, b)`` with every product and partial sum rounded onto ``acc`` (see the
    module docstring), differentiable: both backward GEMMs accumulate in ``acc`` too. 1-d
    operands are treated as torch.matmul treats them; the result has the promoted dtype."""
    acc = parse_accumulator(acc)
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"matmul_acc: both operands need at least 1 dimension, got "
                         f"{a.dim()}-d and {b.dim()}-d")
    if a.shape[-1] != (b.shape[0] if b.dim() == 1 else b.shape[-2]):
        raise ValueError(f"matmul_acc: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be "
                         "multiplied")
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    out = _MatmulAcc.apply(a2, b2, acc, generator, impl)
    if b.dim() == 1:
        out = out.squeeze(-1)
    if a.dim() == 1:
        out = out.squeeze(-2 if b.dim() > 1 else 0) if out.dim() else out
    return out
