"""Stochastic rounding's keys derived from one base pair: the same numbers eagerly (Python
integers) and inside a graph (int tensor ops), so that a forward drawing one base pair from its
generator can give each of its roundings keys of their own whether it runs eagerly or compiled.

``derive_keys((k0, k1), c) = (k0 ^ h(2c), (k1 + h(2c + 1)) mod 2**32)`` with ``h(v) =
lowbias32(lowbias32(v mod 2**32) + lowbias32(floor(v / 2**32) + 0x85EBCA6B) + 0x9E3779B9)``
(C. Wellons' hash, the kernel's), for any counter ``c`` below 2**62: each counter's keys differ
from the base by constants the counter alone determines, computed in Python, so a graph holds
two integer ops per derivation (Philox's key schedule adds fixed constants per round the same
way). The random word of element ``i`` under the derived keys is
``lowbias32(lowbias32(i ^ k0 ^ h(2c)) + k1 + h(2c + 1))``: two counters' words at any pair of
indices are two hashes of inputs differing by a pseudo-random offset. Derivations are not to
be nested: XOR and addition commute, so derive(derive(b, c1), c2) = derive(derive(b, c2), c1);
a two-level numbering takes one counter (the engine's sites: ``c = j * 2**31 + n``). ``base``
is a pair of ints in [0, 2**32) (the result is one too) or an integer tensor of two keys (the
result is an int64 tensor of shape (2,)).
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["derive_keys", "MAX_COUNTER"]

_M32 = 0xFFFFFFFF
MAX_COUNTER = 2**62 - 1


def _mix32(x: int) -> int:
    """lowbias32 (C. Wellons) on a Python integer: the kernel's hash, unsigned."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _h(v: int) -> int:
    return _mix32(_mix32(v & _M32) + _mix32((v >> 32) + 0x85EBCA6B) + 0x9E3779B9)


@lru_cache(maxsize=1 << 16)
def _offsets(c: int) -> tuple[int, int]:
    return _h(2 * c), _h(2 * c + 1)


def derive_keys(base, c: int):
    """The two keys of counter ``c`` (0 <= c <= MAX_COUNTER) under ``base`` (module
    docstring): a pair of ints for a pair of ints, an int64 tensor for a tensor."""
    if not 0 <= c <= MAX_COUNTER:
        raise ValueError(f"key counter {c} outside [0, {MAX_COUNTER}]")
    h0, h1 = _offsets(c)
    if torch.is_tensor(base):
        b = base.reshape(2).to(torch.int64)
        return ((b ^ torch.tensor([h0, 0], dtype=torch.int64, device=b.device))
                + torch.tensor([0, h1], dtype=torch.int64, device=b.device)) & _M32
    k0, k1 = base
    return k0 ^ h0, (k1 + h1) & _M32
