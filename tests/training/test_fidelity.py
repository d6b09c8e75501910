"""Emulated fp16/bf16 against torch's own CPU fp16/bf16 kernels (the reference nobody here wrote).

Op by op: emulation computes each op in fp32 and rounds its output once. Where torch's CPU kernel
for the 16-bit dtype does the same (most elementwise ops, softmax, layer/group norm, means,
matmuls, convolutions), the bits are equal; elsewhere the bound below is in units in the last
place (ulp) of the format, either of each element (``ulp``) or of the largest output magnitude
(``scale``: for kernels that keep an intermediate in 16 bits, whose error is absolute), with the
reason. Whole models: the same fp16-rounded weights in every run; the emulated run must be much
closer to native fp16 than plain fp32 is, and as far from float64 as native fp16 is.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import native_conv_is_reference
from lowprec import Precision
from lowprec.training.policy import Backend, parse_policy
from lowprec.training.emulation import emulated

DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


def _ordered(t: torch.Tensor, dtype) -> torch.Tensor:
    i = t.to(dtype).view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def ulp_distance(a, b, dtype) -> int:
    """Largest distance, in representable values of ``dtype``, between elements of a and b."""
    return int((_ordered(a, dtype) - _ordered(b, dtype)).abs().max())


def scale_distance(a, b, dtype) -> float:
    """Largest |a - b| in ulps of the largest |b| (absolute error at the output's scale)."""
    mant = 10 if dtype == torch.float16 else 7
    top = float(b.abs().max())
    ulp = 2.0 ** (torch.floor(torch.log2(torch.tensor(top))).item() - mant)
    return float((a - b).abs().max()) / ulp


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"x": r(8, 16, 12), "y": r(8, 16, 12), "p": torch.rand(8, 16, 12, generator=g) + 0.5,
            "img": r(2, 4, 9, 9), "W": r(10, 12) * 0.3, "b": r(10), "w": r(6, 4, 3, 3) * 0.3,
            "E": r(10, 12), "q": r(2, 3, 7, 8), "ids": torch.randint(0, 10, (5, 7), generator=g),
            "A": r(4, 16, 12), "B": r(4, 12, 9), "Q": r(2, 2, 40, 8),
            # drawn after the forward table's inputs, which keep their values
            "K": r(2, 2, 40, 8), "V": r(2, 2, 40, 8), "Kg": r(2, 1, 40, 8), "Vg": r(2, 1, 40, 8),
            "ln_w": 1 + 0.1 * r(12), "gn_w": 1 + 0.1 * r(4), "row": r(12),
            "Mb": 0.5 * r(1, 2, 40, 40)}


# name: (function of the inputs, bound kind, bound, reason)
EXACT = ("ulp", 0, "the CPU kernel computes in fp32 and rounds once")
ACCUM = ("ulp", 1, "fp32 accumulation in another order (the kernel's blocking): one unit at times")
OPS = {
    "add": (lambda a: a["x"] + a["y"], *EXACT),
    "sub": (lambda a: a["x"] - a["y"], *EXACT),
    "mul": (lambda a: a["x"] * a["y"], *EXACT),
    "div": (lambda a: a["x"] / a["p"], *EXACT),
    "exp": (lambda a: torch.exp(a["x"]), *EXACT),
    "log": (lambda a: torch.log(a["p"]), *EXACT),
    "rsqrt": (lambda a: torch.rsqrt(a["p"]), *EXACT),
    "tanh": (lambda a: torch.tanh(a["x"]), *EXACT),
    "sigmoid": (lambda a: torch.sigmoid(a["x"]), *EXACT),
    "sin": (lambda a: torch.sin(a["x"]), *EXACT),
    "gelu": (lambda a: F.gelu(a["x"]), *EXACT),
    "gelu_tanh": (lambda a: F.gelu(a["x"], approximate="tanh"), *EXACT),
    "silu": (lambda a: F.silu(a["x"]), *EXACT),
    "mish": (lambda a: F.mish(a["x"]), *EXACT),
    "hardswish": (lambda a: F.hardswish(a["x"]), *EXACT),
    "relu": (lambda a: F.relu(a["x"]), *EXACT),
    "leaky_relu": (lambda a: F.leaky_relu(a["x"], 0.1), *EXACT),
    "elu": (lambda a: F.elu(a["x"]), *EXACT),
    "softplus": (lambda a: F.softplus(a["x"]), *EXACT),
    "pow": (lambda a: a["x"] ** 2, *EXACT),
    "addcmul": (lambda a: torch.addcmul(a["x"], a["y"], a["p"], value=0.5), *EXACT),
    "clamp": (lambda a: a["x"].clamp(-0.5, 0.5), *EXACT),
    "softmax": (lambda a: F.softmax(a["x"], -1), *EXACT),
    "layer_norm": (lambda a: F.layer_norm(a["x"], (12,)), *EXACT),
    "rms_norm": (lambda a: F.rms_norm(a["x"], (12,)), *EXACT),
    "group_norm": (lambda a: F.group_norm(a["img"], 2), *EXACT),
    "mean": (lambda a: a["x"].mean(-1), *EXACT),
    "sum": (lambda a: a["x"].sum(-1), *EXACT),
    "var": (lambda a: a["x"].var(-1), *EXACT),
    "cumsum": (lambda a: a["x"].cumsum(-1), *EXACT),
    "matmul": (lambda a: a["x"] @ a["y"].transpose(-1, -2), *ACCUM),
    "bmm": (lambda a: torch.bmm(a["A"], a["B"]), *ACCUM),
    "conv2d": (lambda a: F.conv2d(a["img"], a["w"], padding=1), *ACCUM),
    "avg_pool2d": (lambda a: F.avg_pool2d(a["img"], 2), *EXACT),
    "max_pool2d": (lambda a: F.max_pool2d(a["img"], 2), *EXACT),
    "interpolate": (lambda a: F.interpolate(a["img"], scale_factor=2, mode="bilinear"), *EXACT),
    "embedding": (lambda a: F.embedding(a["ids"], a["E"]), *EXACT),
    # one unit, now and then: the CPU kernels' own fp16 paths
    "linear": (lambda a: F.linear(a["x"], a["W"], a["b"]), "ulp", 1,
               "fp16 addmm on CPU adds the bias to the product differently (fused epilogue)"),
    "log_softmax": (lambda a: F.log_softmax(a["x"], -1), "ulp", 0,
                    "the last-dimension kernel keeps sum(exp(x - max)) and its log in 16 bits: "
                    "replayed (emulation/backward_kernels.py)"),
    "softmax_dim1": (lambda a: F.softmax(a["x"], 1), "ulp", 0,
                     "along a middle dimension the kernel's scalar tail (inner positions past "
                     "the last whole 16-bit vector of each thread's chunk) rounds exp(x - max) "
                     "before dividing: replayed"),
    "logsumexp": (lambda a: torch.logsumexp(a["x"], -1), "ulp", 0,
                  "the composite's every op rounded to 16 bits: replayed"),
    "pow3": (lambda a: a["x"] ** 3, "ulp", 0,
             "bf16's pow kernel computes x ** 3 as (x * x) * x, each product rounded: replayed"),
    "pow_-2": (lambda a: a["p"] ** -2, "ulp", 0, "bf16: 1 / (x * x), each op rounded: replayed"),
    "sqrt": (lambda a: torch.sqrt(a["p"]), "ulp", 1,
             "the vectorised fp16 sqrt is not correctly rounded; fp32-then-round is"),
    "erf": (lambda a: torch.erf(a["x"]), "ulp", 1, "the vectorised fp16 erf approximation"),
    # kernels that keep an intermediate in 16 bits: absolute error at the output's scale
    "batch_norm": (lambda a: F.batch_norm(a["img"], None, None, training=True), "ulp", 0,
                   "emulated as the 16-bit kernel: mean and 1/std stored in 16 bits; bf16's "
                   "statistics computed in BFloat16 arithmetic, as the kernel does"),
    # the CPU flash kernel, emulated step by step (fexp_u20 on whole 16-key vectors, std::exp on
    # the rest, probabilities in 16 bits): 7 keys (all std::exp) and 40 keys, causal (both)
    "sdpa": (lambda a: F.scaled_dot_product_attention(a["q"], a["q"] * 0.5, a["q"]), *EXACT),
    "sdpa_causal_40": (lambda a: F.scaled_dot_product_attention(a["Q"], a["Q"] * 0.5, a["Q"],
                                                                is_causal=True), *EXACT),
}


@pytest.mark.parametrize("policy", list(DTYPES))
@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_the_native_16_bit_kernel(name, policy):
    fn, kind, bound, reason = OPS[name]
    dtype = DTYPES[policy]
    a16 = {k: (v.to(dtype).float() if v.is_floating_point() else v) for k, v in _inputs().items()}
    native = fn({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in a16.items()})
    with emulated(policy):
        emu = fn(a16)
    assert emu.dtype == torch.float32
    assert torch.equal(emu, emu.to(dtype).float()), "emulated output off the grid"
    d = (ulp_distance(emu, native.float(), dtype) if kind == "ulp"
         else scale_distance(emu, native.float(), dtype))
    assert d <= bound, f"{name} {policy}: {d} {kind} > {bound} ({reason})"


