"""The fused LSTM cell gives the op-by-op replay's bits.

Under an emulated policy with plain formats (IEEE-style or fixed point, rounded to nearest),
each step of an ``nn.LSTM`` runs as one autograd node whose roundings are the C kernel's
(``_LSTMCell`` in emulation/recurrent_kernels.py, ``lp_lstm_*`` in csrc/recurrent.c) instead of some
forty ops and roundings. The reference is the op-by-op replay itself (the kernel's cell
switched off), which tests/training/test_fidelity.py checks bit for bit against torch's own
``.half()`` / ``.bfloat16()`` layers: outputs, every parameter gradient and the parameters
after two SGD steps, for the layer's options and for gradient formats other than the compute
format (fp16 values with bf16 gradients: sigmoid's backward then runs in fp32, not c10::Half).
The gradient format e8m22 keeps all but one bit of each float32 operation, so a kernel that
computes ``dy * ((1 - y) * y)`` where torch computes ``(dy * (1 - y)) * y`` fails there (it
did, 4 of 4 layers), where a 16-bit rounding would hide it in most elements.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import assert_same_bits
from lowprec import Precision
from lowprec.numerics import kernel
from lowprec.training.emulation import recurrent_kernels
from lowprec.training.optim import SGD

pytestmark = pytest.mark.skipif(not kernel.lstm_available(), reason="no compiled kernel")

POLICIES = ["16-true", "p=bf16,c=bf16,g=bf16,o=bf16,b=emulated", "p=fp16,c=fp16,g=bf16",
            "p=bf16,c=bf16,g=fp16,o=bf16,b=emulated", "q8.8", "p=fp16,c=fp16,g=e8m22"]
LAYERS = {  # the layer, a packed input
    "batch-first": (lambda: nn.LSTM(7, 32, batch_first=True), False),
    "time-first-2-layers-bidirectional": (lambda: nn.LSTM(7, 16, 2, bidirectional=True), False),
    "projections-packed": (lambda: nn.LSTM(7, 16, proj_size=5, batch_first=True), True),
    "no-bias-odd-width": (lambda: nn.LSTM(7, 13, bias=False, batch_first=True), False),
}


class Net(nn.Module):
    """Every output of the layer (the sequence and both final states) reaches the loss."""

    def __init__(self, lstm: nn.LSTM, packed: bool) -> None:
        super().__init__()
        self.lstm, self.packed = lstm, packed
        width = lstm.proj_size or lstm.hidden_size
        self.head = nn.Linear(width * (2 if lstm.bidirectional else 1), 3)

    def forward(self, x):  # x: (batch, time, features)
        first = self.lstm.batch_first
        x = x if first else x.transpose(0, 1)
        if self.packed:
            x = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 3, 5, 2, 6]),
                                                  batch_first=first, enforce_sorted=False)
        out, (h, c) = self.lstm(x)
        if self.packed:
            out = nn.utils.rnn.pad_packed_sequence(out, batch_first=first)[0]
        return self.head(out).sum(1 if first else 0) + h.sum() + c.sum()


def run(policy: str, case: str, fused: bool, monkeypatch) -> tuple[list, int]:
    """Outputs, gradients and parameters over two SGD steps; the fused steps run (by the
    per-step node or the whole-layer one)."""
    calls = []
    original = recurrent_kernels._cell_forward
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(kernel, "lstm_available", lambda: False)
        m.setattr(recurrent_kernels, "_cell_forward",
                  lambda *a: calls.append(1) or original(*a))
        make, packed = LAYERS[case]
        torch.manual_seed(0)
        net = Net(make(), packed)
        prec = Precision(policy, seed=0)
        model, opt = prec.setup(net, SGD(net.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(5, 6, 7, generator=g), torch.randint(0, 3, (5,), generator=g)
        seen = []
        for _ in range(2):
            opt.zero_grad()
            with prec.autocast():
                out = model(x)
                loss = nn.functional.cross_entropy(out.float(), y)
            prec.backward(loss)
            seen += [out.detach()] + [p.grad.clone() for p in net.parameters()]
            prec.step(opt)
        seen += [p.detach().clone() for p in net.parameters()]
    return seen, len(calls)


@pytest.mark.filterwarnings("ignore:LSTM with projections")
@pytest.mark.parametrize("case", list(LAYERS))
@pytest.mark.parametrize("policy", POLICIES)
def test_the_fused_cell_gives_the_op_by_op_replays_bits(policy, case, monkeypatch):
    fused, n_fused = run(policy, case, True, monkeypatch)
    replay, n_replay = run(policy, case, False, monkeypatch)
    lstm = LAYERS[case][0]()
    steps = 6 * lstm.num_layers * (2 if lstm.bidirectional else 1)
    if LAYERS[case][1]:  # packed: 6 steps, some with fewer rows, still one call each
        steps = 6
    assert n_replay == 0 and n_fused == 2 * steps, (n_fused, n_replay)
    assert len(fused) == len(replay)
    for i, (a, b) in enumerate(zip(fused, replay)):
        assert_same_bits(a, b, f"{policy} {case}: tensor {i}")


@pytest.mark.filterwarnings("ignore:LSTM with projections")
@pytest.mark.parametrize("case,nodes", [("batch-first", 1), ("time-first-2-layers-bidirectional", 4),
                                        ("no-bias-odd-width", 1), ("projections-packed", 0)])
def test_whole_layers_run_as_one_node(case, nodes, monkeypatch):
    """A layer without projections or packing, with gradients, runs as one autograd node
    (``_LSTMLayer``: each direction of each layer, a forward a step); the test above holds its
    bits to the per-step chain's, and tests/training/test_fidelity.py to ``model.half()``'s."""
    calls = []
    original = recurrent_kernels._LSTMLayer.apply
    monkeypatch.setattr(recurrent_kernels._LSTMLayer, "apply",
                        lambda *a: calls.append(1) or original(*a))
    run("16-true", case, True, monkeypatch)
    assert len(calls) == 2 * nodes


def test_stochastic_and_mixed_policies_keep_the_op_by_op_replay(monkeypatch):
    for policy in ("q6.10-sr", "p=fp16,c=fp16:sr,g=fp16:sr", "16-mixed"):
        _, n = run(policy, "batch-first", True, monkeypatch)
        assert n == 0, policy


class HeadOnLSTM(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(7, hidden, batch_first=True), nn.Linear(hidden, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out) + c.sum()


def _forward(fused: bool, grad: bool, monkeypatch, policy: str, overrides=None, hidden=16,
             batch=4):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(kernel, "lstm_available", lambda: False)
        torch.manual_seed(0)
        net = HeadOnLSTM(hidden)
        prec = Precision(policy, seed=0, overrides=overrides)
        model, _ = prec.setup(net)
        x = torch.randn(batch, 5, 7, generator=torch.Generator().manual_seed(1))
        with torch.set_grad_enabled(grad), prec.autocast():
            out = model(x)
        if grad:
            out.float().pow(2).sum().backward()
            return [out.detach()] + [p.grad for p in net.parameters()]
        return [out]


@pytest.mark.parametrize("grad", [True, False])
def test_a_stochastic_model_around_the_fused_cell_keeps_its_keys(grad, monkeypatch):
    """Stochastic rounding elsewhere in the model: each rounding's keys come from its site's
    number in the forward, so the fused cell must take as many sites as the op-by-op cell
    would: six, and five more without gradients (its activations then rounded as ops).
    Found by review: it took six always, and a no-grad forward's later roundings differed."""
    policy = "p=fp16,c=fp16:sr,g=fp16:sr,s=all,b=emulated"
    nearest = {"lstm": "p=fp16,c=fp16,g=fp16,s=all,b=emulated"}
    a = _forward(True, grad, monkeypatch, policy, nearest)
    b = _forward(False, grad, monkeypatch, policy, nearest)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_bits(x, y, f"tensor {i}")


