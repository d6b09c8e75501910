"""Every instruction-set path of the compiled kernel gives the plain-torch path's bits.

The kernel (``numerics/csrc/*.c``) compiles its loops three times (GCC target clones: x86-64-v4
with AVX-512, AVX2, baseline x86-64) and the loader runs the one this CPU supports, so the other
tests only ever see one of them. Here the library is built once per instruction set with
``-DLP_NO_CLONES -march=...``
(setup.py's flags otherwise) and each build this CPU can execute is checked: quantization
(elementwise, every rounding mode, and MX blocks) against the plain-torch path, the fused
optimizer step against the torch path, the counting and reference-order dot-product loops
against torch, the fused LSTM kernels against the op-by-op replay they stand for, the
emulated attention's row passes against its torch ops, and the
embedding's ordered 16-bit sums against the torch loop. A path this CPU cannot execute (AVX-512 on an AVX2-only EPYC) is skipped with the
reason; CI machines with AVX-512 run it.
"""

from __future__ import annotations

import importlib.util
import math
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import assert_same_bits
from lowprec import quantize
from lowprec import numerics
from lowprec.numerics import kernel
from lowprec.training.optim import SGD, Adam

# every C file of the kernel, as setup.py lists them (lp_common.h is found beside them)
SOURCES = sorted(Path(numerics.__file__).with_name("csrc").glob("*.c"))
# setup.py's flags (no -ffast-math: the kernel relies on IEEE multiplication and subnormals)
CFLAGS = ["-O3", "-fno-trapping-math", "-std=gnu11", "-fopenmp", "-ffp-contract=off",
          "-fno-math-errno", "-fPIC", "-shared", "-DLP_NO_CLONES"]