@pytest.mark.parametrize("policy", list(DTYPES))
def test_layer_norm_backward_matches_the_native_16_bit_kernel(policy):
    """The CPU kernel's backward keeps dgamma/dbeta in a 16-bit buffer per thread (each row's
    add rounded) and mean/rstd in 16 bits; emulated, the weight and bias gradients are equal bit
    for bit, the input gradient within one unit (its fp32 sums in another order)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(3)
    x, dy = (torch.randn(64, 48, generator=g).to(dtype) for _ in range(2))
    w, b = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype), (0.1 * torch.randn(48)).to(dtype)

    def grads(cast, ctx):
        ts = [cast(t).detach().requires_grad_() for t in (x, w, b)]
        with ctx:
            y = F.layer_norm(ts[0], (48,), ts[1], ts[2])
        y.backward(cast(dy))
        return [t.grad.float() for t in ts]

    native = grads(lambda t: t, contextlib.nullcontext())
    emu = grads(lambda t: t.float(), emulated(policy))
    assert ulp_distance(emu[0], native[0], dtype) <= 1
    assert torch.equal(emu[1], native[1]) and torch.equal(emu[2], native[2])


@pytest.mark.parametrize("policy", list(DTYPES))
def test_layer_norm_backward_beyond_the_sequential_rows_sums_in_fp32(policy):
    """Past 256 rows a thread, the weight and bias gradients are the exact sums rounded once
    (float64 reference, within one unit of the 16-bit result) and the input gradient stays
    within one unit, at the gradient's scale, of the native kernel's (where dX cancels to near
    zero its fp32 sums in another order move it by a few of its own units)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(4)
    rows = 300 * torch.get_num_threads() + 7
    x, dy = (torch.randn(rows, 40, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(dtype)
    b = (0.1 * torch.randn(40, generator=g)).to(dtype)
    ts = [t.float().requires_grad_() for t in (x, w, b)]
    with emulated(policy):
        y = F.layer_norm(ts[0], (40,), ts[1], ts[2])
    y.backward(dy.float())
    xn = x.detach().requires_grad_()
    F.layer_norm(xn, (40,), w, b).backward(dy)
    assert scale_distance(ts[0].grad, xn.grad.float(), dtype) <= 1
    # the reference from the 16-bit statistics, as the kernel saves them
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [40], w, b, 1e-5)
    xhat = (x.double() - mean.double()) * rstd.double()
    exact_w = (dy.double() * xhat).sum(0).to(dtype).float()
    exact_b = dy.double().sum(0).to(dtype).float()
    assert ulp_distance(ts[1].grad, exact_w, dtype) <= 1
    assert ulp_distance(ts[2].grad, exact_b, dtype) <= 1
    assert torch.equal(ts[1].grad, ts[1].grad.to(dtype).float())


@pytest.mark.parametrize("rows", [12, 300 * 64 + 7])  # the sequential 16-bit buffer; fp32 sums
@pytest.mark.parametrize("policy", list(DTYPES))
def test_layer_norm_with_a_bias_and_no_weight_has_the_bias_gradient(policy, rows):
    """F.layer_norm(x, shape, None, bias): the bias gradient is the sum of dy over rows, the
    native 16-bit kernel's where the replay is sequential, the exact sum rounded past 256 rows a
    thread (it was zero: the weight's absence dropped it)."""
    dtype = DTYPES[policy]
    g = torch.Generator().manual_seed(6)
    x, dy = (torch.randn(rows, 6, generator=g).to(dtype) for _ in range(2))
    b = (0.1 * torch.randn(6, generator=g)).to(dtype)
    xe, be = x.float().requires_grad_(), b.float().requires_grad_()
    with emulated(policy):
        F.layer_norm(xe, (6,), None, be).backward(dy.float())
    xn, bn = x.clone().requires_grad_(), b.clone().requires_grad_()
    F.layer_norm(xn, (6,), None, bn).backward(dy)
    if rows < 256:
        assert torch.equal(be.grad, bn.grad.float())
    else:
        assert ulp_distance(be.grad, dy.double().sum(0).to(dtype).float(), dtype) <= 1
    assert be.grad.abs().sum() > 0
    assert scale_distance(xe.grad, xn.grad.float(), dtype) <= 1


def test_the_op_table_is_large_enough():
    assert len(OPS) >= 30


# Backward: the gradient of each differentiated input, native against emulated, for the same
# 16-bit inputs and output gradient. name: (function, inputs differentiated, bound kind,
# bound, reason)
FROM_OUTPUT = ("ulp", 0, "differentiated from the rounded output (or input) in 16-bit "
               "arithmetic as the native backward (emulation/backward_kernels.py)")
BWD_EXACT = ("ulp", 0, "the native backward computes in fp32 and rounds once")
BACKWARD_OPS = {
    "add": (lambda a: a["x"] + a["y"], "xy", *BWD_EXACT),
    "mul": (lambda a: a["x"] * a["y"], "xy", *BWD_EXACT),
    "mul_broadcast": (lambda a: a["x"] * a["row"], ("x", "row"), "ulp", 0,
                      "the product at full size rounded, then summed to the operand's shape"),
    "div": (lambda a: a["x"] / a["p"], "xp", *FROM_OUTPUT),
    "exp": (lambda a: torch.exp(a["x"]), "x", *FROM_OUTPUT),
    "expm1": (lambda a: torch.expm1(a["x"]), "x", *FROM_OUTPUT),
    "log": (lambda a: torch.log(a["p"]), "p", *BWD_EXACT),
    "log1p": (lambda a: torch.log1p(a["p"]), "p", *FROM_OUTPUT),
    "rsqrt": (lambda a: torch.rsqrt(a["p"]), "p", *FROM_OUTPUT),
    "reciprocal": (lambda a: torch.reciprocal(a["p"]), "p", *FROM_OUTPUT),
    "tanh": (lambda a: torch.tanh(a["x"]), "x", "ulp", 0,
             "tanh_backward: dy * (1 - y * y) in fp32 from the 16-bit output"),
    "sigmoid": (lambda a: torch.sigmoid(a["x"]), "x", "ulp", 0,
                "sigmoid_backward from the 16-bit output; fp16 in c10::Half arithmetic"),
    "sin": (lambda a: torch.sin(a["x"]), "x", *FROM_OUTPUT),
    "cos": (lambda a: torch.cos(a["x"]), "x", *FROM_OUTPUT),
    "atan": (lambda a: torch.atan(a["x"]), "x", *FROM_OUTPUT),
    "erf": (lambda a: torch.erf(a["x"]), "x", *FROM_OUTPUT),
    "logsigmoid": (lambda a: F.logsigmoid(a["x"]), "x", "ulp", 0,
                   "log_sigmoid_backward reads the forward's 16-bit exp(-|x|) buffer"),
    "pow3": (lambda a: a["x"] ** 3, "x", *FROM_OUTPUT),
    "pow_-2": (lambda a: a["p"] ** -2, "p", *FROM_OUTPUT),
    "pow_0.5": (lambda a: a["p"] ** 0.5, "p", *FROM_OUTPUT),
    "softmax": (lambda a: F.softmax(a["x"], -1), "x", *FROM_OUTPUT),
    "softmax_dim1": (lambda a: F.softmax(a["x"], 1), "x", *FROM_OUTPUT),
    "log_softmax": (lambda a: F.log_softmax(a["x"], -1), "x", *FROM_OUTPUT),
    "logsumexp": (lambda a: torch.logsumexp(a["x"], -1), "x", *FROM_OUTPUT),
    "var": (lambda a: a["x"].var(-1), "x", *FROM_OUTPUT),
    "std": (lambda a: a["x"].std(1, keepdim=True), "x", *FROM_OUTPUT),
    "gelu": (lambda a: F.gelu(a["x"]), "x", *BWD_EXACT),
    "gelu_tanh": (lambda a: F.gelu(a["x"], approximate="tanh"), "x", *BWD_EXACT),
    "silu": (lambda a: F.silu(a["x"]), "x", *BWD_EXACT),
    "mish": (lambda a: F.mish(a["x"]), "x", *BWD_EXACT),
    "elu": (lambda a: F.elu(a["x"]), "x", *BWD_EXACT),
    "softplus": (lambda a: F.softplus(a["x"]), "x", *BWD_EXACT),
    "hardswish": (lambda a: F.hardswish(a["x"]), "x", *BWD_EXACT),
    "leaky_relu": (lambda a: F.leaky_relu(a["x"], 0.1), "x", *BWD_EXACT),
    "pow2": (lambda a: a["x"] ** 2, "x", *BWD_EXACT),
    "mean": (lambda a: a["x"].mean(-1), "x", *BWD_EXACT),
    "sum": (lambda a: a["x"].sum(-1), "x", *BWD_EXACT),
    "rms_norm": (lambda a: F.rms_norm(a["x"], (12,), a["ln_w"]), ("x", "ln_w"), *BWD_EXACT),
    "avg_pool2d": (lambda a: F.avg_pool2d(a["img"], 2), ("img",), *BWD_EXACT),
    "interpolate": (lambda a: F.interpolate(a["img"], scale_factor=2, mode="bilinear"),
                    ("img",), *BWD_EXACT),
    # matmuls: fp32 sums in another order
    "matmul": (lambda a: a["x"] @ a["y"].transpose(-1, -2), "xy", *ACCUM),
    "bmm": (lambda a: torch.bmm(a["A"], a["B"]), "AB", *ACCUM),
    "linear": (lambda a: F.linear(a["x"], a["W"], a["b"]), "xWb", *ACCUM),
    # a non-contiguous 3-D input: aten's matmul then add, the bias gradient the add's 16-bit
    # gradient summed down (sum_to_size)
    "linear_split": (lambda a: F.linear(a["x"].transpose(0, 1), a["W"], a["b"]), "xWb", *ACCUM),
    # attention: cpu_flash_attention_backward replayed (kernels._FlashAttention); dQ's
    # rowsum(dO * O) against dO @ V^T cancels where a row attends to one key, and the
    # kernel's fp32 sums run in their own order: measured 1 unit on 1-2 of 1280 fp16
    # gradients, 0.008 units at the scale of the largest (bf16: 0); the grouped case on an
    # AVX512 EPYC (16-lane vectors sum in another order than AVX2's 8): dQ 4 of 1280 by one
    # unit (0.125 at the largest's scale), dK 6 of 640 by up to two (0.5), dV and bf16 exact
    "sdpa_causal_40": (lambda a: F.scaled_dot_product_attention(a["Q"], a["K"], a["V"],
                                                                is_causal=True),
                       ("Q", "K", "V"), "scale", 0.1, "flash backward, fp32 sums' order"),
    "sdpa_grouped": (lambda a: F.scaled_dot_product_attention(a["Q"], a["Kg"], a["Vg"],
                                                              enable_gqa=True),
                     ("Q", "Kg", "Vg"), "scale", 0.5,
                     "flash backward; dK/dV summed over the group's heads in 16 bits"),
    # a mask that needs a gradient (T5's position bias): the math path, fp32 inside, each
    # input's gradient rounded where native casts it back (the mask's after its batch sum)
    "sdpa_mask_grad_math": (lambda a: F.scaled_dot_product_attention(a["Q"], a["K"], a["V"],
                                                                     attn_mask=a["Mb"]),
                            ("Q", "K", "V", "Mb"), *ACCUM),
    "sdpa_3d_math": (lambda a: F.scaled_dot_product_attention(a["Q"][0], a["K"][0], a["V"][0]),
                     ("Q", "K", "V"), *ACCUM),
}


@pytest.mark.parametrize("policy", list(DTYPES))
@pytest.mark.parametrize("name", list(BACKWARD_OPS))
def test_op_backward_matches_the_native_16_bit_kernel(name, policy):
    fn, wrt, kind, bound, reason = BACKWARD_OPS[name]
    wrt = tuple(wrt)
    dtype = DTYPES[policy]
    a16 = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in _inputs().items()}

    def grads(cast, ctx):
        ts = {k: (cast(v).detach().requires_grad_(k in wrt) if v.is_floating_point() else v)
              for k, v in a16.items()}
        with ctx:
            out = fn(ts)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        out.backward(cast(dy))
        return [ts[k].grad for k in wrt]

    native = grads(lambda t: t, contextlib.nullcontext())
    emu = grads(lambda t: t.float(), emulated(policy))
    for k, n, e in zip(wrt, native, emu):
        assert torch.equal(e, e.to(dtype).float()), f"{name} {policy}: d{k} off the grid"
        d = (ulp_distance(e, n.float(), dtype) if kind == "ulp"
             else scale_distance(e, n.float(), dtype))
        assert d <= bound, f"{name} {policy} d{k}: {d} {kind} > {bound} ({reason})"


