"""The operator-level emulation engine: what it rounds, where, and what it leaves alone.

References: torch's own fp16/bf16 casts and kernels (``model.half()`` on this CPU), float64.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings, strategies as st
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lowprec import Precision, Quantizer
from lowprec.analysis import first_nonfinite
from lowprec.numerics.ops import quantize_op
from lowprec.training.emulation import emulated

from helpers import assert_same_bits


def on_grid(t, dtype=torch.float16) -> bool:
    return torch.equal(t, t.to(dtype).float())


class Seen(TorchFunctionMode):
    """Entered before the model runs, so below the engine's mode: records the arguments each
    op receives after the engine rounded them."""

    def __init__(self, names):
        super().__init__()
        self.names, self.args = names, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.names:
            self.args.setdefault(name, []).append(args)
        return func(*args, **(kwargs or {}))


def test_inplace_relu_and_residual_add_in_place_train_and_stay_on_the_grid(device):
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.relu = nn.Linear(8, 8), nn.ReLU(inplace=True)

        def forward(self, x):  # as torchvision's BasicBlock: in-place add, then in-place ReLU
            out = self.l(x)
            out += x * 0.3
            return self.relu(out)

    torch.manual_seed(0)
    model, _ = Precision("p=fp16,c=fp16,g=fp16,o=fp16,b=emulated").setup(
        nn.Sequential(Res(), nn.Linear(8, 2)).to(device))
    x = torch.randn(4, 8).to(device)
    out = model[0](x)
    assert on_grid(out) and on_grid(model(x))
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_residual_add_overflows_to_inf_where_native_fp16_does_and_first_nonfinite_names_it():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x) + x * 30000  # 60000 + l(x): beyond fp16's 65504 when l(x) > 5504

    torch.manual_seed(0)
    model = Res()
    with torch.no_grad():
        model.l.weight.fill_(2000.0)
        model.l.bias.zero_()
    x = torch.full((2, 4), 2.0)
    native = copy.deepcopy(model).half()(x.half()).float()
    emu, _ = Precision("16-true").setup(copy.deepcopy(model))
    out = emu(x)
    assert torch.isinf(native).all()  # l(x) = 16000, 60000 + 16000 -> Inf in fp16
    assert_same_bits(out, native, "emulated vs native fp16")
    rep = first_nonfinite(model, (x, torch.tensor([0, 1])), F.cross_entropy, "16-true")
    assert rep.forward is not None and (rep.forward.name, rep.forward.kind) == ("", "add")
    assert rep.forward.input_range["inf"] == 0 and rep.forward.output_range["inf"] == 8
    assert first_nonfinite(model, (x, torch.tensor([0, 1])), F.cross_entropy, "32-true").clean
    # below the overflow: 60000 exactly, as native, not fp32's 60000 + l(x)
    with torch.no_grad():
        model.l.weight.fill_(1e-4)
    emu, _ = Precision("16-true").setup(copy.deepcopy(model))
    assert_same_bits(emu(x), copy.deepcopy(model).half()(x.half()).float())


def test_batchnorm_running_statistics_are_held_in_fp16_under_16_true():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with torch.no_grad():
        net[1].running_var.fill_(1.1)
    model, _ = Precision("16-true").setup(copy.deepcopy(net))
    assert on_grid(model[1].running_var)
    model(torch.randn(2, 3, 6, 6))
    assert on_grid(model[1].running_mean) and on_grid(model[1].running_var)
    assert model[1].num_batches_tracked.dtype == torch.int64


def test_integer_tensors_are_untouched_and_keyword_and_dict_inputs_are_rounded():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, *, extra, more):
            return self.emb(ids) + extra + more["x"], ids

    torch.manual_seed(0)
    model, _ = Precision("16-true").setup(Net())
    seen = Seen({"add"})
    ids = torch.randint(0, 10, (3,))
    with seen:
        out, ids_out = model(ids, extra=torch.randn(3, 4), more={"x": torch.randn(3, 4)})
    assert ids_out is ids
    assert all(on_grid(a) for args in seen.args["add"] for a in args if torch.is_tensor(a))
    assert on_grid(out)


def test_mixed_policy_rounds_what_autocast_casts_lstm_addmm_and_the_attention_projection():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(6, 8)
            self.w = nn.Parameter(torch.randn(8, 8))  # GPT-2's Conv1D: an addmm
            self.b = nn.Parameter(torch.randn(8))
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x):
            h, _ = self.lstm(x)
            h = torch.addmm(self.b, h.reshape(-1, 8), self.w).reshape(h.shape)
            a, _ = self.attn(h, h, h, need_weights=False)
            return F.softmax(a, -1)

    prec = Precision("16-mixed")
    model, _ = prec.setup(Net())
    seen = Seen({"lstm", "addmm", "linear", "softmax"})
    x = torch.randn(5, 2, 6)
    with prec.autocast(), seen:
        out = model(x)
    for name in ("lstm", "addmm", "linear"):
        tensors = [t for args in seen.args[name] for a in args
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if torch.is_tensor(a)
                   or isinstance(a, (list, tuple))]
        tensors = [t for t in tensors if torch.is_tensor(t) and t.is_floating_point()]
        assert tensors and all(on_grid(t) for t in tensors), name
    # softmax is on autocast's fp32 list: its output is fp32, off the fp16 grid
    assert not on_grid(out)
    with seen:  # outside autocast a mixed policy rounds nothing
        seen.args.clear()
        model(x)
    assert not all(on_grid(t) for args in seen.args["addmm"] for t in args)


@pytest.mark.parametrize("layer", [
    lambda: nn.LSTM(4, 6),
    lambda: nn.GRU(4, 6, num_layers=2, dropout=0.2, bidirectional=True),
    lambda: nn.RNN(4, 6, nonlinearity="relu")], ids=["lstm", "gru-2-layers-bidirectional", "rnn"])
def test_packed_sequences_run_under_every_scope_all_policy(layer):
    """The recurrent replay (emulation/recurrent_kernels.py) under formats with no 16-bit
    kernel to follow: fixed point, dynamic fixed point, stochastic rounding."""
    torch.manual_seed(0)
    for policy in ("16-true", "p=bf16,b=emulated", "fixed16-rn", "dfxp-10-12",
                   "p=fp16,c=fp16:sr,g=fp16:sr,b=emulated"):
        model, _ = Precision(policy, seed=0).setup(layer())
        packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 4), [5, 3])
        out, _ = model(packed)
        assert isinstance(out, nn.utils.rnn.PackedSequence)
        assert torch.isfinite(out.data).all()
        out.data.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in model.parameters()), policy


def test_per_module_overrides_keep_norms_in_fp32_and_the_head_in_bf16():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("proj", nn.Linear(8, 8))
    net.add_module("norm", nn.LayerNorm(8))
    net.add_module("lm_head", nn.Linear(8, 5))
    with torch.no_grad():
        net.norm.weight.uniform_(0.5, 1.5)
    prec = Precision("16-true", overrides={"*norm*": "32-true", "lm_head": "bf16"})
    model, _ = prec.setup(copy.deepcopy(net))
    assert prec.backend == "emulated"
    assert on_grid(model.proj.weight) and on_grid(model.lm_head.weight, torch.bfloat16)
    assert torch.equal(model.norm.weight, net.norm.weight)  # fp32 norm weights: not rounded
    assert not on_grid(model.norm.weight)
    outs = {}
    for name in ("proj", "norm", "lm_head"):
        getattr(model, name).register_forward_hook(lambda m, a, o, n=name: outs.update({n: o}))
    model(torch.randn(3, 8))
    assert on_grid(outs["proj"])
    assert not on_grid(outs["norm"]) and not on_grid(outs["norm"], torch.bfloat16)
    assert on_grid(outs["lm_head"], torch.bfloat16)  # (bf16 values in range are fp16 values too)
    with pytest.raises(ValueError, match="neither a policy"):
        Precision("16-true", overrides={"x": "fp99"}).setup(copy.deepcopy(net))


def test_views_are_not_copied_and_selection_ops_are_not_rounded():
    x = torch.randn(4, 6).half().float()
    with emulated("16-true"):
        v = x.view(6, 4)
        t = x.t()
        r = F.relu(x)
    assert v.data_ptr() == x.data_ptr() and t.data_ptr() == x.data_ptr()
    assert torch.equal(r, F.relu(x))


def test_stochastic_rounding_follows_the_generator(device):
    torch.manual_seed(0)
    outs = []
    for _ in range(2):
        model, _ = Precision("p=fp32,c=e4m3fn:sr,g=e5m2:sr,s=all,b=emulated",
                             seed=7).setup(nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(device))
        with torch.no_grad():
            model[0].weight.fill_(0.1)
            model[0].bias.zero_()
        outs.append(model(torch.linspace(-1, 1, 64).reshape(8, 8).to(device)).cpu())
    assert torch.equal(outs[0], outs[1])


class _Twice(nn.Module):
    """One value rounded at two sites of one forward: ``x * c`` and ``c * x``."""

    def forward(self, x):
        c = 1.0 + 2**-11  # halfway between two fp16 values
        return torch.stack([x * c, c * x])


def test_a_forward_draws_one_base_pair_and_each_rounding_its_own_keys():
    """Stochastic rounding in a model's forward: one draw from the generator per forward, from
    which every rounding derives keys of its own (what compiled emulation derives in its graph):
    two sites rounding the same values round them independently, consecutive forwards differ,
    the same generator state gives the same bits, and the rounding stays unbiased, forward and
    backward."""
    x = torch.ones(4096)
    from lowprec.numerics.quantize import draw_seed

    prec = Precision("p=fp32,c=fp16:sr,g=fp16:sr,s=all,b=emulated", seed=3)
    model, _ = prec.setup(_Twice())
    state = prec.generator.get_state()
    y = model(x)
    one = torch.Generator()
    one.set_state(state)
    draw_seed(one)  # a forward of two roundings draws once
    assert torch.equal(prec.generator.get_state(), one.get_state())
    up = (y > 1).double()
    tol = 6 * 0.5 / 4096**0.5
    assert abs(up.mean().item() - 0.5) < tol
    assert abs((up[0] == up[1]).double().mean().item() - 0.5) < tol  # independent sites
    y2 = model(x)
    assert abs(((y2 > 1) == (y > 1)).double().mean().item() - 0.5) < tol  # the next forward
    prec.generator.set_state(state)
    assert_same_bits(model(x), y, "the same generator state")
    # backward: each gradient rounding unbiased, so the input's gradient is in expectation
    # the exact 2 * c * g, though its elements differ
    xg = x.clone().requires_grad_()
    g = 1.0 + 2**-11
    model(xg).backward(torch.full((2, 4096), g))
    assert xg.grad.unique().numel() > 1
    err = (xg.grad.double().mean() - 2 * g * g).abs().item()
    assert err < 6 * 2 * 2**-10 / 4096**0.5, err


@pytest.mark.parametrize("policy", ["16-true", "p=fp16,c=fp16:sr,g=fp16:sr,s=all,b=emulated",
                                    "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated", "q6.10",
                                    "p=fp16,c=fp16,g=mxfp8_e4m3,s=all,b=emulated"])
def test_a_gradient_its_one_consumer_rounded_is_not_rounded_again(policy, monkeypatch):
    """An op's output with one consumer gets that consumer's gradient rounded (_Consumed), then
    the same tensor reaches the output's own rounding node (_Round), where rounding it again to
    the same element format is the identity in any mode: skipped (the site's stochastic keys
    advancing as if not); so is _Consumed's rounding of what a replayed 16-bit kernel (layer
    norm, batch norm, tanh, sigmoid) rounded itself. The bits are those of rounding every time; fewer kernel calls; block
    formats (whose shared scale can move) round every time; formats with no torch dtype (fixed
    point) have no per-consumer rounding, but skip the output's after a replayed kernel's."""
    from lowprec.training.emulation import autograd_fns

    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16),
                             nn.BatchNorm1d(16), nn.Sigmoid(), nn.Linear(16, 4))

    _same_bits_fewer_roundings(monkeypatch, policy, net, (32, 8),
                               (autograd_fns, "rounded_already", lambda g, fmt: False))


@pytest.mark.parametrize("policy", ["16-true", "16-mixed", "fixed16-sr",
                                    "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated"])
def test_a_linear_on_3d_input_has_its_output_rounded_in_place(policy, monkeypatch):
    """F.linear on a 3-d input returns a view of its addmm output: that output is rounded in
    place and viewed again (owned_base), not copied; the bits of the copy, stochastic rounding's
    included (the same keys, the same element indices), with fewer copies and no more rounding
    passes in all (a review found the view's backward dropping a gradient's note, so that the
    rounding node behind it rounded an on-grid gradient again: 21 -> 27 passes on a BERT)."""
    from lowprec.training.emulation import autograd_fns, engine
    from lowprec.training.emulation.autograd_fns import owned

    def net():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))

    def run(copying: bool):
        calls = {"copy": 0, "in place": 0}
        with monkeypatch.context() as m:
            if copying:
                m.setattr(engine, "owned_base", lambda t: t if owned(t) else None)
            q, q_ = autograd_fns.quantize_keyed, autograd_fns.quantize_keyed_

            def copy(*a):
                calls["copy"] += 1
                return q(*a)

            def inplace(*a):
                calls["in place"] += 1
                return q_(*a)

            m.setattr(autograd_fns, "quantize_keyed", copy)
            m.setattr(autograd_fns, "quantize_keyed_", inplace)
            torch.manual_seed(0)
            got = _trained(policy, net(),
                           torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(2)))
        return got, calls

    viewed, n_view = run(False)
    copied, n_copy = run(True)
    for i, (u, v) in enumerate(zip(viewed, copied)):
        assert_same_bits(u, v, f"{policy}: tensor {i}")
    assert n_view["copy"] < n_copy["copy"], (n_view, n_copy)
    assert sum(n_view.values()) <= sum(n_copy.values()), (n_view, n_copy)


def _same_bits_fewer_roundings(monkeypatch, policy, build, shape, patch):
    """3 SGD steps of ``build()`` under ``policy``, as it is and with ``patch`` (module, name,
    value: a skip turned off): the same gradients and parameters bit for bit, and fewer kernel
    calls as it is (as many for block formats, never noted)."""
    from lowprec.training.emulation import autograd_fns

    def run(patched: bool):
        calls = []
        with monkeypatch.context() as m:
            if patched:
                m.setattr(*patch)
            q = autograd_fns.quantize_keyed
            m.setattr(autograd_fns, "quantize_keyed", lambda *a: calls.append(1) or q(*a))
            torch.manual_seed(0)
            got = _trained(policy, build(),
                           torch.randn(*shape, generator=torch.Generator().manual_seed(2)))
        return got, len(calls)

    skipped, n_skip = run(False)
    every, n_every = run(True)
    for i, (u, v) in enumerate(zip(skipped, every)):
        assert_same_bits(u, v, f"{policy}: tensor {i}")
    if "mxfp8" in policy:
        assert n_skip == n_every
    else:
        assert n_skip < n_every, (n_skip, n_every)


def _trained(policy, net, x) -> list:
    """The gradients of 3 SGD steps of ``net`` under ``policy`` on ``x`` (the loss the mean
    square of the output), then the parameters."""
    prec = Precision(policy, seed=1)
    model, opt = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    seen = []
    for _ in range(3):
        opt.zero_grad()
        with prec.autocast():
            loss = model(x).float().pow(2).mean()
        prec.backward(loss)
        seen += [p.grad.clone() for p in net.parameters()]
        prec.step(opt)
    return seen + [p.detach().clone() for p in net.parameters()]


class _MaskNet(nn.Module):
    """Convolution, batch norm and every elementwise mask the engine passes gradient notes
    through (ReLU in place, ReLU6, hardtanh, clamp), one of them feeding two consumers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = nn.functional.relu(self.bn(self.conv(x)), inplace=True)
        h = nn.functional.relu6(self.conv2(h) * 4) + h  # two consumers of h
        h = nn.functional.hardtanh(self.conv2(h), -1.0, 1.0).clamp(min=-0.5)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("policy", ["16-true", "p=fp16,c=fp16,g=fp16:sr",
                                    "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated", "q6.10-sr",
                                    "mxfp8_e4m3"])