# the clone each build stands for, and the CPU flags (/proc/cpuinfo) it needs
PATHS = {
    "x86-64": set(),
    "x86-64-v3": {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


_BUILT: dict = {}  # march -> the loaded build (one compilation per module run)


@pytest.fixture(scope="module", params=list(PATHS))
def path_lib(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def baseline_lib(tmp_path_factory):
    """The x86-64 build: no F16C, its loops the plain ones every other path must agree with."""
    return _build("x86-64", tmp_path_factory)


def _build(march: str, tmp_path_factory):
    if march in _BUILT:
        return _BUILT[march]
    cc = shutil.which("gcc")
    if platform.machine() != "x86_64" or cc is None:
        pytest.skip("the clones exist on x86-64 with GCC only")
    missing = PATHS[march] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot execute {march} code (no {', '.join(sorted(missing))}); "
                    "CPUs with it run this path")
    assert SOURCES, "no C sources beside lowprec/numerics (csrc/*.c)"
    out = tmp_path_factory.mktemp(march) / "_qkernel_path.so"
    include = f"-I{sysconfig.get_paths()['include']}"  # Python.h: it is an extension module
    build = subprocess.run([cc, *CFLAGS, include, f"-march={march}", *map(str, SOURCES), "-o",
                            str(out), "-lpthread"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    lib = kernel.open_kernel(str(out))
    assert lib is not None, f"the {march} build did not load"
    _BUILT[march] = lib
    return lib


@pytest.fixture
def on_path(path_lib, monkeypatch):
    """The kernel functions run the given build for the duration of a test."""
    monkeypatch.setattr(kernel.library, "lib", lambda: path_lib)
    assert kernel.available()


def bit_patterns(n: int = 1 << 14, seed: int = 0) -> torch.Tensor:
    """Random float32 bit patterns (every exponent, NaN, Inf, subnormals) and their +-0."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 31), 1 << 31, (n,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    return torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])


# q12.12: a 24-bit word, the widest whose limits lie below 2**(qsub + 23) (nearest even by the
# addition trick); q13.12, 25 bits, takes the general rule
# (e4m3fn-sat, e5m2-sat, e2m1fn and the fixed formats saturate: the fast rule takes the limit;
# uq4.4 is unsigned, a negative value's limit 0; q-5.15 has no integer bits, its step 2**-15
# below the largest value 2**-5; fixed<25,0> is an integer format beyond the addition trick)
FORMATS = ["fp16", "bf16", "e4m3fn", "e4m3fn-sat", "e5m2", "e5m2-sat", "e2m1fn", "q6.10",
           "q12.12", "q13.12", "uq4.4", "q-5.15", "fixed<25,0>"]
MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic", "sr4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_rounding_mode_gives_the_torch_paths_bits(on_path, fmt):
    from lowprec.numerics.formats import parse_format

    x = bit_patterns()
    # also values near the format's own grid, where rounding decisions are made, and whole
    # chunks of them across its range (random bit patterns put a value beyond the range in
    # nearly every chunk of 16, which sends the chunk past the kernel's fast path)
    g = torch.Generator().manual_seed(1)
    top = parse_format(fmt).max
    span = (torch.rand(1 << 12, generator=g) * 2 - 1) * top
    # and magnitudes log-uniform from 2**-40 to the maximum, every binade in whole chunks (the
    # binades just above and below the quantum, where a path changes rule)
    e = torch.rand(1 << 12, generator=g) * (40 + float(torch.log2(torch.tensor(top)))) - 40
    sign = torch.where(torch.rand(1 << 12, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([x, torch.randn(1 << 12, generator=g) * 3, span, sign * torch.exp2(e)])
    for mode in MODES:
        got = quantize(x, fmt, mode, impl="kernel", generator=torch.Generator().manual_seed(5))
        want = quantize(x, fmt, mode, impl="torch", generator=torch.Generator().manual_seed(5))
        assert_same_bits(got, want, f"{fmt} {mode}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2", "e4m3fn-sat", "q6.10"])
def test_the_counting_rounding_gives_the_torch_paths_bits_and_count(on_path, fmt, threads):
    """lp_quantize_f32_nonfinite (the emulated step's gradients rounded and checked in one
    pass): the torch path's bits, and the number of Inf and NaN values among them. Random bit
    patterns and values beyond the format's range, 20,488 of them (chunks of 2,048, a partial
    one, and two threads' shares)."""
    from lowprec.numerics.formats import parse_format
    from lowprec.numerics.params import ROUNDING_CODES, element_params
    from lowprec.numerics.rounding import parse_rounding

    g = torch.Generator().manual_seed(6)
    x = torch.cat([bit_patterns(), torch.randn(4100, generator=g) * 3e5])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mode in ("nearest", "toward_zero", "up"):
            want = quantize(x, fmt, mode, impl="torch")
            prm = kernel.prepare(element_params(parse_format(fmt)),
                                 ROUNDING_CODES[parse_rounding(mode)[0]], 0)
            out = torch.empty_like(x)
            n = kernel.quantize_prepared_nonfinite(x, out, prm)
            assert_same_bits(out, want, f"{fmt} {mode}")
            assert n == int((~torch.isfinite(want)).sum()), f"{fmt} {mode}"
            y = x.clone()  # in place, as the step rounds a gradient
            assert kernel.quantize_prepared_nonfinite(y, y, prm) == n
            assert_same_bits(y, want, f"{fmt} {mode} in place")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["q6.10", "fixed<20,94>", "fixed<24,80>"])
def test_stochastic_rounding_to_fixed_point_ignores_denormals_are_zero(on_path, fmt):
    # the fast rule for fixed point computes in float32 (|x| + 2**(qsub + 23) and its
    # fraction of the quantum): float32 subnormal inputs and fractions truncate to the same
    # 32-bit fraction whether or not the CPU flushes them (torch.set_flush_denormal, which sets
    # the calling thread's MXCSR: one thread here)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1 << 14, generator=g) * 2.0 ** -60
    x[:4096] = torch.randn(4096, generator=g) * 1e-39  # float32 subnormals
    x[4096:8192] = torch.randn(4096, generator=g) * 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = quantize(x, fmt, "stochastic", seed=(3, 4), impl="torch")
        for flush in (False, True):
            if not torch.set_flush_denormal(flush):
                pytest.skip("this CPU cannot flush denormals")
            got = quantize(x, fmt, "stochastic", seed=(3, 4), impl="kernel")
            assert_same_bits(got, want, f"{fmt} flush {flush}")
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["fp16", "e4m3fn", "q6.10"])
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_one_value_past_the_fast_rule_anywhere_in_a_block(on_path, fmt, mode):
    """The fast path tests its values' flags once a block of 64 and sends only the chunks of 16
    holding a flagged value (here one beyond the format's range, or a subnormal) to the general
    rule: one such value at each place of a block, a partial last block, in place and not."""
    from lowprec.numerics.formats import parse_format
    from lowprec.numerics.quantize import quantize_

    top = parse_format(fmt).max
    g = torch.Generator().manual_seed(2)
    for n in (64, 100, 130):  # one block; a block and a partial one (36, 2 values)
        base = (torch.rand(n, generator=g) * 2 - 1) * top / 2
        for at in range(0, n, 7):
            for odd in (top * 4, 1e-30):
                x = base.clone()
                x[at] = odd
                want = quantize(x, fmt, mode, impl="torch",
                                generator=torch.Generator().manual_seed(5))
                got = quantize(x, fmt, mode, impl="kernel",
                               generator=torch.Generator().manual_seed(5))
                assert_same_bits(got, want, f"{fmt} {mode} n={n} at {at}")
                quantize_(x, fmt, mode, generator=torch.Generator().manual_seed(5))
                assert_same_bits(x, want, f"{fmt} {mode} n={n} at {at}, in place")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt, rounding", [("q6.10", "stochastic"), ("fp16", "stochastic"),
                                           ("bf16", "sr4"), ("e4m3fn", "stochastic")])