def test_the_backward_table_is_large_enough():
    assert len(BACKWARD_OPS) >= 40


class _Fanout(nn.Module):
    """An activation read by four ops (h, of three elementwise consumers and a reduction) and
    a weight tied to two uses (an embedding and the output layer)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.head = nn.Linear(12, 20, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.rand(12) + 0.5)

    def forward(self, ids):
        h = self.emb(ids) * self.scale
        h = torch.tanh(h) + h.exp() * 0.25 + h * h + h.mean(-1, keepdim=True)
        return self.head(h) + self.emb(ids.flip(-1)).sum(-1, keepdim=True)


@pytest.mark.parametrize("policy", list(DTYPES))
def test_gradients_of_several_uses_are_summed_as_native_autograd_sums_them(policy):
    """Native autograd adds the 16-bit gradients an activation's consumers (or a tied
    parameter's uses) send back one at a time, each sum rounded, in the order the backward
    runs them; the engine replays that (engine._Sum): bit-exact. Rounding the fp32 sum once
    instead (measured): 5 (fp16) / 8 (bf16) of the 12 scale gradients and 92 / 81 of the
    tied weight's 240 differed."""
    dtype = DTYPES[policy]
    torch.manual_seed(0)
    model = _Fanout()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    ids = torch.randint(0, 20, (6, 9), generator=torch.Generator().manual_seed(1))
    runs = {}
    for mode in ("native", "emulated"):
        m = copy.deepcopy(model)
        if mode == "native":
            m = m.to(dtype)
        else:
            m, _ = Precision(dataclasses.replace(parse_policy(policy),
                                                 backend=Backend.EMULATED)).setup(m)
        out = m(ids)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
                     .to(out.dtype))
        runs[mode] = [out.detach().float()] + [p.grad.to(dtype).float() for p in m.parameters()]
    for n, e in zip(runs["native"], runs["emulated"]):
        assert torch.equal(n, e)


# -- whole models --------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: functional attention and residual adds in its forward."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.f1, self.f2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(self.n1(x)).split(D, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.f2(F.gelu(self.f1(self.n2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab=50, d=32, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.1)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[:ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class Basic(nn.Module):
    """ResNet basic block as torchvision writes it: ReLU(inplace=True), ``out += identity``."""

    def __init__(self, c):
        super().__init__()
        self.c1, self.c2 = (nn.Conv2d(c, c, 3, padding=1, bias=False) for _ in range(2))
        self.b1, self.b2 = nn.BatchNorm2d(c), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.b1(self.c1(x)))
        out = self.b2(self.c2(out))
        out += x
        return self.relu(out)


def resnet(c=16):
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                         nn.ReLU(inplace=True), Basic(c), Basic(c), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(c, 10))


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(12, 24, batch_first=True), nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class GRUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(12, 24, batch_first=True), nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


class PackedBiLSTM(nn.Module):
    """A bidirectional LSTM over a PackedSequence of unsorted lengths; every step's output."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(12, 24, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        lengths = torch.tensor([7, 10, 4, 9])[:x.shape[0]]
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]).sum(1)


class StackedLSTM(nn.Module):
    """Two layers, dropout between them (training mode)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(12, 24, num_layers=2, dropout=0.3, batch_first=True)
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def _run(model, x, mode, match_cpu_kernels=False):
    m = copy.deepcopy(model)
    if mode == "native":
        m, x = m.half(), (x.half() if x.is_floating_point() else x)
    elif mode == "float64":
        m, x = m.double(), (x.double() if x.is_floating_point() else x)
    elif mode == "emulated":
        m, _ = Precision("16-true", match_cpu_kernels=match_cpu_kernels).setup(m)
    m.train()
    with torch.random.fork_rng():
        torch.manual_seed(7)  # dropout draws the same masks in every run
        out = m(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    (out * w).sum().backward()
    grads = [p.grad for p in m.parameters()]
    if mode == "emulated":  # as Precision.step stores them: in the parameter format (fp16)
        grads = [g.half() for g in grads]
    return out.detach().double(), torch.cat([g.double().flatten() for g in grads])


def fidelity(model, x, match_cpu_kernels=False) -> dict:
    """(emulated - native) / (fp32 - native) distances and emulated/native errors vs float64,
    for the outputs and the parameter gradients; the same fp16-rounded weights everywhere."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    r = {k: _run(model, x, k, match_cpu_kernels) for k in ("native", "emulated", "fp32", "float64")}
    d = lambda a, b: float((a - b).norm())  # noqa: E731
    res = {}
    for i, part in enumerate(("forward", "grads")):
        res[part] = (d(r["emulated"][i], r["native"][i]) / d(r["fp32"][i], r["native"][i]),
                     d(r["emulated"][i], r["float64"][i]) / d(r["native"][i], r["float64"][i]))
    return res


def _x(*shape, ints=None):
    g = torch.Generator().manual_seed(1)
    if ints:
        return torch.randint(0, ints, shape, generator=g)
    return torch.randn(*shape, generator=g).half().float()


def _resnet_batches(match_cpu_kernels):
    res = []
    for batch in range(1, 6):
        torch.manual_seed(0)
        x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(batch))
        res.append(fidelity(resnet(16), x.half().float(), match_cpu_kernels))
        for part in res[-1].values():
            assert 0.8 <= part[1] <= 1.25, res[-1]
    return res


def test_resnet_is_bit_exact_with_native_fp16_when_matching_cpu_kernels():
    """With ``match_cpu_kernels=True`` the convolutions sum as torch's own CPU fp16 kernel
    does: where that is the reference kernel, in its order (lowprec.numerics.summation); where
    it is oneDNN's (AVX512-FP16), as fp32 rounded once. Every other op already matches native
    fp16 bit for bit given native's inputs: the forward is bit-exact on all five batches (ratio
    0.0). Gradients (AMD EPYC, AVX2): 0.045 0.065 0.052 0.070 0.052 (native's backward
    convolutions keep their columns and per-sample weight-gradient sums in fp16; the issue
    asks 0.25). On an Intel Xeon with AVX512-FP16 the reference order gave 0.76 forward."""
    res = _resnet_batches(True)
    assert all(r["forward"][0] == 0.0 for r in res), res
    assert max(r["grads"][0] for r in res) <= 0.1, res


def test_the_convolution_order_follows_the_kernel_torch_runs_here():
    """``match_cpu_kernels`` sums fp16 convolutions in the reference kernel's order exactly
    where torch runs that kernel on this CPU (seen by the profiler: ``slow_conv2d``), not where
    oneDNN's runs (CPUs with AVX512-FP16 or AMX-FP16)."""
    from lowprec.training.emulation import native_gemm

    assert native_gemm.conv_is_reference(torch.float16) is native_conv_is_reference()
    assert native_gemm.conv_is_reference(None)  # formats of no torch dtype: the order kept


def test_resnet_matches_native_fp16():
    """The default engine (oneDNN's fp32 convolution, rounded once): every op but the
    convolutions matches native fp16 bit for bit given native's own inputs
    (benchmarks/fidelity_diag.py resnet). Native fp16 convolution on a CPU without AVX512-FP16
    is torch's reference kernel, which sums in four interleaved fp32 partial sums
    (lowprec.numerics.summation): one unit apart from fp32-then-round on 0.01-0.1% of its
    outputs, and batch norm spreads those units, so the ratio depends on the batch. Over 5
    batches, forward 0.74 0.68 0.65 0.08 0.57 (median 0.65) and gradients 0.52 0.22 0.054 0.071
    0.064 (median 0.071). On CPUs whose fp16 convolution is oneDNN's, which rounds fp32 sums
    once, the issue measured 0.00 forward for a plain rounding engine."""
    res = _resnet_batches(False)
    med = {k: sorted(r[k][0] for r in res)[2] for k in ("forward", "grads")}
    assert med["forward"] <= 0.7 and med["grads"] <= 0.12, med


