"""quantize's fast path (a deterministic rounding whose kernel arguments a first call prepared,
on a contiguous float32 CPU tensor) gives the bits of the full path and of the torch path, and
what the full path returns: a new tensor without autograd history."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import assert_same_bits
from lowprec import quantize
from lowprec.numerics import kernel
from lowprec.numerics.formats import parse_format

qmod = sys.modules["lowprec.numerics.quantize"]  # the module (the package exports the function)
pytestmark = pytest.mark.skipif(not kernel.available(), reason="the C kernel is not built")


@pytest.mark.parametrize("fmt,rounding", [("fp16", "nearest"), (parse_format("bf16"), "nearest"),
                                          ("e4m3fn", "toward_zero"), ("q6.10", "nearest"),
                                          ("e5m2", "up")])
def test_the_second_call_takes_the_fast_path_with_the_same_bits(fmt, rounding, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 300
    first = quantize(x, fmt, rounding)  # prepares
    assert (fmt, rounding) in qmod._PREPARED
    calls = []  # the fast path calls quantize_prepared alone; the full one via quantize_f32
    real, real_f32 = kernel.quantize_prepared, kernel.quantize_f32
    monkeypatch.setattr(kernel, "quantize_prepared",
                        lambda *a: calls.append("prepared") or real(*a))
    monkeypatch.setattr(kernel, "quantize_f32", lambda *a: calls.append("f32") or real_f32(*a))
    w = torch.nn.Parameter(x.clone())  # a parameter, needing a gradient, a generator given
    fast = quantize(w, fmt, rounding, generator=torch.Generator())
    assert calls == ["prepared"]
    assert not fast.requires_grad and fast.grad_fn is None and fast.data_ptr() != w.data_ptr()
    assert_same_bits(fast, first, f"{fmt} {rounding}")
    assert_same_bits(fast, quantize(x, fmt, rounding, impl="torch"), f"{fmt} {rounding} torch")
    # not taken: a transposed view, a float16 tensor, stochastic rounding
    t = x.reshape(20, 50).t()
    assert_same_bits(quantize(t, fmt, rounding), quantize(t, fmt, rounding, impl="torch"), "view")
    h = x.half()
    assert quantize(h, fmt, rounding).dtype == torch.float16
    quantize(x, fmt, "stochastic")
    assert calls == ["prepared"] + ["f32", "prepared"] * 3


def test_a_bad_generator_is_refused_on_the_fast_path_too():
    x = torch.randn(8)
    quantize(x, "fp16")
    with pytest.raises(TypeError, match="generator"):
        quantize(x, "fp16", generator=3)


@pytest.mark.parametrize("fmt,rounding", [("fp16", "stochastic"), ("q6.10", "stochastic"),
                                          ("e4m3fn", "sr4"), (parse_format("bf16"), "sr8")])
def test_stochastic_rounding_given_its_keys_takes_the_fast_path_too(fmt, rounding, monkeypatch):
    """The eager engine rounds stochastically with keys derived per site, two ints a call:
    after a first call prepared the kernel's arguments, the keys are put into a copy of them
    (no per-call parsing); the bits are the full path's and the torch path's for the same
    keys, and other keys give other bits."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 300
    keys = (123456789, 2**32 - 5)
    first = quantize(x, fmt, rounding, seed=keys)  # prepares
    assert (fmt, rounding) in qmod._PREPARED_KEYED
    calls = []
    real, real_f32 = kernel.quantize_prepared, kernel.quantize_f32
    monkeypatch.setattr(kernel, "quantize_prepared",
                        lambda *a: calls.append("prepared") or real(*a))
    monkeypatch.setattr(kernel, "quantize_f32", lambda *a: calls.append("f32") or real_f32(*a))
    fast = quantize(x, fmt, rounding, seed=keys)
    assert calls == ["prepared"]
    assert_same_bits(fast, first, f"{fmt} {rounding}")
    assert_same_bits(fast, quantize(x, fmt, rounding, seed=keys, impl="torch"), "torch path")
    assert not torch.equal(fast, quantize(x, fmt, rounding, seed=(keys[0], keys[1] ^ 1)))
    # not taken: keys drawn from a generator, keys out of range (refused as before)
    calls.clear()
    quantize(x, fmt, rounding, generator=torch.Generator().manual_seed(1))
    assert calls == ["f32", "prepared"]
    with pytest.raises(ValueError, match="seed keys"):
        quantize(x, fmt, rounding, seed=(2**32, 0))
