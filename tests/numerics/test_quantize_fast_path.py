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


def _kernel_calls(monkeypatch) -> list:
    """The kernel entry points called from now on, in order: "prepared" (the fast path calls
    quantize_prepared) or "f32" (the full path calls quantize_f32, which runs
    kernel/quantize.py's own quantize_prepared, not the package attribute patched here)."""
    calls = []
    real, real_f32 = kernel.quantize_prepared, kernel.quantize_f32
    monkeypatch.setattr(kernel, "quantize_prepared",
                        lambda *a: calls.append("prepared") or real(*a))
    monkeypatch.setattr(kernel, "quantize_f32", lambda *a: calls.append("f32") or real_f32(*a))
    return calls


@pytest.mark.parametrize("fmt,rounding", [("fp16", "nearest"), (parse_format("bf16"), "nearest"),
                                          ("e4m3fn", "toward_zero"), ("q6.10", "nearest"),
                                          ("e5m2", "up")])
def test_the_second_call_takes_the_fast_path_with_the_same_bits(fmt, rounding, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 300
    first = quantize(x, fmt, rounding)  # prepares
    assert (fmt, rounding) in qmod._PREPARED
    calls = _kernel_calls(monkeypatch)
    w = torch.nn.Parameter(x.clone())  # a parameter, needing a gradient, a generator given
    fast = quantize(w, fmt, rounding, generator=torch.Generator())
    assert calls == ["prepared"]
    assert not fast.requires_grad and fast.grad_fn is None and fast.data_ptr() != w.data_ptr()
    assert_same_bits(fast, first, f"{fmt} {rounding}")
    assert_same_bits(fast, quantize(x, fmt, rounding, impl="torch"), f"{fmt} {rounding} torch")
    # taken by a transposed view too (in its memory order); not by a float16 tensor or
    # stochastic rounding
    t = x.reshape(20, 50).t()
    assert_same_bits(quantize(t, fmt, rounding), quantize(t, fmt, rounding, impl="torch"), "view")
    h = x.half()
    assert quantize(h, fmt, rounding).dtype == torch.float16
    quantize(x, fmt, "stochastic")
    assert calls == ["prepared", "prepared", "f32", "f32"]


def _layouts(x: torch.Tensor):
    """``x`` (4-d) laid out channels-last, as a transposed matrix, and with its middle
    dimensions swapped in memory (no batched transpose: a stochastic rounding copies)."""
    yield "channels_last", x.contiguous(memory_format=torch.channels_last)
    yield "transposed", x.reshape(x.shape[0], -1).t()
    yield "middle_swapped", x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def _args(rounding: str, keys) -> dict:
    """Fresh keyword arguments for one call: none for a deterministic rounding; the keys, or a
    new generator seeded alike, for a stochastic one."""
    if rounding not in ("stochastic", "sr4"):
        return {}
    return {"seed": keys} if keys is not None else {"generator": torch.Generator().manual_seed(5)}


@pytest.mark.parametrize("shape", [(4, 6, 5, 7), (2, 6, 30, 30), (3, 37, 9, 11),
                                   (2, 300, 30, 30), (2, 16, 30, 30), (3, 64, 5, 7),
                                   (16, 128, 3, 3), (2, 8, 30, 30), (3, 2, 5, 7),
                                   (5, 4, 4, 4)])
# stochastic rounding of a batched transpose (channels-last: C columns, H * W rows; the
# transposed matrix: N rows, C * H * W columns): below 256 columns, 2-D tiles of whole memory
# rows, their counters computed for a power of two (16 and 8 channels: two row blocks of 512
# rows; (5, 4, 4, 4) transposed: 64 columns, 5 rows), read from a table for other counts (6
# channels and 900 rows: two row blocks; 37); else runs of the C values (300: one 256-element
# tile and a tail)
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic", "sr4"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "q6.10", "e4m3fn"])
def test_a_dense_tensor_in_any_layout_is_rounded_as_its_contiguous_copy(fmt, rounding, shape):
    """A deterministic rounding runs over a dense tensor in its memory order (no row-major copy);
    a stochastic one draws each element's random bits from its row-major index (a batched
    transpose in memory order, other layouts through a row-major copy): either way the bits of
    the contiguous tensor's rounding, whatever the path (fast after a first call, full, in
    place; keys or a generator), in the input's layout."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g) * torch.logspace(-9, 9, shape[-1])
    for name, v in _layouts(x):
        c = v.contiguous()
        for keys in ((11, 12), None):
            for call in range(2):  # the first call prepares, the second takes the fast path
                got = quantize(v, fmt, rounding, **_args(rounding, keys))
                want = quantize(c, fmt, rounding, **_args(rounding, keys))
                assert_same_bits(got.contiguous(), want, f"{name} {fmt} {rounding} {call}")
                assert got.shape == v.shape and got.stride() == v.stride(), name
            inplace = torch.empty_strided(v.shape, v.stride()).copy_(v)
            qmod.quantize_(inplace, fmt, rounding, **_args(rounding, keys))
            assert inplace.stride() == v.stride()
            assert_same_bits(inplace.contiguous(), quantize(c, fmt, rounding,
                                                            **_args(rounding, keys)),
                             f"{name} {fmt} {rounding} in place")


def test_a_channels_last_tensor_is_rounded_stochastically_without_a_copy(monkeypatch):
    """Stochastic rounding of a channels-last tensor goes to the batched-transpose kernel
    (tiles of whole memory rows in memory order), not to a row-major copy."""
    if not kernel.transposed_available():
        pytest.skip("the loaded kernel has no lp_quantize_f32_bt")
    calls = []
    real = kernel.quantize_transposed
    monkeypatch.setattr(kernel, "quantize_transposed",
                        lambda x, out, *a: calls.append((x.shape, a[:3])) or real(x, out, *a))
    x = torch.randn(2, 5, 3, 4).contiguous(memory_format=torch.channels_last)
    quantize(x, "fp16", "stochastic", seed=(1, 2))
    quantize(x, "fp16", "stochastic", seed=(1, 2))  # prepared: the fast path
    quantize(x, "q6.10", "stochastic", generator=torch.Generator().manual_seed(0))
    assert calls == [((2, 3, 4, 5), (2, 12, 5))] * 3
    assert qmod.batched_transpose(x, qmod.memory_order(x)) == (2, 12, 5)
    assert qmod.batched_transpose(x.transpose(1, 2), (0, 1, 2, 3)) is None


def test_memory_order_finds_dense_layouts_only():
    x = torch.randn(2, 3, 4, 5)
    assert qmod.memory_order(x) is None  # contiguous: nothing to do
    assert qmod.memory_order(x.contiguous(memory_format=torch.channels_last)) == (0, 2, 3, 1)
    assert qmod.memory_order(x[:, :, ::2]) is None  # gaps
    assert qmod.memory_order(x[:, :1].expand(2, 3, 4, 5)) is None  # overlaps
    assert qmod.memory_order(torch.randn(3)) is None


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
    calls = _kernel_calls(monkeypatch)
    fast = quantize(x, fmt, rounding, seed=keys)
    assert calls == ["prepared"]
    assert_same_bits(fast, first, f"{fmt} {rounding}")
    assert_same_bits(fast, quantize(x, fmt, rounding, seed=keys, impl="torch"), "torch path")
    assert not torch.equal(fast, quantize(x, fmt, rounding, seed=(keys[0], keys[1] ^ 1)))
    # not taken: keys drawn from a generator, keys out of range (refused as before)
    calls.clear()
    quantize(x, fmt, rounding, generator=torch.Generator().manual_seed(1))
    assert calls == ["f32"]
    with pytest.raises(ValueError, match="seed keys"):
        quantize(x, fmt, rounding, seed=(2**32, 0))


@pytest.mark.parametrize("fmt,rounding", [("fp16", "stochastic"), ("q6.10", "stochastic"),
                                          ("e4m3fn", "sr4"), (parse_format("bf16"), "sr8")])
def test_in_place_stochastic_rounding_given_its_keys_takes_the_fast_path(fmt, rounding,
                                                                         monkeypatch):
    """quantize_ as quantize: the engine rounds an op's fresh output in place with a site's
    keys; after a first call prepared the arguments, a contiguous tensor goes straight to the
    kernel, a channels-last one to its tiles, with the out-of-place rounding's bits for the
    same keys."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * 300
    keys = (987654321, 77)
    qmod.quantize_(x.clone(), fmt, rounding, seed=keys)  # prepares
    assert (fmt, rounding) in qmod._PREPARED_KEYED
    calls = _kernel_calls(monkeypatch)
    y = x.clone()
    assert qmod.quantize_(y, fmt, rounding, seed=keys) is y
    assert calls == ["prepared"]
    assert_same_bits(y, quantize(x, fmt, rounding, seed=keys, impl="torch"), "contiguous")
    z = x.clone()
    qmod.quantize_(z, fmt, rounding, seed=(keys[0], keys[1] ^ 1))
    assert not torch.equal(y, z)
    c = (torch.randn(4, 6, 5, 7, generator=g) * 300).contiguous(memory_format=torch.channels_last)
    want = quantize(c, fmt, rounding, seed=keys, impl="torch")
    v = c._version
    qmod.quantize_(c, fmt, rounding, seed=keys)
    assert c.is_contiguous(memory_format=torch.channels_last) and c._version > v
    assert_same_bits(c, want, "channels-last")
    with pytest.raises(ValueError, match="seed keys"):
        qmod.quantize_(x.clone(), fmt, rounding, seed=(0, 2**32))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", ["fp16", "q6.10", "e4m3fn", "mxfp8_e4m3", "mxfp4"])
def test_the_output_has_the_strides_of_the_inputs_cast_round_trip(fmt, rounding):
    """quantize's output has the strides torch's cast round trip gives its input
    (``x.half().float()``: what a native 16-bit tensor and its upcast have), on the first call
    and the prepared ones: a channels-last weight of one input channel too, whose size-1 axis
    has a stride row-major order would not give (a convolution handed the row-major one
    answers in row-major order), other strides on size-1 axes, and an MX rounding along a
    channels-last activation's channels (its memory's last axis: the kernel reads and writes
    in place); the kernel's paths and the torch path; not a view on the kernel's paths (the
    engine would copy it);
    with the bits of the contiguous tensor's rounding."""
    from dataclasses import replace

    from lowprec.numerics.formats import BlockFormat, parse_format

    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 1, 5, 5, generator=g).to(memory_format=torch.channels_last)
    a = torch.randn(4, 32, 3, 5, generator=g).to(memory_format=torch.channels_last)
    odd = torch.randn(3, 40, generator=g).as_strided((3, 1, 40), (40, 7, 1))
    base = parse_format(fmt)
    for t, axis in ((w, 1), (a, 1), (a, -1), (w, -1), (odd, -1)):
        f = replace(base, axis=axis) if isinstance(base, BlockFormat) else base
        for call in range(3):  # the first, a prepared one, the torch path (a GPU's fallback)
            got = quantize(t, f, rounding, **_args(rounding, (7, 8)),
                           impl="torch" if call == 2 else "auto")
            assert got.stride() == t.half().float().stride(), (tuple(t.shape), axis, call)
            assert got._base is None or call == 2  # (the torch path's blocks: views, as before)
            assert_same_bits(got.contiguous(),
                             quantize(t.contiguous(), f, rounding, **_args(rounding, (7, 8))),
                             f"{tuple(t.shape)} axis {axis} call {call}")