def test_transformer_matches_native_fp16():
    """Attention follows torch's CPU flash kernel both ways (its fexp_u20 exp, probabilities in
    fp16; the backward's recomputed P and dS in fp16, dK/dV per query block) and layer norm's
    backward the 16-bit kernel's (16-bit dgamma/dbeta buffers); linear differs by one unit at
    times (summation order). Measured 0.046 forward, 0.12 gradients (batches 2 and 3: 0.13 /
    0.23 and 0.04 / 0.10); before the attention backward and the consumers' 16-bit sums, 0.27
    (0.30, 0.24); before the attention and layer norm kernels 0.79 / 0.75. The issue asks
    0.5 / 0.6."""
    torch.manual_seed(0)
    res = fidelity(Transformer(), _x(4, 16, ints=50))
    assert res["forward"][0] <= 0.1 and res["grads"][0] <= 0.2, res
    for part in res.values():
        assert 0.8 <= part[1] <= 1.25, res


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 64, 64, 32), (3, 4, 2, 48, 64, 16),
                                   (2, 2, 2, 80, 32, 8), (2, 2, 2, 40, 40, 8),
                                   (2, 2, 2, 5, 7, 8)],
                         ids=["64", "grouped-48x64", "80x32", "40", "5x7"])
def test_the_fused_attention_passes_keep_the_unfused_bits(shape, causal, fmt, monkeypatch):
    """The emulated flash attention's passes over rows of scores, fused in the kernel (fexp.c:
    scale, causal mask, row max and fexp_u20 forward; s * scale - lse, then p and dS backward,
    the masked keys' exp(-inf) not computed), give the torch ops' bits: output and the three
    input gradients, key counts that are whole vectors or not (the rest by torch's exp)."""
    from lowprec.numerics import kernel
    from lowprec.numerics.formats import parse_format
    from lowprec.numerics.quantize import quantize
    from lowprec.training.emulation import kernels
    from lowprec.training.emulation.gradmarks import rounded_grad_

    if not kernel.attention_rows_available():
        pytest.skip("the kernel is not built here")
    f = parse_format(fmt)
    B, H, Hk, L, S, D = shape
    g = torch.Generator().manual_seed(L + S)

    def mk(*sh):
        return quantize(torch.randn(*sh, generator=g) * 3, f)

    q, k, v, do = mk(B, H, L, D), mk(B, Hk, S, D), mk(B, Hk, S, D), mk(B, H, L, D)
    calls = []
    real = kernel.attn_fwd_rows
    monkeypatch.setattr(kernel, "attn_fwd_rows", lambda *a: calls.append(1) or real(*a))

    def run(fuse):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        o = kernels._FlashAttention.apply(*ts, None, causal, torch.tensor(D ** -0.5),
                                          lambda t: quantize(t, f),
                                          lambda t: rounded_grad_(t, f), fuse)
        o.backward(do)
        return [o] + [t.grad for t in ts]

    fused = run(True)
    assert calls, "the fused passes did not run"
    for name, a, b in zip(("out", "dq", "dk", "dv"), fused, run(False)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_fused_attention_keeps_nan_payloads_and_steps_aside_under_autocast(causal):
    """An infinite query meeting keys of both signs makes NaN scores with the sign bit set
    (the hardware's default NaN): the fused passes give them the NaN the torch ops give
    (theirs for a - b is b's, amax's the canonical one), in the output and every gradient.
    Under CPU autocast the products come out in bf16: the torch ops run then."""
    from lowprec.numerics.formats import parse_format
    from lowprec.numerics.quantize import quantize
    from lowprec.training.emulation import kernels
    from lowprec.training.emulation.gradmarks import rounded_grad_

    f = parse_format("fp16")
    q = torch.ones(2, 2, 20, 16)
    q[0, 0, 0] = float("inf")
    q[1, 1, 5, 3] = -float("inf")
    k, v = torch.ones(2, 2, 20, 16), torch.ones(2, 2, 20, 16)
    k[..., 1, 0] = -1.0
    k[1, 0, 4, 2] = float("nan")
    do = torch.ones(2, 2, 20, 16)

    def run(fuse):
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        o = kernels._FlashAttention.apply(*ts, None, causal, torch.tensor(0.25),
                                          lambda t: quantize(t, f),
                                          lambda t: rounded_grad_(t, f), fuse)
        o.backward(do)
        return [o] + [t.grad for t in ts]

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(True), run(False)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run(True)[0].dtype == torch.bfloat16  # no error: the unfused path ran


GEMMS = ("linear", "matmul", "mm", "bmm")


def test_transformer_with_cpu_kernels_is_bit_exact_forward():
    """With ``match_cpu_kernels=True`` (matrix products by this CPU's 16-bit kernels:
    training/emulation/native_gemm.py), the forward is bit-exact and the gradients 0.028 of
    fp32's distance (batches 2 and 3: 0.055 / 0.15 and 0.0 / 0.078): what remains is the fp32
    summation order inside the attention and layer norm backward kernels (dsum against
    dO @ V^T, ds and db of layer norm), one unit now and then."""
    torch.manual_seed(0)
    res = fidelity(Transformer(), _x(4, 16, ints=50), match_cpu_kernels=True)
    assert res["forward"][0] <= 0.01 and res["grads"][0] <= 0.1, res


RECURRENT = {"lstm": LSTMNet, "gru": GRUNet, "packed-bidirectional-lstm": PackedBiLSTM,
             "2-layer-lstm-dropout": StackedLSTM}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_layers_track_native_fp16(name):
    """LSTM, GRU and RNN layers run op by op as ATen's CPU composite runs them in fp16
    (emulation/recurrent_kernels.py): the input projection, each gate op of each step rounded,
    at::linear's matmul-then-add for a batch_first input, dropout's noise drawn from torch's
    generator as native draws it and rounded to fp16; backward, sigmoid's Half-arithmetic
    derivative from the rounded output, each use's gradient rounded before autograd's 16-bit
    sum, the per-step weight gradients summed in fp16. Measured on this CPU: 0.0 forward and
    0.0 gradients for all four, errors 1.00 (bit-exact; before, the plain LSTM replayed under
    the mode and the others one fp32 op: forward / gradients LSTM 1.06 / 0.76, GRU 1.20 /
    0.97, packed bidirectional LSTM 1.00 / 0.82, 2-layer LSTM 0.70 / 0.66, errors 0.44-1.08;
    benchmarks/fidelity_models.py). Bound 0.5 (the issue's), not 0: fp16 linear sums in
    its own order, one unit apart at times on other CPUs and shapes."""
    torch.manual_seed(0)
    res = fidelity(RECURRENT[name](), _x(4, 10, 12))
    assert res["forward"][0] <= 0.5 and res["grads"][0] <= 0.5, res
    for part in res.values():
        assert 0.9 <= part[1] <= 1.1, res


class AllOutputs(nn.Module):
    """A recurrent layer's every output (the sequence and the final states), flattened into
    one vector, so that each gets a gradient; ``packed``: fed a PackedSequence."""

    def __init__(self, rnn, packed):
        super().__init__()
        self.rnn, self.packed = rnn, packed

    def forward(self, x):  # x: (batch, time, features)
        first = self.rnn.batch_first
        if not first:
            x = x.transpose(0, 1).contiguous()
        if self.packed:
            x = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([3, 6, 2]), batch_first=first,
                                                  enforce_sorted=False)
        out, states = self.rnn(x)
        if self.packed:
            out = nn.utils.rnn.pad_packed_sequence(out, batch_first=first)[0]
        states = states if isinstance(states, tuple) else (states,)
        return torch.cat([t.flatten() for t in (out, *states)])


RNN_OPTIONS = {  # layer, packed input
    "gru-bidirectional": (lambda: nn.GRU(5, 8, bidirectional=True, batch_first=True), False),
    "gru-packed-bidirectional-2-layers-dropout": (
        lambda: nn.GRU(5, 8, 2, dropout=0.3, bidirectional=True, batch_first=True), True),
    "lstm-time-first": (lambda: nn.LSTM(5, 8), False),
    "gru-time-first-packed": (lambda: nn.GRU(5, 8), True),
    "lstm-projections-packed-bidirectional": (
        lambda: nn.LSTM(5, 8, proj_size=4, bidirectional=True, batch_first=True), True),
    "lstm-no-bias-3-layers-dropout": (
        lambda: nn.LSTM(5, 8, 3, bias=False, dropout=0.5, batch_first=True), False),
    "rnn-tanh-2-layers": (lambda: nn.RNN(5, 8, 2, batch_first=True), False),
    "rnn-relu-packed-bidirectional": (
        lambda: nn.RNN(5, 8, nonlinearity="relu", bidirectional=True, batch_first=True), True),
}


