"""A fusible decomposition of ``quantize``: the kernel's integer algorithm on int32 bit patterns.

``csrc/quantize.c`` and :mod:`.reference` round a float32 value by integer operations on its bit
pattern. This module writes the same algorithm once more, as pure elementwise torch ops on
``int32`` tensors (``x.view(torch.int32)``, shifts, masks, ``torch.where``; no Python loop over
data, no data-dependent Python branch, no int64), so that ``torch.compile`` traces it and
Inductor fuses it into the epilogue of the op that produced ``x`` (C++ on a CPU, Triton on a
GPU): compiled, a rounding is a few vector instructions instead of a memory pass plus a call of
the opaque ``lowprec::quantize`` op (:mod:`.ops`). Inside a compiled region :func:`quantize`
(and everything built on it) takes this path where :func:`max_numel` allows.

Why integer bits, not ``x.half().float()``: Inductor simplifies a cast round trip away unless
``torch._inductor.config.emulate_precision_casts`` is set (/work/shared/FACTS.md), and a float
expression may be re-associated; an integer pattern is computed as written, and it covers every
format, not only those torch has a dtype for.

The same bits as the kernel, for every mode (tests/numerics/test_fused_rounding.py):

* The value's significand M (24 bits, implicit bit included) is cut at ``s`` bits below the
  format's quantum 2**qe: k = M >> s is kept, rem = M mod 2**s decides. For 1 <= s <= 23 the
  result's pattern is ``(a & ~(2**s - 1)) + (up << s)``: a carry out of the mantissa moves into
  the exponent field, as in the classic integer trick, which is exactly (k + up) * 2**qe (the
  kernel computes that product in float32, exact too). For s >= 24, k = 0 and the result is 0 or
  2**qe.
* int32 holds uint32 patterns: right shifts of possibly negative words are masked to be logical,
  an unsigned comparison is the signed comparison of both sides with the top bit flipped, and the
  hash's products and sums wrap modulo 2**32 (two's complement, as torch's int32 kernels and
  Inductor's generated code compute them).
* Stochastic rounding: the random word of the element with logical (row-major) index i is
  ``lowbias32(lowbias32(i ^ k0) + k1)``, the kernel's counter-based draw (its high-word term is
  lowbias32(0) = 0 below 2**32 elements); ``k0, k1`` come from the ``seed`` tensor, so the draw
  is part of the graph. Up iff the fraction and the random word, both cut to the mode's random
  bits, carry out of 32 bits.

Fixed point (a constant quantum) takes a shorter route, the same bits in float arithmetic
whose every step is exact (:func:`_fixed`).

Covered: float formats (any eXmY, with or without subnormals, Inf / NaN / saturating overflow,
fnuz zeros), fixed point, binary, and block formats (MX and friends: a per-block amax, a
reduction Inductor fuses too), every rounding mode. Not covered (the op stays): dynamic fixed
point (its range lives outside the tensor) and tensors of 2**31 elements or more (int32 index).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from . import params

from .formats import BF16, FP16, BinaryFormat, BlockFormat, FixedFormat, FloatFormat
from .params import (NAN_SHIFT, R_NEAREST_EVEN, R_STOCHASTIC, ROUNDING_CODES, ElementParams,
                     element_params, random_mask)
from .rounding import Rounding, round_up, toward_zero

__all__ = ["max_numel", "native_casts", "source_token", "quantize_fused", "random_words_i32",
           "quantize_bits_i32"]

_I32_MIN = -(2**31)
_MAX_NUMEL = 2**31 - 1  # element indices are int32
# fp16 and bf16 rounded to nearest-even: torch's own cast rounds exactly so (subnormals, ties,
# overflow to Inf). A NaN stays a NaN of its sign, but its payload bits are not the kernel's
# (which keeps them all): fp16 keeps the top 10, ATen's vector bf16 cast makes every NaN 0xFFFF
# and c10's scalar one +NaN (the sign is copied back). So once a NaN appears, compiled and eager
# emulation agree on the values, not on the NaNs' bits. Used while :func:`native_casts` is on,
# by a caller whose compiler keeps a cast round trip
_CASTS = {FP16: torch.float16, BF16: torch.bfloat16}
_casts = threading.local()  # .on: native_casts depth in this thread (a plain torch.compile in
# another thread meanwhile keeps the int32 ops, which any compiler keeps)


@contextlib.contextmanager
def native_casts():
    """Inside: fp16/bf16 rounded to nearest-even are decomposed into torch's cast round trip
    (``x.to(fp16).float()``; bf16: ``x.to(bf16).float().copysign(x)``), two or three ops
    instead of some thirty int32 ops (a ``where(isnan(x), x, ...)`` keeping NaN payloads
    doubled a ViT's bf16 compile).
    Only for a graph compiled with ``torch._inductor.config.emulate_precision_casts`` (else
    Inductor simplifies the round trip away): compiled emulation's backend sets both. The
    generated code is smaller, so Inductor's code generation takes a fraction of the time
    (benchmarks/RESULTS.md, "Issue 37: compile time"), with the same bits but for NaN payloads
    (tests/numerics/test_fused_rounding.py)."""
    _casts.on = getattr(_casts, "on", 0) + 1
    try:
        yield
    finally:
        _casts.on -= 1


def _s32(v: int) -> int:
    """The int32 value of the uint32 ``v`` (same bits)."""
    v &= 0xFFFFFFFF
    return v - 2**32 if v >= 2**31 else v


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int32 words by the constant ``n`` in [1, 31]."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons), the kernel's hash, on int32 words (products wrap mod 2**32)."""
    x = x ^ _lsr(x, 16)
    x = x * _s32(0x7FEB352D)
    x = x ^ _lsr(x, 15)
    x = x * _s32(0x846CA68B)
    return x ^ _lsr(x, 16)


def _keys_i32(seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two keys of a ``seed`` tensor (values in [0, 2**32)) as int32 words, 0-d tensors."""
    s = seed.reshape(2).to(torch.int32)  # wraps modulo 2**32: the same bits
    return s[0], s[1]


def random_words_i32(index: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The kernel's 32 random bits (int32 words) of the elements at logical ``index`` (int32,
    below 2**31) for the keys in ``seed``."""
    k0, k1 = _keys_i32(seed.to(index.device))
    return _mix32(_mix32(index ^ k0) + k1)


def _pow2_bits(e: torch.Tensor) -> torch.Tensor:
    """float32 bits of 2**e, e in [-149, 127] (int32)."""
    return torch.where(e >= -126, (e + 127) << 23, 1 << (e + 149).clamp(0, 30))


def _ult(a: torch.Tensor, b) -> torch.Tensor:
    """a < b as unsigned 32-bit words held in int32."""
    return (a ^ _I32_MIN) < (b ^ _I32_MIN)


def quantize_bits_i32(u: torch.Tensor, ep: ElementParams, code: int, rmask: int,
                      r: torch.Tensor | None, sh: torch.Tensor | int = 0) -> torch.Tensor:
    """The rounded float32 patterns of the float32 patterns ``u`` (int32), as the kernel's
    ``quantize_one``. ``code``: the rounding code (params.ROUNDING_CODES); ``r``: the random
    words of stochastic rounding; ``sh``: each element's block scale exponent (0 outside blocks,
    NAN_SHIFT for a block whose scale is NaN)."""
    sign = u & _I32_MIN
    neg = u < 0
    a = u & 0x7FFFFFFF
    field = a >> 23
    ef = field.clamp(min=1)
    qe = torch.where(field >= ep.bemin + sh, field - (127 + ep.man), ep.qsub + sh).clamp(-149, 127)
    s = qe - ef + 150  # bits of M below the target quantum
    m = torch.where(field > 0, (a & 0x7FFFFF) | 0x800000, a)  # significand, 24 bits
    sk = s.clamp(1, 24)  # M < 2**24: k = 0 and rem = M for every s >= 24
    k = m >> sk
    rem = m & ((1 << sk) - 1)
    if code != R_STOCHASTIC:  # the mode's rule (rounding.RULES): the discarded part against
        # half a quantum, below it for every s > 24
        half = 1 << (sk - 1)
        up = round_up(code, lambda: (rem > half) & (s <= 24), lambda: (rem == half) & (s <= 24),
                      lambda: rem != 0, lambda: (k & 1) == 1, neg)
        up = torch.zeros_like(neg) if up is None else up
    else:  # stochastic: carry out of (fraction + random bits), both cut to the random bits
        # t: the discarded fraction of the quantum as a 0.32 fixed-point word
        t = torch.where(s < 32, rem << (32 - s).clamp(1, 31), m >> (s - 32).clamp(0, 31))
        tm, rm = t & _s32(rmask), r & _s32(rmask)
        up = _ult(rm ^ -1, tm)  # tm + rm >= 2**32  <=>  tm > ~rm
    upi = up.to(torch.int32)
    low = (1 << sk) - 1
    rounded = torch.where(s <= 23, (a & ~low) + (upi << sk),
                          torch.where(up, _pow2_bits(qe), 0))
    v = torch.where(s <= 0, a, rounded)  # already on the grid
    lim_pos, lim_neg = _float_of(ep.maxpos), _float_of(ep.maxneg)
    if isinstance(sh, int) and sh == 0:
        lim = torch.where(neg, torch.full_like(u, _s32(ep.maxneg)),
                          torch.full_like(u, _s32(ep.maxpos)))
    else:  # the limits scaled by the block's 2**sh, in float32 as the kernel does (exact)
        scale = _pow2_bits(sh.clamp(-127, 127)).view(torch.float32)
        lim = (torch.where(neg, lim_neg, lim_pos) * scale).view(torch.int32)
    if ep.overflow == 2:
        special = lim
    else:
        special = torch.full_like(u, 0x7F800000 if ep.overflow == 0 else 0x7FC00000)
    tz = toward_zero(code, neg)  # rounded toward zero: IEEE 754 section 7.4's largest finite
    tz = torch.full_like(neg, tz) if isinstance(tz, bool) else tz
    v = torch.where(v > lim, torch.where(tz, lim, special), v)
    v = torch.where(a == 0x7F800000, special, v)  # +-Inf in
    res = v | sign
    if not ep.signed_zero:
        res = torch.where(v == 0, 0, res)
    res = torch.where(a > 0x7F800000, u, res)  # NaN passes through
    if not (isinstance(sh, int) and sh == 0):
        res = torch.where(sh == NAN_SHIFT, 0x7FC00000, res)
    return res


def _float_of(bits: int) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def max_numel(fmt) -> int:
    """The most elements :func:`quantize_fused` takes for ``fmt`` (0: it does not cover it)."""
    if isinstance(fmt, (FloatFormat, FixedFormat, BinaryFormat)):
        return _MAX_NUMEL
    if isinstance(fmt, BlockFormat):
        return _MAX_NUMEL // 2  # room for the padding of a last, shorter block
    return 0


@lru_cache(maxsize=1)
def source_token() -> str:
    """A digest of the code that defines the decomposition (this module and the format
    parameters), passed to ``lowprec::quantize_fused`` as an argument. torch's compile caches
    (FX graph and AOTAutograd, on disk) key a graph by its nodes and their arguments, not by the
    Python implementation an op expands into: without the digest, a changed decomposition would
    be served the kernels compiled for the old one (seen while writing this module)."""
    h = hashlib.sha256()
    for mod in (__name__, params.__name__):
        h.update(Path(sys.modules[mod].__file__).read_bytes())
    return h.hexdigest()[:16]


def _index(shape, device, offset: int = 0) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return torch.arange(offset, offset + n, dtype=torch.int32, device=device).reshape(shape)


def _elementwise(xf: torch.Tensor, fmt, code: int, rmask: int, seed,
                 offset: int = 0) -> torch.Tensor:
    """``xf`` (contiguous when ``offset`` is given) rounded elementwise; ``offset``: the
    logical index of its first element in the tensor it is a slice of (the random words')."""
    ep = element_params(fmt)
    r = (random_words_i32(_index(xf.shape, xf.device, offset), seed) if code == R_STOCHASTIC
         else None)
    if isinstance(fmt, FixedFormat) and fmt.frac_bits <= _FIXED_FLOAT_MAX_FRAC:
        return _fixed(xf, fmt, ep, code, rmask, r)
    u = xf.view(torch.int32)
    return quantize_bits_i32(u, ep, code, rmask, r).view(torch.float32)


_FIXED_FLOAT_MAX_FRAC = 126  # 2**-frac_bits a normal float32: every step below exact


def _fixed(xf: torch.Tensor, fmt: FixedFormat, ep: ElementParams, code: int, rmask: int,
           r: torch.Tensor | None) -> torch.Tensor:
    """Fixed point (a constant quantum 2**-f) in float arithmetic, every step exact: the
    kernel's bits in fewer ops than :func:`quantize_bits_i32` (compiled, fewer ops is a shorter
    code generation). y = |x| 2**f, k = floor(y) and the fraction y - k are exact; the
    kernel's stochastic test, fraction and random word cut to their top b bits carrying out of
    32 bits, is floor(frac 2**b) + R >= 2**b for the top b random bits R, that is frac >= 1 -
    R 2**-b (an integer bound), exact in float32 for b <= 24 and in float64 above. Overflow
    saturates (|v| at most the format's limit of that sign, an infinity included: its
    fraction is NaN, no comparison holds), a zero is +0, a NaN passes through."""
    neg = xf < 0  # (-0 becomes +0 and a NaN passes through, whatever their sign bit)
    y = xf.abs() * float(2.0 ** fmt.frac_bits)
    k = y.floor()
    frac = y - k
    if code != R_STOCHASTIC:  # the mode's rule (rounding.RULES)
        up = round_up(code, lambda: frac > 0.5, lambda: frac == 0.5, lambda: frac > 0,
                      lambda: (k * 0.5).floor() * 2.0 != k, neg)
        up = torch.zeros_like(neg) if up is None else up
    else:
        bits = 32 - (rmask ^ 0xFFFFFFFF).bit_length()  # the mask keeps the top ``bits``
        top = _lsr(r, 32 - bits) if bits < 32 else r  # those bits as an integer (int32 words)
        wide = torch.float32 if bits <= 24 else torch.float64
        word = top.to(wide)
        if bits == 32:  # the word as unsigned
            word = torch.where(top < 0, word + 2.0 ** 32, word)
        up = frac.to(wide) >= 1.0 - word * float(2.0 ** -bits)
    v = (k + up.to(torch.float32)) * float(2.0 ** -fmt.frac_bits)
    v = torch.minimum(v, torch.where(neg, _float_of(ep.maxneg), _float_of(ep.maxpos)))
    v = torch.where(neg & (v != 0), -v, v)
    return torch.where(torch.isnan(xf), xf, v)


def _floor_log2_bits(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(v)) of positive finite float32 magnitudes given as patterns ``a`` (int32);
    for a float32 subnormal, from the exponent of its mantissa converted to float (exact)."""
    field = a >> 23
    sub = ((a & 0x7FFFFF).to(torch.float32).view(torch.int32) >> 23) - 127 - 149
    return torch.where(field > 0, field - 127, sub)


def _block_shifts(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Scale exponent of each block: ``rows`` is float32 (..., blocks, block), zero-padded; the
    result has shape (..., blocks, 1), int32, as quantize.block_shifts computes it.

    The amax is taken over the magnitudes' bit patterns, an int32 max (the patterns of
    non-negative floats are ordered as the floats, and every NaN and Inf lies at or above
    0x7F800000), not over floats: a float NaN out of a compiled max reduction can carry its sign
    bit (at::vec::maximum gives the all-ones pattern), and with torch 2.13 Inductor rewrites
    ``isfinite`` of such an amax as a test on its bits that assumes it is >= 0, so NaN blocks
    lost their NaN scale when compiled."""
    amax = (rows.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1, keepdim=True)
    finite = amax < 0x7F800000
    el = fmt.element
    if (fmt.block_size is None and isinstance(el, FixedFormat) and el.signed
            and not el.symmetric):  # dynamic fixed point's two's-complement range (block_shifts)
        neg = (-rows).amax(dim=-1, keepdim=True)
        pos = rows.amax(dim=-1, keepdim=True)
        tight = torch.maximum(pos, torch.nextafter(neg, torch.zeros_like(neg)))
        tight = torch.where(tight > 0, tight, 0.0)  # +0, never -0, for the bits below
        amax = torch.where(finite, tight.view(torch.int32), amax)
    s = (_floor_log2_bits(amax) - el.emax).clamp(fmt.scale_min_exp, fmt.scale_max_exp)
    s = torch.where(amax == 0, fmt.scale_min_exp, s)
    return torch.where(finite, s, NAN_SHIFT)


def _blocks(xf: torch.Tensor, fmt: BlockFormat, code: int, rmask: int, seed,
            offset: int = 0) -> torch.Tensor:
    """``xf`` rounded block by block along ``fmt.axis``. ``offset``, for the random words when
    ``xf`` is a piece of a larger tensor (whole rows of it, or one piece of one row): the
    logical index there (in the layout with the block axis moved last) of its first element."""
    if xf.dim() == 0:
        return _blocks(xf.reshape(1), fmt, code, rmask, seed).reshape(())
    axis = fmt.axis if fmt.axis >= 0 else xf.dim() + fmt.axis
    if not 0 <= axis < xf.dim():
        raise ValueError(f"block axis {fmt.axis} is out of range for a {xf.dim()}-d tensor")
    moved = xf.movedim(axis, -1)
    if fmt.block_size is None:  # one exponent for the whole tensor
        rows = moved.reshape(1, -1)
    else:
        rows = moved.reshape(-1, moved.shape[-1])
    nrows, row_len = rows.shape
    block = row_len if fmt.block_size is None else fmt.block_size
    nblocks = -(-row_len // block)
    padded = rows if nblocks * block == row_len else F.pad(rows, (0, nblocks * block - row_len))
    blocks = padded.reshape(nrows, nblocks, block)
    sh = _block_shifts(blocks, fmt)  # (rows, blocks, 1); zeros change no amax
    r = None
    if code == R_STOCHASTIC:  # the counter of an element: its index in the moved, row-major layout
        pos = torch.arange(nblocks * block, dtype=torch.int32, device=xf.device)
        start = offset + torch.arange(nrows, dtype=torch.int32, device=xf.device) * row_len
        r = random_words_i32((start[:, None] + pos[None, :]).reshape(blocks.shape), seed)
    out = quantize_bits_i32(blocks.view(torch.int32), element_params(fmt.element), code, rmask,
                            r, sh)
    out = out.view(torch.float32).reshape(nrows, nblocks * block)[:, :row_len]
    return out.reshape(moved.shape).movedim(-1, axis)


def _binary(xf: torch.Tensor) -> torch.Tensor:
    one = torch.ones_like(xf)
    return torch.where(torch.isnan(xf), xf, torch.where(xf < 0, -one, one))


def quantize_fused(x: torch.Tensor, fmt, mode: Rounding, random_bits: int,
                   seed: torch.Tensor | None) -> torch.Tensor:
    """``x`` rounded onto ``fmt`` (a parsed, covered format) with ``mode``: the kernel's bits,
    in torch ops that Inductor fuses. ``seed``: the two keys (int tensor) for a stochastic mode.
    No autograd history; same dtype and shape as ``x``."""
    code = ROUNDING_CODES[mode]
    rmask = random_mask(random_bits) if mode.is_stochastic else 0
    if mode.is_stochastic and seed is None:
        raise ValueError("stochastic rounding in the fused path needs seed= (a tensor of two keys)")
    if x.numel() == 0:
        return torch.empty_like(x)
    xf = x.detach()
    xf = xf if xf.dtype == torch.float32 else xf.float()
    cast = _CASTS.get(fmt) if code == R_NEAREST_EVEN and getattr(_casts, "on", 0) else None
    if cast is not None:
        out = xf.to(cast).to(torch.float32)
        if cast == torch.bfloat16:  # c10's scalar bf16 cast makes every NaN +NaN
            out = out.copysign(xf)
    elif isinstance(fmt, BinaryFormat):
        out = _binary(xf)
    elif isinstance(fmt, BlockFormat):
        out = _blocks(xf, fmt, code, rmask, seed)
    elif isinstance(fmt, (FloatFormat, FixedFormat)):
        out = _elementwise(xf, fmt, code, rmask, seed)
    else:
        raise TypeError(f"the fused path does not cover {fmt}: use lowprec.quantize")
    return out if out.dtype == x.dtype else out.to(x.dtype)
