"""Recurrent layers torch cannot run in a 16-bit dtype on this device run in fp32.

oneDNN has no bf16 LSTM on AVX2-only CPUs (torch.autocast("cpu", torch.bfloat16) around an
nn.LSTM raises "could not create a primitive descriptor"); CPUs with AVX-512 run it. Both
branches are tested on every CPU: the probe's answer forced either way (monkeypatch), and the
real probe, whose answer the behaviour must follow. References: the same layer run by torch in
fp32 (what autocast does for an op without a low-precision kernel), its outputs cast by torch.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lowprec import Precision
from lowprec.training import recurrent

from helpers import assert_same_bits, native

LAYERS = {
    "lstm": lambda: nn.LSTM(4, 8, num_layers=2, batch_first=True),
    "gru": lambda: nn.GRU(4, 8, batch_first=True),
    "rnn": lambda: nn.RNN(4, 8, batch_first=True),
    "lstm-cell": lambda: nn.LSTMCell(4, 8),
}


def batch(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn((3, 4) if name.endswith("cell") else (3, 5, 4), generator=g)


def first(out) -> torch.Tensor:
    while not torch.is_tensor(out):
        out = out[0]
    return out


def setup(policy: str, layer: nn.Module) -> tuple[Precision, list]:
    prec = Precision(native(policy))  # the fallback belongs to the native backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prec.setup(layer)
    return prec, [w for w in caught if "cannot run" in str(w.message)]


@pytest.fixture
def forced(monkeypatch):
    """Force the probe's answer: ``forced("reason")`` fails every layer, ``forced(None)``
    passes every layer."""
    def force(answer):
        monkeypatch.setattr(recurrent, "_probe", lambda *a: answer)
    return force


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_failing_probe_runs_the_layer_in_fp32_under_autocast_with_one_warning(name, forced):
    forced("forced failure")
    torch.manual_seed(0)
    layer = LAYERS[name]()
    ref = copy.deepcopy(layer)
    prec, warned = setup("bf16-mixed", layer)
    assert len(warned) == 1, warned
    assert f"nn.{type(layer).__name__}" in str(warned[0].message)
    assert "forced failure" in str(warned[0].message)
    x = batch(name)
    with prec.autocast():
        out = layer(x)
    # autocast's fp32 fallback: fp32 inputs and weights, autocast off; outputs in bf16
    expected = ref(x)
    for got, want in zip(torch.utils._pytree.tree_leaves(out),
                         torch.utils._pytree.tree_leaves(expected)):
        assert got.dtype == torch.bfloat16
        assert_same_bits(got, want.bfloat16(), "output")
    first(out).float().sum().backward()
    first(expected).bfloat16().float().sum().backward()
    for (n, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        assert_same_bits(p.grad, q.grad, f"gradient of {n}")
    # outside autocast the layer is torch's own fp32 layer
    assert_same_bits(first(layer(x)), first(ref(x)), "outside autocast")


def test_one_warning_for_several_layers_and_packed_sequences_and_hidden_states(forced):
    forced("forced failure")
    net = nn.ModuleDict({"a": nn.GRU(4, 8, batch_first=True), "b": nn.GRU(8, 8, batch_first=True)})
    prec, warned = setup("bf16-mixed", net)
    assert len(warned) == 1 and "these 2 layers" in str(warned[0].message)
    x = batch("gru")
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    h0 = torch.zeros(1, 3, 8, dtype=torch.bfloat16)  # a 16-bit state from a previous step
    with prec.autocast():
        out, h = net["a"](packed, h0)
        out2, _ = net["b"](pad_packed_sequence(out, batch_first=True)[0], h)
    assert out.data.dtype == h.dtype == out2.dtype == torch.bfloat16
    assert torch.equal(out.batch_sizes, packed.batch_sizes)  # integer fields kept
    out2.float().sum().backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_a_failing_probe_runs_a_converted_layer_in_fp32_with_bf16_parameters(name, forced):
    forced("forced failure")
    torch.manual_seed(0)
    layer = LAYERS[name]()
    ref = copy.deepcopy(layer).bfloat16().float()  # the bf16 weights, exactly, in fp32
    prec, warned = setup("bf16-true", layer)
    assert len(warned) == 1 and "bfloat16 parameters" in str(warned[0].message)
    x = batch(name)
    out = layer(prec.convert_input(x))
    expected = ref(x.bfloat16().float())
    assert first(out).dtype == torch.bfloat16
    assert_same_bits(first(out), first(expected).bfloat16(), "output")
    first(out).float().sum().backward()
    first(expected).bfloat16().float().sum().backward()
    for (n, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert p.dtype == p.grad.dtype == torch.bfloat16
        assert_same_bits(p.grad, q.grad.bfloat16(), f"gradient of {n}")


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-true"])
def test_a_passing_probe_leaves_the_layer_to_torch(policy, forced):
    layer = LAYERS["lstm"]()
    # the real probe's answer for this layer on this CPU, asked before it is forced
    why = recurrent.native_failure(layer, torch.device("cpu"), torch.bfloat16,
                                   autocast=policy == "bf16-mixed")
    forced(None)
    prec, warned = setup(policy, layer)
    assert warned == [] and "forward" not in layer.__dict__
    x = prec.convert_input(batch("lstm"))
    with prec.autocast():
        if why is None:
            first(layer(x)).float().sum().backward()
        else:  # torch's own error on this CPU, which the fallback exists for
            with pytest.raises(RuntimeError, match=why.split("(")[0][:40]):
                layer(x)


@pytest.mark.parametrize("policy", ["bf16-mixed", "bf16-true", "b=native,p=fp32,c=fp16,s=matmul"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_real_probe_decides_and_training_runs_on_this_cpu(name, policy):
    torch.manual_seed(0)
    layer = LAYERS[name]()
    mixed = "mixed" in policy or "matmul" in policy
    dtype = torch.float16 if "fp16" in policy else torch.bfloat16
    why = recurrent.native_failure(layer, torch.device("cpu"), dtype, autocast=mixed)
    prec, warned = setup(policy, layer)
    assert len(warned) == (why is not None), (why, warned)
    assert ("forward" in layer.__dict__) == (why is not None)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = prec.convert_input(batch(name))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with prec.autocast():
            loss = first(layer(x)).float().pow(2).mean()
        prec.backward(loss)
        prec.step(opt)
        losses.append(loss.item())
    assert all(v == v and abs(v) != float("inf") for v in losses), losses
    assert losses[-1] < losses[0], losses


def test_the_probe_draws_no_random_numbers_keeps_the_modes_and_is_cached():
    recurrent._probe.cache_clear()
    layer = nn.LSTM(3, 5)
    state = torch.get_rng_state()
    with torch.no_grad():
        a = recurrent.native_failure(layer, torch.device("cpu"), torch.bfloat16, autocast=True)
        assert not torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    b = recurrent.native_failure(nn.LSTM(3, 5), torch.device("cpu"), torch.bfloat16,
                                 autocast=True)
    assert a == b and recurrent._probe.cache_info().hits == 1
    assert recurrent.native_failure(nn.Linear(3, 5), torch.device("cpu"), torch.bfloat16,
                                    autocast=True) is None