def test_a_gradient_through_a_mask_keeps_its_note(policy, monkeypatch):
    """ReLU, ReLU6, hardtanh and clamp keep or zero each gradient value: a gradient noted on a
    grid gives an input gradient on it (the note passed by a node hook), whose rounding at the
    producer's output is skipped. Same bits as without the hook, over 3 steps; fewer kernel
    calls, except for block formats, which are never noted."""
    from lowprec.training.emulation import engine

    _same_bits_fewer_roundings(
        monkeypatch, policy, lambda: _MaskNet().to(memory_format=torch.channels_last),
        (8, 2, 6, 6), (engine, "pass_through", lambda out: None))


class _ThreeUses(nn.Module):
    """A tensor with three consumers (as a transformer's q, k and v projections read one) and a
    residual stream (two): the 16-bit sums autograd forms of their gradients."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.a, self.b, self.c = (nn.Conv2d(4, 4, 1) for _ in range(3))
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h = self.a(h) * self.b(h) + self.c(h) + h
        return self.head(h.flatten(1))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("policy", ["16-true", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated",
                                    "p=fp16,c=fp16,g=fp16:sr,s=all,b=emulated"])
def test_a_16_bit_sum_of_gradients_in_one_kernel_pass_gives_the_ops_bits(policy, layout,
                                                                          monkeypatch):
    """GradSum.add_raw: a later arrival at a 16-bit sum of gradients rounded, added, rounded
    and differenced in one kernel pass (lp_round_sum_delta) gives the bits of the torch ops
    it replaces (round_grad, then GradSum.add), over 3 SGD steps; stochastic rounding keeps
    the ops (its keys come from the sites)."""
    from lowprec.numerics import kernel
    from lowprec.training.emulation import autograd_fns

    if not kernel.available():
        pytest.skip("the compiled kernel is not built")

    def run(fused: bool):
        used = []
        with monkeypatch.context() as m:
            if fused:
                real = autograd_fns._kernel.round_sum_delta
                m.setattr(autograd_fns._kernel, "round_sum_delta",
                          lambda *a, **k: used.append(1) or real(*a, **k))
            else:
                m.setattr(autograd_fns.GradSum, "add_raw", lambda self, g, fmt, mode: None)
            torch.manual_seed(0)
            x = torch.randn(8, 2, 6, 6, generator=torch.Generator().manual_seed(2))
            got = _trained(policy, _ThreeUses().to(memory_format=layout),
                           x.to(memory_format=layout))
        return got, len(used)

    ops, _ = run(False)
    one_pass, n = run(True)
    for i, (u, v) in enumerate(zip(ops, one_pass)):
        assert_same_bits(u, v, f"{policy}: tensor {i}")
    assert (n > 0) == (":sr" not in policy), n


def test_a_gradient_changed_in_place_since_it_was_rounded_is_rounded_again():
    from lowprec.numerics.formats import FP16
    from lowprec.training.emulation.gradmarks import note_rounded as _note_rounded
    from lowprec.training.emulation.gradmarks import rounded_already as _rounded_already

    g = torch.tensor([1.0, 2.0])
    _note_rounded(g, FP16)
    assert _rounded_already(g, FP16)
    g.add_(1e-4)  # autograd accumulating into it in place: the version moves
    assert not _rounded_already(g, FP16)
    h = torch.tensor([1.0])
    _note_rounded(h, FP16)
    from lowprec.numerics.formats import BF16
    assert not _rounded_already(h, BF16)


def test_a_forward_failing_while_its_inputs_are_rounded_leaves_no_mode_behind(monkeypatch):
    """call_root (compiled emulation's trace and fallback) entered the engine's mode before
    rounding the inputs; a failure there left it entered, and every later op was rounded (seen
    on a GPU: a model built afterwards failed in its weights' initialisation)."""
    from lowprec.training.emulation import autograd_fns

    prec = Precision("p=fp16,c=fp16,g=fp16,o=fp16,b=emulated")
    model, _ = prec.setup(nn.Linear(3, 3))
    em = prec.emulation

    def fails(*args, **kwargs):
        raise RuntimeError("rounding failed")

    monkeypatch.setattr(autograd_fns, "quantize_keyed", fails)
    with pytest.raises(RuntimeError, match="rounding failed"):
        em.call_root(em.original_forward, (torch.randn(2, 3),))
    monkeypatch.undo()
    assert not torch.overrides._get_current_function_mode_stack()
    x = torch.full((3,), 1.0 + 2**-12)
    assert torch.equal(x * 1.0, x)  # not rounded to fp16 (1.0 there)
    assert_same_bits(model(torch.ones(1, 3)), em.call_root(em.original_forward, (torch.ones(1, 3),)),
                     "the engine still works")


# -- torch.compile -------------------------------------------------------------------------------
def test_quantize_is_a_custom_op_with_a_fake_implementation():
    op = quantize_op()
    x = torch.randn(3, 5)
    assert torch.equal(op(x, "fp16", "nearest", 0), x.half().float())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        y = op(fx, "e4m3fn", "nearest", 0)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_the_quantize_op_is_registered_when_lowprec_is_imported():
    """Registered on first use, the op's registration ran inside the first Dynamo trace that
    reached it and broke that graph (the test below failed when run on its own); a fresh
    interpreter that only imports lowprec finds it, with its fake implementation."""
    code = ("import torch, lowprec\n"
            "op = torch.ops.lowprec.quantize.default\n"
            "from torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    y = op(torch.empty(3, 2), 'fp16', 'nearest', 0)\n"
            "print(tuple(y.shape), y.dtype)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=1800)  # a hang guard only
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "(3, 2) torch.float32"


def test_quantizer_modules_compile_without_graph_breaks_and_give_the_eager_bits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Quantizer("e4m3fn", "e5m2"), nn.GELU(),
                          nn.Linear(8, 4), Quantizer("fp16"))
    x = torch.randn(5, 8, requires_grad=True)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    eager = model(x)
    eager.sum().backward()
    g_eager, x.grad = x.grad.clone(), None
    compiled = torch.compile(model)(x)
    compiled.sum().backward()
    assert_same_bits(compiled, eager, "forward")
    assert_same_bits(x.grad, g_eager, "input gradient")


def test_a_compiled_emulated_model_runs_eagerly_with_a_warning_and_keeps_every_rounding():
    torch.manual_seed(0)
    model, _ = Precision("16-true").setup(nn.Sequential(nn.Linear(8, 16), nn.GELU(),
                                                        nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    eager = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model)(x)
    assert any("runs the model eagerly" in str(w.message) for w in caught)
    assert_same_bits(compiled, eager, "compiled vs eager")
    assert on_grid(compiled)


@pytest.mark.parametrize("make_opt", [
    lambda ps: __import__("lowprec.training.optim", fromlist=["SGD"]).SGD(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1)], ids=["lowprec-sgd", "torch-sgd"])
def test_the_step_writes_each_parameter_back_in_its_own_storage_format(make_opt):
    """Under overrides={"*norm*": "32-true", "lm_head": "bf16"} the optimizer's write-back keeps
    the fp32 norm weights fp32 (w - lr * g in fp32), rounds the head to bf16 and the rest to fp16
    (torch's casts). Before, every parameter was written back in the policy's fp16."""
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("proj", nn.Linear(8, 8))
    net.add_module("norm", nn.LayerNorm(8))
    net.add_module("lm_head", nn.Linear(8, 5))
    prec = Precision("16-true", overrides={"*norm*": "32-true", "lm_head": "bf16"})
    model, opt = prec.setup(net, make_opt(net.parameters()))
    loss = model(torch.randn(3, 8)).square().sum()
    prec.backward(loss)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    prec.step(opt)
    for name, p in model.named_parameters():
        w, g = before[name]
        # Precision.step first rounds each gradient to its parameter's storage format
        g = g if name.startswith("norm") else (g.bfloat16() if name.startswith("lm_head")
                                               else g.half()).float()
        exact = w - 0.1 * g
        if name.startswith("norm"):
            # fp32 (within the fp32 update's own rounding), not rounded to fp16 (0.0002 off)
            assert torch.allclose(p.detach(), exact, rtol=2.5e-7, atol=0), name
        elif name.startswith("lm_head"):
            assert torch.equal(p.detach(), exact.bfloat16().float()), name
        else:
            assert torch.equal(p.detach(), exact.half().float()), name


def test_an_attention_mask_is_added_in_the_accumulator_under_mx_and_fp8():
    """-inf in an attention mask must not reach a block or Inf-less rounding: an MX block holding
    -inf would turn NaN whole, and e4m3fn has no -inf. Native fp32 attention is the reference
    for which entries are masked; the outputs stay finite and close to it."""
    import torch.nn.functional as F

    from lowprec.training.emulation import emulated

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 32) for _ in range(3))
    mask = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1),
                                         float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for policy in ("mxfp8_e4m3", "mxint8", "p=fp32,c=e4m3fn,g=e5m2,s=matmul"):
        with emulated(policy):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all(), policy
        assert (out - ref).abs().max() < 0.5, policy


