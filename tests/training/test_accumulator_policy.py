"""The accumulator as a policy part (acc=): parsed and printed back, and the emulation engine runs
linear, matmul, conv2d and attention with it, forward and backward."""

import math

import pytest
import torch
import torch.nn.functional as F

from lowprec.numerics.accumulation import Accumulator, gemm_acc
from lowprec.training.backends.choice import can_be_native
from lowprec.training.emulation.engine import emulated
from lowprec.training.policy import parse_policy
from lowprec.training.precision import Precision

U16 = 2.0**-11  # fp16 unit roundoff


def test_policy_key_prints_back():
    pol = parse_policy("p=fp32,acc=fp16:chunk128:sr")
    assert pol.accumulator == Accumulator.parse("fp16:chunk128:sr")
    assert pol.spec.endswith(",acc=fp16:chunk128:sr")
    assert parse_policy(pol.spec) == pol
    assert not pol.is_fp32 and not can_be_native(pol)
    named = parse_policy("16-true,acc=e8m13:chunk128")
    assert named.compute == parse_policy("16-true").compute
    assert str(named.accumulator) == "e8m13:chunk128"
    assert parse_policy(named.spec) == named


@pytest.mark.parametrize("bad", ["p=fp32,acc=fp16:zigzag", "p=fp32,acc=mxfp4", "p=fp32,acc="])
def test_bad_accumulator_in_policy(bad):
    with pytest.raises(ValueError, match="accumulator"):
        parse_policy(bad)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("acc", ["fp32", "fp16:chunk8:sr", "bf16:pairwise"])
def test_tiny_model_equals_hand_computation(acc):
    model = _mlp()
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    w1, b1, w2, b2 = [p.detach().clone() for p in model.parameters()]
    prec = Precision(f"p=fp32,acc={acc}", generator=torch.Generator().manual_seed(3))
    m, _ = prec.setup(model)
    with prec.autocast():
        y = m(x)
    # the same GEMMs by hand, seeded as the engine draws them (one seed per GEMM, in order)
    g = torch.Generator().manual_seed(3)
    h = (gemm_acc(x[None], w1.t()[None], acc, generator=g)[0] + b1).relu()
    ref = gemm_acc(h[None], w2.t()[None], acc, generator=g)[0] + b2
    assert torch.equal(y, ref)
    if acc == "fp32":  # sequential fp32 accumulation: what a plain fp32 loop gives
        assert torch.allclose(y, _mlp()(x), rtol=1e-5, atol=1e-6)


def _long_linear_error(spec: str, k: int = 4096) -> float:
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.rand(4, k, generator=g))
    x = torch.rand(8, k, generator=g)
    ref = x.double() @ lin.weight.double().t()
    prec = Precision(spec)
    m, _ = prec.setup(lin)
    with prec.autocast():
        y = m(x)
    return ((y.double() - ref).abs() / ref).max().item()


def test_fp16_accumulator_loses_what_chunking_recovers():
    # K = 4096 positive products of mean 1/4: the sum reaches ~1024, where fp16's quantum is
    # 0.5..1, larger than each product. Measured: sequential 8.2e-2 (167 u), chunk128
    # 6.5e-4 (1.3 u), fp32 1.9e-6. Asserted with margins of 4x and more.
    seq = _long_linear_error("p=fp32,acc=fp16")
    chunked = _long_linear_error("p=fp32,acc=fp16:chunk128")
    assert seq > 40 * U16
    assert chunked < 4 * U16
    assert _long_linear_error("p=fp32,acc=fp32") < 2e-5
    # the ~14-bit fp8 tensor-core accumulator, promoted every 128 terms
    assert _long_linear_error("p=fp32,acc=e8m13:chunk128") < _long_linear_error("p=fp32,acc=e8m13")


def test_weight_gradient_accumulates_in_the_accumulator():
    # dL/dW of a 1 -> 1 linear over 4096 rows is one GEMM with K = 4096 (the batch)
    for acc, expected in (("fp16", 2048.0), ("fp16:chunk128", 4096.0), ("fp32", 4096.0)):
        lin = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            lin.weight.fill_(1.0)
        prec = Precision(f"p=fp32,acc={acc}")
        m, _ = prec.setup(lin)
        with prec.autocast():
            y = m(torch.ones(4096, 1))
        y.sum().backward()
        assert lin.weight.grad.item() == expected, acc