@pytest.mark.filterwarnings("ignore:LSTM with projections")
@pytest.mark.parametrize("policy", list(DTYPES))
@pytest.mark.parametrize("case", list(RNN_OPTIONS))
def test_every_recurrent_option_tracks_the_native_16_bit_layer(case, policy):
    """Each option of nn.GRU / nn.LSTM / nn.RNN through the op-by-op replay, every output and
    parameter gradient against ``.half()`` / ``.bfloat16()``: at most half fp32's distance,
    and dropout draws as many numbers from torch's generator as native does. Measured: 0.0,
    bit-exact, for every case in both formats. Wider fp16 layers after the first (and without
    biases) differ by one unit at times, fp16 linear summing in its own order (2-layer
    bidirectional GRU of 24 units, dropout: 0.12 forward, 0.24 gradients)."""
    dtype = DTYPES[policy]
    make, packed = RNN_OPTIONS[case]
    torch.manual_seed(0)
    model = AllOutputs(make(), packed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    x = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(1)).to(dtype).float()
    runs, rng = {}, {}
    for mode in ("native", "emulated", "fp32"):
        m, xm = copy.deepcopy(model), x
        if mode == "native":
            m, xm = m.to(dtype), x.to(dtype)
        elif mode == "emulated":
            pol = dataclasses.replace(parse_policy(policy), backend=Backend.EMULATED)
            m, _ = Precision(pol).setup(m)
        torch.manual_seed(7)
        # ATen's own recurrent kernels: with AVX512-BF16 or AMX, torch sends a bf16 nn.LSTM
        # to oneDNN's (other roundings, and not what an AVX2 CPU or a GPU runs), which the
        # replay does not model (2.1-2.9x fp32's distance there)
        with torch.backends.mkldnn.flags(enabled=False):
            out = m(xm)
            rng[mode] = torch.get_rng_state()
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            (out * w.to(out.dtype)).sum().backward()
        runs[mode] = [out.detach().double(),
                      torch.cat([p.grad.to(dtype).double().flatten() for p in m.parameters()])]
    assert torch.equal(rng["emulated"], rng["native"])
    for i, part in enumerate(("output", "gradients")):
        d = float((runs["emulated"][i] - runs["native"][i]).norm())
        d32 = float((runs["fp32"][i] - runs["native"][i]).norm())
        assert d <= 0.5 * d32, (part, d / d32)


# -- every op's output on the grid ------------------------------------------------------------
_GRID_NODES = ("View", "Reshape", "Unsafe", "Transpose", "T", "Permute", "Expand", "Squeeze",
               "Unsqueeze", "Select", "Slice", "Split", "Cat", "Stack", "Threshold", "Relu",
               "MaxPool", "Index", "Embedding", "Clone", "Alias", "Unbind", "Chunk",
               "AsStrided", "Narrow", "RoundBackward", "RoundInplace", "ConsumedBackward",
               "UpcastBackward", "BroadcastBackward",
               "torch::autograd::AccumulateGrad")


@pytest.mark.parametrize("make,x", [(Transformer, (4, 16, 50)), (resnet, (4, 3, 12, 12))],
                         ids=["transformer", "resnet"])
def test_no_op_output_off_the_fp16_grid_forward_and_backward(make, x):
    torch.manual_seed(0)
    x = _x(*x[:2], ints=x[2]) if len(x) == 3 else _x(*x)
    prec = Precision("16-true")
    model, _ = prec.setup(make())
    ops, off = [], []

    def probe(name, module, args, kwargs, out):  # each op's outputs as the next op gets them
        ops.append(name)
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if torch.is_tensor(o) and o.dtype == torch.float32 and o.numel() and \
                    not torch.equal(o, o.half().float()):
                off.append(f"{module}/{name}")

    prec.emulation.observers.append(probe)
    out = model(x)
    assert len(ops) > 10 and off == [], off
    # backward: the gradient reaching every computing op's backward is on the grid
    off, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
        if not any(node.name().startswith(k) for k in _GRID_NODES):
            node.register_prehook(lambda gs, node=node: off.extend(
                node.name() for g in gs if g is not None and node.metadata.get("kernel") is None
                and g.numel()
                and not torch.equal(g, g.half().float())))
    out.backward(torch.randn(out.shape).half().float())
    assert len(seen) > 10 and off == [], off  # noqa: the forward's list was empty too


BN_CASES = {  # module, input shape
    "2d_7x7": (lambda: nn.BatchNorm2d(6), (8, 6, 7, 7)),
    "2d_4x4": (lambda: nn.BatchNorm2d(5), (16, 5, 4, 4)),
    "2d_33x1": (lambda: nn.BatchNorm2d(3), (4, 3, 33, 1)),
    "1d_no_affine": (lambda: nn.BatchNorm1d(7, affine=False), (32, 7)),
    "3d": (lambda: nn.BatchNorm3d(4), (4, 4, 3, 5, 5)),
    "2d_no_running_stats": (lambda: nn.BatchNorm2d(6, track_running_stats=False), (8, 6, 7, 7)),
}


@pytest.mark.parametrize("case", list(BN_CASES))
@pytest.mark.parametrize("policy", list(DTYPES))
def test_batch_norm_training_steps_match_the_native_16_bit_kernel(policy, case):
    """Batch norm over three training steps, then in eval mode, against ``.half()`` /
    ``.bfloat16()``: output, input gradient, weight and bias gradients and running statistics.
    The backward follows the kernel's fused formula (before, the engine differentiated its own
    fp32 ops and rounded each intermediate gradient: 12-21% of dx off, up to 36 ulp). bf16's
    statistics are computed in BFloat16 arithmetic as the kernel's are: bit-exact. fp16: the
    kernel keeps fp32 statistics; dx and dweight within one unit (its fp32 sums of dy and
    (x - mean) dy run in another order), measured 0-2 elements of ~2000."""
    dtype = DTYPES[policy]
    make, shape = BN_CASES[case]
    torch.manual_seed(0)
    bn = make()
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(1 + 0.1 * torch.randn(shape[1]))
            bn.bias.copy_(0.1 * torch.randn(shape[1]))
    nat = copy.deepcopy(bn).to(dtype)
    prec = Precision(dataclasses.replace(parse_policy(policy), backend=Backend.EMULATED))
    emu, _ = prec.setup(copy.deepcopy(bn))
    assert prec.emulation is not None  # bf16 on CPU would otherwise run natively
    sums = 0 if dtype == torch.bfloat16 else 1
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype)
        dy = torch.randn(*shape, generator=g).to(dtype)
        xn, xe = x.clone().requires_grad_(), x.float().requires_grad_()
        yn, ye = nat(xn), emu(xe)
        yn.backward(dy)
        ye.backward(dy.float())
        assert torch.equal(ye, yn.float())
        assert ulp_distance(xe.grad, xn.grad.float(), dtype) <= sums
        if bn.affine:
            assert ulp_distance(emu.weight.grad, nat.weight.grad.float(), dtype) <= sums
            assert torch.equal(emu.bias.grad.to(dtype), nat.bias.grad)
        if bn.track_running_stats:
            assert torch.equal(emu.running_mean, nat.running_mean.float())
            assert torch.equal(emu.running_var, nat.running_var.float())
        nat.zero_grad()
        emu.zero_grad()
    nat.eval()
    emu.eval()
    x = torch.randn(*shape).to(dtype)
    assert torch.equal(emu(x.float()), nat(x).float())


BF16_BN_CASES = {  # module, input shape, memory format, offset of the values
    "2d_channels_last": (lambda: nn.BatchNorm2d(32), (64, 32, 6, 6), torch.channels_last, 100.3),
    "2d_channels_last_wide": (lambda: nn.BatchNorm2d(40), (16, 40, 3, 5), torch.channels_last,
                              7.7),
    "3d_channels_last": (lambda: nn.BatchNorm3d(6), (8, 6, 3, 4, 5), torch.channels_last_3d, 20.5),
    "1d_rows": (lambda: nn.BatchNorm1d(40), (64, 40), None, 50.2),
    "nc11": (lambda: nn.BatchNorm2d(24), (9, 24, 1, 1), None, 5.1),
    "rows_fewer_than_threads": (lambda: nn.BatchNorm1d(64), (2, 64), None, 100.3),
    "2d_contiguous": (lambda: nn.BatchNorm2d(32), (64, 32, 6, 6), None, 100.3),
    "2d_contiguous_long_planes": (lambda: nn.BatchNorm2d(4), (8, 4, 30, 31), None, 30.7),
    "1d_sequence": (lambda: nn.BatchNorm1d(12), (16, 12, 50), None, 60.1),
    "2d_contiguous_3x11": (lambda: nn.BatchNorm2d(4), (8, 4, 3, 11), None, 7.7),
    "2d_contiguous_3x3": (lambda: nn.BatchNorm2d(64), (4, 64, 3, 3), None, 5.3),
}


@pytest.mark.parametrize("case", list(BF16_BN_CASES))
def test_pure_bf16_batch_statistics_are_the_kernels_in_every_layout(case):
    """torch's bf16 CPU kernel collects a channels-last input's statistics (and an N x C or
    N x C x 1 x 1 one's) over its threads' chunks of rows and takes the squared deviations from
    the mean stored in bf16; a contiguous one's per channel in vector lanes, from the fp32
    mean: the emulation's outputs and running statistics are its bits over two training steps,
    on values far from zero, where the stored mean moves about half of the 1/std values and
    the order of the sums some (before: 32 of 32 running variances and 47,525 of 73,728
    outputs off in the first case, 2,970 outputs in "2d_contiguous")."""
    make, shape, fmt, offset = BF16_BN_CASES[case]
    torch.manual_seed(0)
    bn = make()
    nat = copy.deepcopy(bn).to(torch.bfloat16)
    prec = Precision(dataclasses.replace(parse_policy("bf16-true"), backend=Backend.EMULATED))
    emu, _ = prec.setup(copy.deepcopy(bn))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = (torch.randn(*shape, generator=g) * 0.5 + offset).to(torch.bfloat16)
        if fmt is not None:
            x = x.contiguous(memory_format=fmt)
        assert torch.equal(emu(x.float()), nat(x).float()), step
        assert torch.equal(emu.running_mean, nat.running_mean.float())
        assert torch.equal(emu.running_var, nat.running_var.float())


