"""``match_cpu_kernels=True``: the engine's matrix products are this CPU's own 16-bit kernels.

References: torch's native CPU float16/bfloat16 kernels on the same (16-bit valued) operands,
forward and backward; and, for the summation orders the module documents, the kernel itself.
"""
import pytest
import torch
import torch.nn.functional as F

from lowprec.training.emulation.engine import emulated

SHAPES = [(1, 37, 5), (3, 64, 48), (16, 120, 45), (37, 171, 65), (5, 300, 7)]  # (M, K, N)


def _grid(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).float()


def _both(fn, dtype, tensors, match=True):
    """(emulated outputs and input gradients, native ones) of ``fn`` on ``tensors``."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    with emulated("16-true" if dtype == torch.float16 else "bf16-true",
                  match_cpu_kernels=match):
        out = fn(*leaves)
        out.backward(_grid(*out.shape, dtype=dtype, seed=99))
    emu = [out.detach()] + [t.grad for t in leaves]
    leaves16 = [t.to(dtype).requires_grad_() for t in tensors]
    out16 = fn(*leaves16)
    out16.backward(_grid(*out16.shape, dtype=dtype, seed=99).to(dtype))
    nat = [out16.detach().float()] + [t.grad.float() for t in leaves16]
    return emu, nat


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_linear_with_and_without_bias_is_native_forward_and_backward(shape, dtype):
    m, k, n = shape
    x, w, b = (_grid(m, k, dtype=dtype, seed=1, scale=3), _grid(n, k, dtype=dtype, seed=2),
               _grid(n, dtype=dtype, seed=3))
    for fn, ts in ((F.linear, (x, w)), (F.linear, (x, w, b))):
        emu, nat = _both(fn, dtype, ts)
        for e, v in zip(emu, nat):
            assert torch.equal(e, v)


@pytest.mark.parametrize("op", ["matmul", "bmm", "mm", "addmm", "baddbmm"])
def test_products_are_native_forward_and_backward(op):
    d = torch.float16
    a, b = _grid(3, 20, 72, dtype=d, seed=4), _grid(3, 72, 9, dtype=d, seed=5)
    c = _grid(3, 20, 9, dtype=d, seed=6)
    fns = {"matmul": (torch.matmul, (a, b)), "bmm": (torch.bmm, (a, b)),
           "mm": (torch.mm, (a[0], b[0])), "addmm": (torch.addmm, (c[0], a[0], b[0])),
           "baddbmm": (torch.baddbmm, (c, a, b))}
    fn, ts = fns[op]
    emu, nat = _both(fn, d, ts)
    for e, v in zip(emu, nat):
        assert torch.equal(e, v)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2",
                    reason="CPUs with AVX512-FP16 or AMX run fp16 GEMMs through oneDNN, which may "
                           "sum as fp32 does")
def test_default_engine_differs_from_native_by_units_of_summation_order():
    """Without the option the engine's fp32 product rounded once is at most one unit from
    native on the outputs where the two summation orders straddle a rounding boundary (the
    reason the option exists), and equal elsewhere."""
    x, w = _grid(37, 171, dtype=torch.float16, seed=1, scale=3), _grid(65, 171,
                                                                       dtype=torch.float16, seed=2)
    emu, nat = _both(F.linear, torch.float16, (x, w), match=False)
    diff = (emu[0] - nat[0]).abs()
    ulp = torch.finfo(torch.float16).eps * nat[0].abs().clamp_min(6.1e-5)
    assert 0 < int((diff > 0).sum()) < diff.numel() // 50
    assert bool((diff <= ulp * 1.0001).all())


@pytest.mark.parametrize("policy", ["p=fp16,c=fp16,g=fp16,r=stochastic", "p=fp16,c=fp16,g=fp32"])
def test_not_used_where_native_would_not_be_exact(policy):
    """Stochastic rounding, or gradients in another format than compute: the native kernel
    would not give the policy's bits, so the engine keeps its own fp32 product."""
    from lowprec.training.emulation import engine, native_gemm
    from lowprec.training.policy import parse_policy

    rule = engine.Rule.of(parse_policy(policy))
    x = torch.randn(3, 4)
    assert not native_gemm.applies(rule, (x, x), {}, torch.float16)
    assert native_gemm.applies(engine.Rule.of(parse_policy("16-true")), (x, x), {},
                               torch.float16)


@pytest.mark.parametrize("policy", ["p=fp32,c=fp16,g=fp32", "p=fp32,c=fp16,g=bf16",
                                    "p=fp16,c=fp16,g=fp32"])
def test_policies_whose_gradients_are_not_the_compute_format_keep_the_engines_product(policy):
    """The kernel's backward would hold the products' gradients in fp16 (overflowing to Inf
    above 65504); where the policy's gradients are another format, mixed policies included,
    match_cpu_kernels leaves the product to the engine: the same bits as without it."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 32, generator=g).half().float()
    w0 = torch.randn(16, 32, generator=g).half().float()
    grads = []
    for match in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with emulated(policy, match_cpu_kernels=match):
            y = F.linear(x, w)
            (y * 3e4).sum().backward()
        grads.append((y.detach(), x.grad, w.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    if "g=fp32" in policy:
        assert bool(torch.isfinite(grads[1][1]).all()) and float(grads[1][1].abs().max()) > 65504


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX2",
                    reason="the vector widths below are AVX2's (8 fp32 lanes)")
@pytest.mark.parametrize("seed", range(4))
def test_documented_orders_reproduce_the_avx2_kernels(seed):
    """The orders native_gemm.py documents, written out in float32 torch ops, give the
    kernel's bits: forward (fp16_dot_with_fp32_arith: 8 registers x 8 lanes per 64 terms,
    folded 4-2-1, lanes reduced (i, i+4), (i, i+2), (i, i+1), then a vector tail of 16-term
    steps and a scalar tail), input gradient (four interleaved partial sums), weight gradient
    (sequential)."""
    g = torch.Generator().manual_seed(seed)
    m, k, n = (int(v) for v in torch.randint(1, 140, (3,), generator=g))
    x = _grid(m, k, dtype=torch.float16, seed=seed, scale=3)
    w = _grid(n, k, dtype=torch.float16, seed=seed + 10)
    gy = _grid(m, n, dtype=torch.float16, seed=seed + 20)

    def hred(v):
        v = v[..., :4] + v[..., 4:]
        v = v[..., :2] + v[..., 2:]
        return v[..., 0] + v[..., 1]

    prod = x[:, None, :] * w[None, :, :]  # exact in fp32
    main = k - k % 64
    acc = torch.zeros(m, n, 8, 8)
    for j in range(0, main, 64):
        acc += prod[..., j:j + 64].reshape(m, n, 8, 8)
    for off in (4, 2, 1):
        acc = acc[..., :off, :] + acc[..., off:2 * off, :]
    total = hred(acc[..., 0, :])
    vec = k - k % 16
    tail = torch.zeros(m, n, 8)
    for j in range(main, vec, 8):
        tail += prod[..., j:j + 8]
    total = total + hred(tail)
    for j in range(vec, k):
        total = total + prod[..., j]
    assert torch.equal(total.half(), F.linear(x.half(), w.half()))

    four = torch.zeros(4, m, k)
    for i in range(n):
        four[i % 4 if i < n - n % 4 else 0] += gy[:, i, None] * w[i]
    assert torch.equal((((four[0] + four[1]) + four[2]) + four[3]).half(), gy.half() @ w.half())

    seq = torch.zeros(n, k)
    for i in range(m):
        seq += gy[i, :, None] * x[i]
    assert torch.equal(seq.half(), gy.t().half() @ x.half())
