"""``quantize`` inside ``torch.compile``: one rounding node, the eager bits.

The node is ``lowprec::quantize_fused`` (the integer decomposition Inductor fuses, checked in
test_fused_rounding.py) where it covers the format, else the opaque ``lowprec::quantize`` op.
Integer bit patterns cannot be simplified away as Inductor drops fp16 cast round trips by
default (../shared/FACTS.md), and bit identity with eager is checked anyway, with
Inductor (the default backend) wherever the code around the rounding is torch's own arithmetic
that Inductor does not reorder; where Inductor's generated code sums or fuses fp32 arithmetic in
another order (parameter gradients of a linear layer, an optimizer's update), the rounding is
checked with ``aot_eager``, which runs the traced graph with eager kernels.
"""

import subprocess
import sys

import pytest
import torch
from torch import nn

import lowprec
from lowprec import Quantizer, quantize, quantize_
from lowprec.numerics.ops import quantize_op
from lowprec.numerics.quantize import seed_tensor
from lowprec.training.optim import SGD, Adam

from helpers import assert_same_bits

OP = torch.ops.lowprec.quantize.default
FUSED = torch.ops.lowprec.quantize_fused.default


def explain(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


def ops_in(explained, ops=(OP, FUSED)) -> int:
    """Rounding nodes (lowprec::quantize or lowprec::quantize_fused) in the graphs, their
    subgraphs included (an autograd.Function is a higher-order op whose forward and backward
    are subgraphs)."""
    return sum(n.target in ops for g in explained.graphs for m in g.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "sr4"])
@pytest.mark.parametrize("fmt", ["fp16", "e4m3fn", "mxfp8_e4m3", "mxfp4"])
def test_quantize_is_one_node_of_one_graph_with_the_eager_bits(fmt, rounding):
    x = torch.randn(16, 64) * 4
    seed = seed_tensor(torch.Generator().manual_seed(3)) if rounding != "nearest" else None

    def f(x, seed):
        return quantize(x * 2, fmt, rounding, seed=seed) + 1

    e = explain(f, x, seed)
    assert (e.graph_count, e.graph_break_count, ops_in(e, (FUSED,))) == (1, 0, 1)
    torch._dynamo.reset()
    assert_same_bits(torch.compile(f, fullgraph=True)(x, seed), f(x, seed), f"{fmt} {rounding}")


@pytest.mark.parametrize("impl", ["op", "fused"])
def test_impl_picks_the_opaque_op_or_the_decomposition_with_the_eager_bits(impl):
    x = torch.randn(16, 64) * 4
    seed = seed_tensor(torch.Generator().manual_seed(4))

    def f(x, seed):
        return quantize(x * 2, "e5m2", "sr4", seed=seed, impl=impl) + 1

    e = explain(f, x, seed)
    assert ops_in(e, (OP if impl == "op" else FUSED,)) == 1 and ops_in(e) == 1
    torch._dynamo.reset()
    assert_same_bits(torch.compile(f, fullgraph=True)(x, seed), f(x, seed), impl)
    assert_same_bits(f(x, seed), quantize(x * 2, "e5m2", "sr4", seed=seed) + 1, "eager")


def test_a_seed_tensor_gives_the_bits_of_the_generator_it_was_drawn_from():
    x = torch.randn(1000)
    g = torch.Generator().manual_seed(9)
    a = quantize(x, "e4m3fn", "sr4", generator=g)
    g.manual_seed(9)
    b = quantize(x, "e4m3fn", "sr4", seed=seed_tensor(g))
    assert_same_bits(a, b)
    g.manual_seed(9)
    y = x.clone()
    quantize_(y, "e4m3fn", "sr4", seed=seed_tensor(g))
    assert_same_bits(y, a)
    with pytest.raises(ValueError, match="not both"):
        quantize(x, "fp16", "stochastic", generator=g, seed=seed_tensor(g))
    with pytest.raises(TypeError, match="integer tensor"):
        quantize(x, "fp16", "stochastic", seed=torch.zeros(2))
    with pytest.raises(ValueError, match="two keys"):
        quantize(x, "fp16", "stochastic", seed=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"2\*\*32"):
        quantize(x, "fp16", "stochastic", seed=torch.tensor([-1, 0]))