def test_matmul_under_emulation_is_gemm_acc():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 6, 200, generator=g), torch.randn(3, 200, 5, generator=g)
    with emulated("p=fp32,acc=fp16:pairwise"):
        y1 = torch.matmul(a, b)
        y2 = a @ b
        y3 = torch.bmm(a, b)
        y4 = torch.mm(a[0], b[0])
    ref = gemm_acc(a, b, "fp16:pairwise")
    assert torch.equal(y1, ref) and torch.equal(y2, ref) and torch.equal(y3, ref)
    assert torch.equal(y4, ref[0])


@pytest.mark.parametrize("groups", [1, 2])
def test_conv2d_forward_and_backward(groups):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 7, 6, generator=g)
    conv = torch.nn.Conv2d(4, 6, 3, padding=1, stride=(1, 2), groups=groups)
    ref = F.conv2d(x, conv.weight, conv.bias, (1, 2), 1, 1, groups)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in conv.parameters()]
    conv.zero_grad()
    xg = x.clone().requires_grad_()
    with emulated("p=fp32,acc=fp32"):
        y = conv(xg)
        y.square().sum().backward()
    assert torch.allclose(y, ref, atol=1e-5)
    for p, r in zip(conv.parameters(), ref_grads):
        assert torch.allclose(p.grad, r, atol=1e-4)
    if groups == 1:  # exactly im2col and one GEMM with the accumulator
        with emulated("p=fp32,acc=bf16"), torch.no_grad():
            yb = conv(x)
        cols = F.unfold(x, 3, padding=1, stride=(1, 2))
        hand = gemm_acc(cols.transpose(1, 2), conv.weight.detach().reshape(6, -1).t().expand(
            2, 36, 6), "bf16").transpose(1, 2) + conv.bias.detach().view(1, 6, 1)
        assert torch.equal(yb, hand.reshape(yb.shape))
        assert (yb - ref).abs().max() > 1e-3  # bf16 accumulation is visible


def test_attention_forward_and_backward():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.square().sum().backward()
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    with emulated("p=fp32,acc=fp32"):
        y = F.scaled_dot_product_attention(*mine, is_causal=True)
        y.square().sum().backward()
    assert torch.allclose(y, ref, atol=1e-5)
    for a, b in zip(mine, leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-4)
    # the two GEMMs by hand with an fp16 accumulator
    with emulated("p=fp32,acc=fp16"), torch.no_grad():
        y16 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = gemm_acc(q.reshape(6, 5, 8), k.reshape(6, 5, 8).transpose(1, 2), "fp16") * (1.0 / math.sqrt(8))
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    hand = gemm_acc(torch.softmax(s, -1), v.reshape(6, 5, 8), "fp16").reshape(2, 3, 5, 8)
    assert torch.equal(y16, hand)


@pytest.mark.parametrize("padding,kernel", [("same", 3), ("same", 4), ("valid", 3)])
def test_conv2d_string_padding(padding, kernel):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 6, 5, generator=g)
    w = torch.randn(3, 2, kernel, kernel, generator=g)
    with emulated("p=fp32,acc=fp32"):
        y = F.conv2d(x, w, padding=padding)
    ref = F.conv2d(x, w, padding=padding)
    assert y.shape == ref.shape and torch.allclose(y, ref, atol=1e-5)


def test_attention_dropout_runs_and_keeps_the_expectation_shape():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    torch.manual_seed(0)
    with emulated("p=fp32,acc=fp32"):
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert y.shape == (1, 2, 4, 8) and torch.isfinite(y).all()


def test_compare_policy_list_takes_the_accumulator_spec():
    from lowprec.experiments.config import split_policies

    pols = split_policies("32-true,p=fp32,acc=fp16:chunk128:sr,16-true")
    assert pols == ["32-true", "p=fp32,acc=fp16:chunk128:sr", "16-true"]
    assert str(parse_policy(pols[1]).accumulator) == "fp16:chunk128:sr"


def test_integer_and_float64_matmuls_keep_torch_kernels():
    a = torch.arange(12).reshape(3, 4)
    af, ad, big = a.float(), a.double(), torch.full((4, 2), 1000.0)
    with emulated("p=fp32,acc=fp16"):
        y = torch.mm(a, a.t())
        z = torch.mm(ad, ad.t())
        w = torch.mm(input=af, mat2=big)  # keywords as torch names them
    assert y.dtype == torch.int64 and torch.equal(y, a @ a.t())
    assert z.dtype == torch.float64 and torch.equal(z, ad @ ad.t())
    # 8000 + 9000 + 10000 + 11000 = 38000 in fp32; in fp16 17000 -> 16992 (spacing 16, tie to
    # even) and 37992 -> 37984 (spacing 32)
    assert w[2].tolist() == [37984.0, 37984.0]
    assert torch.equal(w, gemm_acc(af[None], big[None], "fp16")[0])