def test_uninitialised_buffers_are_neither_rounded_nor_observed_and_their_writer_is():
    """torch.empty & co. hold stale memory, not values: rounding it made fp16 Inf that
    first_nonfinite reported (timm's DropPath, ``x.new_empty(shape).bernoulli_(keep)``). The
    in-place op that fills the buffer is rounded and observed like any op."""
    from lowprec.training.emulation import emulated
    from lowprec.training.emulation.engine import MARK

    x = torch.randn(4, 3)
    with emulated("16-true") as em:
        seen = []
        em.observers.append(lambda name, *rest: seen.append(name))
        bufs = [torch.empty(64), x.new_empty((64,)), torch.empty_like(x),
                torch.empty_strided((8, 8), (8, 1)), x.new_empty_strided((8,), (1,))]
        filled = x.new_empty((1000,)).uniform_()
        mask = x.new_empty((4, 1)).bernoulli_(0.7)
    assert not {"empty", "new_empty", "empty_like", "empty_strided",
                "new_empty_strided"} & set(seen), seen
    assert all(getattr(b, MARK, None) is None for b in bufs)  # never rounded
    assert seen.count("uniform_") == 1 and seen.count("bernoulli_") == 1, seen
    assert on_grid(filled) and not on_grid(torch.rand(1000, generator=torch.Generator()))
    assert set(mask.flatten().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("policy,fmt,lo,hi,grid", [
    ("16-true", "fp16", 0.0, 6.0, True), ("16-true", "fp16", -1.0, 1.0, True),
    ("16-true", "fp16", 0.0, 0.1, False),  # 0.1 is no fp16 value
    ("p=q2.6,c=q2.6,g=q2.6", "q2.6", 0.0, 6.0, False),  # 6 beyond q2.6's 1.98: saturated
    ("p=q2.6,c=q2.6,g=q2.6", "q2.6", -1.0, 1.5, True),
    ("16-true", "fp16", float("-inf"), 0.5, True),
], ids=["relu6", "unit", "off_grid_bound", "bound_out_of_range", "fixed", "infinite_bound"])
def test_a_clamp_is_rounded_only_when_a_bound_is_off_the_grid(monkeypatch, policy, fmt, lo, hi,
                                                             grid):
    """hardtanh (ReLU6) and clamp map grid values onto the grid when both bounds are on it:
    their output is then not rounded; with a bound off the grid it is, and every form gives
    what rounding the clamped values gives."""
    from lowprec import quantize
    from lowprec.training.emulation import engine

    rounded = []
    real = engine.Emulation.round
    monkeypatch.setattr(engine.Emulation, "round",
                        lambda self, t, *a, **k: rounded.append(1) or real(self, t, *a, **k))
    x = quantize(torch.randn(256, generator=torch.Generator().manual_seed(0)) * 4, fmt)
    want = quantize(x.clamp(lo, hi), fmt)
    with emulated(policy):
        x = x + 0  # an op's output: rounded, and known to be on the grid
        rounded.clear()
        outs = [F.hardtanh(x, lo, hi), x.clamp(lo, hi), torch.clamp(x, min=lo, max=hi),
                torch.clip(x, lo, hi), F.hardtanh(x.clone(), lo, hi, inplace=True),
                x.clone().clamp_(lo, hi)]
        if (lo, hi) == (0.0, 6.0):
            outs += [F.relu6(x), nn.ReLU6()(x)]
    for o in outs:
        assert_same_bits(o, want, f"{policy} [{lo}, {hi}]")
    assert (len(rounded) == 0) is grid, len(rounded)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "e4m3fn", "e5m2", "e2m1", "q6.10", "q2.6",
                                 "q13.12", "e3m2"])
