"""Backends as plug-ins, and ``auto``'s choice between them from the device's facts.

The rules are tested on facts given as data (an AVX2-only CPU, AVX512-BF16, AMX, CUDA GPUs of
several generations), so they hold on any machine; the machine running the tests is only asked
whether Precision reports the choice the rules give for it.
"""

import re
import warnings

import pytest
import torch
from torch import nn

from lowprec import Precision, parse_policy
from lowprec.numerics.formats import BF16, FP16, FP32, parse_format
from lowprec.training import backends as backends_mod
from lowprec.training.backends import (BackendChoiceWarning, EmulatedBackend, NativeBackend,
                                       PrecisionBackend, backend_class, choose_backend,
                                       register_backend)
from lowprec.training.backends import choice as choice_mod
from lowprec.training.hardware import DeviceFacts, device_facts, native_speed
from lowprec.training.policy import Backend

AVX2 = DeviceFacts("cpu", "AMD EPYC", "AVX2", {"avx2"})
AVX512 = DeviceFacts("cpu", "Xeon", "AVX512", {"avx2", "avx512_f"})
COOPER_LAKE = DeviceFacts("cpu", "Xeon", "AVX512", {"avx2", "avx512_f", "avx512_bf16"})
SAPPHIRE_RAPIDS = DeviceFacts("cpu", "Xeon", "AVX512",
                              {"avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_tile",
                               "amx_bf16"})
AMX_BF16_ONLY = DeviceFacts("cpu", "Xeon", "AVX512", {"avx2", "avx512_f", "amx_bf16"})
GRAVITON3 = DeviceFacts("cpu", "Neoverse-V1", "SVE256", {"bf16", "sve_bf16", "fp16_arith"})
A100 = DeviceFacts("cuda", "A100", "sm_80", cuda_capability=(8, 0))
T4 = DeviceFacts("cuda", "T4", "sm_75", cuda_capability=(7, 5))


@pytest.mark.parametrize("facts,bf16,fp16", [
    (AVX2, False, False), (AVX512, False, False), (COOPER_LAKE, True, False),
    (SAPPHIRE_RAPIDS, True, False), (AMX_BF16_ONLY, True, False), (GRAVITON3, True, False),
    (A100, True, True), (T4, False, True),
], ids=["avx2", "avx512", "avx512_bf16", "amx", "amx_bf16", "arm_bf16", "a100", "t4"])
def test_native_speed_follows_the_instructions_the_device_has(facts, bf16, fp16):
    assert native_speed(BF16, facts)[0] is bf16
    assert native_speed(FP16, facts)[0] is fp16
    assert native_speed(FP32, facts) == (True, "fp32")
    assert native_speed(parse_format("e4m3fn"), facts)[0] is False  # no torch kernels at all
    reason = native_speed(BF16, facts)[1]
    assert reason and (("no " in reason) is not bf16)


@pytest.mark.parametrize("policy", ["bf16-true", "bf16-mixed", "16-true", "16-mixed",
                                    "16-master", "p=fp32,c=bf16,g=bf16,s=matmul"])
def test_auto_emulates_16_bit_formats_on_an_avx2_only_cpu(policy):
    c = choose_backend(parse_policy(policy), AVX2)
    assert c.backend is Backend.EMULATED and c.automatic
    assert "AVX2" in c.reason
    # fp16: no AVX512-FP16 either, so its matmuls are slow too (not only convolutions)
    assert ("no AVX512-BF16" in c.reason) if "bf16" in policy else \
        ("no AVX512-FP16" in c.reason and "matmuls" in c.reason)


@pytest.mark.parametrize("facts", [COOPER_LAKE, SAPPHIRE_RAPIDS, AMX_BF16_ONLY, A100],
                         ids=["avx512_bf16", "amx", "amx_bf16", "cuda"])
def test_auto_runs_bf16_natively_where_the_device_has_bf16_kernels(facts):
    for policy in ("bf16-true", "bf16-mixed"):
        c = choose_backend(parse_policy(policy), facts)
        assert c.backend is Backend.NATIVE and c.automatic, c