@pytest.mark.parametrize("rounding,keys", [("nearest", None), ("toward_zero", "gen"),
                                           ("stochastic", (3, 4)), ("stochastic", "gen"),
                                           ("sr4", (3, 4))])
@pytest.mark.parametrize("channels", [16, 6, 96])
def test_in_place_rounding_of_a_channels_last_tensor_takes_no_copy(monkeypatch, rounding, keys,
                                                                    channels):
    """``quantize_`` of a channels-last float32 tensor rounds its memory where it lies (the
    engine rounds a convolution's fresh output so): the contiguous copy's bits, without the
    out-of-place rounding and copy back it took before (a generator given to a deterministic
    rounding, as the engine passes one, included)."""
    x = torch.randn(4, channels, 5, 3, generator=torch.Generator().manual_seed(0)) * 30
    x = x.contiguous(memory_format=torch.channels_last)

    def kw():
        if keys == "gen":
            return {"generator": torch.Generator().manual_seed(9)}
        return {"seed": keys} if rounding in ("stochastic", "sr4") else {}

    want = quantize(x.contiguous(), "fp16", rounding, **kw())
    quantize(x, "fp16", rounding, **kw())  # (prepared, as a first call leaves it)
    monkeypatch.setattr(qmod, "quantize", lambda *a, **k: pytest.fail("copied through quantize"))
    y = x.clone()
    assert qmod.quantize_(y, "fp16", rounding, **kw()) is y
    assert y.stride() == x.stride()
    assert_same_bits(y.contiguous(), want, f"{rounding} {keys} {channels}")