def test_a_bound_is_on_the_grid_exactly_when_rounding_keeps_it(fmt):
    """The clamp rule decides from the format's fields (no tensor: it runs while compiled
    emulation traces with fake tensors); it agrees with rounding the bound, and refuses -0.0
    (a format may have no -0) and numbers float32 cannot hold."""
    import struct

    from lowprec import quantize
    from lowprec.numerics.formats import parse_format
    from lowprec.training.emulation.engine import _representable

    f = parse_format(fmt)
    g = torch.Generator().manual_seed(0)
    cands = [0.0, 1, 6, 6.0, 0.1, 0.25, 448.0, 65504.0, 65520.0, 1e-7, 2.0 ** -24, 2.0 ** -25,
             3 * 2.0 ** -24, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, 2.0 ** 15, 1e40, True,
             f.max, -f.max, f.min_normal, f.min_subnormal, f.min_subnormal / 2]
    cands += (torch.randn(300, generator=g) * 10.0 ** torch.randint(-8, 6, (300,),
                                                                    generator=g)).tolist()
    cands += quantize(torch.randn(300, generator=g) * 8, f).tolist()
    for b in cands:
        if not math.isfinite(b):
            continue  # an infinite bound clamps nothing: on the grid (the clamp test)
        b = float(b) if not isinstance(b, bool) else b
        try:
            b32 = struct.unpack("<f", struct.pack("<f", float(b)))[0]
        except OverflowError:
            b32 = None
        t = torch.tensor([float(b)])
        want = (not isinstance(b, bool) and b32 == b and b != 0.0 or b == 0.0) and \
            torch.equal(quantize(t, f), t)
        if b == 0.0:
            want = math.copysign(1.0, b) > 0  # -0.0 refused
        assert _representable(b, f) == want, (fmt, b)
    assert not _representable(-0.0, f) and _representable(0.0, f)
    assert not _representable(1.0 + 1e-12, parse_format("fp16"))  # not a float32
    assert not _representable(torch.tensor(1.0), f)
    assert not _representable(float("inf"), f) and not _representable(float("nan"), f)


