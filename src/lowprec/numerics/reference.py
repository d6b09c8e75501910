"""The plain-torch quantization path: the kernel's integer algorithm written with torch ops.

It runs wherever torch runs (CUDA, MPS, a machine without a C compiler) and gives the same bits
as the C kernel (``csrc/quantize.c``); the tests check this. uint32 values are held in int64
tensors (torch has few uint32 ops), and 32-bit products are split into 16-bit halves so that no
intermediate overflows.
"""

from __future__ import annotations

import torch

from .params import NAN_SHIFT, R_STOCHASTIC, ElementParams
from .rounding import round_up, toward_zero

__all__ = ["quantize_bits", "quantize_f32", "random_words", "mix32"]

CHUNK = 1 << 18  # elements per step: keeps the int64 temporaries in cache

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons), the kernel's integer hash."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_words(n: int, seed: tuple[int, int], device, start: int = 0) -> torch.Tensor:
    """The 32 random bits of elements start..start+n-1 for ``seed`` (int64 tensor), as the
    kernel draws them."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    lo, hi = idx & _M32, idx >> 32
    k1 = seed[1] ^ mix32(hi)
    return mix32((mix32(lo ^ seed[0]) + k1) & _M32)


def _pow2_bits(e: torch.Tensor) -> torch.Tensor:
    """float32 bits of 2**e, e in [-149, 127]."""
    normal = (e + 127) << 23
    sub = torch.bitwise_left_shift(torch.ones_like(e), (e + 149).clamp(0, 31))
    return torch.where(e >= -126, normal, sub)


def _bits_to_f32(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _f32_to_bits(f: torch.Tensor) -> torch.Tensor:
    return f.contiguous().view(torch.int32).to(torch.int64) & _M32


def quantize_bits(
    u: torch.Tensor,
    ep: ElementParams,
    rounding: int,
    rmask: int,
    r: torch.Tensor | None,
    sh: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Quantize float32 bit patterns ``u`` (int64 in [0, 2**32)); returns the result bits.

    ``sh`` is the scale exponent of each element's block (0 outside blocks), ``r`` the random
    words for stochastic rounding.
    """
    if not torch.is_tensor(sh):
        sh = torch.full_like(u, sh)
    sign = u & 0x80000000
    neg = sign != 0
    a = u & 0x7FFFFFFF
    field = a >> 23
    ef = field.clamp(min=1)
    qe = torch.where(field >= ep.bemin + sh, field - 127 - ep.man, ep.qsub + sh).clamp(-149, 127)
    s = qe - ef + 150
    M = (a & 0x7FFFFF) | ((field > 0).to(torch.int64) << 23)
    sl = s.clamp(1, 31)
    sb = (s - 32).clamp(0, 31)
    big = s >= 32
    k = torch.where(big, 0, M >> sl)
    rem = torch.where(big, M, M & ((torch.bitwise_left_shift(torch.ones_like(sl), sl)) - 1))
    t = torch.where(big, M >> sb, (rem << (32 - sl)) & _M32)
    if rounding == R_STOCHASTIC:  # carry out of the fraction plus the random bits, cut to r bits
        up = ((t & rmask) + (r & rmask)) >> 32
    else:  # the mode's rule (rounding.RULES); t is the fraction of the quantum as a 0.32 word
        up = round_up(rounding, lambda: t > 0x80000000, lambda: t == 0x80000000,
                      lambda: rem != 0, lambda: (k & 1) == 1, neg)
        up = torch.zeros_like(t) if up is None else up.to(torch.int64)
    mag = (k + up).to(torch.float32) * _bits_to_f32(_pow2_bits(qe))
    v = torch.where(s <= 0, a, _f32_to_bits(mag))
    scale = _bits_to_f32(_pow2_bits(sh.clamp(-127, 127)))
    lim_f = torch.where(neg, _bits_to_f32(torch.tensor(ep.maxneg)),
                        _bits_to_f32(torch.tensor(ep.maxpos))).to(u.device) * scale
    lim = _f32_to_bits(lim_f)
    if ep.overflow == 2:
        special = lim
    else:
        special = torch.full_like(u, 0x7F800000 if ep.overflow == 0 else 0x7FC00000)
    tz = toward_zero(rounding, neg)
    tz = torch.full_like(neg, tz) if isinstance(tz, bool) else tz
    v = torch.where(v > lim, torch.where(tz, lim, special), v)
    v = torch.where(a == 0x7F800000, special, v)
    res = v | sign
    if not ep.signed_zero:
        res = torch.where(v == 0, 0, res)
    res = torch.where(a > 0x7F800000, u, res)
    return torch.where(sh == NAN_SHIFT, 0x7FC00000, res)


def quantize_f32(x: torch.Tensor, ep: ElementParams, rounding: int, rmask: int,
                 seed: tuple[int, int], sh: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize a float32 tensor (flattened in logical order) chunk by chunk; returns float32 of
    the same shape. ``sh``: per-element block shifts (int64, flat) or None."""
    flat = x.contiguous().reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), CHUNK):
        stop = min(start + CHUNK, flat.numel())
        u = _f32_to_bits(flat[start:stop])
        r = random_words(stop - start, seed, x.device, start) if rounding == R_STOCHASTIC else None
        s = 0 if sh is None else sh[start:stop]
        out[start:stop] = _bits_to_f32(quantize_bits(u, ep, rounding, rmask, r, s))
    return out.reshape(x.shape)
