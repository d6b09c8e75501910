"""Stochastic rounding: unbiased, only the two neighbours, probability proportional to the
distance, reproducible from a seed whatever the thread count, and bit-exact against gfloat
given the same random bits."""

import math

import gfloat
import numpy as np
import pytest
import torch
from helpers import assert_same_bits, assert_same_values
from gfloat.formats import format_info_binary16, format_info_ocp_e2m1, format_info_ocp_e4m3
from reference import interesting_values, round_reference

from lowprec import parse_format, quantize
from lowprec.numerics.reference import random_words
from lowprec.numerics.quantize import draw_seed

N = 200_000


def _neighbours(fmt, x: float):
    vals = fmt.values()
    i = np.searchsorted(vals, x, side="right") - 1
    return vals[i], vals[i + 1]


CASES = [("fp16", 1.0 + 2**-10 * p, p) for p in (0.1, 0.25, 0.5, 0.9)] + [
    ("bf16", 3.0 + 2**-6 * (1 / 3), 1 / 3),
    ("e4m3fn", 0.3, None),
    ("e4m3fn", 2.0**-9 * 0.7, 0.7),  # in the subnormal range
    ("q2.14", 0.1234, None),
    ("fp4_e2m1", 2.6, 0.3),
]


@pytest.mark.parametrize("spec,x,p", CASES)
def test_unbiased_two_neighbours_probability(spec, x, p, impl):
    fmt = parse_format(spec)
    x = float(np.float32(x))
    lo, hi = _neighbours(fmt, x)
    p = (x - lo) / (hi - lo)
    g = torch.Generator().manual_seed(1234)
    out = quantize(torch.full((N,), x), fmt, "stochastic", generator=g, impl=impl).double().numpy()
    assert set(np.unique(out).tolist()) <= {lo, hi}
    freq = (out == hi).mean()
    sigma = math.sqrt(p * (1 - p) / N)
    assert abs(freq - p) < 5 * sigma, (freq, p)
    assert abs(out.mean() - x) < 5 * (hi - lo) * sigma
    neg = quantize(torch.full((N,), -x), fmt, "stochastic", generator=g, impl=impl).double().numpy()
    assert abs((neg == -hi).mean() - p) < 5 * sigma  # symmetric in sign


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_limited_random_bits_truncate_the_probability(bits, impl):
    fmt = parse_format("fp16")
    p = 0.3
    x = float(np.float32(1.0 + 2**-10 * p))
    lo, hi = _neighbours(fmt, x)
    p = (x - lo) / (hi - lo)
    p_eff = math.floor(p * 2**bits) / 2**bits  # hardware-style: fraction cut to `bits` bits
    g = torch.Generator().manual_seed(99)
    out = quantize(torch.full((N,), x), fmt, f"sr{bits}", generator=g, impl=impl).double().numpy()
    freq = (out == hi).mean()
    sigma = math.sqrt(max(p_eff * (1 - p_eff), 1e-12) / N)
    assert abs(freq - p_eff) < 5 * sigma + 1e-12, (freq, p_eff)
    # the same mode spelled with the Enum and random_bits
    g = torch.Generator().manual_seed(99)
    again = quantize(torch.full((N,), x), fmt, "stochastic_limited", random_bits=bits, generator=g,
                     impl=impl)
    assert np.array_equal(again.double().numpy(), out)


def test_same_seed_same_bits_other_seed_other_bits(impl):
    x = torch.randn(100_000)
    a = quantize(x, "e4m3fn", "stochastic", generator=torch.Generator().manual_seed(5), impl=impl)
    b = quantize(x, "e4m3fn", "stochastic", generator=torch.Generator().manual_seed(5), impl=impl)
    c = quantize(x, "e4m3fn", "stochastic", generator=torch.Generator().manual_seed(6), impl=impl)
    assert_same_bits(a, b, "same seed")
    assert not torch.equal(a, c)
    torch.manual_seed(3)
    d = quantize(x, "e4m3fn", "stochastic", impl=impl)
    torch.manual_seed(3)
    e = quantize(x, "e4m3fn", "stochastic", impl=impl)
    assert_same_bits(d, e, "global seed")


def test_thread_count_does_not_change_the_bits():
    x = torch.randn(1 << 19)
    old = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(7)))
    finally:
        torch.set_num_threads(old)
    assert_same_bits(outs[0], outs[1], "1 vs 2 threads")
    assert_same_bits(outs[0], outs[2], "1 vs 3 threads")