def test_a_clamp_of_an_unrounded_input_rounds_it_first_as_before():
    """A parameter stored in fp32 reaches a clamp unrounded under p=fp32,c=fp16: it is rounded
    to fp16 first, as any op's input, so the backward's mask is fp16's (1.0002 -> 1.0, inside
    [-1, 1]: gradient 1, as with native fp16)."""
    w = nn.Parameter(torch.tensor([1.0002, 0.5]))
    with emulated("p=fp32,c=fp16,g=fp16,s=all,b=emulated"):
        (torch.ones(2) * w.clamp(-1, 1)).sum().backward()
    assert w.grad.tolist() == [1.0, 1.0]
    native = nn.Parameter(torch.tensor([1.0002, 0.5]).half())
    (torch.ones(2).half() * native.clamp(-1, 1)).sum().backward()
    assert native.grad.float().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_batch_norm_of_non_plain_formats_against_float64(layout):
    """Batch norm under a format no 16-bit kernel stands for (here stochastic rounding): the
    batch statistics rounded by the engine, y = x * a + b' from them, the backward of batch
    norm evaluated at the rounded statistics and the running statistics' momentum update, each
    against the same formulas in float64."""
    from types import SimpleNamespace

    from lowprec.numerics.formats import FP16
    from lowprec.numerics.rounding import Rounding
    from lowprec.training.emulation import kernels

    rule = SimpleNamespace(compute=FP16, grads=FP16, params=FP16,
                           rounding=Rounding.STOCHASTIC, grad_rounding=Rounding.STOCHASTIC)
    assert not kernels.plain_formats(rule)
    rounded = []

    class Engine:  # the stats rounded to nearest fp16, as a stand-in for the engine's rounding
        def round(self, t, rule_, key, grads=True):
            assert key == "bn.stats" and not grads and rule_ is rule
            rounded.append(t.clone())
            return t.half().float()

        def next_site_keys(self):  # outside a forward's stream: y comes unrounded
            return None

    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 5, 4, 3, generator=g) * 3 + 1
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(5, generator=g) * 0.5 + 1, torch.randn(5, generator=g) * 0.1
    rm0, rv0 = torch.randn(5, generator=g) * 0.1, torch.rand(5, generator=g) + 0.5
    rm, rv = rm0.clone(), rv0.clone()
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = kernels.batch_norm(Engine(), rule, "bn", xs, ws, bs, rm, rv, True, 0.1, 1e-5)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)

    X, W, B, G = (t.double() for t in (x, w, b, dy))
    dims, n = (0, 2, 3), x.numel() // 5
    mean, var = X.mean(dims), X.var(dims, unbiased=False)
    assert torch.allclose(rounded[0].double(), mean, rtol=1e-6, atol=1e-7)
    assert torch.allclose(rounded[1].double(), 1 / torch.sqrt(var + 1e-5), rtol=1e-6)
    m_q, r_q = (t.half().double().view(1, -1, 1, 1) for t in (mean, 1 / torch.sqrt(var + 1e-5)))
    a = r_q * W.view(1, -1, 1, 1)
    assert torch.allclose(y.double(), X * a + B.view(1, -1, 1, 1) - m_q * a, rtol=1e-6,
                          atol=1e-6)
    xhat = (X - m_q) * r_q
    dx = a * (G - G.mean(dims, keepdim=True) - xhat * (G * xhat).mean(dims, keepdim=True))
    assert torch.allclose(xs.grad.double(), dx, rtol=1e-5, atol=1e-6)
    assert torch.allclose(ws.grad.double(), (G * xhat).sum(dims), rtol=1e-5, atol=1e-6)
    assert torch.allclose(bs.grad.double(), G.sum(dims), rtol=1e-6, atol=1e-6)
    assert torch.allclose(rm.double(), 0.9 * rm0.double() + 0.1 * mean, rtol=1e-6)
    assert torch.allclose(rv.double(), 0.9 * rv0.double() + 0.1 * var * n / (n - 1), rtol=1e-6)