def test_a_channels_last_tensors_stochastic_rounding_draws_by_logical_index(on_path, fmt,
                                                                            rounding, threads):
    """lp_quantize_f32_bt's tiles of whole memory rows (a power of two of channels: counters
    computed; other counts below 256: read from a table; 256 and more: runs of a row) give the
    bits of the row-major copy's rounding, whose random counters are its indices. Channel counts
    around each bound, row blocks of 512 and a partial tile; values across and beyond the range."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for c, hw in [(1, 9), (3, 30), (6, 28), (7, 5), (16, 33), (24, 16), (37, 3), (100, 6),
                      (255, 2), (256, 2), (300, 3)]:
            g = torch.Generator().manual_seed(c)
            x = torch.randn(3, c, hw, hw, generator=g) * torch.logspace(-9, 9, hw)
            x.view(-1)[::97] = bit_patterns(x.numel() // 97 + 1)[:x[::1].view(-1)[::97].numel()]
            cl = x.contiguous(memory_format=torch.channels_last)
            got = quantize(cl, fmt, rounding, seed=(5, 9))
            want = quantize(x, fmt, rounding, seed=(5, 9))
            assert got.stride() == cl.stride()
            assert_same_bits(got.contiguous(), want, f"{fmt} {rounding} {c} channels")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(64, 96), (50, 14), (30, 45)])  # whole blocks; rows shorter
# than a block (a channels-last activation's W = 14) and than a chunk of 16; a last partial block
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4", "mxint8"])
def test_mx_blocks_give_the_torch_paths_bits(on_path, fmt, shape):
    """The kernel's scale exponents and rounding against the torch ops' (block_shifts in torch
    ops, the reference rounding), NaN and Inf blocks, all-zero and subnormal-range blocks."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    x[3, :40] *= 1e-30  # a block of subnormal-range values
    x[4] = 0.0
    x[5, 2], x[7, 1] = float("nan"), -float("inf")
    for mode in ("nearest", "stochastic", "sr4", "toward_zero"):
        got = quantize(x, fmt, mode, impl="kernel", generator=torch.Generator().manual_seed(3))
        want = quantize(x, fmt, mode, impl="torch", generator=torch.Generator().manual_seed(3))
        assert_same_bits(got, want, f"{fmt} {mode}")


@pytest.mark.parametrize("fmt, shape", [
    ("mxfp8_e4m3", (600, 1)), ("mxfp8_e4m3", (200, 6)), ("mxfp8_e5m2", (90, 15)),
    ("mxfp6_e3m2", (120, 3)), ("mxfp4", (150, 6)), ("mxint8", (100, 6)),
    ("block<e4m3fn-sat,8>", (24, 50)), ("block<e2m1fn,4>", (30, 37))])
def test_short_blocks_by_each_values_shift_give_the_torch_paths_bits(on_path, fmt, shape):
    """Blocks shorter than 16 values (rows shorter than a block: an MX rounding along a
    channels-last activation of a few channels; or short blocks along a row, a partial last
    one) are rounded by the unshifted format's fast rule on each value's exponent moved by its
    block's scale: values whose fields would leave float32's normal range (block scales at both
    ends of the exponent range, float32 subnormals beside normal values, results that saturate)
    and NaN / Inf blocks take the general rule. Every mode against the torch path's bits."""
    g = torch.Generator().manual_seed(4)
    rows, cols = shape
    # each row its own scale, 2**-149 .. 2**127: the block scales' whole range
    scale = torch.exp2(torch.randint(-149, 128, (rows, 1), generator=g).float())
    x = torch.randn(rows, cols, generator=g) * scale
    x[::7] = torch.randn(len(x[::7]), cols, generator=g)  # and ordinary rows
    x[1] = torch.tensor([447.0, 465.0, 480.0, 511.0, -500.0, 1.0] * 10)[:cols]  # saturating
    x[2, 0] = 1e-40  # a float32 subnormal beside normal values
    x[4, -1], x[5, 0], x[8, 0] = float("nan"), -float("inf"), -0.0
    x[9] = 0.0
    x[10] = bit_patterns(cols, seed=3)[:cols]
    for mode in ("nearest", "stochastic", "sr4", "toward_zero", "up"):
        got = quantize(x, fmt, mode, impl="kernel", generator=torch.Generator().manual_seed(3))
        want = quantize(x, fmt, mode, impl="torch", generator=torch.Generator().manual_seed(3))
        assert_same_bits(got, want, f"{fmt} {mode} {shape}")


def _steps(cls, kw, dtype, fuse: bool):
    w = torch.randn(37, 301, generator=torch.Generator().manual_seed(7)).to(dtype)
    opt = cls([w], update="stochastic", generator=torch.Generator().manual_seed(11), **kw)
    if not fuse:
        opt._can_fuse = lambda p, s: False
    for i in range(3):
        g = torch.Generator().manual_seed(100 + i)
        w.grad = (torch.randn(w.shape, generator=g)
                  * torch.pow(10.0, -torch.randint(0, 7, w.shape, generator=g).float())).to(dtype)
        opt.step(grad_scale=0.37)
        assert not fuse or opt._can_fuse(w, opt.state[w])
    return w, opt.state[w]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls, kw", [(SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
                                     (Adam, dict(lr=1e-2, weight_decay=1e-3))],
                         ids=["sgd", "adam"])
def test_the_fused_optimizer_step_gives_the_torch_paths_bits(on_path, cls, kw, dtype):
    w_f, st_f = _steps(cls, kw, dtype, fuse=True)
    w_t, st_t = _steps(cls, kw, dtype, fuse=False)
    assert_same_bits(w_f, w_t, "parameter")
    for key, val in st_f.items():
        if torch.is_tensor(val):
            assert_same_bits(val, st_t[key], key)