@pytest.mark.parametrize("hidden,batch", [(1, 1), (1, 4), (5, 1), (300, 2)])
def test_one_unit_one_row_and_wide_layers(hidden, batch, monkeypatch):
    """A gradient of one row or one unit may come with stride 0 (an expanded sum's gradient):
    the kernel's row stride is not read then (it raised); 300 units: two column pieces."""
    a = _forward(True, True, monkeypatch, "16-true", hidden=hidden, batch=batch)
    b = _forward(False, True, monkeypatch, "16-true", hidden=hidden, batch=batch)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_bits(x, y, f"tensor {i}")


def test_a_traced_sum_of_gradients_takes_graph_ops(monkeypatch):
    """While compiled emulation traces a backward, the 16-bit sum of a recurrent layer's
    gradients must be graph ops, not the kernel on a tensor's memory (review: a GRU compiled
    with Dynamo's allow_rnn fell back to eager, 'Cannot access data pointer')."""
    from lowprec.numerics.formats import FP16
    from lowprec.numerics.quantize import tracing_graph

    def refuse(*args):
        raise AssertionError("the kernel was called while tracing")

    r = recurrent_kernels._Rounder(FP16)
    a, b = torch.randn(64), torch.randn(64)
    want = r.add2(a, b)
    monkeypatch.setattr(kernel, "round_add2", refuse)
    with tracing_graph():
        got = r.add2(a, b)
    assert_same_bits(got, want, "add2 traced")