def test_a_second_order_gradient_raises():
    """The engine's gradient roundings have no derivative (``once_differentiable``): a gradient
    penalty (``create_graph=True``, then differentiating the gradient) raises torch's error for
    it, rather than giving a gradient with some terms missing or an unrelated error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 4))
    prec = Precision("16-true", seed=0)
    model, _ = prec.setup(net)
    with prec.autocast():
        out = model(torch.randn(32, 8)).float().pow(2).sum()
    (g,) = torch.autograd.grad(out, [net[0].weight], create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        g.pow(2).sum().backward()


@pytest.mark.parametrize("policy", ["16-true", "q6.10-sr", "mxfp8_e4m3", "mxfp4"])
def test_a_channels_last_cnn_keeps_its_fp32_runs_layouts(policy):
    """The layout of every convolution's input and output under emulation is the fp32 run's
    (a first convolution of one input channel too, whose rounded weight once came back
    row-major: the convolution then answered in row-major order, and MX roundings along the
    channels copied the activations to row-major and back)."""
    from lowprec.experiments.models import channels_last

    def layouts(pol):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.AvgPool2d(2),
                            nn.Conv2d(6, 32, 3), nn.ReLU(), nn.Conv2d(32, 4, 1))
        channels_last(net)  # (as lowprec compare lays out a CNN)
        prec = Precision(pol, seed=0)
        model, _ = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        seen = []
        for m in net:
            if isinstance(m, nn.Conv2d):
                m.register_forward_hook(lambda mod, i, o: seen.append(
                    (i[0].stride(), o.stride())))
        x = torch.randn(4, 1, 16, 16).to(memory_format=torch.channels_last)
        with prec.autocast():
            model(x)
        return seen

    assert layouts(policy) == layouts("32-true")


@pytest.mark.parametrize("shape,channels_last", [((8, 6, 5, 5), False), ((16, 32, 9, 9), True),
                                                 ((3, 7, 1, 1), True), ((2, 16, 9), False),
                                                 ((5, 4), False)])
@pytest.mark.parametrize("running", [True, False])
def test_batch_statistics_are_the_fp32_kernels(shape, channels_last, running):
    """The engine's batch statistics (mean and 1/std, the running statistics updated) without
    the normalised output: the bits of torch's own ``native_batch_norm`` in training."""
    from lowprec.training.emulation.kernels import _batch_stats

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    rm, rv = (torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5) if running \
        else (None, None)
    rm2, rv2 = (rm.clone(), rv.clone()) if running else (None, None)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, None, None, rm, rv, True, 0.1, 1e-5)
    got_mean, got_invstd = _batch_stats(x, rm2, rv2, 0.1, 1e-5)
    assert_same_bits(got_mean, mean, "mean")
    assert_same_bits(got_invstd, invstd, "1/std")
    if running:
        assert_same_bits(rm2, rm, "running mean")
        assert_same_bits(rv2, rv, "running var")