def _sgd_16_bit_carriers(lib, monkeypatch, pf: str, sf: str, threads: int,
                         flush: bool) -> list[torch.Tensor]:
    """Three SGD steps on float32 carriers of ``pf`` values by ``lib``'s fused kernel on
    ``threads`` threads (``flush``: denormals are zero): lowprec's SGD (plain; momentum and
    Nesterov kept in ``sf``'s dtype, a grad_scale) and a wrapped torch.optim.SGD (float32
    momentum of ``sf`` values), 70,001 values (split between threads, a partial vector last),
    gradients holding NaNs with payloads (high bits that float16 keeps, low bits it drops, a
    negative one), infinities, values past float16's range and subnormals; a float16 momentum
    given signalling NaNs, and subnormals beside a NaN, after the first step. Returns
    parameters and momenta."""
    from lowprec import parse_format
    from lowprec.training.optim import FormatOptimizer

    monkeypatch.setattr(kernel.library, "lib", lambda: lib)
    n = 70001
    nans = torch.tensor([0x7FE00000, 0x7FC00001, -0x2F0000, 0x7FD01234], dtype=torch.int32)
    out = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(flush)
    try:
        for kind, kw in [("lowprec", dict(lr=1.0, weight_decay=0.7)),
                         ("lowprec", dict(lr=0.75, momentum=0.9, dampening=0.2,
                                          weight_decay=0.6)),
                         ("lowprec", dict(lr=0.5, momentum=0.7, nesterov=True,
                                          weight_decay=0.9)),
                         ("torch", dict(lr=0.75, momentum=0.9, weight_decay=0.6))]:
            w = quantize(torch.randn(n, generator=torch.Generator().manual_seed(3)) * 4, pf)
            w[192:216] = 0.0  # (with zero gradients there: the momentum alone moves them)
            if kind == "lowprec":
                opt = SGD([w], param_format=pf, state_format=sf, **kw)
                state = opt.state
            else:
                inner = torch.optim.SGD([w], **kw)
                opt = FormatOptimizer(inner, param_format=parse_format(pf),
                                      state_format=parse_format(sf))
                state = inner.state
            for i in range(3):
                g = torch.randn(n, generator=torch.Generator().manual_seed(50 + i)) * 3
                g[[9 + i, 700, 2050 + i, 40000, n - 1]] = torch.cat(
                    [nans, nans[:1]]).view(torch.float32)
                g[[40 + i, 2001]] = float("inf")
                g[[41, n - 3]] = -float("inf")
                g[[60 + i, 61]] = 7e4
                g[80:96] = 3e-8  # (subnormal in float16)
                g[192:216] = 0.0
                w.grad = g
                if kind == "lowprec":
                    opt.step(grad_scale=0.37)
                else:
                    opt.step()
                buf = state[w].get("momentum_buffer")
                if i == 0 and buf is not None and buf.dtype == torch.float16:
                    # signalling NaNs, which F16C's widening would quiet, and float16
                    # subnormals beside a NaN, which the integer widening flushes under DAZ
                    bits = buf.view(torch.int16)
                    bits[[100, 2100]] = torch.tensor([0x7D00, -0x2FF], dtype=torch.int16)
                    bits[[200, 201, 202]] = torch.tensor([0x7E00, 0x0001, 0x0200],
                                                         dtype=torch.int16)
            out += [w] + [v for v in state[w].values() if torch.is_tensor(v) and v.dim()]
    finally:
        torch.set_num_threads(before)
        torch.set_flush_denormal(False)
    return out


PF_SF = [("fp16", "fp16"), ("bf16", "bf16"), ("fp16", "bf16"), ("bf16", "fp16")]


def _same_steps(got, want) -> None:
    assert len(got) == len(want) == 7
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.isnan().any(), i
        assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32)), i


@pytest.mark.parametrize("pf, sf", PF_SF)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_one_loop_sgd_step_gives_the_tile_loops_bits(path_lib, baseline_lib, monkeypatch,
                                                        pf, sf, threads):
    """SGD on float32 carriers of float16 / bfloat16 values: where the CPU has F16C and FMA the
    kernel steps whole vectors in one loop (optimizer.c's sgd_f32_fast), the baseline build its
    tiles (by its integer conversions); every stored bit the same, NaN payloads included (the
    torch path does not fix those: its momentum in a 16-bit dtype carries a NaN otherwise),
    split between two threads."""
    want = _sgd_16_bit_carriers(baseline_lib, monkeypatch, pf, sf, threads, False)
    _same_steps(_sgd_16_bit_carriers(path_lib, monkeypatch, pf, sf, threads, False), want)