# -- in-place ops --------------------------------------------------------------------------------
class _InPlace(nn.Module):
    """y = x * w1 read by one op (z), then written in place, then read again: elementwise, so
    native fp16 rounds each result once on any CPU."""

    def __init__(self, op):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.w1 = nn.Parameter(torch.randn(40, 96, generator=g).half().float())
        self.w2 = nn.Parameter(torch.randn(40, 96, generator=g).half().float())
        self.op = op

    def forward(self, x):
        y = x * self.w1
        z = y * 1.5  # a consumer of y's first version (its backward keeps nothing of y)
        self.op(y)
        return y * self.w2 + z


_IN_PLACE = {"sigmoid_": lambda y: y.sigmoid_(), "tanh_": lambda y: y.tanh_(),
             "exp_": lambda y: y.mul_(0.25).exp_(), "relu_": lambda y: y.relu_(),
             "relu(inplace=True)": nn.ReLU(inplace=True),
             # on a view: the base's consumers after it sum apart too
             "view.relu_": lambda y: y[:, :5].relu_(),
             "view.sigmoid_": lambda y: y[:, :5].sigmoid_(),
             "view.exp_": lambda y: y[2:].mul_(0.25).exp_(),
             "view.mul_": lambda y: y[:, 3:].mul_(2)}


@pytest.mark.parametrize("name", list(_IN_PLACE))
def test_in_place_ops_whose_node_saves_the_output_match_native_fp16(name):
    # an in-place op whose autograd node saves its output (sigmoid_, tanh_, exp_, relu_) ran
    # in place and was rounded after: autograd refused it in backward (sigmoid_, tanh_, exp_);
    # now it is its out-of-place op's replay then a copy, and the gradients of the tensor's
    # two versions are summed apart, as native autograd sums them (relu_: 65% of the first
    # parameter's gradient equal before)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(3)).half()
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(4)).half()
    native = copy.deepcopy(_InPlace(_IN_PLACE[name])).half()
    yn = native(x)
    (yn * w).float().sum().backward()
    model, _ = Precision("16-true").setup(_InPlace(_IN_PLACE[name]))
    ye = model(x.float())
    (ye * w.float()).sum().backward()
    assert torch.equal(ye.half(), yn)
    for pe, pn in zip(model.parameters(), native.parameters()):
        assert torch.equal(pe.grad.half(), pn.grad)


@pytest.mark.parametrize("view", [False, True], ids=["tensor", "view"])
@pytest.mark.parametrize("op", ["relu_", "sigmoid_"])
@pytest.mark.parametrize("policy, override", [("16-true", "bf16-true"), ("bf16-true", "16-true"),
                                              ("q6.10-sr", "16-true")])
def test_an_in_place_op_on_another_formats_output_runs_as_its_out_of_place_op(op, policy,
                                                                              override, view):
    # an in-place op whose node saves its output, on a tensor another override rounded (a
    # bf16 layer's output, ReLU(inplace=True) in an fp16 model), or on a view of it, was
    # rounded in place after the node saved it, and backward raised; now the values and
    # gradients of the out-of-place op
    def run(inplace):
        fn = getattr(torch.Tensor, op if inplace else op[:-1])

        class Act(nn.Module):
            def forward(self, x):
                if not view:
                    return fn(x)
                if inplace:
                    fn(x[:, :5])
                    return x
                return torch.cat([fn(x[:, :5]), x[:, 5:]], 1)

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(12, 16), Act(), nn.Linear(16, 4))
        prec = Precision(policy, seed=0, overrides={"0": override})
        model, _ = prec.setup(net)
        with prec.autocast():
            y = model(torch.randn(8, 12, generator=torch.Generator().manual_seed(1)))
        y.float().pow(2).sum().backward()
        return [y.detach()] + [p.grad for p in net.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


class _InPlaceOf(nn.Module):
    """y = x * w1 written in place by ``op(y, s)`` (s an fp32 island value: x.float() * 0.37 +
    1.1), returned: elementwise, native fp16 rounds each result once on any CPU."""

    def __init__(self, op):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 24, generator=torch.Generator().manual_seed(2))
                               .half().float())
        self.op = op

    def forward(self, x):
        y = x * self.w1
        self.op(y, x.float() * 0.37 + 1.1)
        return y


_IN_PLACE_INPUTS = {  # replayed ops whose backward reads the input; an fp32 island operand
    "sin_": lambda y, s: y.sin_(), "cos_": lambda y, s: y.cos_(), "pow_(2)": lambda y, s: y.pow_(2),
    "div_(fp32)": lambda y, s: y.div_(s), "/= fp32": lambda y, s: y.__itruediv__(s),
    "pow_(fp32)": lambda y, s: y.abs_().pow_(s)}


@pytest.mark.parametrize("name", list(_IN_PLACE_INPUTS))
def test_in_place_ops_reading_their_input_or_an_fp32_operand_match_native_fp16(name):
    # (a first version of the in-place handling above ran these as their out-of-place op and
    # a copy too: the copy overwrote the input the op's backward reads, and backward raised;
    # with an fp32 operand the fp32 result was copied into the target unrounded. Known gap:
    # log1p_'s gradient is torch's fp32 formula, not the replay's 16-bit one)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(3)).half()
    native = copy.deepcopy(_InPlaceOf(_IN_PLACE_INPUTS[name])).half()
    yn = native(x)
    yn.float().sum().backward()
    model, _ = Precision("16-true").setup(_InPlaceOf(_IN_PLACE_INPUTS[name]))
    ye = model(x.float())
    ye.float().sum().backward()
    assert torch.equal(ye.detach(), yn.detach().float())
    assert torch.equal(model.w1.grad.half(), native.w1.grad)


def _exact_linear() -> nn.Linear:
    """A 64 -> 64 linear layer with the identity for its weight: its output x + b, and its
    input's gradient, are exact sums in any GEMM's order, so the native 16-bit run's equal the
    emulation's on every CPU (a weight's gradient may differ by a unit where oneDNN or AMX
    sums in another order)."""
    lin = nn.Linear(64, 64)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64))
    return lin


class _AfterLinear(nn.Module):
    """``op`` of an exact linear layer's output (16-bit under every policy here)."""

    def __init__(self, op):
        super().__init__()
        self.lin, self.op = _exact_linear(), op

    def forward(self, x):
        return self.op(self.lin(x))


# a Python number beside a 16-bit tensor, an fp16-unrepresentable one: cast to the 16-bit dtype
# first by most kernels (add: fp16(0.3) = 0.30004883), read in float32 by some (mul, div, and
# Scalar parameters); comparisons on y * 0 + 0.3 (= the 16-bit 0.3: equal to it, above 0.3)
_SCALAR_OPS = {
    "y + 0.3": lambda y: y + 0.3, "0.3 + y": lambda y: 0.3 + y, "1.3 - y": lambda y: 1.3 - y,
    "y - 1e-5": lambda y: y - 1e-5, "add_(0.3)": lambda y: y.add_(0.3),
    "-= 1e-5": lambda y: y.__isub__(1e-5), "y + 3001": lambda y: y + 3001,
    "add alpha": lambda y: torch.add(y, y.flip(0), alpha=0.3),
    "sub alpha": lambda y: torch.sub(y, y.flip(0), alpha=0.3),
    "remainder": lambda y: torch.remainder(y, 0.3), "fmod": lambda y: torch.fmod(y, 0.3),
    "y + tensor(0.3)": lambda y: y + torch.tensor(0.3),
    "atan2 tensor": lambda y: torch.atan2(y, torch.tensor(0.3)),
    "y > 0.3": lambda y: (y * 0 + 0.3 > 0.3).to(y.dtype),
    "y == 0.3": lambda y: (y * 0 + 0.3).eq(0.3).to(y.dtype),
    "y <= 0.3": lambda y: torch.le(y * 0 + 0.3, 0.3).to(y.dtype),
    "y + np.float64(0.3)": lambda y: y + np.float64(0.3),
    "tensor(0.3) < y": lambda y: (torch.tensor(0.3) < y * 0 + 0.3).to(y.dtype),
    "gt(input=, other=)": lambda y: torch.gt(input=y * 0 + 0.3, other=0.3).to(y.dtype),
    "y ** 1.7": lambda y: y.abs() ** 1.7, "pow_(0.3)": lambda y: y.abs().pow_(0.3),
    "0.3 ** y": lambda y: 0.3 ** y, "pow(y, tensor)": lambda y: y.abs() ** torch.tensor(0.3),
    "lerp tensor": lambda y: torch.lerp(y, y.flip(0), torch.tensor(0.3)),
    "logaddexp": lambda y: torch.logaddexp(y, torch.tensor(0.3)),
    # 0-dim tensors alone promote among themselves: fp32 wins, nothing is cast
    "0-dim > tensor(0.3)": lambda y: ((y[0, 0] * 0 + 0.3) > torch.tensor(0.3)).to(y.dtype),
    # read in float32 (they matched before the cast was emulated; they must not start casting)
    "y * 0.3": lambda y: y * 0.3, "y / 0.3": lambda y: y / 0.3,
    "lerp": lambda y: torch.lerp(y, y.flip(0), 0.3),
    "addcmul": lambda y: torch.addcmul(y, y, y.flip(0), value=0.3),
    "leaky_relu": lambda y: F.leaky_relu(y, 0.3), "softplus": lambda y: F.softplus(y, 0.9),
}


BF16_EMULATED = "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated"  # (bf16-true may run natively here)


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED, "16-mixed"],
                         ids=["16-true", "bf16-emulated", "16-mixed"])