def test_values_on_the_grid_never_move():
    fmt = parse_format("e5m2")
    v = torch.tensor(np.concatenate([fmt.values(), -fmt.values()]), dtype=torch.float32)
    v = v.repeat(50)
    assert torch.equal(quantize(v, fmt, "stochastic"), v)


def test_position_not_layout_determines_the_draw():
    """An element's random bits follow its logical index, so a transposed copy quantizes the
    same as the original read in the same logical order."""
    x = torch.randn(64, 48)
    a = quantize(x, "e4m3fn", "sr", generator=torch.Generator().manual_seed(1))
    xt = x.t().contiguous().t()  # same values and logical order, column-major storage
    b = quantize(xt, "e4m3fn", "sr", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


SR_REFS = [("fp16", format_info_binary16, False), ("e4m3fn", format_info_ocp_e4m3, False),
           ("fp4_e2m1", format_info_ocp_e2m1, True)]


@pytest.mark.parametrize("bits", [32, 5])
@pytest.mark.parametrize("spec,fi,sat", SR_REFS, ids=[s[0] for s in SR_REFS])
def test_sr_matches_gfloat_given_the_same_random_bits(spec, fi, sat, bits):
    """gfloat's StochasticFastest adds `bits` random bits to the exact fraction: same rule."""
    fmt = parse_format(spec)
    x = interesting_values(fmt, neighbours=False)
    x = x[np.isfinite(x) & (np.abs(x) <= fmt.max)]
    if spec == "fp16":
        x = x[::11]
    seed = draw_seed(torch.Generator().manual_seed(21))  # the draw quantize will make
    words = random_words(x.size, seed, "cpu").numpy()
    expected = np.array([
        gfloat.round_float(fi, float(v), gfloat.RoundMode.StochasticFastest, sat=sat,
                           srbits=int(w) >> (32 - bits), srnumbits=bits)
        for v, w in zip(x, words)])
    got = quantize(torch.from_numpy(x), fmt, "stochastic" if bits == 32 else f"sr{bits}",
                   generator=torch.Generator().manual_seed(21))
    assert_same_values(got, expected, f"{spec} sr{bits}")
    # and the float64 table reference with the same words
    assert_same_values(got, round_reference(x, fmt, "stochastic", random_words=words,
                                            random_bits=bits), "table reference")


def test_random_words_are_uniform():
    w = random_words(1 << 20, (12345, 678), "cpu")
    counts = torch.bincount(w >> 24, minlength=256).double()
    expected = (1 << 20) / 256
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)  # 255 degrees of freedom, six sigma
    low = torch.bincount(w & 0xFF, minlength=256).double()
    assert ((low - expected) ** 2 / expected).sum().item() < 255 + 6 * math.sqrt(2 * 255)
    # consecutive words are uncorrelated
    a, b = (w[:-1].double() / 2**32 - 0.5), (w[1:].double() / 2**32 - 0.5)
    corr = (a * b).mean() / (a * a).mean()
    assert abs(corr.item()) < 6 / math.sqrt(w.numel())