def test_auto_decides_fp16_by_its_own_instructions():
    """fp16 is fast on CUDA tensor cores and on no CPU: torch's CPU fp16 convolution backward is
    a reference kernel even with AVX512-FP16 (an Intel Xeon with AVX512-FP16: 175 ms against
    fp32's 3.7 ms for a LeNet-5 convolution's forward and backward, figure F42)."""
    pol = parse_policy("16-true")
    assert choose_backend(pol, COOPER_LAKE).backend is Backend.EMULATED  # bf16 only
    slow = choose_backend(pol, SAPPHIRE_RAPIDS)
    assert slow.backend is Backend.EMULATED and "reference kernel" in slow.reason
    assert "matmuls" not in slow.reason  # (oneDNN takes its fp16 matmuls)
    assert "matmuls" in choose_backend(pol, AVX512).reason  # (no AVX512-FP16)
    assert choose_backend(pol, GRAVITON3).backend is Backend.EMULATED
    assert choose_backend(pol, A100).backend is Backend.NATIVE
    assert choose_backend(pol, T4).backend is Backend.NATIVE
    assert choose_backend(parse_policy("bf16-true"), T4).backend is Backend.EMULATED


@pytest.mark.parametrize("policy,why", [
    ("p=fp32,c=bf16,g=bf16,s=all", "p= must equal c="),  # model.bfloat16() has bf16 weights
    ("p=bf16,c=fp32,g=fp32", "p= must equal c="),
    ("p=bf16,c=bf16,g=bf16,s=matmul", "p=fp32"),  # autocast keeps fp32 weights
    ("p=bf16,c=bf16,g=fp32", "gradients in the compute format"),
    ("p=q6.10,c=q6.10,g=q6.10", "fp32, fp16 or bf16"),
])
def test_a_policy_native_dtypes_cannot_run_as_written_is_emulated_and_says_why(policy, why):
    """torch's dtypes run a model cast to its parameter format (``model.bfloat16()``, s=all)
    or autocast from fp32 parameters (s=matmul): any other policy would silently train as
    another one natively, so
    ``auto`` emulates it, even where bf16 is fast, and ``b=native`` is refused, naming why."""
    c = choose_backend(parse_policy(policy), SAPPHIRE_RAPIDS)
    assert c.backend is Backend.EMULATED and why in c.reason, c
    with pytest.raises(ValueError, match=f"cannot run natively: .*{re.escape(why)}"):
        choose_backend(parse_policy(policy + ",b=native"), SAPPHIRE_RAPIDS)


@pytest.mark.parametrize("policy", ["p=bf16,c=bf16:sr,g=bf16", "p=bf16,c=bf16,g=bf16:sr4",
                                    "p=fp16,c=fp16:toward_zero,g=fp16"])
def test_a_rounding_other_than_nearest_even_is_never_native(policy):
    """torch's kernels round to nearest-even only: on a device fast in the format, ``auto``
    still emulates such a policy, and ``b=native`` is refused by name."""
    for facts in (SAPPHIRE_RAPIDS, A100):
        c = choose_backend(parse_policy(policy), facts)
        assert c.backend is Backend.EMULATED and "nearest-even" in c.reason
    with pytest.raises(ValueError, match="cannot run natively.*nearest-even"):
        choose_backend(parse_policy(policy + ",b=native"), A100)


def test_what_the_user_chose_or_only_one_backend_can_run_is_not_decided_by_facts():
    forced = choose_backend(parse_policy("p=bf16,b=native"), AVX2)
    assert forced.backend is Backend.NATIVE and not forced.automatic
    emulated = choose_backend(parse_policy("p=bf16,b=emulated"), SAPPHIRE_RAPIDS)
    assert emulated.backend is Backend.EMULATED and not emulated.automatic
    fp8 = choose_backend(parse_policy("p=fp32,c=e4m3fn,g=e5m2,s=matmul"), A100)
    assert fp8.backend is Backend.EMULATED and not fp8.automatic
    fp32 = choose_backend(parse_policy("32-true"), AVX2)
    assert fp32.backend is Backend.NATIVE and not fp32.automatic
    over = choose_backend(parse_policy("bf16-true"), SAPPHIRE_RAPIDS, overrides=True)
    assert over.backend is Backend.EMULATED and not over.automatic
    with pytest.raises(ValueError, match="overrides"):
        choose_backend(parse_policy("p=bf16,b=native"), AVX2, overrides=True)
    with pytest.raises(ValueError, match="emulated"):
        choose_backend(parse_policy("p=e4m3fn,b=native"), A100)