@pytest.mark.parametrize("pf, sf", PF_SF)
@pytest.mark.parametrize("flush", [False, True], ids=["ieee", "flush-denormal"])
def test_the_one_loop_sgd_step_gives_its_own_builds_tile_bits(path_lib, monkeypatch, pf, sf,
                                                              flush):
    """The same against the tiles of the same build (``ONE_LOOP`` off), also with denormals
    flushed (torch.set_flush_denormal: a float16 momentum's subnormal beside a NaN is widened by
    the integer conversion, which flushes it, as the tiles widen it; F16C would keep it). (Across
    builds the flushed steps differ already: the baseline's integer rounding and F16C's
    conversion round a flushed step apart.)"""
    from lowprec.numerics.kernel import optimizer as kernel_optimizer

    monkeypatch.setattr(kernel_optimizer, "ONE_LOOP", False)
    want = _sgd_16_bit_carriers(path_lib, monkeypatch, pf, sf, 1, flush)
    monkeypatch.setattr(kernel_optimizer, "ONE_LOOP", True)
    _same_steps(_sgd_16_bit_carriers(path_lib, monkeypatch, pf, sf, 1, flush), want)


def test_counting_and_reference_order_dot_products(on_path):
    x = bit_patterns(5000)
    x = x[~x.isnan()].contiguous()
    n1, n2 = kernel.count_abs_ge(x, 1.0, 1e20)
    assert (n1, n2) == (int((x.abs() >= 1.0).sum()), int((x.abs() >= 1e20).sum()))
    g = torch.Generator().manual_seed(4)
    cols = torch.randn(2, 2 * 9, 50, generator=g)
    w = torch.randn(2 * 3, 9, generator=g)
    out = torch.empty(2, 6, 50)
    kernel.dot4(cols, w, out, 2)
    ref = torch.cat([w[3 * i:3 * i + 3].double() @ cols[:, 9 * i:9 * i + 9].double()
                     for i in range(2)], dim=1)
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    installed = kernel.open_kernel(importlib.util.find_spec("lowprec.numerics._qkernel").origin)
    if installed is not None:  # the clone this CPU dispatches to: the same summation order
        with pytest.MonkeyPatch.context() as m:
            m.setattr(kernel.library, "lib", lambda: installed)
            again = torch.empty_like(out)
            kernel.dot4(cols, w, again, 2)
        assert_same_bits(out, again, "dot4")


def test_fexp_u20_gives_the_torch_ops_bits(on_path):
    # the flash attention's exp: fmaf (one vfmadd on x86-64-v3/v4, libm's on the baseline)
    # against the same polynomial in torch ops with its FMAs exact through float64; random bit
    # patterns (NaN, infinities, subnormals), the range of attention's s - max and the edges
    # of the kernel's range (ln FLT_MIN, ln FLT_MAX)
    from lowprec.training.emulation.kernels import fexp_u20

    g = torch.Generator().manual_seed(3)
    edges = torch.tensor([0.0, -0.0, 88.72, 88.7228, 88.73, -87.33, -87.3365, -87.34, -103.0,
                          1e-30, -1e-30, float("nan"), float("inf"), -float("inf")])
    x = torch.cat([bit_patterns(), -torch.rand(1 << 16, generator=g) * 100,
                   torch.randn(1 << 14, generator=g) * 30, edges])
    assert kernel.fexp_available()
    assert_same_bits(fexp_u20(x, impl="kernel"), fexp_u20(x, impl="torch"), "fexp_u20")


