"""A float64 reference for rounding, written differently from lowprec's integer kernel.

It takes a format's table of representable magnitudes, finds each value's two neighbours with
``searchsorted`` and chooses between them by the rounding rule, all in float64 (exact here: the
neighbours of a float32 value in formats of at most 24 significant bits, their differences and
midpoints, are all exactly representable in float64).
"""

from __future__ import annotations

import numpy as np

from lowprec.numerics.formats import FixedFormat, FloatFormat, Overflow


def _tables(fmt):
    """(positive magnitudes, negative magnitudes, quantum beyond max) of an element format."""
    pos = fmt.values()
    if isinstance(fmt, FixedFormat):
        neg = np.arange(round(-fmt.min / fmt.step) + 1, dtype=np.float64) * fmt.step
        return pos, neg, fmt.step
    return pos, pos, 2.0 ** (fmt.emax - fmt.man_bits)


def _is_even(v: np.ndarray, fmt) -> np.ndarray:
    """Whether the code of magnitude v has an even last digit."""
    if isinstance(fmt, FixedFormat):
        k = np.round(v / fmt.step)
    else:
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(np.where(v > 0, v, 1.0)))
        e = np.maximum(e, fmt.emin)
        if not fmt.subnormals:
            # below min_normal the only magnitudes are 0 (even) and min_normal (odd code 1)
            e = np.where(v < fmt.min_normal, fmt.emin, e)
        k = np.round(v / 2.0 ** (e - fmt.man_bits))
        if not fmt.subnormals:
            k = np.where(v < fmt.min_normal, 0, k)
    return (k % 2) == 0


def round_reference(x, fmt, mode: str, *, random_words=None, random_bits: int = 32):
    """Round float32 values ``x`` (numpy) to ``fmt``; returns float64.

    mode: nearest, nearest_away, toward_zero, up, down, stochastic. For stochastic, random_words
    are the 32-bit words the generator produced for each element, of which the top random_bits
    are used.
    """
    x = np.asarray(x, dtype=np.float32).astype(np.float64).ravel()
    pos, neg, beyond_q = _tables(fmt)
    out = np.empty_like(x)
    neg_side = np.signbit(x)
    a = np.abs(x)
    overflow = fmt.overflow if isinstance(fmt, FloatFormat) else Overflow.SATURATE
    has_nz = isinstance(fmt, FloatFormat) and fmt.has_negative_zero
    for side, table in ((False, pos), (True, neg)):
        sel = (neg_side == side) & np.isfinite(x)
        av = a[sel]
        top = table[-1]
        i = np.searchsorted(table, av, side="right") - 1
        lo = table[np.clip(i, 0, len(table) - 1)]
        nxt = np.where(i + 1 < len(table), table[np.clip(i + 1, 0, len(table) - 1)], top + beyond_q)
        # beyond the top value the grid continues with the top binade's quantum
        over = av > top
        lo = np.where(over, np.floor(av / beyond_q) * beyond_q, lo)
        nxt = np.where(over, lo + beyond_q, nxt)
        exact = av == lo
        frac = (av - lo) / (nxt - lo)
        if mode == "nearest":
            # past the top value the codes keep counting with the top binade's quantum
            even_lo = np.where(lo >= top, (np.round(lo / beyond_q) % 2) == 0,
                               _is_even(np.minimum(lo, top), fmt))
            up = (frac > 0.5) | ((frac == 0.5) & ~even_lo)
        elif mode == "nearest_away":
            up = frac >= 0.5
        elif mode == "toward_zero":
            up = np.zeros_like(exact)
        elif mode == "up":
            up = ~exact & (not side)
        elif mode == "down":
            up = ~exact & side
        elif mode == "stochastic":
            w = np.asarray(random_words, dtype=np.uint64).ravel()[sel]
            scale = 2.0**random_bits
            fr = np.floor(frac * scale)
            rnd = (w >> np.uint64(32 - random_bits)).astype(np.float64)
            up = fr + rnd >= scale
        else:
            raise ValueError(mode)
        res = np.where(up & ~exact, nxt, lo)
        toward_zero = mode == "toward_zero" or (mode == "up" and side) or (mode == "down" and not side)
        if overflow is Overflow.SATURATE or toward_zero:
            big = top
        else:
            big = np.inf if overflow is Overflow.INF else np.nan
        res = np.where(res > top, big, res)
        out[sel] = -res if side else res
    inf = np.isinf(x)
    if overflow is Overflow.INF:
        out[inf] = x[inf]
    elif overflow is Overflow.NAN:
        out[inf] = np.nan
    else:
        out[inf] = np.where(x[inf] > 0, pos[-1], -neg[-1])
    out[np.isnan(x)] = np.nan
    zero = out == 0
    out[zero] = np.where(neg_side[zero] & has_nz, -0.0, 0.0)
    return out


def interesting_values(fmt, *, neighbours: bool = True) -> np.ndarray:
    """Every value of ``fmt`` (both signs), every midpoint, and float32 values just either side
    of each midpoint, plus the overflow region, zeros, Infs and NaN; as float32."""
    pos, neg, q = _tables(fmt)
    ext = np.concatenate([pos, [pos[-1] + q, pos[-1] + 2 * q, pos[-1] * 4]])
    mids = (ext[1:] + ext[:-1]) / 2
    quarter = np.concatenate([(3 * ext[:-1] + ext[1:]) / 4, (ext[:-1] + 3 * ext[1:]) / 4])
    base = np.concatenate([ext, mids, quarter]).astype(np.float32)
    vals = [base]
    if neighbours:
        vals.append(np.nextafter(base, np.float32(np.inf)))
        vals.append(np.nextafter(base, np.float32(0)))
    v = np.concatenate(vals)
    specials = np.array([0.0, np.inf, np.nan, 1e-45, 1e-40, 3e38], dtype=np.float32)
    return np.concatenate([v, -v, specials, -specials]).astype(np.float32)


def random_f32_patterns(n: int, seed: int = 0) -> np.ndarray:
    """n uniformly random float32 bit patterns (every exponent, NaNs and subnormals included)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