@pytest.mark.parametrize("policy", ["16-true", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated",
                                    "q6.10-sr", "mxfp8_e4m3", "c=e5m2,g=e5m2:sr", "dfxp-10-12"])
def test_outputs_rounded_in_place_give_the_out_of_place_bits(monkeypatch, policy):
    """An op's fresh output its backward does not hold (a convolution's, batch norm's, a
    residual add's, a linear's) is rounded in place (``RoundInplace``): outputs, gradients and
    parameters of two SGD steps bit for bit those of rounding every output into a new tensor,
    on a channels-last CNN with batch norm, a residual add, GELU, layer norm and a head."""
    from lowprec.experiments.models import channels_last
    from lowprec.training.emulation import autograd_fns, engine

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
            self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.ln, self.head = nn.LayerNorm(16), nn.Linear(16, 5)

        def forward(self, x):
            h = F.relu6(self.b1(self.c1(x)))
            h = h + self.b2(self.c2(h))  # residual add
            h = self.ln(F.gelu(h.mean((2, 3)) * 2))
            return self.head(h)

    used = []
    real = autograd_fns.RoundInplace.forward
    monkeypatch.setattr(autograd_fns.RoundInplace, "forward",
                        staticmethod(lambda ctx, x, *a: used.append(x.shape) or real(ctx, x, *a)))

    def run(in_place):
        monkeypatch.setattr(engine, "IN_PLACE", in_place)
        torch.manual_seed(0)
        net = Net()
        channels_last(net)
        prec = Precision(policy, seed=0)
        model, opt = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        g = torch.Generator().manual_seed(1)
        seen = []
        for _ in range(2):
            x = torch.randn(8, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
            opt.zero_grad()
            with prec.autocast():
                out = model(x)
                loss = F.cross_entropy(out.float(), torch.arange(8) % 5)
            prec.backward(loss)
            seen += [out.detach().float().clone()] + [p.grad.clone() for p in net.parameters()]
            prec.step(opt)
        return seen + [p.detach().clone() for p in net.parameters()]

    want = run(False)
    assert used == []
    got = run(True)
    if policy != "mxfp8_e4m3":  # (MX rounds the operands, not the fp32 outputs)
        assert len(used) >= 8  # 2 steps: convolutions, batch norms, the add, the head at least
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, b, f"tensor {i}")


@pytest.mark.parametrize("policy,dtype", [("16-true", torch.float16),
                                          ("p=bf16,c=bf16,g=bf16,o=bf16,b=emulated",
                                           torch.bfloat16)])
