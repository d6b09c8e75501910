"""The fused decomposition (lowprec.numerics.fused): the kernel's bits, eagerly and compiled.

Eagerly, ``quantize(..., impl="fused")`` runs the int32 torch ops; it must give the bits of the
default path (the C kernel for float32 CPU tensors; the plain-torch path on other devices) for
every format family and rounding mode, stochastic included with the same seed, and the values of
the float64 table reference (tests/reference.py) and of torch's own casts. Compiled with
Inductor's default configuration (``emulate_precision_casts`` off, under which Inductor drops a
``.half().float()`` round trip), the rounding must still be there: the compiled output equals
the eager kernel's bits, is not the input, and a Linear -> quantize -> GELU graph compiles to the
matmul plus one generated kernel, with no call of the opaque op left.
"""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from helpers import assert_same_bits, assert_same_values
from reference import interesting_values, random_f32_patterns, round_reference

from lowprec import Quantizer, quantize
from lowprec.numerics import reference as torch_path
from lowprec.numerics.formats import FloatFormat, parse_format
from lowprec.numerics.fused import random_words_i32, source_token
from lowprec.numerics.quantize import seed_tensor

OP = torch.ops.lowprec.quantize.default
FUSED = torch.ops.lowprec.quantize_fused.default

FLOATS = ["fp16", "bf16", "tf32", "e4m3fn", "e5m2", "e2m1fn", "e3m0", "e4m3fnuz", "e5m2fnuz",
          "e5m10-nosub", "e4m3-sat", "e3m2-ovnan", "e2m3fn", "e4m3-nosub-sat", "e8m23"]
FIXED = ["q2.14", "uq4.4", "fixed<8,3>", "int<8>", "q6.10", "fixed<24,126>", "fixed<10,130>"]
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic", "sr4", "sr1"]
BLOCKS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4", "mxint8", "dfx<8>",
          "block<e2m1fn,16,axis=0>", "block<q1.6,tensor>"]


def _seed(mode, k=3):
    return seed_tensor(torch.Generator().manual_seed(k)) if mode.startswith(("st", "sr")) else None


def _probe(fmt) -> torch.Tensor:
    """Every value of the format, midpoints and quarter points, their float32 neighbours
    (tests/reference.py), the overflow region, zeros of both signs, Infs, NaN; every float16
    pattern and 2**16 random float32 patterns (subnormals, NaN payloads)."""
    parts = [random_f32_patterns(2**16, seed=7),
             np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)]
    if isinstance(fmt, FloatFormat) and fmt.bits <= 16 or not isinstance(fmt, FloatFormat):
        values = interesting_values(fmt)
        if len(values) > 2**22:  # fixed<24,126>: 2e8 values, 1.6 GB a mode: the 2**16 at
            # each end (the overflow region) and 2**21 drawn from the rest, every kind alike
            pick = np.random.default_rng(5).integers(2**16, len(values) - 2**16, 2**21)
            values = np.concatenate([values[:2**16], values[np.sort(pick)], values[-2**16:]])
        parts.append(values)
    return torch.from_numpy(np.concatenate(parts))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", FLOATS + FIXED + ["binary"])
def test_the_decomposition_has_the_kernels_bits(spec, mode):
    fmt = parse_format(spec)
    x = _probe(fmt) if spec != "binary" else torch.from_numpy(random_f32_patterns(4096))
    seed = _seed(mode)
    got = quantize(x, fmt, mode, seed=seed, impl="fused")
    assert_same_bits(got, quantize(x, fmt, mode, seed=seed), f"{spec} {mode}")


@pytest.mark.parametrize("mode", ["nearest", "nearest_away", "toward_zero", "up", "down"])
@pytest.mark.parametrize("spec", ["fp16", "e4m3fn", "e5m2fnuz", "e2m1fn", "e3m0", "e5m10-nosub",
                                  "e3m2-ovnan", "q2.14", "uq4.4"])
