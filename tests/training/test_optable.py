"""The op table (lowprec.training.emulation.optable) and the compiled backend's registration:
the dispatch the engine's tests check bit for bit, seen from its structure."""

import torch
from torch import nn

from lowprec import Precision
from lowprec.training.backends import (COMPILED_BACKENDS, CompiledEmulatedBackend,
                                       EmulatedBackend, NativeBackend, backend_class)
from lowprec.training.emulation import optable
from lowprec.training.policy import Backend


def _names(op: str) -> list[str]:
    return [h.__name__ for h in optable.PURE.get(op, optable.FIRST)]


def test_each_op_tries_its_handlers_in_the_chain_s_order():
    assert _names("lstm") == ["accumulated", "recurrent_native", "recurrent"]
    assert _names("scaled_dot_product_attention") == ["accumulated", "attention_native",
                                                      "attention"]
    # erf and sqrt: this CPU's kernel (match_cpu_kernels) before the replayed backward
    assert _names("erf") == ["accumulated", "elementwise_native", "replayed"]
    assert _names("conv2d") == ["accumulated", "conv_bias_after"]
    assert _names("linear") == ["accumulated", "split_linear"]
    assert _names("add") == ["accumulated"]  # then plain
    listing = optable.listing()
    assert "layer_norm" in listing and listing.count("\n") == len(optable.PURE)


def test_a_declining_handler_hands_the_op_to_the_next():
    x = torch.randn(3)
    op = optable.OpCall(torch.exp, "exp", None, "", (x,), {})

    class Engine:
        match_cpu_kernels = False

    calls = []
    saved = optable.PURE.get("exp")
    try:
        optable.PURE["exp"] = (lambda em, op: calls.append(1) or optable.DECLINE,)
        assert torch.equal(optable.run(Engine(), op), torch.exp(x))  # plain
    finally:
        optable.PURE["exp"] = saved
    assert calls == [1]


def test_compile_selects_the_compiled_backend_of_the_emulated_kind():
    assert COMPILED_BACKENDS == {Backend.EMULATED: CompiledEmulatedBackend}
    assert backend_class(Backend.EMULATED, compiled=True) is CompiledEmulatedBackend
    assert backend_class(Backend.NATIVE, compiled=True) is NativeBackend
    assert backend_class(Backend.EMULATED) is EmulatedBackend
    prec = Precision("p=fp16,c=fp16,g=fp16,b=emulated", compile=True)
    prec.setup(nn.Linear(2, 2))
    assert type(prec._backend) is CompiledEmulatedBackend and prec.backend is Backend.EMULATED
    assert prec._backend.compiled is not None
    prec = Precision("p=fp16,c=fp16,g=fp16,b=emulated")
    prec.setup(nn.Linear(2, 2))
    assert type(prec._backend) is EmulatedBackend and prec._backend.compiled is None