@pytest.mark.parametrize("name", list(_SCALAR_OPS))
def test_a_number_beside_a_16_bit_tensor_is_read_as_the_native_kernel_reads_it(name, policy):
    # (before: y + 0.3 89% of fp16 results equal native, 76% bf16; remainder 14%; the
    # comparisons none)
    if policy == "16-mixed" and name in ("softplus", "y ** 1.7", "pow_(0.3)", "0.3 ** y",
                                         "pow(y, tensor)"):
        pytest.skip("softplus and pow are on CUDA autocast's fp32 list, which 16-mixed "
                    "follows; CPU autocast runs them in fp16")
    torch.manual_seed(0)
    op = _SCALAR_OPS[name]
    x = torch.randn(256, 64)
    native = _AfterLinear(op)
    model = copy.deepcopy(native)
    if policy == "16-mixed":
        with torch.autocast("cpu", torch.float16):
            want = native(x)
    else:
        dtype = torch.float16 if policy == "16-true" else torch.bfloat16
        want = native.to(dtype)(x.to(dtype))
    prec = Precision(policy)
    model, _ = prec.setup(model)
    with prec.autocast():
        got = model(x).float()
    want = want.float()
    assert torch.equal(got, want), f"{(got == want).float().mean():.4f} equal"


class _InPlaceAfter(nn.Module):
    """y = x * w1, optionally read first by z = y * 3, then ``op`` writes y in place."""

    def __init__(self, op, earlier: bool):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 24, generator=torch.Generator().manual_seed(2))
                               .half().float())
        self.op, self.earlier = op, earlier

    def forward(self, x):
        y = x * self.w1
        z = y * 3 if self.earlier else 0
        self.op(y)
        return y + z


_IN_PLACE_READING_INPUT = {  # replayed ops whose 16-bit backward reads the input
    "log1p_": lambda y: y.abs_().log1p_(), "sin_": lambda y: y.sin_(),
    "cos_": lambda y: y.cos_(), "erf_": lambda y: y.erf_(), "atan_": lambda y: y.atan_(),
    "pow_(3)": lambda y: y.pow_(3)}


@pytest.mark.parametrize("earlier", [False, True], ids=["alone", "after a consumer"])
@pytest.mark.parametrize("policy", list(DTYPES))
@pytest.mark.parametrize("name", list(_IN_PLACE_READING_INPUT))
def test_in_place_ops_reading_their_input_have_their_replays_gradient(name, policy, earlier):
    # (before, differentiated in place by autograd's fp32 formula: w1's fp16 gradient 68-82%
    # equal native for log1p_, erf_, atan_, pow_(3); 93-95% for sin_, cos_ after a consumer)
    dtype, op = DTYPES[policy], _IN_PLACE_READING_INPUT[name]
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(3))
    native = _InPlaceAfter(op, earlier).to(dtype)
    yn = native(x.to(dtype))
    yn.float().sum().backward()
    model, _ = Precision(policy).setup(_InPlaceAfter(op, earlier))
    ye = model(x.to(dtype).float())
    ye.float().sum().backward()
    if not (name == "erf_" and dtype == torch.float16):  # (the vectorised fp16 erf: 1 ulp)
        assert torch.equal(ye.detach(), yn.detach().float())
    assert torch.equal(model.w1.grad.to(dtype), native.w1.grad)


def test_compiled_emulation_casts_a_0_dim_tensor_as_eager_does():
    # (Inductor folded the cast round trip of a constant 0-dim tensor into the literal 0.3:
    # 70% of y - tensor(0.3) and none of the comparison equal native before the opaque op)
    class Consts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _exact_linear()

        def forward(self, x):
            y = self.lin(x)
            return torch.stack([y - torch.tensor(0.3),
                                (y * 0 + 0.3 > torch.tensor(0.3)).to(y.dtype)]).float()

    torch.manual_seed(0)
    x, native = torch.randn(256, 64), Consts()
    prec = Precision("16-true", compile=True)
    model, _ = prec.setup(copy.deepcopy(native))
    with prec.autocast():
        got = model(x)
    assert torch.equal(got, native.half()(x.half()))


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("exponent", [3, -2, 1.7])
def test_pow__without_a_gradient_is_the_pow_kernels(exponent, policy):
    # (in place it was x ** e in fp32 rounded once: bf16's x ** 3 is (x * x) * x, each product
    # rounded, and 1.7 is read as bf16(1.7): 34-77% equal native before)
    dtype = torch.float16 if policy == "16-true" else torch.bfloat16
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(3))
    op = lambda y: y.abs_().add_(0.5).pow_(exponent)  # noqa: E731
    native = _InPlaceAfter(op, False).to(dtype)
    model, _ = Precision(policy).setup(_InPlaceAfter(op, False))
    with torch.no_grad():
        assert torch.equal(model(x.to(dtype).float()), native(x.to(dtype)).float())


