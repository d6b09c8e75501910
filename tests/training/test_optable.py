"""The op table (lowprec.training.emulation.optable): the dispatch the engine's tests check bit
for bit, seen from its structure."""

import torch

from lowprec.training.emulation import optable


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