def test_stochastic_block_formats_unbiased():
    x = torch.full((N // 32, 32), 0.3)
    x[:, 0] = 1.0  # sets the scale: amax 1 -> e2m1 emax 2 -> 2**-2
    out = quantize(x, "mxfp4", "stochastic", generator=torch.Generator().manual_seed(3))
    vals = out[:, 1:].double()
    # 0.3 / 0.25 = 1.2 lies between fp4 values 1.0 and 1.5 -> 0.25 and 0.375 after scaling
    assert set(torch.unique(vals).tolist()) <= {0.25, 0.375}
    p = (0.3 - 0.25) / 0.125
    freq = (vals == 0.375).double().mean().item()
    assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / vals.numel())


# -- generator= of the wrong type (hostile-tester finding) --------------------------------------

def _generator_takers():
    from torch import nn

    from lowprec.analysis.updates import lost_updates
    from lowprec.numerics.autograd import Quantizer, quantize_ste
    from lowprec.numerics.quantize import draw_seed, quantize_
    from lowprec.training.emulation import emulated
    from lowprec.training.optim import SGD
    from lowprec.training.regimes.binary import binarize
    from lowprec import Precision

    x = torch.randn(8)
    lin = nn.Linear(2, 2)
    return {
        "quantize": lambda g: quantize(x, "fp16", "stochastic", generator=g),
        "quantize-nearest": lambda g: quantize(x, "fp16", generator=g),
        "quantize_": lambda g: quantize_(x.clone(), "fp16", "stochastic", generator=g),
        "draw_seed": lambda g: draw_seed(g),
        "quantize_ste": lambda g: quantize_ste(x, "fp16", generator=g),
        "Quantizer": lambda g: Quantizer("fp16", generator=g),
        "emulated": lambda g: emulated("16-true", g).__enter__(),
        "binarize": lambda g: binarize(nn.Sequential(nn.Linear(2, 2)), generator=g),
        "Precision": lambda g: Precision("16-true", generator=g),
        "SGD": lambda g: SGD(lin.parameters(), lr=0.1, generator=g),
        "lost_updates": lambda g: lost_updates(lin, (torch.randn(2, 2), torch.tensor([0, 1])),
                                               nn.functional.cross_entropy, "bf16", generator=g),
    }


@pytest.mark.parametrize("where", list(_generator_takers()))
@pytest.mark.parametrize("gen", ["0", 0, 1.5])
def test_a_generator_that_is_not_one_is_a_type_error(where, gen):
    """lowprec.quantize(x, "fp16", "stochastic", generator="0") used to raise AttributeError."""
    with pytest.raises(TypeError) as err:
        _generator_takers()[where](gen)
    msg = str(err.value)
    assert f"generator={gen!r}" in msg and "a torch.Generator" in msg and "\n" not in msg


# -- keys derived from one base pair (lowprec.numerics.keys) ---------------------------------------
@pytest.mark.parametrize("base", [(0, 0), (12345, 678), (2**32 - 1, 2**31 + 7)])
def test_derived_keys_are_the_same_eagerly_and_as_tensor_ops(base):
    """derive_keys as Python ints (eager emulation) and as int64 tensor ops (a graph), checked
    against its definition computed here with numpy's uint32 arithmetic."""
    from lowprec.numerics.keys import MAX_COUNTER, derive_keys

    def mix(v):  # lowbias32 in numpy uint32, wrapping
        v = np.uint32(v)
        with np.errstate(over="ignore"):
            v ^= v >> np.uint32(16)
            v *= np.uint32(0x7FEB352D)
            v ^= v >> np.uint32(15)
            v *= np.uint32(0x846CA68B)
        return v ^ (v >> np.uint32(16))

    def h(v):  # v below 2**63: its low and high words
        with np.errstate(over="ignore"):
            return mix(mix(v % 2**32) + mix(np.uint32(v // 2**32) + np.uint32(0x85EBCA6B))
                       + np.uint32(0x9E3779B9))

    for c in (0, 1, 2, 1000, 2**20 + 3, 2**31 - 1, 2**31, 3 * 2**31 + 7, MAX_COUNTER):
        with np.errstate(over="ignore"):
            want = (int(np.uint32(base[0]) ^ h(2 * c)), int(np.uint32(base[1]) + h(2 * c + 1)))
        assert derive_keys(base, c) == want, c
        t = derive_keys(torch.tensor(base, dtype=torch.int64), c)
        assert t.dtype == torch.int64 and tuple(t.tolist()) == want, c
    with pytest.raises(ValueError, match="key counter"):
        derive_keys(base, MAX_COUNTER + 1)


def test_derived_keys_give_independent_streams():
    """Keys of consecutive counters round independently: the draws of 64 sites over one tensor
    agree as often as two independent coins (fp16 at probability 1/2 of going up)."""
    from lowprec.numerics.keys import derive_keys

    x = torch.full((4096,), 1.0 + 2**-11)  # halfway between two fp16 values
    ups = torch.stack([quantize(x, "fp16", "stochastic", seed=derive_keys((9, 4), c)) > 1
                       for c in range(64)]).double()
    assert abs(ups.mean().item() - 0.5) < 6 * 0.5 / math.sqrt(ups.numel())
    same = (ups[:-1] == ups[1:]).double().mean(1)  # each pair of consecutive sites
    assert (same - 0.5).abs().max().item() < 6 * 0.5 / math.sqrt(x.numel())


def test_the_engines_two_level_counters_give_distinct_keys():
    """Site n's j-th rounding takes counter j * 2**31 + n: all distinct (derivations nested
    one in the other commute, and shared keys between (n=1, j=8) and (n=2, j=4))."""
    from lowprec.numerics.keys import derive_keys

    keys = [derive_keys((12345, 678), j * 2**31 + n) for n in range(256) for j in range(16)]
    assert len(set(keys)) == len(keys)


def test_a_seed_may_be_two_ints_eagerly():
    x = torch.randn(1000)
    k = torch.tensor([5, 2**32 - 3])
    assert_same_bits(quantize(x, "e4m3fn", "stochastic", seed=(5, 2**32 - 3)),
                     quantize(x, "e4m3fn", "stochastic", seed=k), "a pair of ints")
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        quantize(x, "fp16", "stochastic", seed=(5, 2**32))
