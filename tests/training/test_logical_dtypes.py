"""Model code under emulated 16-bit sees what ``model.half()`` gives it (issue 18).

References: torch's own fp16/bf16 dtypes and kernels (``copy.deepcopy(model).half()``), and
Hugging Face ``transformers`` model definitions (tiny configs, random weights).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from lowprec import Precision
from lowprec.training.policy import Backend, parse_policy

DTYPES = {"16-true": torch.float16, "bf16-true": torch.bfloat16}


def _emulated(policy: str):
    return dataclasses.replace(parse_policy(policy), backend=Backend.EMULATED)


class HFRMSNorm(nn.Module):
    """RMSNorm as Hugging Face writes it (LlamaRMSNorm): an fp32 island, one rounding."""

    def __init__(self, n=256):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.5 + 1)
        self.eps = 1e-6

    def forward(self, h):
        input_dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


class Seen(nn.Module):
    """Records what model code sees, and takes a dtype branch as T5 does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.seen = {}

    def forward(self, x):
        h = self.lin(x)
        s = self.seen
        s["h"] = h.dtype
        s["weight"] = self.lin.weight.dtype
        s["buffer"] = self.scale.dtype
        s["element_size"] = h.element_size()
        s["float"] = h.float().dtype
        s["to32"] = h.to(torch.float32).dtype
        s["island_op"] = (h.float() * 2).dtype
        s["back"] = h.float().to(h.dtype).dtype
        s["type_as"] = h.float().type_as(h).dtype
        s["zeros_dtype"] = torch.zeros(3, dtype=h.dtype).dtype
        s["ones_default"] = torch.ones(3).dtype
        s["promoted"] = (h + torch.ones(8)).dtype
        s["scalar_0dim"] = (h * torch.tensor(2.0)).dtype
        s["softmax32"] = torch.softmax(h, -1, dtype=torch.float32).dtype
        s["finfo_max"] = torch.finfo(h.dtype).max
        s["type"] = h.type()
        if h.dtype == torch.float16:  # T5's fp16 branch
            h = torch.clamp(h, min=-1.0, max=1.0)
            s["branch"] = "fp16"
        else:
            s["branch"] = "other"
        return h * self.scale


@pytest.mark.parametrize("policy", ["16-true", "bf16-true"])
def test_model_code_sees_the_native_dtypes(policy):
    dt = DTYPES[policy]
    torch.manual_seed(0)
    model = Seen()
    x = torch.randn(4, 8)
    native = copy.deepcopy(model).to(dt)
    native(x.to(dt))
    emu, _ = Precision(_emulated(policy)).setup(copy.deepcopy(model))
    emu(x)
    assert emu.seen == native.seen
    assert emu.seen["h"] == dt and emu.seen["float"] == torch.float32


@pytest.mark.parametrize("policy", ["16-true", "bf16-true"])
def test_real_16_bit_inputs_are_taken_as_model_half_takes_them(policy):
    """``model(x.half())``, the call a model.half() run makes: the emulated model takes it (it
    raised a dtype mismatch in the first matmul), sees the dtypes native code sees, gives the
    bits of the same values passed in fp32, and the input's gradient in its own dtype, with
    native fp16's bits on this RMSNorm."""
    dt = DTYPES[policy]
    torch.manual_seed(0)
    model = Seen()
    x = torch.randn(4, 8).to(dt)
    native = copy.deepcopy(model).to(dt)
    native(x)
    emu, _ = Precision(_emulated(policy)).setup(copy.deepcopy(model))
    xh, xf = x.clone().requires_grad_(), x.float().requires_grad_()
    out = emu(xh)
    assert emu.seen == native.seen
    assert torch.equal(out, emu(xf))
    out.sum().backward()
    emu(xf).sum().backward()
    assert xh.grad.dtype == dt and torch.equal(xh.grad, xf.grad.to(dt))
    norm = HFRMSNorm()
    with torch.no_grad():
        norm.weight.copy_(norm.weight.to(dt).float())
    h = torch.randn(8, 256).to(dt)
    xn, xe = h.clone().requires_grad_(), h.clone().requires_grad_()
    copy.deepcopy(norm).to(dt)(xn).sum().backward()
    got = Precision(_emulated(policy)).setup(copy.deepcopy(norm))[0](xe)
    got.sum().backward()
    assert torch.equal(got.detach().to(dt), copy.deepcopy(norm).to(dt)(h))
    assert torch.equal(xe.grad, xn.grad)