def test_quantize_in_place_compiles_to_the_op_and_a_copy():
    x = torch.randn(256)

    def h(x):
        y = x * 3
        quantize_(y, "e5m2")
        return y

    e = explain(h, x)
    assert (e.graph_count, e.graph_break_count, ops_in(e)) == (1, 0, 1)
    torch._dynamo.reset()
    assert_same_bits(torch.compile(h, fullgraph=True)(x), h(x))


def test_a_generator_is_drawn_between_graphs_with_the_eager_bits():
    """A torch.Generator cannot enter a graph: its keys are drawn by a function Dynamo does not
    trace (one break, refused under fullgraph=True); the bits are still eager's."""
    g = torch.Generator()

    def f(x):
        return quantize(x, "fp16", "stochastic", generator=g) * 2

    x = torch.randn(512)
    e = explain(f, x)
    assert (e.graph_count, e.graph_break_count) == (2, 1)
    g.manual_seed(5)
    eager = f(x)
    g.manual_seed(5)
    torch._dynamo.reset()
    assert_same_bits(torch.compile(f)(x), eager)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(f, fullgraph=True)(x)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Quantizer("e4m3fn", "e5m2"), nn.GELU(),
                         nn.Linear(8, 32), Quantizer("mxfp8_e4m3", "fp16"))


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_quantizer_modules_are_one_graph_with_fullgraph_and_the_eager_bits(backend):
    model = _model()
    x = torch.randn(5, 8, requires_grad=True)
    e = explain(model, x)
    # two roundings forward, two in the backward subgraphs
    assert (e.graph_count, e.graph_break_count, ops_in(e)) == (1, 0, 4)
    eager = model(x)
    eager.sum().backward()
    grads = [t.grad.clone() for t in (x, *model.parameters())]
    x.grad = None
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)(x)
    compiled.sum().backward()
    assert_same_bits(compiled, eager, "forward")
    assert_same_bits(x.grad, grads[0], "input gradient")  # through both backward roundings
    if backend == "aot_eager":  # Inductor sums the weight gradients in its own order
        for p, g in zip(model.parameters(), grads[1:]):
            assert_same_bits(p.grad, g, "parameter gradient")


@pytest.mark.parametrize("update", ["nearest", "kahan"])
@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9), lambda ps: Adam(ps, lr=1e-3)],
    ids=["sgd", "adam"])
def test_an_optimizer_step_compiles_to_one_graph_whose_roundings_are_the_op(make, update):
    """The fused C step is the eager path; compiled, the torch path (the same bits) runs, each
    write-back a lowprec::quantize node. aot_eager: Inductor's generated fp32 arithmetic differs
    from eager's even with fp32 storage."""
    x = torch.randn(4, 16)
    finals = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(16, 8)
        opt = make(model.parameters())
        opt.configure_storage(param_format="fp16", state_format="bf16", update=update)
        step = opt.step
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            step()
        finals.append([t.detach().clone() for t in model.parameters()] +
                      [v.clone() for s in opt.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.is_floating_point()])
    for a, b in zip(*finals):
        assert_same_bits(b, a, "parameters and state after three steps")
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    e = explain(opt.step)
    assert (e.graph_count, e.graph_break_count) == (1, 0) and ops_in(e) >= 2


def test_the_op_has_a_fake_and_takes_the_seed_as_a_tensor():
    op = quantize_op()
    x = torch.randn(3, 5)
    assert torch.equal(op(x, "fp16", "nearest", 0), x.half().float())
    keys = seed_tensor(torch.Generator().manual_seed(1))
    assert torch.equal(op(x, "fp16", "stochastic", 0, keys),
                       quantize(x, "fp16", "stochastic", seed=keys))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        y = op(mode.from_tensor(x), "mxfp4", "stochastic", 0, mode.from_tensor(keys))
    assert y.shape == x.shape and y.dtype == x.dtype


