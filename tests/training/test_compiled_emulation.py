"""Compiled emulation (lowprec.training.emulation.compiled): a model set up under an emulated
policy with ``Precision(..., compile=True)`` runs its forward and backward compiled by Inductor
with every rounding of the eager engine in the graph, and gives the eager engine's bits:
outputs, gradients and parameters after 3 optimizer steps, compared with ``torch.equal`` on
float32 bit patterns. One model compiled per test (an Inductor compile takes 10-60 s here)."""

import dataclasses
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import assert_same_bits
from lowprec import Precision, quantize
from lowprec.numerics import kernel
from lowprec.experiments.models import MLP, LeNet5, TransformerClassifier, build_model
from lowprec.training.backends import BackendChoiceWarning
from lowprec.training.policy import Backend, parse_policy
from lowprec.training.emulation.compiled import CompiledForward, compile_model
from lowprec.training.tree import call_model, output_tensor

GRID = {"16-true": "fp16", "bf16-true": "bf16"}

MODELS = {
    "mlp": (lambda: MLP((1, 8, 8), 10, hidden=(32, 16)), (8, 1, 8, 8)),
    "lenet": (lambda: LeNet5((1, 16, 16), 10), (8, 1, 16, 16)),
    "transformer": (lambda: TransformerClassifier((6, 8), 10, d_model=16, layers=1, heads=2),
                    (8, 6, 8)),
    # batch norm in training: the engine's 16-bit replay runs torch's fp32 batch-norm kernels,
    # and 16-mixed runs batch norm in fp32; Inductor's decompositions of them sum in another
    # order (49 and 76 of 83 tensors of the zoo ResNet differed before they were kept whole)
    "bncnn": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4),
                                    nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1),
                                    nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                    nn.Flatten(), nn.Linear(16, 10)), (8, 1, 8, 8)),
    # pure bf16 batch statistics: the kernel's sums in ATen's order (contiguous: by planes,
    # channels-last: by rows), opaque ops in the trace
    "bncnn_cl": (lambda: MODELS["bncnn"][0]().to(memory_format=torch.channels_last),
                 (8, 1, 8, 8)),
    # softmax along the channels, 5 x 5 positions a channel: fewer than a vector, so the CPU
    # kernel's scalar tail (each exp stored in 16 bits), decided from shapes while tracing
    "softmaxnet": (lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Softmax(dim=1),
                                         nn.Flatten(), nn.Linear(100, 10)), (8, 1, 5, 5)),
    # a frozen batch norm (eval mode while the rest trains): its running statistics only read
    "frozenbn": (lambda: _frozen(MODELS["bncnn"][0](), 1), (8, 1, 8, 8)),
    # residual blocks: batch norm's y = x * a + b' (addcmul) in every block
    "resnet20": (lambda: build_model("resnet20", (1, 28, 28), 10), (8, 1, 28, 28)),
}


def _frozen(model: nn.Sequential, i: int) -> nn.Sequential:
    model[i].eval()
    return model


class _ClampNet(nn.Module):
    """ReLU6 (in place), hardtanh and clamp with bounds on the grid (not rounded: the engine
    decides that from the format's fields while the graph is traced with fake tensors), and a
    clamp of integer indices."""

    def __init__(self):
        super().__init__()
        self.conv, self.emb = nn.Conv2d(1, 4, 3, padding=1), nn.Embedding(4, 4)
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        ids = (x.flatten(1)[:, 0] * 10).long().clamp(0, 3)
        h = F.relu6(self.conv(x), inplace=True) + self.emb(ids)[:, :, None, None]
        h = F.hardtanh(h, -1.0, 1.0).clamp(min=-0.5, max=0.25)
        return self.head(h.flatten(1))


MODELS["clampnet"] = (_ClampNet, (8, 1, 8, 8))


def _emu(policy: str):
    """``policy`` on the emulated backend: ``auto`` runs bf16 natively on a CPU with AVX512-BF16
    or AMX (and fp16 with AMX-FP16), where there is no emulation to compile."""
    return dataclasses.replace(parse_policy(policy), backend=Backend.EMULATED)


def _batch(shape):
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)