def test_a_precision_reports_its_choice_once_per_process_and_policy(monkeypatch):
    """Whatever this CPU has, Precision takes the choice the rules give for its facts, and
    warns once (policy, device, choice); a second set-up of the same policy is silent."""
    monkeypatch.setattr(choice_mod, "_ANNOUNCED", set())
    expected = choose_backend(parse_policy("bf16-true"), device_facts("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prec = Precision("bf16-true")
        prec.setup(nn.Linear(4, 4))
        Precision("bf16-true").setup(nn.Linear(4, 4))
    assert prec.backend_choice == expected and prec.backend is expected.backend
    assert prec.resolve_backend("cpu") is expected.backend
    notes = [w for w in caught if issubclass(w.category, BackendChoiceWarning)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    msg = str(notes[0].message)
    assert "bf16-true" in msg and expected.reason in msg and str(expected.backend) in msg
    assert notes[0].filename == __file__  # points at the caller of setup()
    dtype = torch.bfloat16 if expected.backend is Backend.NATIVE else torch.float32
    assert prec.model.weight.dtype == dtype


def test_the_choice_names_the_users_line_when_lowprec_itself_set_up(monkeypatch):
    """``setup()`` called by lowprec's own code (its runner, certify, the Hugging Face trainer:
    here a function compiled as a file of the package) warns at the first line outside the
    package, the user's, not at lowprec's file (a new user's report)."""
    import os

    import lowprec

    monkeypatch.setattr(choice_mod, "_ANNOUNCED", set())
    inner = os.path.join(os.path.dirname(lowprec.__file__), "experiments", "_inside.py")
    ns = {"Precision": Precision, "nn": nn}
    exec(compile("def set_up():\n    Precision('16-true').setup(nn.Linear(4, 4))\n",  # noqa: S102
                 inner, "exec"), ns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns["set_up"]()
    notes = [w for w in caught if issubclass(w.category, BackendChoiceWarning)]
    assert len(notes) == 1 and notes[0].filename == __file__, [
        (w.filename, w.lineno) for w in notes]


def test_a_policy_that_names_its_backend_is_not_announced(monkeypatch):
    monkeypatch.setattr(choice_mod, "_ANNOUNCED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error", BackendChoiceWarning)
        for spec in ("p=bf16,b=native", "p=bf16,b=emulated", "32-true", "p=e4m3fn"):
            Precision(spec).setup(nn.Linear(4, 4))


def test_backends_are_registered_plug_ins():
    assert backend_class(Backend.NATIVE) is NativeBackend
    assert backend_class("emulated") is EmulatedBackend
    assert set(backends_mod.BACKENDS) == {Backend.NATIVE, Backend.EMULATED}
    with pytest.raises(ValueError, match="already registered"):
        @register_backend
        class Other(PrecisionBackend):
            kind = Backend.NATIVE
    with pytest.raises(ValueError, match="auto"):
        @register_backend
        class Auto(PrecisionBackend):
            kind = Backend.AUTO
    with pytest.raises(TypeError):
        register_backend(object)
    prec = Precision("p=bf16,b=emulated")
    prec.setup(nn.Linear(4, 4))
    assert isinstance(prec._backend, EmulatedBackend) and prec.emulation is prec._backend.engine
    prec = Precision("p=bf16,b=native")
    prec.setup(nn.Linear(4, 4))
    assert prec.emulation is None and prec.convert_input(torch.ones(2)).dtype == torch.bfloat16


def test_native_says_a_torch_optimizers_state_is_not_in_the_policys_format():
    """Natively, torch creates a plain optimizer's state in its parameters' dtype: with ``o=``
    another format, setup says so (and names what keeps it); lowprec's SGD keeps ``o=``
    itself, and a policy whose ``o=`` is the parameters' format says nothing."""
    from lowprec.training.optim import SGD
    from lowprec.training.optim.torch_adam import OptimizerPrecisionWarning

    def warned(policy, make_opt):
        m = nn.Linear(4, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Precision(policy).setup(m, make_opt(m.parameters()))
        return [str(w.message) for w in caught
                if issubclass(w.category, OptimizerPrecisionWarning)]

    torch_sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    said = warned("p=bf16,c=bf16,g=bf16,o=fp32,b=native", torch_sgd)
    assert len(said) == 1 and "o=fp32" in said[0] and "(bf16)" in said[0], said
    assert not warned("p=bf16,c=bf16,g=bf16,o=fp32,b=native",
                      lambda ps: SGD(ps, lr=0.1, momentum=0.9))
    assert not warned("p=bf16,c=bf16,g=bf16,o=bf16,b=native", torch_sgd)
    assert not warned("p=bf16,c=bf16,g=bf16,o=fp32,b=emulated", torch_sgd)