def test_eval_mode_reads_running_statistics_as_16_bit_buffers_hold_them(policy, dtype):
    """Running statistics loaded off the grid after setup (an fp32 checkpoint) are read in eval
    mode as the 16-bit buffers of a native run would hold them (torch's cast), from the first
    eval forward on, and stay on the grid; the same outputs as a model given them cast."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Flatten(),
                             nn.Linear(3 * 4 * 4, 2))

    g = torch.Generator().manual_seed(1)
    stats = (torch.randn(3, generator=g) * 0.3, torch.rand(3, generator=g) + 0.5)
    x = torch.randn(4, 2, 4, 4, generator=g)
    outs = []
    for cast in (False, True):
        net = build()
        prec = Precision(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = prec.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        bn = net[1]
        for buf, v in zip((bn.running_mean, bn.running_var), stats):
            buf.copy_(v.to(dtype).float() if cast else v)  # after setup: off the grid unless cast
        model.eval()
        with torch.no_grad(), prec.autocast():
            outs.append([model(x).float().clone() for _ in range(2)])
        assert on_grid(bn.running_mean, dtype) and on_grid(bn.running_var, dtype)
    for a, b in zip(*outs):
        assert_same_bits(a, b, policy)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0, 1, 1, 2, 3]), max_size=4), min_size=2, max_size=3))
def test_the_engines_broadcast_of_sizes_is_torchs(sizes):
    # the engine broadcasts plain int sizes itself (torch's function is slow): it must agree
    # with torch.broadcast_shapes, None where torch raises
    from lowprec.training.emulation.engine import _broadcast

    shapes = [torch.Size(s) for s in sizes]
    try:
        want = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        want = None
    got = _broadcast(shapes)
    assert got == want
    assert want is None or type(got) is torch.Size


def test_a_broadcast_operands_gradient_is_rounded_at_the_outputs_size():
    # (the engine's own broadcast decides where a Broadcast node goes: a weight-like operand of
    # a mul is expanded, its gradient's full-size product rounded to 16 bits and then summed
    # down, as native fp16 computes it)
    torch.manual_seed(0)
    x = (torch.randn(64, 32) * 3).requires_grad_()
    b = torch.randn(32).requires_grad_()
    c = torch.randn(64, 32)
    with emulated("16-true"):
        y = torch.exp(x * 0.1)  # an activation (rounded)
        z = (y * b * c).sum()
    z.backward()
    xh, bh = x.detach().half().requires_grad_(), b.detach().half().requires_grad_()
    (torch.exp(xh * 0.1) * bh * c.half()).float().sum().backward()
    assert_same_bits(b.grad, bh.grad.float())
    assert_same_bits(x.grad, xh.grad.float())


def test_the_engines_fast_apply_is_torchs_apply_under_a_functorch_transform():
    # the engine calls its autograd functions' C apply directly, except under a functorch
    # transform, where torch's Function.apply runs (a function that supports transforms)
    from lowprec.training.emulation.autograd_fns import fast_apply

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    x = torch.randn(8, dtype=torch.float64)
    cube = fast_apply(Cube)
    assert torch.equal(torch.func.grad(lambda t: cube(t).sum())(x), 3 * x * x)
    y = x.clone().requires_grad_()
    cube(y).sum().backward()  # (no transform: the C apply)
    assert torch.equal(y.grad, 3 * x * x)


@pytest.mark.parametrize("L", [1, 2, 16])
@pytest.mark.parametrize("layout", ["split", "gqa", "expand"])
def test_the_emulated_attentions_copies_made_once_change_no_bit(monkeypatch, L, layout):
    # the emulated flash attention copies a head-split query (and the output's gradient) once
    # instead of letting torch.matmul copy it at every product: the bits must be those of
    # matmul on the operands as given (its own copies), which the attention gives with the
    # copy-once step switched off. (Copying k or v once would not do: matmul copies their
    # transposes row-major, another GEMM for one or two queries.)
    import torch.nn.functional as F
    from lowprec.training.emulation import kernels

    def run():
        g = torch.Generator().manual_seed(1)
        B, H, S, D = 2, 8, 77, 64
        hk = 2 if layout == "gqa" else H
        xq = torch.randn(B, L, H * D, generator=g).requires_grad_()
        xk = torch.randn(B, S, hk * D, generator=g).requires_grad_()
        xv = torch.randn(B, S, hk * D, generator=g).requires_grad_()
        with emulated("16-true"):
            q = xq.view(B, L, H, D).transpose(1, 2)
            if layout == "expand":
                k = xk[..., :D].view(B, 1, S, D).expand(B, H, S, D)
                v = xv[..., :D].view(B, 1, S, D).expand(B, H, S, D)
            else:
                k = xk.view(B, S, hk, D).transpose(1, 2)
                v = xv.view(B, S, hk, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=hk != H)
        o.backward(torch.full_like(o, 0.37))
        return [o.detach(), xq.grad, xk.grad, xv.grad]

    got = run()
    monkeypatch.setattr(kernels, "_batched", lambda t: t)
    want = run()
    for a, b in zip(got, want):
        assert_same_bits(a, b)


def test_changing_the_attentions_inputs_after_its_forward_still_raises():
    # (the emulated attention saves the query as given beside its copy: autograd's version
    # check sees an in-place change of it, as it does for torch's attention)
    import torch.nn.functional as F

    B, H, L, D = 2, 4, 16, 32
    x = torch.randn(B, L, H * D).requires_grad_()
    kv = torch.randn(B, H, L, D).requires_grad_()
    with emulated("16-true"):
        base = x * 1.0
        q = base.view(B, L, H, D).transpose(1, 2)  # (copied inside: a head-split view)
        o = F.scaled_dot_product_attention(q, kv * 1.0, kv * 1.0)
        base.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified inplace"):
        o.sum().backward()


@pytest.mark.parametrize("policy", ["16-true", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated",
                                    "q6.10-sr", "p=fp16,c=fp16:sr,g=fp16:sr,o=fp16",
                                    "p=bf16,c=bf16:sr8,g=bf16,o=bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_batch_norms_output_rounded_as_it_is_computed_changes_no_bit(monkeypatch, policy,
                                                                       layout):
    # the batch-norm replay writes its output rounded (one pass: lp_affine_round, or
    # lp_affine_round_bt for a channels-last stochastic rounding, with the keys the engine's
    # rounding would take) and the engine's rounding of it then skips it: the bits of the two
    # passes, and one pass fewer
    from lowprec.numerics import kernel as knl
    from lowprec.training.emulation import autograd_fns

    def run():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
                            nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8))
        for m in (net[1], net[4]):  # (a scale of 1 and a shift of 0 make the products exact)
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
        x = torch.randn(8, 3, 12, 12)
        if layout == "channels_last":
            net, x = net.to(memory_format=torch.channels_last), \
                x.contiguous(memory_format=torch.channels_last)
        prec = Precision(policy, seed=0)
        model, _ = prec.setup(net)
        with prec.autocast():
            y = model(x)
        y.float().pow(2).sum().backward()
        return [y.detach(), *[p.grad for p in net.parameters()],
                *[b.clone() for b in net.buffers()]]

    passes = []
    real = autograd_fns.quantize_keyed_
    monkeypatch.setattr(autograd_fns, "quantize_keyed_",
                        lambda x, *a: passes.append(x.shape) or real(x, *a))
    got, fused = run(), len(passes)
    passes.clear()
    monkeypatch.setattr(knl, "affine_round", lambda *a: None)  # the two passes, as before
    want = run()
    assert fused == len(passes) - 2  # the two batch norms' output roundings skipped
    for a, b in zip(got, want):
        assert_same_bits(a, b)



def test_a_batch_norms_output_keeps_atens_two_roundings_where_its_addcmul_has_them():
    # torch's DEFAULT CPU build rounds addcmul's product before the add: the batch-norm replay
    # then keeps addcmul (the fused pass computes one fused multiply-add), and its bits
    script = """
import torch
from torch import nn
from lowprec import Precision
from lowprec.numerics import kernel as knl
from lowprec.training.emulation.kernels import _addcmul_contracts

def run():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16))
    nn.init.normal_(net[1].weight)
    nn.init.normal_(net[1].bias)
    prec = Precision("16-true", seed=0)
    model, _ = prec.setup(net)
    with prec.autocast():
        return model(torch.randn(16, 3, 30, 30)).detach()

got = run()
knl.affine_round = lambda *a: None
want = run()
print(_addcmul_contracts(), torch.equal(got.view(torch.int32), want.view(torch.int32)))
"""
    import os

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]
