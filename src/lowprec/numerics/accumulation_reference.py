"""Scalar float64-then-round reference of :func:`lowprec.numerics.accumulation.gemm_acc`.

Plain Python floats (IEEE float64) and integers, one output and one operation at a time: each
product and each sum is computed in float64, then rounded onto the accumulator format by exact
integer arithmetic on the value's (integer significand, exponent) from ``math.frexp``. Slow;
the tests compare the compiled kernel and the plain-torch path with it on small shapes.
"""

from __future__ import annotations

import math

from .accumulation import Accumulator, Order, limits_of, parse_accumulator
from .params import random_mask
from .rounding import Rounding, round_up, toward_zero

__all__ = ["round_scalar", "gemm_acc_reference"]

_M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _word(element: int, step: int, seed: tuple[int, int]) -> int:
    lo, hi = element & _M32, element >> 32
    base = _mix32((_mix32(lo ^ seed[0]) + (seed[1] ^ _mix32(hi))) & _M32)
    return _mix32(base ^ _mix32((step + 0x9E3779B9) & _M32))


def round_scalar(x: float, fmt, mode: Rounding, rmask: int = 0, r: int = 0) -> float:
    """``x`` (a Python float) rounded onto ``fmt`` with ``mode``; ``r`` the 32 random bits."""
    lim = limits_of(fmt)
    if math.isnan(x):
        return x
    neg = math.copysign(1.0, x) < 0
    a = abs(x)
    limit = lim.maxneg if neg else lim.maxpos
    special = limit if lim.overflow == 2 else (math.inf if lim.overflow == 0 else math.nan)
    if math.isinf(a):
        v = special
    else:
        # a = M * 2**E exactly, M an integer below 2**53
        m, ex = math.frexp(a)
        M, E = int(m * 2**53), ex - 53
        e = ex - 1  # a in [2**e, 2**(e+1))
        qe = e - lim.man if (a != 0 and e >= lim.emin) else lim.qsub
        if E >= qe:  # on the grid already
            k, rem_num, rem_den = M << (E - qe), 0, 1
        else:
            sh = qe - E
            k, rem_num, rem_den = M >> sh, M & ((1 << sh) - 1), 1 << sh
        # fraction f = rem_num / rem_den of the quantum, exactly
        if not mode.is_stochastic:  # the mode's rule (rounding.RULES)
            up = round_up(mode, lambda: 2 * rem_num > rem_den, lambda: 2 * rem_num == rem_den,
                          lambda: rem_num != 0, lambda: (k & 1) == 1, neg)
        else:
            t = (rem_num << 32) // rem_den  # floor(f * 2**32)
            up = (t & rmask) + (r & rmask) >= 2**32
        v = math.ldexp(k + int(bool(up)), qe)
        if v > limit:
            v = limit if toward_zero(mode, neg) else special
    if v == 0 and not lim.signed_zero:
        return 0.0
    return -v if neg else v


def gemm_acc_reference(a, b, acc: "str | Accumulator", seed: tuple[int, int] = (0, 0)):
    """``a`` (batch, M, K), ``b`` (batch, K, N) nested lists or tensors of floats ->
    nested lists (batch, M, N) of floats, one scalar operation at a time."""
    acc = parse_accumulator(acc)
    a = a.tolist() if hasattr(a, "tolist") else a
    b = b.tolist() if hasattr(b, "tolist") else b
    mode, rmask = acc.rounding.mode, random_mask(acc.rounding.bits)
    sr = mode.is_stochastic
    out = []
    for bi, (am, bm) in enumerate(zip(a, b)):
        m, kk, n = len(am), len(bm), len(bm[0]) if bm else 0
        rows = []
        for i in range(m):
            row = []
            for j in range(n):
                e = (bi * m + i) * n + j

                def rnd(x, step):
                    return round_scalar(x, acc.fmt, mode, rmask,
                                        _word(e, step, seed) if sr else 0)

                prods = [rnd(float(am[i][l]) * float(bm[l][j]), l) for l in range(kk)]
                if acc.order is Order.PAIRWISE:
                    level, step = prods, kk
                    while len(level) > 1:
                        nxt = []
                        for q in range(len(level) // 2):
                            nxt.append(rnd(level[2 * q] + level[2 * q + 1], step))
                            step += 1
                        if len(level) % 2:
                            nxt.append(level[-1])
                        level = nxt
                    row.append(level[0] if level else 0.0)
                    continue
                chunk = acc.chunk if acc.order is Order.CHUNKED else max(kk, 1)
                wide = None
                for c0 in range(0, kk, chunk):
                    s = prods[c0]
                    for l in range(c0 + 1, min(c0 + chunk, kk)):
                        s = rnd(s + prods[l], kk + l - 1)
                    wide = s if wide is None else round_scalar(wide + s, acc.wide,
                                                               Rounding.NEAREST_EVEN)
                row.append(0.0 if wide is None else wide)
            rows.append(row)
        out.append(rows)
    return out