# (the last: values rounded to nearest, gradients stochastically: a site's backward keys are
# then its first draw, not its second; found by review)
SR_POLICIES = ["q6.10-sr", "p=fp16,c=fp16:sr,g=fp16:sr", "p=fp16,c=e5m2:sr,g=e4m3fn:sr4",
               "p=fp16,c=e5m2,g=e5m2:sr"]


def _run_ops(policy: str, case: str, op_layer: bool, monkeypatch) -> tuple[list, int]:
    """:func:`run` with the op-by-op layer node (``_LSTMLayerOps``) on or off: outputs,
    gradients and parameters over two SGD steps, and how many times the node ran."""
    calls = []
    original = recurrent_kernels._LSTMLayerOps.apply
    with monkeypatch.context() as m:
        if not op_layer:
            m.setattr(kernel, "lstm_op_available", lambda: False)
        m.setattr(recurrent_kernels._LSTMLayerOps, "apply",
                  lambda *a: calls.append(1) or original(*a))
        seen, _ = run(policy, case, True, m)
    return seen, len(calls)


@pytest.mark.filterwarnings("ignore:LSTM with projections")
@pytest.mark.parametrize("case,nodes", [("batch-first", 1), ("time-first-2-layers-bidirectional", 4),
                                        ("no-bias-odd-width", 1), ("projections-packed", 0)])
@pytest.mark.parametrize("policy", SR_POLICIES)
def test_the_op_by_op_layer_node_gives_the_chains_bits(policy, case, nodes, monkeypatch):
    """Formats the fused cell does not take (stochastic rounding, fp8 gradients with 4 random
    bits) run a whole layer as one node whose steps round at the chain's sites, with their keys,
    in the C kernel (``_LSTMLayerOps``, ``lp_lstm_op_*``): the chain's bits, and the sites after
    the layer keep theirs (the head's stochastic roundings), over two steps of training."""
    ops, n_ops = _run_ops(policy, case, True, monkeypatch)
    chain, n_chain = _run_ops(policy, case, False, monkeypatch)
    assert n_chain == 0 and n_ops == 2 * nodes, (n_ops, n_chain)
    assert len(ops) == len(chain)
    for i, (a, b) in enumerate(zip(ops, chain)):
        assert_same_bits(a, b, f"{policy} {case}: tensor {i}")


@pytest.mark.parametrize("hidden,batch", [(1, 1), (5, 3), (600, 2), (2049, 1)])
@pytest.mark.parametrize("grad", [True, False])
def test_the_op_by_op_layer_node_where_h_takes_no_gradient(hidden, batch, grad, monkeypatch):
    """The last hidden state unused (only the output sequence and the cell state reach the
    loss), no gradient at all (its sites still counted), one unit, one row, 600 units (tiles
    of three rows in the kernel), 2,049 (a row in two pieces)."""
    policy = "q6.10-sr"
    with monkeypatch.context() as m:
        a = _forward(True, grad, m, policy, hidden=hidden, batch=batch)
        m.setattr(kernel, "lstm_op_available", lambda: False)
        b = _forward(True, grad, m, policy, hidden=hidden, batch=batch)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same_bits(x, y, f"tensor {i}")