def test_the_decomposition_has_the_float64_references_values(spec, mode):
    fmt = parse_format(spec)
    x = interesting_values(fmt)
    got = quantize(torch.from_numpy(x), fmt, mode, impl="fused")
    assert_same_values(got, round_reference(x, fmt, mode), f"{spec} {mode}")


@pytest.mark.parametrize("spec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                        ("e5m2", torch.float8_e5m2)])
def test_nearest_is_torchs_own_cast(spec, dtype):
    x = torch.from_numpy(np.concatenate([random_f32_patterns(2**18, seed=2),
                                         np.float32([65520, -65520, 2.0**-25, -0.0])]))
    x = x[~torch.isnan(x)]
    assert_same_bits(quantize(x, spec, impl="fused"), x.to(dtype).float(), spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spec", BLOCKS)
def test_blocks_have_the_kernels_bits(spec, mode):
    """Rows of 70 (two whole blocks of 32 and a short one), a block holding NaN, one holding
    Inf, an all-zero block, a block of float32 subnormals, one beyond every scale."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 70, generator=g) * torch.logspace(-8, 8, 70)
    x[1, 3] = float("nan")
    x[2, 40] = float("-inf")
    x[3, :32] = 0.0
    x[3, 33] = -0.0
    x[4, :32] = torch.randn(32, generator=g) * 1e-41
    x[5, 64:] = 3e38
    seed = _seed(mode)
    for t in (x, x.t()):  # axis -1 of a transposed tensor: blocks along its other dimension
        got = quantize(t, spec, mode, seed=seed, impl="fused")
        assert_same_bits(got, quantize(t, spec, mode, seed=seed), f"{spec} {mode}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["e4m3fn", "mxfp4"])
def test_other_dtypes_shapes_and_layouts(spec, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 40, generator=g) * 30).to(dtype)
    seed = _seed("sr4")
    for t in (x, x.t(), x[:, ::3], x[0, 0], x[:0]):
        got = quantize(t, spec, "sr4", seed=seed, impl="fused")
        assert got.dtype == dtype and got.shape == t.shape
        assert_same_bits(got, quantize(t, spec, "sr4", seed=seed), f"{spec} {tuple(t.shape)}")


def test_the_random_words_are_the_kernels_draw():
    seed = seed_tensor(torch.Generator().manual_seed(11))
    idx = torch.cat([torch.arange(5000), torch.tensor([2**31 - 1, 2**24 + 3])])
    got = random_words_i32(idx.to(torch.int32), seed).to(torch.int64) & 0xFFFFFFFF
    keys = tuple(int(k) for k in seed.tolist())
    expected = torch.cat([torch_path.random_words(5000, keys, "cpu"),
                          torch_path.random_words(1, keys, "cpu", start=2**31 - 1),
                          torch_path.random_words(1, keys, "cpu", start=2**24 + 3)])
    assert torch.equal(got, expected)


@given(exp_bits=st.integers(2, 8), man_bits=st.integers(0, 22), subnormals=st.booleans(),
       overflow=st.sampled_from(["inf", "nan", "saturate"]), mode=st.sampled_from(MODES),
       words=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_any_exmy_has_the_kernels_bits(exp_bits, man_bits, subnormals, overflow, mode, words):
    fmt = FloatFormat(exp_bits, man_bits, subnormals=subnormals, overflow=overflow)
    x = torch.tensor(np.array(words, dtype=np.uint32).view(np.float32))
    seed = _seed(mode, k=len(words))
    assert_same_bits(quantize(x, fmt, mode, seed=seed, impl="fused"),
                     quantize(x, fmt, mode, seed=seed), f"{fmt} {mode}")


# -- compiled: Inductor with its default configuration --------------------------------------------
COMPILED = [("fp16", "nearest"), ("bf16", "stochastic"), ("e4m3fn", "sr4"), ("e2m1fn", "up"),
            ("e3m2-ovnan", "toward_zero"), ("q2.14", "down"), ("e5m2fnuz", "nearest_away"),
            ("mxfp4", "stochastic"), ("block<e2m1fn,16,axis=0>", "nearest"),
            ("q6.10", "stochastic"), ("uq4.4", "sr4"), ("q2.14", "nearest"),
            ("fixed<8,3>", "nearest_away"), ("q2.14", "up")]


def test_compiled_roundings_have_the_eager_kernels_bits():
    """One compiled function rounds a probe of odd length (vector loops and their scalar tails)
    to several formats and modes; each output must be the eager kernel's, and must differ from
    its input (a rounding Inductor simplified away would return the input)."""
    assert torch._inductor.config.emulate_precision_casts is False
    x = torch.from_numpy(np.concatenate([random_f32_patterns(4001, seed=5),
                                         interesting_values(parse_format("e4m3fn"))]))
    x = x[: x.numel() // 14 * 14].reshape(14, -1)
    seed = _seed("stochastic", k=8)

    def f(x, seed):
        return [quantize(x, s, m, seed=seed) for s, m in COMPILED]

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, seed)
    for (spec, mode), g in zip(COMPILED, got):
        expected = quantize(x, spec, mode, seed=seed)
        assert_same_bits(g, expected, f"compiled {spec} {mode}")
        finite = torch.isfinite(x)
        assert not torch.equal(g[finite], x[finite]), f"{spec} {mode}: nothing was rounded"


@pytest.mark.parametrize("simdlen", [None, 1])  # vector loops (masked tails); scalar code
@pytest.mark.parametrize("spec", ["fp16", "bf16"])
def test_native_casts_compiled_keeping_casts_have_the_kernels_bits(spec, simdlen):
    """Under ``native_casts`` (compiled emulation's backend) fp16/bf16 to nearest are a cast
    round trip, which Inductor keeps with ``emulate_precision_casts``: the compiled output of
    every pattern of an odd-length probe (vector loops and scalar tails: subnormals, ties,
    overflow, both zeros, Infs) has the eager kernel's bits, in vector code and in scalar code
    (c10's conversions); a NaN stays a NaN of its sign (its payload bits are not kept)."""
    from torch._inductor.utils import run_and_get_code

    from lowprec.numerics.fused import native_casts, quantize_fused
    from lowprec.numerics.rounding import Rounding

    fmt = parse_format(spec)
    x = _probe(fmt)
    x = x[1:] if x.numel() % 2 == 0 else x  # odd: a tail after the vector loop
    torch._dynamo.reset()
    with native_casts(), torch._inductor.config.patch({"emulate_precision_casts": True,
                                                       "cpp.simdlen": simdlen}):
        got, (code,) = run_and_get_code(torch.compile(
            lambda t: quantize_fused(t, fmt, Rounding.NEAREST_EVEN, 0, None), fullgraph=True), x)
    assert "int32_t" not in code  # the cast round trip, not the int32 decomposition
    expected = quantize(x, spec)
    nan = torch.isnan(x)
    assert_same_bits(got[~nan], expected[~nan], f"compiled cast round trip, {spec}")
    assert torch.isnan(got[nan]).all() and torch.equal(got[nan].signbit(), x[nan].signbit())


def _kernels(code: str) -> set[str]:
    return set(re.findall(r"\b(cpp_fused_\w+|triton_\w+)\(", code))


@pytest.mark.parametrize("spec,mode", [("e4m3fn", "stochastic"), ("mxfp4", "nearest")])
def test_linear_quantize_gelu_is_the_matmul_and_one_fused_kernel(spec, mode):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(32, 64)
    seed = _seed(mode)

    def f(x, seed, impl):
        q = quantize(lin(x), spec, mode, seed=seed, impl=impl)
        return q, nn.functional.gelu(q)

    codes = {}
    with torch.no_grad():
        for impl in ("auto", "op"):
            torch._dynamo.reset()
            (q, y), code = run_and_get_code(torch.compile(f, fullgraph=True), x, seed, impl)
            codes[impl] = "\n".join(code)
            assert_same_bits(q, quantize(lin(x), spec, mode, seed=seed), f"{impl}: the rounding")
            torch.testing.assert_close(y, nn.functional.gelu(q), rtol=2e-6, atol=1e-7)
    assert "lowprec" not in codes["auto"] and len(_kernels(codes["auto"])) == 1, codes["auto"]
    # the control: the opaque op is a call of its own, GELU another kernel
    assert "torch.ops.lowprec.quantize" in codes["op"] and len(_kernels(codes["op"])) == 1


def test_dynamic_shapes_keep_the_bits():
    seed = _seed("stochastic")

    def f(x, seed):
        return quantize(x * 2, "e5m2", "sr4", seed=seed), quantize(x, "mxfp4", "sr", seed=seed)

    torch._dynamo.reset()
    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for n in (37, 100):
        x = torch.randn(3, n, generator=torch.Generator().manual_seed(n)) * 10
        for g, e in zip(compiled(x, seed), f(x, seed)):
            assert_same_bits(g, e, f"n={n}")


# -- routing: what compiled code records ----------------------------------------------------------
def _nodes(explained, op) -> int:
    return sum(n.target is op for g in explained.graphs for m in g.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


def test_compiled_quantizers_and_write_backs_record_the_fused_node():
    from lowprec.training.optim import SGD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Quantizer("e4m3fn", "e5m2", backward_rounding="up"),
                          nn.Linear(8, 4), Quantizer("mxfp8_e4m3", "fp16"))
    torch._dynamo.reset()
    e = torch._dynamo.explain(model)(torch.randn(5, 8, requires_grad=True))
    assert (e.graph_count, e.graph_break_count) == (1, 0)
    assert (_nodes(e, FUSED), _nodes(e, OP)) == (4, 0)
    # the digest of the decomposition's code is an argument: torch's compile caches key on it
    args = [n.args for g in e.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is FUSED]
    assert all(source_token() in a for a in args) and len(source_token()) == 16
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.configure_storage(param_format="fp16", state_format="bf16")
    model(torch.randn(5, 8)).sum().backward()
    torch._dynamo.reset()
    e = torch._dynamo.explain(opt.step)()
    assert (e.graph_count, e.graph_break_count) == (1, 0)
    assert _nodes(e, FUSED) >= 2 and _nodes(e, OP) == 0


def test_formats_the_decomposition_does_not_cover_keep_the_opaque_op():
    from lowprec.numerics.fused import max_numel

    assert max_numel(parse_format("dfxp<8>")) == 0
    assert max_numel(parse_format("fp16")) == 2**31 - 1


def test_bad_impl_is_named():
    with pytest.raises(ValueError, match="impl='fast'.*fused"):
        quantize(torch.ones(2), "fp16", impl="fast")


@pytest.mark.parametrize("mode", ["nearest", "down", "stochastic", "sr4"])
@pytest.mark.parametrize("spec", ["fp16", "bf16", "e4m3fn", "e2m1fn", "q2.14", "mxfp8_e4m3",
                                  "mxfp4", "block<e2m1fn,16,axis=0>"])
def test_eager_quantize_on_a_gpu_takes_the_decomposition_with_the_kernels_bits(
        spec, mode, monkeypatch):
    # on a GPU, quantize rounds by the decomposition's ops over the whole tensor (the reference
    # path's chunk loop launched thousands of kernels); here the CPU stands in for the GPU
    import importlib

    from lowprec.numerics import fused

    qmod = importlib.import_module("lowprec.numerics.quantize")  # the module, not the function
    calls = []
    real = fused.quantize_fused
    monkeypatch.setattr(qmod, "_on_accelerator", lambda x: True)
    monkeypatch.setattr(fused, "quantize_fused", lambda *a: calls.append(a) or real(*a))
    # the CPU fast path (arguments an earlier call prepared) is for CPU tensors only
    monkeypatch.setattr(qmod, "_PREPARED", {})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-6, 6, 64)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -0.0
    for t in (x, x.t(), x.half()):
        got = quantize(t, spec, mode, generator=torch.Generator().manual_seed(9))
        monkeypatch.setattr(qmod, "_on_accelerator", lambda x: False)
        want = quantize(t, spec, mode, generator=torch.Generator().manual_seed(9))
        monkeypatch.setattr(qmod, "_on_accelerator", lambda x: True)
        assert_same_bits(got, want, f"{spec} {mode} {t.dtype} {tuple(t.stride())}")
    native = mode == "nearest" and spec in ("fp16", "bf16")  # torch's own cast stays
    assert len(calls) == (0 if native else 3)


@pytest.mark.parametrize("mode", ["nearest", "up", "stochastic", "sr4"])
@pytest.mark.parametrize("spec", ["e4m3fn", "e5m10-nosub", "q2.14", "mxfp8_e4m3",
                                  "block<e2m1fn,16,axis=0>"])
def test_eager_quantize_on_a_gpu_rounds_large_tensors_in_slices(spec, mode, monkeypatch):
    # the decomposition's int32 temporaries take ~20x the input: on a GPU large tensors go
    # in slices (elementwise formats: random words at their logical indices; block formats:
    # whole rows along the block axis); the bits stay the kernel's
    import importlib

    qmod = importlib.import_module("lowprec.numerics.quantize")
    monkeypatch.setattr(qmod, "_on_accelerator", lambda x: True)
    monkeypatch.setattr(qmod, "_PREPARED", {})
    monkeypatch.setattr(qmod, "_DEVICE_CHUNK", 1000)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g) * torch.logspace(-6, 6, 96)
    x[0, 0], x[17, 50] = float("nan"), float("-inf")
    # 3,840 and 2,560 elements: several slices, a short one; rows longer than a slice
    for t in (x, x.t(), x[:, :64], x.reshape(-1), x.reshape(2, -1), x[:, :63].reshape(-1),
              x[:, 5:6]):  # ... and rows padded to a block (1 element: 32 with MXFP8)
        got = quantize(t, spec, mode, generator=torch.Generator().manual_seed(9))
        monkeypatch.setattr(qmod, "_on_accelerator", lambda x: False)
        want = quantize(t, spec, mode, generator=torch.Generator().manual_seed(9))
        monkeypatch.setattr(qmod, "_on_accelerator", lambda x: True)
        assert_same_bits(got, want, f"{spec} {mode} {tuple(t.shape)} {t.stride()}")


def test_tracing_outside_dynamo_emits_the_rounding_as_graph_ops():
    """Code traced outside Dynamo (compiled emulation's backend runs the engine under
    AOTAutograd, where torch 2.11 reports is_compiling() False) gets graph ops inside
    ``tracing_graph()``: the seed stays an input of the graph. Traced without it, the eager path
    ran at trace time."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowprec.numerics.quantize import seed_tensor, tracing_graph

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))

    def f(x, seed):
        return quantize(x, "e4m3fn", "stochastic", seed=seed)

    a, b = (seed_tensor(torch.Generator().manual_seed(s)) for s in (1, 2))
    with tracing_graph():
        g = make_fx(f)(x, a)
    assert_same_bits(g(x, b), quantize(x, "e4m3fn", "stochastic", seed=b), "traced, other seed")
    assert not torch.equal(g(x, a), g(x, b))
    # without it the eager path ran at trace time: the C kernel filled a buffer the graph does
    # not hold (its output is uninitialised memory), the seed's values were read as constants
    untraced = make_fx(f)(x, a)
    assert not torch.equal(untraced(x, b), quantize(x, "e4m3fn", "stochastic", seed=b))