def _train(name, policy, steps=3, **precision):
    """``steps`` SGD steps of the README loop; the model's output and gradients at each step
    and its parameters after the last."""
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x, y = _batch(shape)
    prec = Precision(_emu(policy), **precision)
    with warnings.catch_warnings():
        # the backend auto chose (emulated on this CPU)
        warnings.simplefilter("ignore", BackendChoiceWarning)
        model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    outs, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        with prec.autocast():
            out = model(x)
            loss = F.cross_entropy(out, y)
        prec.backward(loss)
        outs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        prec.step(opt)
    return model, outs, grads, [p.detach().clone() for p in model.parameters()]


def _same_run(a, b, what):
    (ma, oa, ga, pa), (mb, ob, gb, pb) = a, b
    for s in range(len(oa)):
        assert_same_bits(oa[s], ob[s], f"{what}: output, step {s}")
        for i, (u, v) in enumerate(zip(ga[s], gb[s])):
            assert_same_bits(u, v, f"{what}: gradient {i}, step {s}")
    for i, (u, v) in enumerate(zip(pa, pb)):
        assert_same_bits(u, v, f"{what}: parameter {i} after {len(oa)} steps")
    # and the buffers (batch norm's running statistics), which eval mode reads
    bufs = dict(mb.named_buffers())
    for name, u in ma.named_buffers():
        if u.is_floating_point():
            assert_same_bits(u, bufs[name], f"{what}: buffer {name} after {len(oa)} steps")


@pytest.mark.parametrize("name,policy", [
    ("mlp", "16-true"), ("lenet", "bf16-true"), ("transformer", "16-true"),
    ("mlp", "16-mixed"), ("lenet", "16-mixed"), ("transformer", "16-mixed"),
    ("bncnn", "16-true"), ("bncnn", "16-mixed"), ("clampnet", "16-true"),
    ("bncnn", "bf16-true"), ("bncnn_cl", "bf16-true"), ("softmaxnet", "16-true"),
    ("softmaxnet", "bf16-true"), ("frozenbn", "16-true"), ("frozenbn", "bf16-true"),
    # stochastic rounding: one base pair of keys drawn per forward, a graph input, each
    # rounding's keys derived from it in the graph as the eager engine derives them
    ("mlp", "q6.10-sr"), ("transformer", "p=fp16,c=fp16:sr,g=fp16:sr"),
    # batch norm of a format no 16-bit kernel stands for: the fp32 kernels, opaque
    ("bncnn", "q6.10-sr"),
    # Inductor's addcmul (no fused multiply-add on a CPU) moved roundings at step 2
    ("resnet20", "q6.10-sr")])
def test_compiled_emulation_has_the_eager_bits(name, policy):
    compiled = _train(name, policy, compile=True)  # first: nothing cached by an eager run
    eager = _train(name, policy)
    fwd = compiled[0].forward
    assert isinstance(fwd, CompiledForward) and fwd.reason is None  # it did not fall back
    # every rounding is in the compiled graphs, forward and backward (a lowprec::quantize node
    # or the fused decomposition, expanded inline for Inductor to fuse)
    assert fwd.quantize_nodes.get("forward", 0) > 0 and fwd.quantize_nodes.get("backward", 0) > 0
    _same_run(eager, compiled, f"{name} {policy}")
    if policy in GRID:  # the output is on the compute format's grid: rounded
        out = compiled[1][-1]
        assert torch.equal(quantize(out, GRID[policy]), out)


def test_a_batch_norm_compiles_before_any_eager_step_has_probed_the_cpus_addcmul():
    # the batch-norm replay's probe of ATen's addcmul (cached once) ran first while a graph was
    # traced, on fake tensors: a data-dependent guard, and the forward fell back to eager
    # (test_compiled_emulation_has_the_eager_bits[bncnn-16-true] failed alone, passed after
    # other tests had run the probe eagerly)
    from lowprec.training.emulation import kernels

    kernels._addcmul_contracts.cache_clear()
    model = _train("bncnn", "16-true", steps=1, compile=True)[0]
    assert model.forward.reason is None, model.forward.reason