def _every_16_bit_value(dtype: torch.dtype) -> torch.Tensor:
    """The 65,536 values of a 16-bit dtype as float32, in the order of their unsigned bits."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_activation_tables_hold_torchs_16_bit_kernels(dtype):
    """The one-pass step's tables: on every 16-bit input, what torch's own float16 / bfloat16
    sigmoid and tanh return (NaN for NaN)."""
    from lowprec.numerics.formats import BF16, FP16
    tables = recurrent_kernels._activation_tables(FP16 if dtype == torch.float16 else BF16)
    if tables is None:
        pytest.skip("the kernel build has no one-pass step")
    x16 = _every_16_bit_value(dtype).to(dtype)
    for table, op in zip(tables[:2], (torch.sigmoid, torch.tanh)):
        native = op(x16).float()
        assert torch.equal(table.isnan(), native.isnan())
        keep = ~native.isnan()
        assert_same_bits(table[keep], native[keep], f"{dtype} {op.__name__}")


@pytest.mark.parametrize("fmt_name", ["fp16", "bf16"])
def test_the_one_pass_step_gives_the_steps_bits_on_every_16_bit_value(fmt_name):
    """``lp_lstm_step_tab`` (the gates, activations by table, the cell state, its tanh and h in
    one pass) against the step of torch's activations and three kernel calls, with every 16-bit
    value as each gate's pre-activation and as the cell state (infinities, NaN, subnormals,
    signed zeros), odd widths included."""
    from lowprec.numerics.formats import BF16, FP16
    fmt = FP16 if fmt_name == "fp16" else BF16
    tables = recurrent_kernels._activation_tables(fmt)
    if tables is None:
        pytest.skip("the kernel build has no one-pass step")
    prm = recurrent_kernels._cell_params(fmt)
    values = _every_16_bit_value(torch.float16 if fmt == FP16 else torch.bfloat16)
    for hidden in (16384, 13):
        rows = 65536 // hidden + 1
        order = torch.randperm(65536, generator=torch.Generator().manual_seed(hidden))
        pool = values[order].repeat(5)
        lin = torch.stack([pool[r * 4 * hidden:(r + 1) * 4 * hidden] for r in range(4)]) \
            if hidden == 16384 else pool[:rows * 4 * hidden].view(rows, 4 * hidden) * 1.5
        rows = lin.shape[0]
        xw = torch.zeros(rows, 4 * hidden) if hidden == 16384 else \
            pool[7:7 + rows * 4 * hidden].view(rows, 4 * hidden)
        c = values[torch.randperm(65536, generator=torch.Generator().manual_seed(1))]
        c = c.repeat(rows * hidden // 65536 + 1)[:rows * hidden].view(rows, hidden)
        one = recurrent_kernels._cell_forward(lin, xw, c, recurrent_kernels._CellRounding(prm, tables))
        ref = recurrent_kernels._cell_forward(lin, xw, c, recurrent_kernels._CellRounding(prm, None))
        assert_same_bits(one[2][0], ref[2][0], f"{fmt_name} hidden {hidden}: activations")
        # (h, the cell state and its tanh: a product or sum of two NaNs has the payload of the
        # operand the compiler put first, here as in torch: NaN for NaN only)
        for i, (a, b) in enumerate(zip(one[:2] + one[2][1:2], ref[:2] + ref[2][1:2])):
            assert torch.equal(a.isnan(), b.isnan()), (fmt_name, hidden, i)
            keep = ~a.isnan()
            assert_same_bits(a[keep], b[keep], f"{fmt_name} hidden {hidden}: output {i}")


@pytest.mark.parametrize("fmt_name", ["fp16", "bf16"])
def test_the_gate_sum_is_torchs_add_and_two_nans_give_the_first(fmt_name):
    """lp_lstm_gates (the one-pass step's gates are checked against it above) against torch's
    ``add`` of linear_hh's rounded output and the input projection, rounded: every 16-bit
    value in both, widths with vector tails. Where both are NaN the kernel returns the first
    operand's payload, written out: the compiler's operand order decides it otherwise (GCC's
    scalar epilogue of the AVX2 clone took the second, so the step's two forms differed on an
    AMD EPYC), and decides torch's too (its float32 add returns the second's there)."""
    from lowprec.numerics import quantize
    from lowprec.numerics.formats import BF16, FP16
    if not kernel.available():
        pytest.skip("the kernel is not built")
    fmt = FP16 if fmt_name == "fp16" else BF16
    values = _every_16_bit_value(torch.float16 if fmt == FP16 else torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for hidden in (13, 64):
        n = (65536 // (4 * hidden) + 1) * 4 * hidden
        lin = values[torch.randint(0, 65536, (n,), generator=g)].view(-1, 4 * hidden)
        xw = values[torch.randint(0, 65536, (n,), generator=g)].view(-1, 4 * hidden)
        nans = values[values.isnan()]  # (and every 61st position NaN in both)
        for t in (lin, xw):
            t.view(-1)[::61] = nans[torch.randint(0, len(nans), (len(t.view(-1)[::61]),),
                                                  generator=g)]
        rl = quantize(lin, fmt)
        want = quantize(rl + xw, fmt)
        both = rl.isnan() & xw.isnan()
        want[both] = (rl[both].view(torch.int32) | 0x400000).view(torch.float32)  # quiet
        gates = torch.empty_like(lin)
        kernel.lstm_gates(lin, xw, gates, recurrent_kernels._cell_params(fmt))
        assert both.any()
        assert_same_bits(gates, want, f"{fmt_name} hidden {hidden}")


def test_a_whole_layer_frees_what_it_saved():
    """The layer node saves its output sequence itself, not views of it: a saved view would hold
    the output, so its node, so the view, in a cycle that is never freed (every step's tensors
    kept: the whole forward leaked per call)."""
    import gc
    import weakref
    from lowprec.numerics import quantize
    from lowprec.numerics.formats import FP16
    rk = recurrent_kernels
    cell = rk._CellRounding(rk._cell_params(FP16), rk._activation_tables(FP16))
    g = torch.Generator().manual_seed(0)
    xw = quantize(torch.randn(6, 5, 64, generator=g), FP16).requires_grad_()
    w = quantize(torch.randn(64, 16, generator=g) * 0.1, FP16).requires_grad_()
    b = quantize(torch.randn(64, generator=g) * 0.1, FP16).requires_grad_()
    h0 = c0 = torch.zeros(5, 16)
    out, h, c = rk._LSTMLayer.apply(xw, h0, c0, w, b, False, cell, cell.prm, True,
                                    rk._Rounder(FP16), rk._Rounder(FP16))
    assert out.grad_fn is not None
    ref = weakref.ref(out)
    del out, h, c
    gc.collect()
    assert ref() is None


def test_the_activation_tables_are_torchs_whatever_mode_or_device_is_active(monkeypatch):
    """The tables are built once, at the first use, and kept: on the CPU and by torch's own
    kernels even when that first use runs under another default device or a user's dispatch
    mode (a table built on the meta device crashed the kernel; one built under a mode that
    changed sigmoid changed every later step)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from lowprec.numerics.formats import FP16
    if recurrent_kernels._activation_tables(FP16) is None:
        pytest.skip("the kernel build has no one-pass step")
    reference = [t.clone() for t in recurrent_kernels._activation_tables(FP16)[:2]]

    class Shifted(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out + 0.01 if func is torch.ops.aten.sigmoid.default else out

    for context in (lambda: torch.device("meta"), Shifted):
        monkeypatch.setattr(recurrent_kernels, "_TABLES", {})
        with context():
            tables = recurrent_kernels._activation_tables(FP16)
        for table, ref in zip(tables[:2], reference):
            assert table.device.type == "cpu"
            assert_same_bits(table, ref, str(context))