def test_the_op_is_registered_when_the_numerics_layer_is_imported():
    code = ("import torch, lowprec.numerics\n"
            "print(torch.ops.lowprec.quantize.default(torch.ones(2), 'e4m3fn', 'nearest', 0)"
            ".tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=1800)  # a hang guard only
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[1.0, 1.0]"
    assert lowprec.quantize is quantize


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced",
                                    "sliced_channels_last"])
@pytest.mark.parametrize("rounding,bits", [("nearest", 0), ("stochastic", 32), ("stochastic", 0),
                                           ("stochastic_limited", 4)])
def test_the_op_returns_the_layout_its_fake_declares(layout, rounding, bits):
    """The op's result has ``empty_like(x)``'s strides, what its fake declares (Inductor
    asserts them): a dense input's layout kept, a sliced one's result dense, in the order
    empty_like gives (a sliced channels-last tensor: channels-last, where quantize's result is
    row-major); the values are quantize's. Stochastic rounding's 32 bits, as a graph passes
    them, give the bits of the mode's default."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 5, 4, 7, generator=g) * 3
    x = {"channels_last": base.to(memory_format=torch.channels_last),
         "transposed": base[0, 0].t(), "sliced": base[:, :, ::2],
         "sliced_channels_last": base.to(memory_format=torch.channels_last)[..., ::2]}[layout]
    keys = seed_tensor(torch.Generator().manual_seed(6)) if rounding != "nearest" else None
    y = quantize_op()(x, "q6.10", rounding, bits, keys)
    assert y.stride() == torch.empty_like(x).stride()
    want = quantize(x, "q6.10", rounding, seed=keys, random_bits=bits or None
                    if rounding == "stochastic_limited" else None)
    assert_same_bits(y, want, f"{layout} {rounding} {bits}")


def test_inductor_hands_the_op_a_channels_last_producer_as_it_was_traced():
    """Inside an Inductor graph the op takes a pointwise producer's result in the traced
    (channels-last) layout and its result stays so, with the eager bits. Here Dynamo records
    the eager input values, which constrain a custom op's inputs without a tag too; the op's
    needs_fixed_stride_order tag keeps the order where a graph records none (Inductor leaves
    an untagged custom op unconstrained there), and only its check below fails without it."""
    x = torch.randn(4, 16, 5, 5).to(memory_format=torch.channels_last)
    keys = seed_tensor(torch.Generator().manual_seed(7))

    def f(x, seed):
        return quantize((x * 2).relu(), "q6.10", "stochastic", seed=seed, impl="op") * 3

    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True)(x, keys)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_same_bits(y, f(x, keys), "channels-last")
    assert torch.Tag.needs_fixed_stride_order in quantize_op().tags


def test_the_ops_are_pt2_compliant_as_custom_ops_would_be():
    # lowprec's ops are defined with torch.library.Library (cheaper calls than custom_op's
    # wrappers): they carry the tag custom_op gives, so that Dynamo's
    # only_allow_pt2_compliant_ops accepts them, and compiled emulation's opaque ops too
    from lowprec.training.emulation.compiled import _opaque_ops

    _opaque_ops()
    ops = [torch.ops.lowprec.quantize.default, torch.ops.lowprec.channel_sums.default,
           torch.ops.lowprec.quantize_fused.default,
           torch.ops.lowprec_compiled.mm.default, torch.ops.lowprec_compiled.layer_norm.default]
    for op in ops:
        assert torch.Tag.pt2_compliant_tag in op.tags, op
    assert torch.Tag.needs_fixed_stride_order in torch.ops.lowprec.quantize.default.tags