class _Composite(nn.Module):
    """A linear layer, then an ATen composite op (its ops each 16-bit natively)."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin, self.kind = _exact_linear(), kind
        self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "cosine_similarity":
            return F.cosine_similarity(y, y.flip(0) * 0.5, dim=-1)
        if self.kind == "cosine_similarity_int":  # (an integer input: cast to y's dtype)
            return F.cosine_similarity(y, torch.arange(64).view(1, 64) % 7 - 3, dim=-1)
        if self.kind == "instance_norm":
            return self.norm(y.view(-1, 4, 16)).flatten(1)
        # +-inf: the dtype's largest values, defaulted by keyword and by a positional None
        return torch.stack([torch.nan_to_num(y / (y > 0), nan=0.25),
                            torch.nan_to_num(-y / (y > 0), 0.5, None)])


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("kind", ["cosine_similarity", "cosine_similarity_int", "instance_norm",
                                  "nan_to_num"])
def test_composite_ops_run_op_by_op_as_natively(kind, policy):
    # (before, one fp32 op rounded once: cosine_similarity 52% of fp16 outputs equal native,
    # 25% of the weight gradient (63% with the composite, before the 2-norm's backward was
    # replayed); instance_norm 65%, its weight gradient 0%; nan_to_num replaced -inf by fp32's
    # lowest, which rounds to -inf: 49%)
    r = _run_both(lambda: _Composite(kind), policy)
    dtype, native, model = r["dtype"], r["native"], r["model"]
    pairs = [(r["got"].detach(), r["want"].detach().float())]
    if kind != "nan_to_num":
        pairs.append((r["xe"].grad, r["xn"].grad.float()))
    for got, want in pairs:
        # the composites' reductions (the norm's sum of squares, the row sum, the batch-norm
        # kernel's statistics) sum in the 16-bit kernels' own order: at times one unit of
        # the largest value off where terms cancel (fp16, over 60 seeds: at least 99.2% of
        # outputs and input gradients equal, one unit at most; bf16 all but 1 in 10,000)
        assert (got == want).float().mean() >= 0.98
        assert scale_distance(got, want, dtype) <= 1
    for name, buf in native.named_buffers():
        if buf.is_floating_point():
            assert torch.equal(dict(model.named_buffers())[name].to(dtype), buf), name


def test_compiled_instance_norm_updates_its_running_statistics():
    # (the composite's batch norm, traced, did not write the repeated statistics it was
    # given: compiled, the running statistics stayed at their initial values, 0 and 1. Traced,
    # instance_norm runs whole: fp32 statistics rounded once, one unit from the composite's
    # 16-bit mean of the examples' at times)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = _exact_linear()
            self.norm = nn.InstanceNorm1d(4, affine=True, track_running_stats=True)

        def forward(self, x):
            return self.norm(self.lin(x).view(-1, 4, 16)).flatten(1)

    torch.manual_seed(0)
    x, native = torch.randn(32, 64), Net()
    prec = Precision("16-true", compile=True)
    model, _ = prec.setup(copy.deepcopy(native))
    model(x)
    native.half()(x.half())
    for name in ("running_mean", "running_var"):
        got, want = getattr(model.norm, name), getattr(native.norm, name)
        assert ulp_distance(got, want.float(), torch.float16) <= 1, name


def _run_both(make, policy: str) -> dict:
    """The module ``make()`` builds, natively in the policy's 16-bit dtype and emulated, on one
    input that takes a gradient, then backward from one random output gradient (fixed
    seeds)."""
    dtype = torch.float16 if policy == "16-true" else torch.bfloat16
    torch.manual_seed(0)
    module = make()
    x = torch.randn(256, 64).to(dtype)
    model, _ = Precision(policy).setup(copy.deepcopy(module))
    native = module.to(dtype)
    xn, xe = x.clone().requires_grad_(), x.float().requires_grad_()
    want, got = native(xn), model(xe)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want.backward(g)
    got.backward(g.float())
    return dict(dtype=dtype, native=native, model=model, want=want, got=got, xn=xn, xe=xe)


def _matches_native_after_a_linear(op, policy) -> None:
    """The output and the input's gradient of ``op`` after an exact linear layer (the
    gradient reaching the layer's output, through the identity), bit-exact with the native
    16-bit run."""
    r = _run_both(lambda: _AfterLinear(op), policy)
    assert torch.equal(r["got"], r["want"].float())
    assert torch.equal(r["xe"].grad, r["xn"].grad.float())


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("eps", [None, 1e-3, 0.05])
def test_logit_is_the_16_bit_kernels(eps, policy):
    # (the 16-bit logit computes log(x / (1 - x)) and its backward grad / (x * (1 - x)) each
    # op rounded; one fp32 op rounded once gave 35% of fp16 outputs equal native, 71% of the
    # input gradient)
    _matches_native_after_a_linear(
        lambda y: torch.logit(torch.sigmoid(y).clamp(0.01, 0.99), eps), policy)


_XLOGY = {
    # (x = 0 at about half the elements)
    "xlogy": lambda y: torch.xlogy(torch.relu(y), y.flip(0).abs() + 0.5),
    "special.xlogy": lambda y: torch.special.xlogy(torch.relu(y), y.flip(0).abs() + 0.5),
    # a number operand: cast to the 16-bit dtype, then the same kernel; a number x's gradient
    # formula (grad * x / y) reads it as given (before: one fp32 op rounded once, 84% of fp16
    # outputs equal native with y, 68% with x)
    "xlogy(y, 0.3)": lambda y: torch.xlogy(torch.relu(y), 0.3),
    "xlogy(0.3, y)": lambda y: torch.xlogy(0.3, y.abs() + 0.5),
    "xlogy(y, tensor(0.3))": lambda y: torch.xlogy(torch.relu(y), torch.tensor(0.3)),
    "xlogy_(0.3)": lambda y: (torch.relu(y) + 0).xlogy_(0.3),
    # (review: a float64 0-dim y raised; a 0-dim x's gradient formula reads it uncast)
    "xlogy(y, float64 tensor)": lambda y: torch.xlogy(torch.relu(y),
                                                      torch.tensor(0.3, dtype=torch.float64)),
    "xlogy(tensor(0.3), y)": lambda y: torch.xlogy(torch.tensor(0.3), y.abs() + 0.5),
}


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("name", list(_XLOGY))
def test_xlogy_is_the_16_bit_kernels(name, policy):
    # (x * log(y): the log and the product each rounded; backward grad * xlogy(x != 0, y) and
    # grad * x / y, each op rounded; one fp32 op rounded once: 74% of fp16 outputs equal
    # native, 43% of the weight gradient)
    _matches_native_after_a_linear(_XLOGY[name], policy)


@pytest.mark.parametrize("policy", ["fixed16-rn", "e4m3fn"])
def test_the_16_bit_kernels_replays_leave_other_formats_one_rounding(policy):
    # (logit's replay rounds x / (1 - x) to the format: q6.10 clipped it at 32, logit(0.999)
    # 3.47 for 6.91; e4m3 rounded 1 - eps to 1: NaN)
    x = torch.tensor([0.999, 0.5, 0.01, 0.0005])
    with emulated(policy):
        y = torch.logit(x, 1e-3)
    assert torch.isfinite(y).all()
    assert (y - torch.logit(x, 1e-3)).abs().max() < 0.5


def test_instance_norm_without_input_statistics_needs_running_ones():
    with pytest.raises(RuntimeError, match="running_mean and running_var"):
        with emulated("16-true"):
            F.instance_norm(torch.randn(2, 3, 4), use_input_stats=False)


_TARGETS = torch.arange(256) % 64
_IGNORED = torch.where(torch.arange(256) % 7 == 0, -100, _TARGETS)
_PROBS = torch.softmax(torch.randn(256, 64, generator=torch.Generator().manual_seed(5)), 1)
# F.cross_entropy as ATen's composite computes it in 16 bits (log_softmax, nll_loss's reduction
# in the input's dtype, the smoothing term): before, one fp32 op rounded once, with 50% (fp16)
# and 22% (bf16) of the input gradient equal native and the mean one unit off; a smoothed
# fp16 loss over a batch of 256 is inf natively (its smoothing sum overflows) and was 4.66
_CROSS_ENTROPY = {  # (op, every input gradient equal native; else >= 99.9%)
    "mean": (lambda y: F.cross_entropy(y, _TARGETS).expand(2), True),
    "sum": (lambda y: F.cross_entropy(y, _TARGETS, reduction="sum").expand(2), True),
    "none": (lambda y: F.cross_entropy(y, _TARGETS, reduction="none"), True),
    "1-d": (lambda y: F.cross_entropy(y[0], _TARGETS[3]).expand(2), True),
    "nll_loss": (lambda y: F.nll_loss(F.log_softmax(y, 1), _TARGETS).expand(2), True),
    "smoothing": (lambda y: F.cross_entropy(y[:64], _TARGETS[:64], label_smoothing=0.1)
                  .expand(2), False),
    "smoothing, batch 256": (lambda y: F.cross_entropy(y, _TARGETS, label_smoothing=0.1)
                             .expand(2), False),
    "smoothing, none": (lambda y: F.cross_entropy(y, _TARGETS, label_smoothing=0.2,
                                                  reduction="none"), False),
    "smoothing, ignored": (lambda y: F.cross_entropy(y[:64], _IGNORED[:64],
                                                     label_smoothing=0.1).expand(2), True),
    "CrossEntropyLoss": (lambda y: nn.CrossEntropyLoss(label_smoothing=0.05)(y[:32], _TARGETS[:32])
                         .expand(2), True),
    "16-bit class probabilities": (None, False),  # (the targets in the policy's dtype)
    # (review: the swapped-in value reported float32, so fp32 arithmetic after it was rounded;
    # -inf at a target gave inf - inf = NaN; uint8 targets raised in the value's gather)
    "mean, then .float() * 3.3": (lambda y: (F.cross_entropy(y, _TARGETS).float() * 3.3)
                                  .expand(2), False),
    "-inf at a target": (lambda y: F.cross_entropy(
        y.masked_fill((torch.arange(64) == 5) & (_TARGETS.view(-1, 1) == 5), float("-inf")),
        _TARGETS).expand(2), True),
    "uint8 targets": (lambda y: F.cross_entropy(y, _TARGETS.to(torch.uint8)).expand(2), True),
}


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("name", list(_CROSS_ENTROPY))
def test_cross_entropy_is_the_16_bit_composite(name, policy):
    op, exact_grad = _CROSS_ENTROPY[name]
    if name == "16-bit class probabilities":
        dtype = torch.float16 if policy == "16-true" else torch.bfloat16
        probs = _PROBS.to(dtype)
        op = lambda y: F.cross_entropy(y, probs).expand(2)  # noqa: E731
    r = _run_both(lambda: _AfterLinear(op), policy)
    got, want = r["got"], r["want"].float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()]), (got.flatten()[:2], want.flatten()[:2])
    same = (r["xe"].grad == r["xn"].grad.float()).float().mean().item()
    assert same == 1.0 if exact_grad else same >= 0.999, same


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_cascade_is_nll_loss_s_16_bit_reduction(dtype):
    # (its sum in the input's dtype, eight levels carried up every 16 terms: a float32 sum
    # rounded once was one or two units off at batch 256)
    from lowprec.training.emulation.composites import _cascade_sum, _round16
    for n in (1, 2, 16, 17, 33, 100, 256, 1000, 4096):
        g = torch.Generator().manual_seed(n)
        logp = F.log_softmax((torch.randn(n, 64, generator=g) * 3).to(dtype), 1)
        target = torch.randint(0, 64, (n,), generator=g)
        total = _cascade_sum(logp.float().gather(1, target.view(-1, 1)).view(-1).numpy(), dtype)
        assert float(total) == F.nll_loss(logp, target, reduction="sum").float().item(), n
        mean = _round16(np.array([total], np.float32) / _round16(np.array([n], np.float32),
                                                                  dtype), dtype)[0]
        assert float(mean) == F.nll_loss(logp, target).float().item(), n


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("kw", [dict(scale_factor=1.5), dict(scale_factor=0.75), dict(size=100),
                                dict(size=100, align_corners=True),
                                dict(scale_factor=3.0, align_corners=True)],
                         ids=["x1.5", "x0.75", "size", "size-align", "x3-align"])
def test_linear_interpolation_weights_are_16_bit(kw, policy):
    # (the 16-bit kernel holds lambda1 and 1 - lambda1 in its dtype; one fp32 op rounded
    # once: 73% of fp16 outputs equal native at scale 1.5)
    _matches_native_after_a_linear(
        lambda y: F.interpolate(y.unsqueeze(1), mode="linear", **kw).squeeze(1), policy)


def test_the_loss_reports_the_16_bit_dtype_and_cuda_s_value_for_cuda():
    # (the value swapped in keeps the loss's grid: it reports float16 as natively; target
    # "cuda": CUDA's nll_loss sums in float32 and rounds once, the engine's value, not the CPU
    # kernel's 16-bit cascade)
    torch.manual_seed(0)
    y = torch.randn(256, 64).half().float()
    with emulated("16-true"):
        loss = F.cross_entropy(y, _TARGETS)
        assert loss.dtype == torch.float16
    assert loss.item() == F.cross_entropy(y.half(), _TARGETS).float().item()
    with emulated("16-true", target="cuda"):
        cuda = F.cross_entropy(y, _TARGETS)
    once = F.nll_loss(F.log_softmax(y.half(), 1).float(), _TARGETS).half().float().item()
    assert cuda.item() == once


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
def test_div_of_a_number_by_a_16_bit_tensor_runs(policy):
    # (review: the number-first form reached xlogy's operand rule and raised AttributeError;
    # its gradient stays one rounding of the fp32 formula)
    r = _run_both(lambda: _AfterLinear(lambda y: torch.div(2.0, y.abs() + 0.5)), policy)
    assert torch.equal(r["got"], r["want"].float())


_INF_ROWS = (torch.arange(64) == 5) & (torch.arange(256).view(-1, 1) % 3 == 0)


@pytest.mark.parametrize("policy", ["16-true", BF16_EMULATED], ids=["16-true", "bf16-emulated"])
@pytest.mark.parametrize("name", ["log_softmax", "cross_entropy none"])
def test_a_row_holding_inf_is_nan_as_natively(name, policy):
    # (the log_softmax replay replaced an infinite row max by 0: the +inf element NaN, the
    # others -inf, and finite gradients where native's are NaN: review)
    op = {"log_softmax": lambda y: F.log_softmax(y.masked_fill(_INF_ROWS, float("inf")), 1),
          "cross_entropy none": lambda y: F.cross_entropy(
              y.masked_fill(_INF_ROWS, float("inf")), _TARGETS, reduction="none")}[name]
    r = _run_both(lambda: _AfterLinear(op), policy)
    got, want = r["got"], r["want"].float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    got, want = r["xe"].grad, r["xn"].grad.float()
    assert torch.equal(got.isnan(), want.isnan())
    # (the finite rows: the backward's fp32 row sum in another order, 1 of 16384 at times)
    assert (got[~got.isnan()] == want[~want.isnan()]).float().mean() >= 0.999
