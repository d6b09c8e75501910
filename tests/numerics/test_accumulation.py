"""The GEMM accumulator: the compiled kernel, the plain-torch path and the scalar float64 reference
give the same bits for every format family, order and rounding; and the physical facts
(fp16 stalls at 2048, chunking recovers, fixed point saturates)."""

import math

import pytest
import torch

from lowprec.numerics import kernel
from lowprec.numerics.accumulation import (Accumulator, Order, gemm_acc, matmul_acc,
                                           parse_accumulator)
from lowprec.numerics.accumulation_reference import gemm_acc_reference, round_scalar
from lowprec.numerics.quantize import quantize
from lowprec.numerics.formats import parse_format
from lowprec.numerics.rounding import Rounding

needs_kernel = pytest.mark.skipif(not kernel.gemm_acc_available(),
                                  reason="compiled accumulation kernel not built")

FORMATS = ["fp32", "fp16", "bf16", "e8m13", "q6.6", "e5m2", "e4m3fn", "e4m3fn-sat", "e5m10-nosub",
           "e5m0"]
ORDERS = ["seq", "pairwise", "chunk3", "chunk4@bf16"]
ROUNDINGS = ["rn", "sr", "sr6", "rz", "ru", "rd", "rna"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, all NaNs alike."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, math.nan), t).view(torch.int32)


def _data(seed: int, shape, spread: int = 6) -> torch.Tensor:
    """Values of random sign and magnitudes over 2**-spread..2**spread, some exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-spread, spread + 1, shape, generator=g).float())
    return torch.where(torch.rand(shape, generator=g) < 0.1, torch.zeros_like(x), x)


def _operands(seed, batch=2, m=3, k=7, n=5, spread=6):
    return _data(seed, (batch, m, k), spread), _data(seed + 1, (batch, k, n), spread)


@pytest.mark.parametrize("spec", ["fp32", "fp16:chunk128:sr", "e8m13:chunk128", "bf16:pairwise",
                                  "q8.8:chunk64@bf16:rz", "fp16:sr4", "e5m2:pairwise:rna"])
def test_spec_prints_back(spec):
    acc = parse_accumulator(spec)
    assert str(acc) == spec
    assert parse_accumulator(str(acc)) == acc


def test_spec_defaults_and_aliases():
    acc = parse_accumulator("FP16:sequential:nearest")
    assert acc == Accumulator("fp16") and str(acc) == "fp16"
    assert parse_accumulator("fp16:chunk128") == Accumulator("fp16", Order.CHUNKED, 128)
    assert parse_accumulator("fp16:sr:chunk8").chunk == 8  # parts in any order


@pytest.mark.parametrize("bad", ["fp17", "fp16:chunk0", "fp16:zigzag", "fp16:seq:pairwise",
                                 "fp16:rn:sr", "mxfp8_e4m3", "fp16:chunk8@nope", ""])
def test_bad_specs_name_the_value(bad):
    with pytest.raises(ValueError, match="accumulator"):
        parse_accumulator(bad)


def test_wide_only_for_chunked():
    with pytest.raises(ValueError, match="wide"):
        Accumulator("fp16", Order.SEQUENTIAL, wide="bf16")


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_kernel_torch_reference_agree(fmt, order):
    a, b = _operands(hash((fmt, order)) % 1000)
    for rounding in ROUNDINGS:
        spec = f"{fmt}:{order}:{rounding}"
        seed = (12345, 678)
        ref = torch.tensor(gemm_acc_reference(a, b, spec, seed))
        ker = gemm_acc(a, b, spec, seed=seed, impl="kernel")
        tor = gemm_acc(a, b, spec, seed=seed, impl="torch")
        assert torch.equal(_bits(ker), _bits(ref)), spec
        assert torch.equal(_bits(tor), _bits(ref)), spec


@needs_kernel
@pytest.mark.parametrize("k", [1, 2, 5, 64, 65, 130])
@pytest.mark.parametrize("spec", ["fp16:chunk32:sr", "bf16:pairwise", "e8m13:chunk16", "q4.10:rn"])
def test_kernel_matches_reference_over_shapes(k, spec):
    # K not a multiple of the chunk, N across the kernel's 64-column tiles
    a, b = _data(k, (1, 2, k), 3), _data(k + 7, (1, k, 259), 3)
    seed = (7, 9)
    ref = torch.tensor(gemm_acc_reference(a, b, spec, seed))
    assert torch.equal(_bits(gemm_acc(a, b, spec, seed=seed, impl="kernel")), _bits(ref))


@needs_kernel
@pytest.mark.parametrize("spec", ["fp16:chunk16", "fp16:chunk16:sr", "bf16:sr5", "e8m13:pairwise",
                                  "fp32:sr", "e4m3fn-sat:chunk8", "e6m0:chunk4"])
def test_kernel_fast_path_matches_reference(spec):
    # (e6m0: no mantissa bit, the kept significand is the implicit 1 and a tie rounds up; the
    # fast path once took the exponent's lsb for it)
    # magnitudes in [0.5, 2): every product and sum stays in the normal range, so the kernel's
    # integer-trick fast path rounds whole tiles (elsewhere mixed with the general path)
    g = torch.Generator().manual_seed(8)
    sign = lambda shape: torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    a = (0.5 + 1.5 * torch.rand(1, 3, 40, generator=g)) * sign((1, 3, 40))
    b = (0.5 + 1.5 * torch.rand(1, 40, 70, generator=g)) * sign((1, 40, 70))
    ref = torch.tensor(gemm_acc_reference(a, b, spec, (3, 4)))
    assert torch.equal(_bits(gemm_acc(a, b, spec, seed=(3, 4), impl="kernel")), _bits(ref))


@needs_kernel
@pytest.mark.parametrize("inputs", ["fp16", "bf16"])
@pytest.mark.parametrize("spec", ["fp16", "fp16:chunk16", "bf16:chunk7", "e5m2", "e4m3fn:chunk5",
                                  "e3m4fn-sat", "e5m10-nosub:chunk4", "e5m0:chunk3"])
def test_kernel_float32_lanes_match_reference(inputs, spec):
    # operands of at most 12 significant bits and an accumulator of at most 11: the kernel
    # runs nearest rounding on float32 lanes (exact products, innocuous double rounding of
    # sums); subnormal, zero, overflowing and Inf lanes fall back to the float64 path
    a = quantize(_data(21, (2, 3, 150), 9), inputs)
    b = quantize(_data(22, (2, 150, 40), 9), inputs)
    a[0, 0, 3] = math.inf
    b[1, 4, 7] = 3e4
    ref = torch.tensor(gemm_acc_reference(a, b, spec))
    assert torch.equal(_bits(gemm_acc(a, b, spec, impl="kernel")), _bits(ref))


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_overflow_and_specials(impl):
    if impl == "kernel" and not kernel.gemm_acc_available():
        pytest.skip("kernel not built")
    a = torch.tensor([[[300.0, 300.0, 1.0], [math.inf, -math.inf, 1.0], [math.nan, 1.0, 1.0],
                       [-60000.0, -60000.0, 1.0]]])
    b = torch.tensor([[[300.0], [300.0], [1.0]]])
    for spec in ["fp16", "e4m3fn", "e4m3fn-sat", "q8.8", "fp16:rz"]:
        ref = torch.tensor(gemm_acc_reference(a, b, spec))
        out = gemm_acc(a, b, spec, impl=impl)
        assert torch.equal(_bits(out), _bits(ref)), spec
    fp16 = gemm_acc(a, b, "fp16", impl=impl)[0, :, 0]
    assert math.isinf(fp16[0]) and math.isnan(fp16[1]) and math.isnan(fp16[2])
    assert fp16[3] == -math.inf


def test_reference_rounding_is_quantize_on_float32():
    # the scalar reference rounds a float32 value as quantize does (every mode)
    x = _data(3, (400,), 20)
    for fmt in ["fp16", "bf16", "e4m3fn", "e5m2", "q4.6", "e8m13", "e3m2fn-nosub"]:
        for mode in ["nearest", "nearest_away", "toward_zero", "up", "down"]:
            q = quantize(x, fmt, mode)
            ref = torch.tensor([round_scalar(v, parse_format(fmt), Rounding(mode))
                                for v in x.tolist()])
            assert torch.equal(_bits(q), _bits(ref)), (fmt, mode)


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e4m3fn", "q4.6", "e8m13"])
@pytest.mark.parametrize("mode", ["rn", "rna", "rz", "ru", "rd"])
def test_kernel_rounds_float32_values_as_quantize(fmt, mode):
    # K = 1, b = 1: the output is the product a * 1 rounded once: quantize(a)
    a = _data(11, (1, 300, 1), 20)
    out = gemm_acc(a, torch.ones(1, 1, 1), f"{fmt}:{mode}", impl="kernel")
    assert torch.equal(_bits(out), _bits(quantize(a, fmt, Rounding(
        {"rn": "nearest", "rna": "nearest_away", "rz": "toward_zero", "ru": "up",
         "rd": "down"}[mode]))))


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_fp32_sequential_is_a_plain_float32_loop(impl):
    a, b = _operands(5, 1, 4, 33, 6)
    out = gemm_acc(a, b, "fp32", impl=impl)
    acc = a[0, :, 0, None] * b[0, None, 0, :]
    for l in range(1, 33):
        acc = acc + a[0, :, l, None] * b[0, None, l, :]  # float32 mul, float32 add
    assert torch.equal(out[0], acc)


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_chunked_fp32_is_float32_chunk_sums(impl):
    a, b = _operands(6, 1, 3, 50, 4)
    out = gemm_acc(a, b, "fp32:chunk16", impl=impl)
    wide = None
    for c0 in range(0, 50, 16):
        s = a[0, :, c0, None] * b[0, None, c0, :]
        for l in range(c0 + 1, min(c0 + 16, 50)):
            s = s + a[0, :, l, None] * b[0, None, l, :]
        wide = s if wide is None else wide + s
    assert torch.equal(out[0], wide)
    # one chunk holding every term is the sequential order
    assert torch.equal(gemm_acc(a, b, "fp32:chunk64", impl=impl), gemm_acc(a, b, "fp32", impl=impl))


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_fp16_stalls_at_2048_and_chunking_recovers(impl):
    ones_a, ones_b = torch.ones(1, 1, 4096), torch.ones(1, 4096, 1)
    assert gemm_acc(ones_a, ones_b, "fp16", impl=impl).item() == 2048.0  # 2048 + 1 ties to 2048
    assert gemm_acc(ones_a, ones_b, "fp16:chunk128", impl=impl).item() == 4096.0
    assert gemm_acc(ones_a, ones_b, "fp16:pairwise", impl=impl).item() == 4096.0
    assert gemm_acc(ones_a, ones_b, "bf16", impl=impl).item() == 256.0  # 8 significant bits


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_fixed_point_saturates(impl):
    fmt = parse_format("q4.4")  # [-8, 7.9375]
    a, b = torch.ones(1, 2, 40), torch.ones(1, 40, 1)
    a[0, 1] = -1.0
    out = gemm_acc(a, b, "q4.4", impl=impl)[0, :, 0]
    assert out.tolist() == [fmt.max, fmt.min]
    # a product beyond the range saturates too; chunks promoted to fp32 no longer do
    out = gemm_acc(torch.full((1, 1, 4), 3.0), torch.full((1, 4, 1), 3.0), "q4.4:chunk1",
                   impl=impl)
    assert out.item() == 4 * fmt.max


def test_stochastic_accumulation_is_unbiased_and_seeded():
    k, n = 4096, 64
    a, b = torch.ones(1, 1, k), torch.ones(1, k, n)
    out = gemm_acc(a, b, "fp16:sr", seed=(1, 2))[0, 0]
    assert torch.equal(out, gemm_acc(a, b, "fp16:sr", seed=(1, 2))[0, 0])
    assert not torch.equal(out, gemm_acc(a, b, "fp16:sr", seed=(3, 4))[0, 0])
    # above 2048 each add of 1 rounds to a quantum of 2, up or down with probability 1/2:
    # variance at most 1 per add, so the mean of n outputs has sd <= sqrt(k / n)
    assert abs(out.double().mean().item() - k) < 5 * math.sqrt(k / n)
    assert torch.equal(gemm_acc(a, b, "fp16:sr", generator=torch.Generator().manual_seed(5)),
                       gemm_acc(a, b, "fp16:sr", generator=torch.Generator().manual_seed(5)))


@needs_kernel
def test_kernel_bits_do_not_depend_on_threads():
    a, b = _operands(9, 2, 64, 200, 70)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm_acc(a, b, "fp16:chunk32:sr", seed=(5, 6))
        torch.set_num_threads(2)
        two = gemm_acc(a, b, "fp16:chunk32:sr", seed=(5, 6))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_matmul_acc_shapes_and_gradients():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 4, 9, generator=g, requires_grad=True)
    b = torch.randn(9, 5, generator=g, requires_grad=True)
    out = matmul_acc(a, b, "fp32")
    assert out.shape == (2, 3, 4, 5)
    ref = a.detach().double() @ b.detach().double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    # both backward GEMMs accumulate in the accumulator: fp32 sequential here
    ga = gemm_acc(gout.reshape(-1, 4, 5), b.detach().t().expand(6, 5, 9), "fp32")
    assert torch.equal(a.grad, ga.reshape(2, 3, 4, 9))
    # the weight's gradient: one GEMM whose reduction runs over batch and rows (K = 24)
    gb = gemm_acc(a.detach().reshape(1, 24, 9).transpose(1, 2), gout.reshape(1, 24, 5), "fp32")
    assert torch.equal(b.grad, gb[0])
    v = torch.randn(9, generator=g)
    assert matmul_acc(a.detach()[0, 0], v, "fp32").shape == (4,)
    assert matmul_acc(v, b.detach(), "fp32").shape == (5,)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        matmul_acc(a, torch.randn(4, 5), "fp32")


def test_fp16_accumulator_gradient_is_rounded():
    # forward K = 1 (exact), backward grad_a = g @ b^T sums 4096 products: fp16 stalls at 2048
    a = torch.ones(1, 1, requires_grad=True)
    b = torch.ones(1, 4096, requires_grad=True)
    y = matmul_acc(a, b, "fp16")
    assert torch.equal(y, torch.ones(1, 4096))
    y.backward(torch.ones(1, 4096))
    assert a.grad.item() == 2048.0
    assert torch.equal(b.grad, torch.ones(1, 4096))
    a.grad = None
    matmul_acc(a, b, "fp16:chunk128").backward(torch.ones(1, 4096))
    assert a.grad.item() == 4096.0