def test_dynamo_takes_the_model_as_one_graph_and_an_outer_compile_keeps_the_bits():
    torch.manual_seed(0)
    build, shape = MODELS["lenet"]
    model, (x, _) = build(), _batch(shape)
    prec = Precision(_emu("16-true"), compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = prec.setup(model)
    # what the compiled path hands Dynamo: the model's own forward, its hooks traced as no-ops
    ex = torch._dynamo.explain(prec.emulation.original_forward)(x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    # a torch.compile around the set-up model runs the compiled emulation inside it
    out = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs eagerly" warning either
        again = torch.compile(model)(x)
    assert_same_bits(again, out, "outer torch.compile")
    with torch.no_grad():  # an inference graph: the same roundings, no backward
        assert_same_bits(model(x), out, "no_grad")
    assert model.forward.quantize_nodes["inference"] == model.forward.quantize_nodes["forward"]


def test_overrides_run_eagerly_with_one_warning_and_the_eager_bits():
    over = {"2": "32-true"}  # the second Linear in fp32
    eager = _train("mlp", "16-true", steps=2, overrides=over)
    with pytest.warns(UserWarning, match="compiled emulation runs this model eagerly: "
                                         "per-module overrides") as rec:
        compiled = _train("mlp", "16-true", steps=2, overrides=over, compile=True)
    assert sum("compiled emulation" in str(w.message) for w in rec) == 1
    _same_run(eager, compiled, "overrides")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        if x.sum().item() > 0:  # a Python branch on a value: Dynamo cannot keep one graph
            x = x * 2
        return self.fc(x)


@pytest.mark.parametrize("policy", ["bf16-true", "p=fp16,c=fp16:sr,g=fp16:sr"])
def test_a_model_that_breaks_the_graph_falls_back_once_with_the_reason(policy):
    # stochastic rounding: the call that falls back rounds with the keys it drew already
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    runs = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = _DataDependent()
        prec = Precision(_emu(policy), compile=compile)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = prec.setup(model)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            outs = [model(x), model(x)]
        said = [str(w.message) for w in rec if "compiled emulation" in str(w.message)]
        runs.append(outs)
    assert len(said) == 1 and "runs this model eagerly: " in said[0], said
    assert model.forward.reason is not None
    for a, b in zip(*runs):
        assert_same_bits(a, b, "fallback")


def test_a_mixed_stochastic_policy_compiles_inside_and_outside_autocast():
    """Outside autocast a mixed policy does not round (no keys drawn); that call compiled a
    function without keys, which the backend took for keys missing from the graph and fell
    back to eager for good. Traced op by op (compiler="aten"): the bits are eager's either way."""
    x, _ = _batch((8, 1, 8, 8))
    runs = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = MODELS["mlp"][0]()
        prec = Precision(_emu("p=fp32,c=fp16:sr,g=fp16:sr,s=matmul"), seed=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BackendChoiceWarning)
            model, _ = prec.setup(model)
        if compile:
            fwd = compile_model(prec.emulation, compiler="aten")
        with torch.no_grad():
            outs = [model(x)]
        with prec.autocast():
            outs += [model(x), model(x)]
        runs.append(outs)
    assert fwd.reason is None, fwd.reason
    assert fwd.quantize_nodes.get("inference", 0) > 0 or fwd.quantize_nodes.get("forward", 0) > 0
    for i, (a, b) in enumerate(zip(*runs)):
        assert_same_bits(a, b, f"call {i}")
    assert not torch.equal(runs[1][1], runs[1][2])  # fresh keys each forward


def test_bad_arguments_are_refused():
    torch.manual_seed(0)
    prec = Precision(_emu("16-true"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prec.setup(MLP((4,), 2, hidden=(3,)))
    with pytest.raises(ValueError, match="compiler='xla'; accepted: inductor, aten"):
        compile_model(prec.emulation, compiler="xla")
    with pytest.raises(TypeError, match="compile='yes'"):
        Precision("16-true", compile="yes")


def _zoo():
    """tests/zoo/zoo.py (the model zoo), imported as the zoo tests import it."""
    if "zoo" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "zoo" / "zoo.py"
        spec = importlib.util.spec_from_file_location("zoo", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["zoo"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["zoo"].ZOO


def _train_entry(entry, policy, compile, steps=3):
    model = entry.build()
    inputs, targets = entry.batch()
    prec = Precision(_emu(policy), compile=compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendChoiceWarning)
        model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    outs, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        with prec.autocast():
            out = output_tensor(call_model(model, inputs))
            loss = entry.loss(out, targets)
        prec.backward(loss)
        outs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        prec.step(opt)
    return model, outs, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name,policy,reason", [
    ("kw-dict-output", "bf16-true", None),  # keyword inputs, a dict output, LayerNorm, SiLU
    # an embedding's 16-bit gradient (its data-dependent sums: one opaque op) beside GELU
    # (ATen's kernel, opaque: Inductor's erf moved a 16-bit rounding at step 3)
    ("dict-input", "16-true", None),
    # its fp32 embedding gradient: ATen's kernel (the decomposition added 3 rows otherwise)
    ("encoder", "16-mixed", None),
    # its masked mean runs .to(h.dtype): float16 eagerly, float32 in Dynamo's plain trace; traced
    # again with the engine's answer (float16)
    ("encoder", "16-true", None),
    # dropout: ATen's kernel (native_dropout, Inductor's fallback_random), the eager draws;
    # stochastic rounding: the opaque op (the C kernel) beside them
    ("bert", "16-true", None), ("bert", "q6.10-sr", None),
])
def test_zoo_models_compile_or_say_why_with_the_eager_bits(name, policy, reason):
    entry = _zoo()[name]
    eager = _train_entry(entry, policy, False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run = _train_entry(entry, policy, True)
    said = [str(w.message) for w in rec if "compiled emulation" in str(w.message)]
    assert (run[0].forward.reason is None) == (reason is None)
    assert len(said) == (0 if reason is None else 1), said
    if reason is not None:
        assert reason in said[0], said[0]
    _same_run(eager, run, f"{name} {policy}")


def test_a_copy_of_a_compiled_model_runs_its_own_weights_and_its_twin_the_plain_forward():
    # copy.deepcopy (and fp32_twin, which the analyses use) once kept the original's compiled
    # graphs: the copy computed with the original's weights
    import copy

    from lowprec.analysis.common import fp32_twin

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    prec = Precision(_emu("bf16-true"), compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendChoiceWarning)
        model, _ = prec.setup(model)
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    # the backward is compiled with the forward (a failure there falls back too)
    assert model.forward.quantize_nodes.get("backward", 0) > 0
    twin_copy = copy.deepcopy(model)
    with torch.no_grad():
        twin_copy.weight.zero_()
        twin_copy.bias.zero_()
    assert torch.equal(twin_copy(x), torch.zeros(2, 4))
    assert not torch.equal(model(x), torch.zeros(2, 4))
    twin = fp32_twin(model)
    assert "forward" not in twin.__dict__  # the plain module forward, in fp32
    ref = torch.nn.functional.linear(x, model.weight, model.bias)
    assert torch.equal(twin(x), ref)


def test_compile_on_the_native_backend_says_it_does_nothing():
    with pytest.warns(UserWarning, match="compile=True has no effect"):
        Precision("p=bf16,c=bf16,g=bf16,b=native", compile=True).setup(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="accepted: True or False"):
        Precision("16-true", compile="yes")


class _ReadsDtypes(torch.nn.Module):
    """Model code reading dtypes: harmlessly (a comparison whose answer is the same under
    16-true, float16 == float16, as in a graph, float32 == float32: ViT's input check); with
    ``finfo``, into a constant the graph would freeze (-3.4e38 for float16's -65504); with
    ``eye``, into a factory's dtype; with ``branch``, into a branch taken only under float16,
    which breaks the graph; with ``literal``, into comparisons with ``torch.float16`` (Dynamo
    takes the other branch on float32, leaving nothing of the read in the graph); with
    ``renamed``, the same after a ``finfo`` read whose answer renames the later nodes."""

    def __init__(self, read: str):
        super().__init__()
        torch.manual_seed(0)
        self.read = read
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        if x.dtype != self.lin.weight.dtype:
            x = x.to(self.lin.weight.dtype)
        h = self.lin(x)
        if self.read == "finfo":  # a large negative score where a native fp16 run has -65504
            h = torch.where(h > 0.5, torch.finfo(h.dtype).min, h)
        if self.read == "eye":  # float16 in the re-trace: its matmul with float32 is fake's
            h = h @ torch.eye(3, dtype=h.dtype)
        if self.read == "branch":
            lo = torch.finfo(h.dtype).min
            if h.dtype == torch.float16:
                torch._dynamo.graph_break()
            h = torch.where(h > 0.5, lo, h)
        if self.read in ("literal", "renamed"):
            if self.read == "renamed":  # an answer that adds nodes: later reads get new keys
                h = torch.where(h > 5, torch.finfo(h.dtype).min, h)
            for _ in range(2):
                if h.dtype == torch.float16:  # a comparison with a literal: x4 eagerly
                    h = h * 2
        return h


@pytest.mark.parametrize("read", ["compare", "finfo", "eye", "branch", "literal", "renamed"])
def test_a_dtype_read_is_traced_as_the_engine_answers_it_or_falls_back(read):
    """A read the graph would freeze otherwise than eager emulation answers it (finfo) is
    traced again with the engine's answer, and compiles with the eager bits; where that trace
    fails (a branch Dynamo cannot take), it runs eagerly, both reasons said in one line."""
    import types as _types

    entry = _types.SimpleNamespace(
        build=lambda: _ReadsDtypes(read),
        batch=lambda: (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)),
                       torch.tensor([0, 1, 2, 0, 1, 2])),
        loss=lambda out, y: torch.nn.functional.cross_entropy(out.float().clamp(min=-1e4), y))
    eager = _train_entry(entry, "16-true", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run = _train_entry(entry, "16-true", True)
    said = [str(w.message) for w in rec if "compiled emulation" in str(w.message)]
    if read == "branch":
        assert len(said) == 1 and "reads the dtype of a tensor made at test_compiled" in said[0]
        assert "traced again with the engine's answers" in said[0]
        assert run[0].forward.reason is not None
    else:
        assert said == [] and run[0].forward.reason is None
    if read == "finfo":  # the eager answer, float16's, is in the graph
        assert all(o.min() >= -65504.0 for o in run[1]) and (run[1][0] == -65504.0).any()
    _same_run(eager, run, f"read={read}")


def test_the_forward_saves_no_boolean_mask_and_the_backward_reads_the_same_values():
    """A ReLU's backward mask (``threshold_backward``'s ``self <= 0``) crosses from the forward
    graph to the backward graph as float32 0/1 (Inductor stores a boolean vector element by
    element), and becomes boolean again there: the gradient is unchanged."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from lowprec.training.emulation.compiled import _partition

    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm)
        return compiler

    def f(x, w):  # the mask is saved (a matmul is not recomputed, its output is 4x the mask)
        return torch.relu(x @ w).sum()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 33, generator=g)
    w = torch.randn(33, 17, generator=g, requires_grad=True)
    wc = w.detach().clone().requires_grad_(True)
    plain = aot_function(f, fw_compiler=keep("fw0"), bw_compiler=keep("bw0"),
                         partition_fn=min_cut_rematerialization_partition,
                         decompositions=select_decomp_table())
    plain(x, wc).backward()
    saved0 = [getattr(n, "meta", {}).get("val") for n in graphs["fw0"].graph.output_node().args[0]]
    assert any(torch.is_tensor(v) and v.dtype == torch.bool for v in saved0)  # what is fixed

    compiled = aot_function(f, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                            partition_fn=_partition(min_cut_rematerialization_partition),
                            decompositions=select_decomp_table())
    loss = compiled(x, w)
    loss.backward()
    saved = [getattr(n, "meta", {}).get("val") for n in graphs["fw"].graph.output_node().args[0]]
    assert not any(torch.is_tensor(v) and v.dtype == torch.bool for v in saved)
    ref = w.detach().clone().requires_grad_(True)
    f(x, ref).backward()
    assert torch.equal(w.grad, ref.grad) and torch.equal(loss, f(x, ref.detach()))


def _compiled_graphs(monkeypatch, name: str, policy: str) -> list:
    """The ATen graphs (forward, backward) Inductor gets for one compiled training step of
    ``name`` under ``policy``, after lowprec's rewrites (opaque ops): copies taken as Inductor
    is called, since Inductor's own passes rewrite the graph in place where its cache misses."""
    import types

    import torch._inductor.compile_fx as cfx

    from lowprec.training.emulation import compiled as mod

    graphs = []
    inner, lowprec_inner = cfx.compile_fx_inner, mod._inner

    def keep(gm, example_inputs, **kwargs):
        graph = torch.fx.Graph()  # (nodes copied, their metadata shared: no deep copy of
        graph.output(graph.graph_copy(gm.graph, {}))  # the fake tensors while tracing)
        graphs.append(types.SimpleNamespace(graph=graph))
        return inner(gm, example_inputs, **kwargs)

    def lowprec_keeps(gm, example_inputs, **kwargs):  # (a compiler of its own: no graph of an
        return lowprec_inner(gm, example_inputs, **kwargs)  # earlier test from the caches)

    monkeypatch.setattr(cfx, "compile_fx_inner", keep)
    monkeypatch.setattr(mod, "_inner", lowprec_keeps)
    _train(name, policy, steps=1, compile=True)
    return graphs


def test_a_gradient_on_the_grid_is_not_rounded_again_in_the_graph(monkeypatch):
    """The gradient marks hold while a graph is traced: no fp16 cast round trip in the compiled
    graphs of a 16-true transformer takes a value that such a round trip gave (19 of 68 did
    before), and the run keeps the eager bits (the test above)."""
    from lowprec.training.emulation.compiled import _cast_to

    graphs = _compiled_graphs(monkeypatch, "transformer", "16-true")

    def round_trip(n):  # what a round trip to fp16 that ends in ``n`` rounded, or None
        if _cast_to(n) == torch.float32 and _cast_to(n.args[0]) == torch.float16:
            return n.args[0].args[0]
        return None

    trips = doubled = 0
    for gm in graphs:
        for n in gm.graph.nodes:
            src = round_trip(n)
            if src is not None:
                trips += 1
                doubled += round_trip(src) is not None
    assert len(graphs) == 2 and trips > 10 and doubled == 0, (trips, doubled)


def test_max_pooling_runs_atens_kernel_in_the_compiled_graphs(monkeypatch):
    """LeNet-5's max pooling and its backward are ATen's kernels in the compiled graphs (an
    opaque op each: Inductor's window loop is scalar code), with the eager bits (above)."""
    graphs = _compiled_graphs(monkeypatch, "lenet", "bf16-true")
    targets = [{n.target for n in gm.graph.nodes} for gm in graphs]
    lc = torch.ops.lowprec_compiled
    assert len(targets) == 2 and lc.max_pool2d.default in targets[0] and \
        lc.max_pool2d_backward.default in targets[1]
    aten = torch.ops.aten
    assert not any(aten.max_pool2d_with_indices.default in t or
                   aten.max_pool2d_with_indices_backward.default in t for t in targets)


@pytest.mark.skipif(not kernel.available(), reason="the compiled C kernel is not built")
def test_stochastic_roundings_run_the_kernel_in_the_compiled_graphs(monkeypatch):
    """Under q6.10-sr every rounding of the compiled graphs is the opaque lowprec::quantize
    (the C kernel, one pass) on a CPU: the fused decomposition's random-word hash was most of
    the first compiled step. The bits are eager's (test_compiled_emulation_has_the_eager_bits:
    mlp, bncnn under q6.10-sr)."""
    from lowprec.numerics.ops import quantize_op
    from lowprec.training.emulation.compiled import roundings_in

    graphs = _compiled_graphs(monkeypatch, "mlp", "q6.10-sr")
    opaque = [len(gm.graph.find_nodes(op="call_function", target=quantize_op()))
              for gm in graphs]
    # every rounding (opaque ones, and the fused decomposition's, which end in a bitcast or
    # fixed point's saturating where) is an opaque one
    assert len(graphs) == 2 and min(opaque) >= 2
    assert [roundings_in(gm.graph) for gm in graphs] == opaque


@pytest.mark.skipif(not kernel.available(), reason="the compiled C kernel is not built")
def test_a_channels_last_step_rounds_stochastically_in_channels_last():
    """In the code Inductor generates for a channels-last CNN's step under q6.10-sr, every
    4-d stochastic rounding (the opaque lowprec::quantize, whose result's strides the code
    asserts) takes and gives channels-last tensors. Compiled emulation once lowered the op with
    contiguous inputs, and each channels-last gradient was transposed for its rounding and
    back (ResNet-20 on an AMD EPYC with AVX512-BF16: 1.7x eager fp32's step against eager
    emulation's 1.5x), with the eager bits all the same. (Inductor's cache is off here: a cache hit generates no code.)"""
    import re

    from torch._inductor.utils import run_and_get_code

    from lowprec.experiments.models import channels_last

    build, shape = MODELS["bncnn"]
    torch.manual_seed(0)
    model = build()
    channels_last(model)
    x, y = _batch(shape)
    x = x.contiguous(memory_format=torch.channels_last)
    prec = Precision(_emu("q6.10-sr"), compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendChoiceWarning)
        model, opt = prec.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def step():
        opt.zero_grad()
        with prec.autocast():
            loss = F.cross_entropy(model(x), y)
        prec.backward(loss)
        prec.step(opt)

    with torch._inductor.config.patch(force_disable_caches=True):
        _, codes = run_and_get_code(step)
    assert getattr(model.forward, "reason", None) is None
    asserted = re.findall(r"assert_size_stride\(\w+, \(\d+, (\d+), (\d+), (\d+)\), "
                          r"\(\d+, (\d+), \d+, \d+\), 'torch.ops.lowprec.quantize.default'\)",
                          "\n".join(codes))
    # the convolutions' activations and gradients (4 channels, 8 x 8; not the one-channel
    # input, both layouts at once, nor the pooled 2 x 2 gradient, which the flatten's backward
    # hands on row-major in eager emulation too)
    convs = [a for a in asserted if a[:3] == ("4", "8", "8")]
    assert len(codes) == 2 and len(convs) >= 6, (len(codes), asserted)
    assert all(stride_c == "1" for *_, stride_c in convs), convs


def test_addcmul_and_adaptive_pooling_run_atens_kernels_in_the_compiled_graphs(monkeypatch):
    """Batch norm's y = x * a + b' (addcmul: ATen's CPU kernel contracts it to one fused
    multiply-add, Inductor's CPU code does not) and adaptive average pooling (Inductor sums
    its windows in another order) are ATen's kernels in the compiled graphs."""
    graphs = _compiled_graphs(monkeypatch, "bncnn", "16-true")
    targets = {n.target for gm in graphs for n in gm.graph.nodes}
    lc, aten = torch.ops.lowprec_compiled, torch.ops.aten
    assert {lc.addcmul.default, lc.adaptive_avg_pool2d.default} <= targets
    assert not {aten.addcmul.default, aten._adaptive_avg_pool2d.default} & targets


class _Dropped(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.drop, self.b = nn.Linear(64, 256), nn.Dropout(p), nn.Linear(256, 10)

    def forward(self, x):
        return self.b(self.drop(self.a(x)))


@pytest.mark.parametrize("policy", ["q6.10-sr", "16-mixed"])
@pytest.mark.parametrize("p", [0.15, 0.42])
def test_dropout_compiles_with_the_eager_masks_and_scale(p, policy):
    """Dropout draws eager's masks (torch's generator, ATen's kernel) and scales by eager's
    float32 1 / (1 - p): the trace's native_dropout scales in double, an ulp apart at these p
    (the zoo BERT's 0.1 happens to agree)."""
    import types as _types

    entry = _types.SimpleNamespace(
        build=lambda: _Dropped(p),
        batch=lambda: (torch.randn(64, 64, generator=torch.Generator().manual_seed(1)),
                       torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(2))),
        loss=lambda out, y: F.cross_entropy(out.float(), y))
    torch.manual_seed(5)
    eager = _train_entry(entry, policy, False)
    torch.manual_seed(5)
    run = _train_entry(entry, policy, True)
    assert run[0].forward.reason is None
    _same_run(eager, run, f"dropout p={p} {policy}")


class _Pool1(nn.Module):
    """Max pooling spelled with one-element lists (ATen reads them as both sides)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.conv(x)), (3,), stride=1, padding=(1,))
        return self.fc(y.flatten(1))


def test_max_pooling_spelled_with_one_element_lists_compiles_with_the_eager_bits(monkeypatch):
    monkeypatch.setitem(MODELS, "pool1", (_Pool1, (8, 1, 8, 8)))
    compiled = _train("pool1", "16-true", compile=True)
    assert compiled[0].forward.reason is None
    _same_run(_train("pool1", "16-true"), compiled, "pool1 16-true")
