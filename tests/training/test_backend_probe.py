"""``auto`` checked by timing the model's own steps (lowprec.training.backends.probe).

The decision is tested on timings given as data and on device facts given as data, so it holds
on any CPU and under any load; the one real timing only checks what it leaves behind (nothing)
and that it measured something, never how fast anything is.
"""

import pytest
import torch
from torch import nn

from lowprec import Precision, parse_policy
from lowprec.training import precision as precision_mod
from lowprec.training.backends import BackendChoice, choose_backend
from lowprec.training.backends.probe import SLOWER, BackendTiming, decide
from lowprec.training.precision import time_backends
from lowprec.training.hardware import DeviceFacts
from lowprec.training.policy import Backend

AVX2 = DeviceFacts("cpu", "AMD EPYC", "AVX2", {"avx2"})
COOPER_LAKE = DeviceFacts("cpu", "Xeon", "AVX512", {"avx2", "avx512_f", "avx512_bf16"})


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.1), nn.Linear(4 * 6 * 6, 3))


def test_native_is_kept_unless_clearly_slower_than_emulation():
    facts = choose_backend(parse_policy("bf16-true"), COOPER_LAKE)
    assert facts.backend is Backend.NATIVE and facts.automatic
    kept = decide(facts, BackendTiming(native=0.12, emulated=0.10, rounds=3))  # within SLOWER
    assert kept.backend is Backend.NATIVE and kept.automatic
    assert "120 ms native, 100 ms emulated" in kept.reason and "AVX512-BF16" in kept.reason
    slow = decide(facts, BackendTiming(native=0.25, emulated=0.10, rounds=3))
    assert slow.backend is Backend.EMULATED and slow.automatic
    assert "250 ms native, 100 ms emulated" in slow.reason
    edge = decide(facts, BackendTiming(native=SLOWER * 0.1, emulated=0.1, rounds=1))
    assert edge.backend is Backend.NATIVE  # a tie at the margin keeps native
    assert decide(facts, None) is facts


@pytest.mark.parametrize("spec,facts", [("bf16-true", AVX2), ("p=bf16,b=native", COOPER_LAKE),
                                        ("32-true", COOPER_LAKE), ("p=e4m3fn", COOPER_LAKE)])
def test_a_choice_auto_did_not_make_natively_is_not_changed_by_timing(spec, facts):
    choice = choose_backend(parse_policy(spec), facts)
    assert decide(choice, BackendTiming(native=9.0, emulated=0.1, rounds=3)) is choice
    assert decide(choice, BackendTiming(native=0.1, emulated=9.0, rounds=3)) is choice


def _fake_timing(native: float, emulated: float, calls: list):
    def fake(model, policy, example, **kwargs):
        calls.append((policy.spec, tuple(example.shape)))
        return BackendTiming(native, emulated, 3)
    return fake


@pytest.mark.parametrize("native,emulated,backend,dtype", [
    (0.30, 0.10, Backend.EMULATED, torch.float32), (0.08, 0.10, Backend.NATIVE, torch.bfloat16)])
def test_setup_with_an_example_times_where_the_facts_say_native(monkeypatch, native, emulated,
                                                                 backend, dtype):
    calls: list = []
    monkeypatch.setattr(precision_mod, "device_facts", lambda device: COOPER_LAKE)
    monkeypatch.setattr(precision_mod, "time_backends", _fake_timing(native, emulated, calls))
    prec = Precision("bf16-true")
    x = torch.randn(2, 1, 8, 8)
    model, _ = prec.setup(_net(), example=x)
    assert calls == [(prec.policy.spec, (2, 1, 8, 8))]
    assert prec.backend is backend and prec.backend_choice.automatic
    assert "ms native" in prec.backend_choice.reason
    assert model[0].weight.dtype == dtype


@pytest.mark.parametrize("spec,facts", [("bf16-true", AVX2), ("32-true", COOPER_LAKE),
                                        ("p=bf16,b=native", COOPER_LAKE),
                                        ("p=bf16,b=emulated", COOPER_LAKE)])
def test_setup_with_an_example_times_nothing_where_auto_has_no_native_choice(monkeypatch, spec,
                                                                             facts):
    monkeypatch.setattr(precision_mod, "device_facts", lambda device: facts)
    monkeypatch.setattr(precision_mod, "time_backends",
                        lambda *a, **k: pytest.fail("timed a choice auto does not make"))
    prec = Precision(spec)
    prec.setup(_net(), example=torch.randn(2, 1, 8, 8))
    assert prec.backend_choice == choose_backend(prec.policy, facts)


def test_a_choice_made_before_is_given_back_and_checked(monkeypatch):
    monkeypatch.setattr(precision_mod, "device_facts", lambda device: COOPER_LAKE)
    stored = BackendChoice(Backend.EMULATED, "measured before", automatic=True)
    prec = Precision("bf16-true")
    model, _ = prec.setup(_net(), choice=stored)
    assert prec.backend_choice is stored and model[0].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="conflicts"):  # fp32 runs natively, always
        Precision("32-true").setup(_net(), choice=stored)
    with pytest.raises(ValueError, match="conflicts"):
        Precision("p=bf16,b=native").setup(_net(), choice=stored)
    with pytest.raises(ValueError, match="not both"):
        Precision("bf16-true").setup(_net(), choice=stored, example=torch.randn(1, 1, 8, 8))
    with pytest.raises(TypeError, match="BackendChoice"):
        Precision("bf16-true").setup(_net(), choice="emulated")
    model = _net()  # a refused set-up leaves the model free for another Precision
    with pytest.raises(ValueError):
        Precision("32-true").setup(model, choice=stored)
    Precision("32-true").setup(model)


def test_timing_trains_copies_and_leaves_the_caller_s_model_and_random_state_alone():
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 0])
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    timing = time_backends(model, parse_policy("bf16-true"), x, target=y,
                           loss_fn=nn.functional.cross_entropy, rounds=2)
    assert timing.native > 0 and timing.emulated > 0 and timing.rounds == 2
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's draws were the copies'
    for k, v in model.state_dict().items():  # weights and BatchNorm statistics unchanged
        assert torch.equal(v, before[k]) and v.dtype == before[k].dtype, k
    assert all(p.grad is None for p in model.parameters())
    Precision("bf16-true").setup(model)  # not marked as set up by the copies' Precisions
    built = time_backends(_net, parse_policy("bf16-true"), x, rounds=1)  # a factory; any loss
    assert built.native > 0 and built.emulated > 0
    with pytest.raises(ValueError, match="rounds"):
        time_backends(model, "bf16-true", x, rounds=0)
    with pytest.raises(TypeError, match="nn.Module or a function"):
        time_backends("resnet", "bf16-true", x)