def test_in_place_rounding_of_a_channels_last_tensor_moves_its_version():
    """Rounding a non-contiguous tensor in place moves its version counter, as the copy back it
    once took did: autograd still refuses a saved tensor overwritten so."""
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    y = x.exp().contiguous(memory_format=torch.channels_last).exp()  # saves its channels-last output
    with torch.no_grad():
        qmod.quantize(y.detach().clone(), "fp16")  # (prepared)
        before = y._version
        qmod.quantize_(y, "fp16")
    assert y._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_counting_rounding_runs_where_the_fast_path_would_and_declines_elsewhere(
        monkeypatch):
    """quantize_counting_ rounds in place and counts the Inf and NaN values left (quantize_'s
    bits), for what quantize_'s fast path takes: a contiguous float32 CPU tensor and a
    deterministic rounding a first call prepared; elsewhere it declines (None) and leaves the
    tensor as it was, for the caller's two passes."""
    fmt = parse_format("e5m2")
    # (another test may have prepared it: not here; restored after)
    monkeypatch.delitem(qmod._PREPARED, (fmt, "down"), raising=False)
    x = torch.tensor([1.0, 70000.0, float("inf"), float("nan"), -3.3, 57344.0] * 700)
    assert qmod.quantize_counting_(x.clone(), fmt, "down") is None  # not prepared yet
    want = quantize(x, fmt, "down")  # prepares it
    y = x.clone()
    assert qmod.quantize_counting_(y, fmt, "down") == int((~want.isfinite()).sum()) == 1400
    assert_same_bits(y, want, "in place")
    for declined in (x.clone()[::2], x.clone().to(torch.float16), x.clone()):
        kept = declined.clone()
        mode = "stochastic" if declined.dtype == torch.float32 and declined.is_contiguous() \
            else "down"
        assert qmod.quantize_counting_(declined, fmt, mode) is None
        assert torch.equal(declined.isnan(), kept.isnan())
        assert torch.equal(declined.nan_to_num(0.0), kept.nan_to_num(0.0))