def test_an_upcast_island_rounds_once_bit_exact_with_native():
    """The Hugging Face RMSNorm: forward and both gradients bit-exact with native fp16 (the
    engine rounding each step of the island gave 70% equal elements)."""
    torch.manual_seed(0)
    model = HFRMSNorm()
    with torch.no_grad():
        model.weight.copy_(model.weight.half().float())
    x = torch.randn(8, 256).half()
    g = torch.randn(8, 256).half()
    nat = copy.deepcopy(model).half()
    xn = x.clone().requires_grad_()
    nat(xn).backward(g)
    emu, _ = Precision("16-true").setup(copy.deepcopy(model))
    xe = x.float().requires_grad_()
    out = emu(xe)
    out.backward(g.float())
    assert torch.equal(out.detach().half(), nat(x).detach())
    assert torch.equal(emu.weight.grad.half(), nat.weight.grad)
    assert torch.equal(xe.grad.half(), xn.grad)


def test_mixed_policy_islands_stay_fp32():
    """Under emulated 16-mixed, ``.float()`` of an autocast output opens an island: the ops that
    follow on it are not rounded to fp16 (autocast leaves promote ops on fp32 inputs alone)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    prec = Precision(_emulated("16-mixed"))
    model, _ = prec.setup(nn.Sequential(lin))
    x = torch.randn(4, 16)
    seen = []
    prec.emulation.observers.append(lambda name, mod, a, k, out: seen.append((name, out)))
    with prec.autocast():
        y = model(x)
    with prec.autocast(), prec.emulation.enabled():
        z = y.float() * 1.0009765625
    assert torch.equal(y, y.half().float())  # the linear's output: fp16
    assert not torch.equal(z, z.half().float())  # the island's product: fp32


def test_uninitialised_buffers_are_neither_rounded_nor_reported():
    """``x.new_empty(shape).bernoulli_(p)`` (timm's DropPath): the mask is what bernoulli_
    wrote, and nothing reads the uninitialised values."""
    torch.manual_seed(0)

    class DropPath(nn.Module):
        def forward(self, x):
            keep = x.new_empty((x.shape[0], 1)).bernoulli_(0.5)
            return x * keep / 0.5

    model, _ = Precision("16-true").setup(DropPath())
    out = model(torch.randn(64, 8))
    assert torch.isfinite(out).all()
    assert set(torch.unique(out[:, :1] == 0).tolist()) <= {True, False}


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _hf_t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


class Logits(nn.Module):
    def __init__(self, m, t5=False):
        super().__init__()
        self.m, self.t5 = m, t5

    def forward(self, ids):
        if self.t5:
            return self.m(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
        return self.m(input_ids=ids).logits


def test_t5_takes_its_fp16_branch_under_emulation():
    model = Logits(_hf_t5(), t5=True)
    calls = []
    import transformers.models.t5.modeling_t5 as t5mod

    orig = t5mod.torch.clamp

    class Spy:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def clamp(*a, **k):
            calls.append(1)
            return orig(*a, **k)

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    t5mod.torch, saved = Spy(), t5mod.torch
    try:
        copy.deepcopy(model).half()(ids)
        native = len(calls)
        calls.clear()
        Precision("16-true").setup(copy.deepcopy(model))[0](ids)
        emulated = len(calls)
        calls.clear()
        copy.deepcopy(model)(ids)
        fp32 = len(calls)
    finally:
        t5mod.torch = saved
    assert native > 0 and emulated == native and fp32 == 0


def test_llama_follows_native_fp16():
    """A Llama decoder (RMSNorm islands, rotary embeddings, grouped-query SDPA): emulated logits
    much closer to native fp16 than fp32's (measured 0.13x; 0.94x before logical dtypes and
    grouped heads), gradients 0.46x (batches 2 and 3: 0.41, 0.54; 0.61x before the flash
    attention backward, the consumers' 16-bit sums and the elementwise backward replays;
    1.28x before logical dtypes), as far from float64 as native. What remains is fp16
    linear's summation order: with ``match_cpu_kernels=True`` (next test), 0.0 and 0.001."""
    from tests.training.test_fidelity import _x, fidelity

    res = fidelity(Logits(_hf_llama()), _x(4, 16, ints=128))
    assert res["forward"][0] <= 0.25 and res["grads"][0] <= 0.5, res
    for part in res.values():
        assert 0.9 <= part[1] <= 1.1, res


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("model", ["llama", "t5"])
def test_hf_models_match_native_fp16_with_cpu_kernels(model, batch):
    """``Precision("16-true", match_cpu_kernels=True)``: matrix products by this CPU's own
    16-bit kernels (training/emulation/native_gemm.py), everything else emulated. Measured on
    three batches: Llama forward 0.0, gradients 0.001 / 0.0 / 0.0; T5 forward 0.0, gradients
    0.012 / 0.020 / 0.035 (default engine: 0.90 / 0.74 / 0.95 and 1.03 / 2.9 / 0.28): the
    attention backward (flash and math paths), the consumers' and tied weights' 16-bit sums,
    T5's fp16 islands and clamps follow native; errors vs float64 1.00."""
    from tests.training.test_fidelity import fidelity

    make, length = (lambda: Logits(_hf_llama()), 16) if model == "llama" else \
        (lambda: Logits(_hf_t5(), t5=True), 12)
    x = torch.randint(0, 128, (4, length), generator=torch.Generator().manual_seed(batch))
    torch.manual_seed(0)
    res = fidelity(make(), x, match_cpu_kernels=True)
    assert res["forward"][0] <= 0.01 and res["grads"][0] <= 0.1, res
    for part in res.values():
        assert 0.98 <= part[1] <= 1.02, res