def _attention_scores(causal_rows: int, n: int, seed: int):
    """Raw scores [2, 3, L, n] of every kind a row meets: normal, huge (the max overflows to
    inf when scaled), -inf keys, a NaN, a row entirely -inf; the log-sum-exp and the row sums
    the backward's passes take."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 3, causal_rows, n, generator=g) * 8
    s[0, 0, 1] *= 1e38
    s[0, 1, 2, ::3] = -float("inf")
    s[1, 0, 3, 1] = float("nan")
    s[1, 2, 4] = -float("inf")
    s[1, 1, 5, 0] = float("inf")
    lse = torch.randn(2, 3, causal_rows, 1, generator=g) * 4
    lse[0, 2, 0] = -float("inf")
    lse[1, 2, 6] = float("nan")
    dsum = torch.randn(2, 3, causal_rows, 1, generator=g)
    # NaNs other than torch's canonical one (the hardware's default NaN has the sign bit: an
    # overflowed score inf - inf), where torch's ops choose between two NaN operands; away from
    # the tensors' last elements, where ATen's scalar tail chooses the other in a product
    s[0, 2, 0, 1], lse[0, 1, 3], dsum[0, 0, 2] = _nan(0xFFC00000), _nan(0xFFC00001), \
        _nan(0x7FC00005)
    lse[0, 0, 2] = _nan(0xFFC00003)
    return s, lse, dsum


def _nan(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("L, n", [(16, 16), (9, 32), (40, 64), (12, 48), (8, 7), (40, 40)])
def test_attention_row_passes_give_the_torch_ops_bits(on_path, causal, L, n):
    # the emulated flash attention's fused passes (fexp.c) against the torch ops they replace
    # (kernels._FlashAttention's unfused path): scale and causal mask, the row max, fexp_u20
    # of s - max; backward, s * scale - lse before torch's exp, then p zero where masked and
    # dp = (dp - dsum) * p
    from lowprec.training.emulation.kernels import _masked_scores, fexp_u20

    s, lse, dsum = _attention_scores(L, n, seed=L + n)
    sc = torch.tensor(0.17677669529663687, dtype=torch.float32)
    assert kernel.attention_rows_available()
    ref = _masked_scores(s * sc, None, causal)
    m = ref.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    ref = fexp_u20(ref - m, impl="torch")
    got = s.clone()
    got_m = kernel.attn_fwd_rows(got, float(sc), causal, n)
    assert_same_bits(got_m, m, "row max")
    assert_same_bits(got, ref, "fexp_u20(s - max)")
    got = s.clone()  # the first whole vectors of 16 keys by fexp_u20, the rest s - max
    kernel.attn_fwd_rows(got, float(sc), causal, n // 16 * 16)
    assert_same_bits(got[..., :n // 16 * 16], ref[..., :n // 16 * 16], "fexp_u20 part")
    assert_same_bits(got[..., n // 16 * 16:], (_masked_scores(s * sc, None, causal) - m)
                     [..., n // 16 * 16:], "s - max past the vectors")

    p = (_masked_scores(s * sc, None, causal) - lse).exp()
    dp = torch.randn(s.shape, generator=torch.Generator().manual_seed(1)) * 3
    dp[0, 0, 1, 0], dp[0, 0, 2, 1] = _nan(0xFFC00007), _nan(0x7FC00009)
    ds = (dp - dsum) * p
    got_p = s.clone()
    kernel.attn_bwd_p(got_p, lse, float(sc), causal)
    got_p = got_p.exp()
    got_ds = dp.clone()
    kernel.attn_bwd_ds(got_ds, got_p, dsum, causal)
    assert_same_bits(got_p, p, "P")
    assert_same_bits(got_ds, ds, "dS")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attention_row_passes_split_among_threads_give_the_same_bits(on_path, threads):
    # rows enough for several threads (8,192 values or more each), whatever count the test
    # process runs with (one under pytest-xdist on two cores)
    from lowprec.training.emulation.kernels import _masked_scores, fexp_u20

    s, lse, dsum = _attention_scores(128, 64, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = s.clone()
        m = kernel.attn_fwd_rows(got, 0.125, True, 64)
        p = s.clone()
        kernel.attn_bwd_p(p, lse, 0.125, True)
        p = p.exp()
        ds = torch.ones_like(s)
        kernel.attn_bwd_ds(ds, p, dsum, True)
    finally:
        torch.set_num_threads(before)
    ref = _masked_scores(s * 0.125, None, True)
    ref_m = torch.where(torch.isinf(ref.amax(-1, keepdim=True)), 0.0, ref.amax(-1, keepdim=True))
    assert_same_bits(got, fexp_u20(ref - ref_m, impl="torch"), "forward")
    ref_p = (ref - lse).exp()
    assert_same_bits(p, ref_p, "P")
    assert_same_bits(ds, (torch.ones_like(s) - dsum) * ref_p, "dS")


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2", "q6.10"])
def test_the_rounded_sum_of_two_gives_the_torch_ops_bits(on_path, fmt):
    # one step of a 16-bit sum of gradients, rnd(rnd(a) + rnd(b)), in one pass (lp_round_add2)
    from lowprec.numerics.params import element_params
    from lowprec.numerics.formats import parse_format

    a, b = bit_patterns(1 << 13, seed=1), bit_patterns(1 << 13, seed=2)
    keep = ~(a.isnan() | b.isnan())  # a NaN's payload: whichever operand the compiler put first
    a, b = a[keep].contiguous(), b[keep].contiguous()
    prm = kernel.prepare(element_params(parse_format(fmt)), 0, 0)
    ref = quantize(quantize(a, fmt, impl="torch") + quantize(b, fmt, impl="torch"), fmt,
                   impl="torch")
    assert_same_bits(kernel.round_add2(a, b, prm), ref, fmt)
    assert kernel.round_add2(a, b[:-1].contiguous(), prm) is None  # shapes differ: torch ops


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, layout", [((7, 5, 9, 11), "contiguous"),
                                           ((7, 5, 9, 11), "channels_last"),
                                           ((3, 6, 1000), "contiguous"), ((300, 17), "contiguous"),
                                           ((2, 1, 40, 40), "channels_last"),
                                           ((8, 64, 1, 1), "contiguous"),
                                           ((2, 16, 5, 7), "channels_last"),
                                           ((2, 300, 3, 3), "channels_last")])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "sr4"])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2", "q6.10"])
def test_the_rounded_batch_norm_output_gives_the_torch_ops_bits(on_path, fmt, shape, layout,
                                                                threads, rounding, monkeypatch):
    # a batch norm's y = addcmul(b, x, a) over the channels, rounded, in one pass
    # (lp_affine_round; a channels-last tensor rounded stochastically: lp_affine_round_bt, each
    # value with its logical index's random word): ATen's addcmul contracts its multiply and
    # add (one rounding)
    from lowprec.numerics.quantize import prepared_params
    from lowprec.training.emulation.kernels import _addcmul_contracts

    if not _addcmul_contracts():  # (torch's DEFAULT build: the replay keeps addcmul there)
        pytest.skip("this torch's addcmul rounds its product before the add")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(4)
    # activations (where the fused multiply-add's one rounding matters: x * a near -b), and
    # every seventh value a bit pattern (every exponent, subnormals, Inf, NaN, 0)
    x = torch.randn(n, generator=g)
    x[::7] = bit_patterns(n, seed=3)[-n:][::7]
    x = x.view(shape)
    x = x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x
    a = torch.randn(shape[1], generator=g) * 3  # (finite: a NaN's payload is x's)
    b = torch.randn(shape[1], generator=g)
    a[0] = 2.0 ** -130  # a subnormal scale: products underflow
    stochastic = rounding != "nearest"
    keys = (0x9E3779B9, 12345) if stochastic else None
    quantize(x, fmt, rounding, seed=keys)  # (quantize's fast path prepares the parameters)
    prm = prepared_params(fmt, rounding, keys)
    view = [1, -1] + [1] * (len(shape) - 2)
    ref = quantize(torch.addcmul(b.view(view), x, a.view(view)), fmt, rounding, seed=keys,
                   impl="torch")
    got = kernel.affine_round(x, a, b, prm, stochastic)
    assert got.stride() == x.stride()
    assert_same_bits(got, ref, f"{fmt} {rounding}")
    assert kernel.affine_round(x, a[:-1].contiguous(), b, prm) is None  # not x's channels


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2"])
def test_an_embeddings_ordered_16_bit_sums_give_the_torch_ops_bits(on_path, fmt, monkeypatch):
    # the 16-bit weight gradient of an embedding, each use added in index order and rounded
    # (lp_index_add_rounded), against the op's torch loop (rank by rank); rows used many times
    # and never, a padding row, int32 indices, -0, sums that overflow to Inf, a NaN
    from lowprec.training.emulation import kernels as emulation_kernels

    op = emulation_kernels._embedding_backward
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 40, (700,), generator=g)
    ids[:300] = torch.randint(0, 3, (300,), generator=g)  # three rows used ~100 times each
    grads = torch.randn(700, 70, generator=g) * torch.exp2(
        torch.randint(-30, 12, (700, 1), generator=g).float())
    grads = quantize(grads, fmt, impl="torch")
    grads[5, 0], grads[6, 1], grads[7, 2] = -0.0, float("nan"), float("inf")
    for indices, pad in ((ids, -1), (ids.to(torch.int32).reshape(35, 20), 7)):
        got = op(grads.reshape(*indices.shape, 70), indices, 41, pad, fmt, "nearest")
        with monkeypatch.context() as m:
            m.setattr(kernel, "index_add_rounded", lambda *a: False)  # the torch loop
            want = op(grads.reshape(*indices.shape, 70), indices, 41, pad, fmt, "nearest")
        assert_same_bits(got, want, f"{fmt} pad {pad}")


@pytest.mark.parametrize("rows,channels,parts", [(1001, 7, 3), (300, 96, 2), (5, 40, 1),
                                                  (3, 17, 8)])
def test_channel_sums_run_in_the_batch_norm_kernels_order(on_path, rows, channels, parts):
    # per-channel float32 sums over chunks of ceil(rows / parts) rows, row by row from zero,
    # the partials added in chunk order (lp_channel_sums), against that loop in numpy float32;
    # the squared deviations as fused multiply-adds (float64 product, one rounding); more
    # chunks than rows: the empty ones add zero
    import numpy as np

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, channels, generator=g) * 3 + 40
    mean = torch.randn(channels, generator=g) + 40
    xn, mn = x.numpy(), mean.numpy()
    chunk = -(-rows // parts)
    for with_mean in (False, True):
        part = np.zeros((parts, channels), np.float32)
        for t in range(parts):
            for i in range(t * chunk, min(rows, (t + 1) * chunk)):
                if with_mean:
                    d = (xn[i] - mn).astype(np.float32)
                    part[t] = (d.astype(np.float64) * d + part[t]).astype(np.float32)
                else:
                    part[t] = part[t] + xn[i]
        want = np.zeros(channels, np.float32)
        for t in range(parts):
            want = want + part[t]
        got = kernel.channel_sums(x, parts, mean if with_mean else None)
        assert got is not None
        assert_same_bits(got, torch.from_numpy(want), f"mean {with_mean}")
    assert kernel.channel_sums(x.t(), parts) is None  # not (rows, C) contiguous: refused


@pytest.mark.parametrize("batch,channels,hw,lanes", [(4, 3, 36, 16), (3, 5, 70, 8), (2, 2, 7, 16),
                                                     (5, 4, 64, 8)])
def test_plane_sums_run_in_the_contiguous_batch_norm_kernels_order(on_path, batch, channels,
                                                                   hw, lanes):
    # per channel: runs of 2 * lanes values into `lanes` float32 partials (the run's first
    # half, then its second), each plane's remainder into a scalar sum, sample after sample,
    # the partials then folded in lane order into it (lp_plane_sums), against that loop in
    # numpy float32; squared deviations as a rounded product, then a sum
    import numpy as np

    g = torch.Generator().manual_seed(hw)
    x = torch.randn(batch, channels, hw, generator=g) * 3 + 40
    mean = torch.randn(channels, generator=g) + 40
    xn, mn = x.numpy(), mean.numpy()
    body = hw - hw % (2 * lanes)
    for with_mean in (False, True):
        want = np.zeros(channels, np.float32)
        for c in range(channels):
            acc, s = np.zeros(lanes, np.float32), np.float32(0)
            for n in range(batch):
                p = xn[n, c]
                terms = (p - mn[c]).astype(np.float32) if with_mean else p

                def add(a, v):
                    return np.float32(a + (np.float32(v * v) if with_mean else v))

                for d in range(0, body, 2 * lanes):
                    for half in (0, lanes):
                        for lane in range(lanes):
                            acc[lane] = add(acc[lane], terms[d + half + lane])
                for d in range(body, hw):
                    s = add(s, terms[d])
            r = acc[0]
            for lane in range(1, lanes):
                r = np.float32(r + acc[lane])
            want[c] = np.float32(s + r)
        got = kernel.plane_sums(x, lanes, mean if with_mean else None)
        assert got is not None
        assert_same_bits(got, torch.from_numpy(want), f"mean {with_mean}")
    assert kernel.plane_sums(x.transpose(0, 1), lanes) is None  # not contiguous: refused


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e5m2", "q6.10"])
def test_one_arrival_at_a_16_bit_sum_gives_the_torch_ops_bits(on_path, fmt):
    # s = rnd(v + rnd(g)) and s - v in one pass (lp_round_sum_delta), v on the grid, with the
    # sum kept or not, contiguous and channels-last; other layouts are refused (torch ops)
    from lowprec.numerics.params import element_params
    from lowprec.numerics.formats import parse_format

    g, v = bit_patterns(1 << 13, seed=3), bit_patterns(1 << 13, seed=4)
    keep = ~(g.isnan() | v.isnan())  # a NaN's payload: whichever operand the compiler put first
    g, v = g[keep][:8000].contiguous(), quantize(v[keep][:8000], fmt, impl="torch")
    prm = kernel.prepare(element_params(parse_format(fmt)), 0, 0)
    s = quantize(v + quantize(g, fmt, impl="torch"), fmt, impl="torch")
    for shape in ((8000,), (10, 20, 8, 5)):
        gs, vs = g.reshape(shape), v.reshape(shape)
        if len(shape) == 4:
            gs, vs = (t.to(memory_format=torch.channels_last) for t in (gs, vs))
        for keep_sum in (True, False):
            delta, kept = kernel.round_sum_delta(gs, vs, prm, keep_sum)
            assert delta.stride() == gs.stride()
            assert_same_bits(delta, (s - v).reshape(shape), fmt)
            if keep_sum:
                assert_same_bits(kept, s.reshape(shape), fmt)
            assert (kept is None) == (not keep_sum)
    g2 = g.reshape(80, 100)
    assert kernel.round_sum_delta(g2, v.reshape(80, 100).t().contiguous().t(), prm, True) \
        is None  # strides differ


# plain formats: the fused cell and whole-layer node (lp_lstm_*); stochastic rounding (its keys
# at each site) and fp8 gradients: the layer of op-by-op steps (lp_lstm_op_*)
FUSED_LSTM = {"16-true": "cell", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated": "cell",
              "p=fp16,c=fp16,g=e8m22": "cell", "q6.10-sr": "ops",
              "p=fp16,c=e5m2:sr,g=e4m3fn:sr4": "ops"}


@pytest.mark.parametrize("policy", list(FUSED_LSTM))
def test_the_fused_lstm_kernels_give_the_op_by_op_replays_bits(on_path, policy, monkeypatch):
    from training.test_lstm_cell import _run_ops, run

    runner = run if FUSED_LSTM[policy] == "cell" else _run_ops
    fused, n = runner(policy, "time-first-2-layers-bidirectional", True, monkeypatch)
    replay, _ = runner(policy, "time-first-2-layers-bidirectional", False, monkeypatch)
    assert n > 0
    for i, (x, y) in enumerate(zip(fused, replay)):
        assert_same_bits(x, y, f"{policy}: tensor {i}")


@pytest.mark.parametrize("fmt_name", ["fp16", "bf16"])
def test_the_one_pass_lstm_step_gives_the_steps_bits(on_path, fmt_name):
    """lp_lstm_step_tab (its table lookups' index arithmetic vectorised per instruction set)
    on every 16-bit value."""
    from training.test_lstm_cell import test_the_one_pass_step_gives_the_steps_bits_on_every_16_bit_value as check

    check(fmt_name)


@pytest.mark.parametrize("fmt_name", ["fp16", "bf16"])
def test_the_lstm_gate_sum_is_torchs_add(on_path, fmt_name):
    """lp_lstm_gates per instruction-set build: where two NaNs meet, the first's payload
    whatever order the build's compiler gave its loop's operands."""
    from training.test_lstm_cell import test_the_gate_sum_is_torchs_add_and_two_nans_give_the_first as check

    check(fmt_name)