def test_t5_is_as_far_from_float64_as_native_fp16():
    """T5 (encoder-decoder, relative position bias through SDPA's math path, tied
    embeddings, no attention scaling): one-unit differences of fp16 linear's summation order
    grow through its layers to fp16's own scale, so emulated and native fp16 are about as far
    apart as fp32 and native (measured forward 0.90, gradients 1.03; batches 2 and 3: 0.74 /
    2.9 and 0.95 / 0.28, the gradients swinging with which ReLU gates flip). What emulation
    promises holds: as far from float64 as native (measured 0.97 forward, 1.06 gradients on
    an AVX2 EPYC; 0.90 / 1.33 from native and 1.01 / 1.18 from float64 on an AVX512-BF16 EPYC,
    whose kernels sum in other orders). With this CPU's GEMM kernels (``match_cpu_kernels=True``,
    previous test) the rest is bit-exact forward and the gradients 0.012-0.035 of fp32's
    distance."""
    from tests.training.test_fidelity import _x, fidelity

    res = fidelity(Logits(_hf_t5(), t5=True), _x(4, 12, ints=128))
    assert res["forward"][0] <= 1.0 and res["grads"][0] <= 1.5, res
    assert 0.9 <= res["forward"][1] <= 1.1, res
    assert 0.8 <= res["grads"][1] <= 1.25, res


def test_linear_on_a_non_contiguous_3d_input_rounds_twice_as_aten_does():
    """nn.MultiheadAttention(batch_first=True) hands F.linear a transposed 3-D input; aten runs
    matmul then add there (two fp16 roundings): bit-exact with native fp16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 16, generator=g).half().transpose(0, 1)
    w = torch.randn(24, 16, generator=g).half()
    b = torch.randn(24, generator=g).half()
    native = torch.nn.functional.linear(x, w, b)
    from lowprec.training.emulation import emulated

    x32, w32, b32 = x.float(), w.float(), b.float()  # fp32 carriers of fp16 values
    with emulated("16-true"):
        out = torch.nn.functional.linear(x32, w32, b32)
    assert torch.equal(out.half(), native)


class MHA(nn.Module):
    """nn.MultiheadAttention(batch_first=True): F.linear on a transposed 3-D input, SDPA
    called positionally."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x, need_weights=False)[0]


def test_multihead_attention_batch_first_follows_native_fp16():
    """nn.MultiheadAttention(batch_first=True): the split linear's two roundings, the flash
    kernel forward and backward (kernels._FlashAttention). Measured forward 2e-5, gradients
    0.002 (0.61 before the attention backward: in_proj_weight 0.86, in_proj_bias 0.51)."""
    from tests.training.test_fidelity import fidelity

    torch.manual_seed(0)
    x = torch.randn(4, 10, 32, generator=torch.Generator().manual_seed(1)).half().float()
    res = fidelity(MHA(), x)
    assert res["forward"][0] <= 0.05 and res["grads"][0] <= 0.05, res
    for part in res.values():
        assert 0.9 <= part[1] <= 1.1, res
