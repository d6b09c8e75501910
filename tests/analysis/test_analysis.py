"""The analyses: the certificate (hypothesis over random networks), range profiles, lost updates,
first non-finite, layer errors, advise."""

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import round_reference
from torch import nn

from lowprec import find_loss_scale, parse_format, quantize
from lowprec.analysis import (advise, certificate_from_outputs, certify, classify,
                              first_nonfinite, layer_errors, lost_fractions, lost_updates,
                              range_profile)
from lowprec.analysis.ranges import BINS, log2_histogram, overflow_threshold
from lowprec.experiments.data import Dataset


def random_mlp(seed, widths, scale):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) * scale / math.sqrt(a))
            lin.bias.copy_(torch.randn(b, generator=g) * 0.1)
        layers += [lin, nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def manual_low_precision(model, x, fmt):
    """The same network computed by hand: every weight, input and layer output rounded to fmt,
    float32 arithmetic (how the emulated 16-bit model computes)."""
    h = quantize(x, fmt)
    for m in model:
        if isinstance(m, nn.Linear):
            h = quantize(nn.functional.linear(h, quantize(m.weight.detach(), fmt),
                                              quantize(m.bias.detach(), fmt)), fmt)
        else:
            h = torch.relu(h)
    return h


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 4), width=st.integers(2, 24),
       classes=st.integers(2, 10), scale=st.floats(0.3, 3.0), xscale=st.floats(0.01, 30.0),
       fmt=st.sampled_from(["fp16", "bf16", "e4m3fn"]))
def test_certified_inputs_always_agree(seed, depth, width, classes, scale, xscale, fmt):
    d_in = 6
    model = random_mlp(seed, [d_in] + [width] * (depth - 1) + [classes], scale)
    x = torch.randn(64, d_in, generator=torch.Generator().manual_seed(seed + 1)) * xscale
    cert = certify(model, x, fmt)
    assert cert.violations == 0
    assert not (cert.certified & ~cert.agree).any()
    # δ and Γ against a float64 computation from independently computed outputs
    o32 = model(x).detach().double().numpy()
    o16 = manual_low_precision(model, x, fmt).detach().double().numpy()
    def same(a, b):
        return a == b or (math.isnan(a) and math.isnan(b))

    for i in range(len(x)):
        diffs = [abs(float(a) - float(b)) for a, b in zip(o16[i], o32[i])]
        delta = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
        top = sorted(float(v) for v in o32[i])
        gamma = top[-1] - top[-2]
        assert same(cert.delta[i], delta) and same(cert.gamma[i], gamma)
        assert cert.certified[i] == (gamma > 2 * delta)
        assert cert.agree[i] == (int(np.argmax(o16[i])) == int(np.argmax(o32[i])))


def test_certificate_rejects_ties_and_counts_violations():
    out32 = torch.tensor([[1.0, 1.0, 0.0], [3.0, 1.0, 0.0], [2.0, 1.9, 0.0]])
    out16 = torch.tensor([[1.0, 1.0, 0.0], [3.0, 1.1, 0.0], [1.9, 2.0, 0.0]])
    c = certificate_from_outputs(out32, out16)
    assert c.certified.tolist() == [False, True, False]  # a tie is never certified
    assert c.agree.tolist() == [True, True, False]
    assert c.violations == 0
    s = c.summary()
    assert s["certified"] == pytest.approx(1 / 3) and s["agreement"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="outputs"):
        certify(random_mlp(0, [3, 4], 1.0), torch.randn(2, 3), outputs="votes")


def test_certify_probs_and_per_class():
    model = random_mlp(3, [6, 16, 4], 2.0)
    x = torch.randn(200, 6)
    y = torch.randint(0, 4, (200,))
    c = certify(model, (x, y), "bf16", outputs="probs")
    assert c.violations == 0 and c.outputs == "probs"
    per = c.per_class()
    assert sum(r["n"] for r in per) == 200 and {r["class"] for r in per} <= {0, 1, 2, 3}
    assert 0 <= c.summary()["accuracy16"] <= 1


def test_certify_runs_both_models_without_autograd():
    """Both twins run under no_grad: no graph kept per batch (a refactor once moved the
    decorator off certify: peak memory grew by 1.6 GB for 4,000 MNIST-sized inputs)."""
    seen = []

    class Seen(nn.Linear):  # (certify runs copies of the model: a hook would not follow)
        def forward(self, x):
            out = super().forward(x)
            seen.append((torch.is_grad_enabled(), out.requires_grad))
            return out

    torch.manual_seed(0)
    model = nn.Sequential(Seen(6, 16), nn.ReLU(), Seen(16, 4))
    for fmt in ("bf16", "fp8-tensorwise"):
        certify(model, (torch.randn(50, 6), torch.randint(0, 4, (50,))), fmt, batch_size=20)
    assert seen and not any(g or r for g, r in seen), seen


@pytest.mark.parametrize("spec,why", [
    ("16-mixed", "holds several formats and rounds the matrix ops only"),
    ("p=fp16,c=fp16,g=fp16,s=matmul", "rounds the matrix ops only (s=matmul)"),
    ("p=dfxp<16>,c=dfxp<16>,g=dfxp<16>", "has a dynamic format")])
def test_advise_says_why_it_cannot_study_a_policy(spec, why):
    """A policy advise cannot study through one static format: the reason that holds for it
    (a review found one format in a matmul scope, and one dynamic format, called "several")."""
    from lowprec.analysis.advise import advise_target

    with pytest.raises(ValueError, match=re.escape(why)):
        advise_target(spec)
    assert str(advise_target("q6.10-sr")[0]) == "q6.10" and advise_target("bf16")[1] is None


def test_range_fractions_match_a_direct_count():
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.randn(5000, generator=g) * 10.0 ** torch.randint(-12, 6, (5000,),
                                                                             generator=g)])
    values = torch.cat([values, torch.tensor([65504.0, 65519.0, 65520.0, 1e6, 2.0**-25,
                                              2.0**-25 * 1.01, 0.0])])
    for spec in ["fp16", "bf16", "e4m3fn-sat", "e5m2"]:
        fmt = parse_format(spec)
        c = classify(values, fmt)
        v = values[values != 0]
        q = quantize(v, fmt)
        flush = (q == 0).double().mean().item()
        if fmt.has_inf:
            over = torch.isinf(q).double().mean().item()
        else:  # saturating: overflow is where nearest rounding would leave the top binade
            over = (v.abs().double() >= fmt.max + 2.0 ** (fmt.emax - fmt.man_bits) / 2
                    ).double().mean().item()
        a = v.abs().double()
        sub = ((a > fmt.min_subnormal / 2) & (a < fmt.min_normal)).double().mean().item()
        assert c["flush"] == pytest.approx(flush, abs=1e-12), spec
        assert c["overflow"] == pytest.approx(over, abs=1e-12), spec
        assert c["subnormal"] == pytest.approx(sub, abs=1e-12), spec


def _float64_reference(values: torch.Tensor, fmt) -> tuple[dict, list]:
    """classify's fractions and the log2 histogram, counted in float64 and numpy."""
    v = values.detach().double().abs().flatten()
    v = v[torch.isfinite(v) & (v > 0)]
    n = v.numel()
    half = fmt.min_subnormal / 2
    counts = {"n": n, "overflow": (v >= overflow_threshold(fmt)).sum().item() / n,
              "flush": (v <= half).sum().item() / n,
              # (a format whose smallest step is its smallest normal, fixed point: none)
              "subnormal": ((v > half) & (v < fmt.min_normal)).sum().item() / n
              if fmt.min_subnormal < fmt.min_normal else 0.0}
    return counts, np.histogram(np.log2(v.numpy()), bins=BINS)[0].tolist()


@pytest.mark.parametrize("spec", ["fp16", "bf16", "e4m3fn", "e5m2", "q13.12", "q6.10", "e8m23"])
def test_range_statistics_in_any_layout_and_dtype_match_a_float64_count(spec):
    """The range profile's counts (thresholds compared exactly in the values' own dtype) and
    its log2 histogram (read from the exponent) equal a float64/numpy count: every float32 bit
    pattern class, each threshold and its neighbours, powers of two and theirs, subnormals, in
    channels-last, float16, bfloat16 and float64 tensors too."""
    fmt = parse_format(spec)
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-2**31, 2**31, (40000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    edges = torch.tensor([fmt.min_subnormal / 2, fmt.min_normal, overflow_threshold(fmt)]
                         + [2.0 ** k for k in range(-149, 128)], dtype=torch.float64).float()
    edges = edges[torch.isfinite(edges)]
    x = torch.cat([x, edges, torch.nextafter(edges, torch.zeros(1)),
                   torch.nextafter(edges, torch.full((1,), float("inf"))), torch.zeros(5)])
    x = x[: x.numel() // 60 * 60].reshape(-1, 3, 4, 5)
    for name, t in [("float32", x), ("channels_last", x.contiguous(
            memory_format=torch.channels_last)), ("float16", x.half()),
            ("bfloat16", x.bfloat16()), ("float64", x.double() * 3.0)]:
        counts, hist = _float64_reference(t, fmt)
        assert classify(t, fmt) == counts, (spec, name)
        v = t.detach().abs().flatten()
        v = v[torch.isfinite(v) & (v > 0)]
        assert log2_histogram(v if v.dtype == torch.float64 else v.float()) == hist, name


def test_a_format_without_subnormals_has_none_in_the_profile_and_the_report():
    """Fixed point's smallest step is its smallest normal: no value is "subnormal" there (a
    new user's report showed 14.79% of q6.10 weight gradients "subnormal"); the report's cell
    is "-" for such a format, a number for fp16."""
    from lowprec.experiments.report_sections import _range_table, has_subnormals

    q = parse_format("q6.10")
    assert q.min_subnormal == q.min_normal
    v = torch.tensor([2.0 ** -10.5, 2.0 ** -12, 0.25])
    assert classify(v, q)["subnormal"] == 0 and classify(v, q)["flush"] == pytest.approx(1 / 3)
    assert classify(v, parse_format("fp16"))["subnormal"] == 0  # (fp16 normals, all three)
    assert [has_subnormals(f) for f in ("fp16", "e4m3fn", "q6.10", "e5m10-nosub")] == \
        [True, True, False, False]
    stats = {"overflow": 0.0, "flush": 0.1, "subnormal": 0.2}
    _, rows = _range_table({("q6.10-sr", "q6.10"): [{"roles": {"weight_grads": stats}}],
                            ("16-true", "fp16"): [{"roles": {"weight_grads": stats}}]})
    assert [r[-1] for r in rows] == ["-", "20.00"]


def test_a_threshold_between_two_floats_is_compared_as_the_real_number():
    """torch compares a float32 tensor with a Python float in float32 (``1.0 >= 1 + 1e-9`` is
    True there): each threshold is replaced by the largest value of the dtype at most it (below
    it, for a strict comparison), so the count is the real comparison's."""
    from lowprec.analysis.ranges import _at_most

    f32 = torch.float32
    assert bool(torch.tensor([1.0]) >= 1.0 + 1e-9)  # what the replacement avoids
    assert _at_most(1.0 + 1e-9, f32) == 1.0 and _at_most(1.0 + 1e-9, f32, strict=True) == 1.0
    assert _at_most(1.0, f32) == 1.0
    assert _at_most(1.0, f32, strict=True) == float(np.nextafter(np.float32(1), np.float32(0)))
    assert _at_most(1.0 - 1e-9, f32) == float(np.nextafter(np.float32(1), np.float32(0)))
    assert _at_most(1e40, f32) == float(np.finfo(np.float32).max)
    assert _at_most(2.0 ** -150, f32) == 0.0  # half float32's smallest subnormal
    assert _at_most(1.0 + 1e-9, torch.float64) == 1.0 + 1e-9


def test_range_profile_roles_and_loss_scale_cross_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o, t) * 1e-5

    prof = range_profile(model, (x, y), loss_fn, "fp16")
    roles = {s.role for s in prof.stats}
    assert roles == {"weights", "activations", "activation_grads", "weight_grads"}
    assert "hist" not in repr(prof) and len(repr(prof)) < 300 * len(prof.stats)  # (readable)
    assert prof.fraction("activation_grads", "flush") > 0.1  # why fp16 needs a loss scale
    choice = find_loss_scale(model, (x, y), loss_fn, "fp16")
    assert prof.gradient_scale() == choice.scale
    scaled = range_profile(model, (x, y), loss_fn, "fp16", loss_scale=choice.scale)
    assert scaled.fraction("activation_grads", "flush") < prof.fraction("activation_grads",
                                                                         "flush")
    assert scaled.fraction("weight_grads", "overflow") == 0


def test_range_profile_keeps_each_layers_output_before_later_in_place_ops():
    """A batch norm followed by ``ReLU(inplace=True)`` and a residual ``out += identity``
    (a new user's ResNet): each layer's activation statistics are of the values the layer
    output (reference: the same model with out-of-place ReLU and add, and the batch norm's
    output computed by torch), not of what the later in-place ops left in that tensor (the
    negative half was missing: n 16447 of 32768)."""

    class Block(nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.relu, self.conv2 = nn.ReLU(inplace=inplace), nn.Conv2d(8, 3, 1)
            self.head, self.inplace = nn.Linear(3, 4), inplace

        def forward(self, x):
            out = self.conv2(self.relu(self.bn(self.conv(x))))
            if self.inplace:
                out += x
            else:
                out = out + x
            return self.head(self.relu(out).mean((2, 3)))

    torch.manual_seed(0)
    inplace = Block(True)
    plain = Block(False)
    plain.load_state_dict(inplace.state_dict())
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 4, (4,))
    with torch.no_grad():
        bn = nn.BatchNorm2d(8)
        bn.load_state_dict(inplace.bn.state_dict())
        bn_out = bn(inplace.conv(x))
    got = range_profile(inplace, (x, y), nn.functional.cross_entropy, "fp16")
    want = range_profile(plain, (x, y), nn.functional.cross_entropy, "fp16")
    acts = {s.layer: s for s in got.stats if s.role == "activations"}
    assert acts["bn"].n == bn_out.count_nonzero() == bn_out.numel()
    ref = {(s.layer, s.role): s for s in want.stats}
    for s in got.stats:
        assert s == ref[(s.layer, s.role)], (s.layer, s.role)


def test_a_layer_called_twice_is_profiled_over_both_outputs_and_their_gradients():
    """A module used twice in a forward (a shared layer): its activation and gradient rows
    count the values of both calls, as of their concatenation (reference: classify, the
    histogram and the extremes of the two outputs and gradients, taken directly)."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = nn.Linear(5, 5, bias=False), nn.Linear(5, 3)

        def forward(self, x):
            a = self.shared(x)
            b = self.shared(a * 3e-5)  # (smaller values: subnormal in fp16)
            a.retain_grad()
            b.retain_grad()
            self.kept = (a, b)
            return self.head(b + a)

    torch.manual_seed(1)
    model = Twice()
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    prof = range_profile(model, (x, y), nn.functional.cross_entropy, "fp16")
    a, b = model.kept
    for role, vals in (("activations", (a, b)), ("activation_grads", (a.grad, b.grad))):
        row = next(r for r in prof.stats if r.layer == "shared" and r.role == role)
        cat = torch.cat([v.detach().reshape(-1) for v in vals])
        mags = cat.abs()[cat != 0]
        want = classify(cat, parse_format("fp16"))
        assert (row.n, row.overflow, row.flush, row.subnormal) == pytest.approx(
            (want["n"], want["overflow"], want["flush"], want["subnormal"]), rel=1e-12), role
        assert row.max_abs == mags.max().item() and row.min_abs == mags.min().item()
        assert row.hist == log2_histogram(mags)
    assert 0 < next(r for r in prof.stats if r.layer == "shared" and
                    r.role == "activations").subnormal < 1


def test_the_analyses_leave_a_model_in_train_mode_as_they_found_it():
    """A forward in train mode moves a BatchNorm's running statistics and batch count: every
    measuring pass (range profile, lost updates, loss-scale search, advise) puts the buffers
    and the gradients back (a new user's network changed under advise: num_batches_tracked +3,
    running_mean moved by 0.1)."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                        nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).train()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 3, (32,))
    nn.functional.cross_entropy(net(x), y).backward()  # the caller's own gradients
    before = {k: v.clone() for k, v in net.state_dict().items()}
    grads = [p.grad.clone() for p in net.parameters()]
    ce = nn.functional.cross_entropy
    for run in (lambda: range_profile(net, (x, y), ce, "fp16"),
                lambda: lost_updates(net, (x, y), ce, "bf16", lr=0.1),
                lambda: find_loss_scale(net, (x, y), ce, "fp16"),
                lambda: advise(net, (x, y), "fp16", batches=1)):
        run()
        assert net.training
        for k, v in net.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))


def test_the_analyses_restore_a_rebound_buffer_and_take_lazy_and_inference_buffers():
    """A forward that rebinds a buffer (``self.seen = self.seen + n``) gets the caller's
    tensor and values back (module_profile had, by name); a lazy module's uninitialised
    buffer and a buffer made under inference_mode do not stop a profile (a review found
    both raising)."""
    from lowprec.analysis.plan_scores import module_profile

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.register_buffer("seen", torch.zeros(()))
            with torch.inference_mode():
                self.register_buffer("frozen", torch.ones(3))

        def forward(self, x):
            self.seen = self.seen + x.shape[0]  # rebinds
            return self.fc(x)  # (an inference tensor cannot enter autograd: kept only)

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ce = nn.functional.cross_entropy
    for run in (lambda m: range_profile(m, (x, y), ce, "fp16"),
                lambda m: module_profile(m, (x, y), ce),
                lambda m: find_loss_scale(m, (x, y), ce, "fp16")):
        m = Counting().train()
        seen = m.seen
        run(m)
        assert m.seen is seen and m.seen.item() == 0.0
        assert torch.equal(m.frozen, torch.ones(3))
    lazy = nn.Sequential(nn.Linear(4, 5), nn.LazyBatchNorm1d(), nn.Linear(5, 3)).train()
    prof = range_profile(lazy, (x, y), ce, "fp16")
    assert any(r.layer == "1" and r.role == "activations" for r in prof.stats)


def test_lost_update_fractions_match_an_elementwise_check():
    g = torch.Generator().manual_seed(2)
    w = quantize(torch.randn(3000, generator=g), "bf16")
    dw = torch.randn(3000, generator=g) * 10.0 ** torch.randint(-6, -1, (3000,), generator=g)
    fmt = parse_format("bf16")
    f = lost_fractions(w, dw, fmt, torch.Generator().manual_seed(0))
    target = (w.double() + dw.double()).float().numpy()  # w + Δw in float32
    rounded = round_reference(target, fmt, "nearest")
    lost = [rounded[i] == float(w[i]) for i in range(3000) if dw[i] != 0]
    assert f["nearest"] == pytest.approx(sum(lost) / len(lost), abs=1e-12)
    comp = round_reference((-dw).numpy(), fmt, "nearest")
    kahan = [rounded[i] == float(w[i]) and comp[i] == 0 for i in range(3000) if dw[i] != 0]
    assert f["kahan"] == pytest.approx(sum(kahan) / len(kahan), abs=1e-12)
    assert f["kahan"] <= f["nearest"] and 0 < f["nearest"] < 1
    # stochastic rounding loses an update of a fraction p of the spacing with probability 1 - p
    assert f["stochastic"] < f["nearest"] + 0.05


def test_lost_updates_per_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(32, 10), torch.randint(0, 3, (32,))
    rows = lost_updates(model, (x, y), nn.functional.cross_entropy, "bf16", lr=1e-5)
    assert [r.layer for r in rows] == ["0", "2"]
    assert all(r.nearest > 0.9 for r in rows)  # lr 1e-5 is below half a bf16 spacing
    big = lost_updates(model, (x, y), nn.functional.cross_entropy, "bf16", lr=10.0)
    assert all(r.nearest < 0.5 for r in big)


def _planted():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def test_first_nonfinite_finds_a_forward_overflow():
    model = _planted()
    with torch.no_grad():
        model[2].weight.mul_(1e5)  # its outputs exceed fp16's 65504
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))
    rep = first_nonfinite(model, batch, nn.functional.cross_entropy, "16-true")
    assert rep.forward is not None and rep.forward.name == "2"
    assert rep.forward.input_range["inf"] == 0 and rep.forward.output_range["inf"] > 0
    assert first_nonfinite(model, batch, nn.functional.cross_entropy, "32-true").clean


def test_first_nonfinite_finds_a_backward_overflow():
    model = _planted()
    with torch.no_grad():  # small activations forward, a large weight amplifies the gradient
        model[0].weight.mul_(1e-4)
        model[0].bias.zero_()
        model[2].weight.mul_(3e4)
    batch = (torch.randn(32, 8), torch.randint(0, 4, (32,)))

    def loss_fn(o, t):
        return nn.functional.cross_entropy(o, t) * 1e4

    rep = first_nonfinite(model, batch, loss_fn, "16-true")
    assert rep.forward is None
    assert rep.backward is not None and rep.backward.name == "2"
    assert rep.backward.input_range["inf"] == 0 and rep.backward.output_range["inf"] > 0
    assert first_nonfinite(model, batch, loss_fn, "32-true").clean


def test_layer_errors_grow_with_a_coarser_format():
    model = random_mlp(1, [6, 32, 32, 5], 1.0)
    x = torch.randn(128, 6)
    e16 = layer_errors(model, x, "fp16")
    e8 = layer_errors(model, x, "e4m3fn")
    assert [e.name for e in e16] == ["0", "1", "2", "3", "4"]
    assert all(e.rel_error < 4 * parse_format("fp16").eps for e in e16)
    assert all(a.rel_error < b.rel_error for a, b in zip(e16, e8))
    assert all(e.rel_error == 0 for e in layer_errors(model, x, "fp32"))


def _dataset(model_in=6, n=256, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, model_in, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return Dataset("toy", x, y, x[:128], y[:128], classes)


def test_advise_reports_measurements():
    model = random_mlp(4, [6, 16, 4], 1.0)
    adv = advise(model, _dataset(), "bf16", lr=1e-6)
    assert adv.verdict == "needs care"
    assert any("loses" in r and "%" in r for r in adv.reasons)  # lr 1e-6: every update lost
    assert adv.certificate.violations == 0
    text = str(adv)
    assert text.startswith("pure bf16: needs care") and "certified" in text
    ok = advise(model, _dataset(), "fp16", lr=10.0)
    # the numbers in the text are the measurements: the certificate measured again on its own,
    # the underflow and lost-update fractions of the Advice's own records
    cert = certify(model, _dataset(), "fp16").summary()
    m = re.fullmatch(r"([\d.]+)% of (\d+) test inputs certified \(Γ > 2δ\), ([\d.]+)% predict "
                     r"the fp32 class, (\d+) violations", ok.reasons[0])
    assert m is not None, ok.reasons[0]
    assert m[1] == f"{100 * cert['certified']:.1f}" and int(m[2]) == cert["n"] == 128
    # a batch given (not a data set's test split) is certified as "inputs"
    d = _dataset()
    pair = advise(model, (d.x_train[:40], d.y_train[:40]), "fp16", batches=1)
    assert re.match(r"[\d.]+% of 40 inputs certified", pair.reasons[0]), pair.reasons[0]
    assert m[3] == f"{100 * cert['agreement']:.2f}" and int(m[4]) == cert["violations"]
    assert ok.certificate.summary()["certified"] == cert["certified"]
    under = f"{100 * ok.underflow_at_1:.2f}% of gradient values underflow at scale 1"
    assert sum(under in r for r in ok.reasons) == 1
    worst = max(ok.lost, key=lambda r: r.nearest)
    assert worst.nearest <= 0.10 and ok.verdict == "safe"
    assert f"at most {100 * worst.nearest:.1f}% lost with nearest rounding (layer {worst.layer})" \
        in " ".join(ok.reasons)
    bad = random_mlp(4, [6, 16, 4], 1.0)
    with torch.no_grad():
        bad[0].weight.mul_(1e6)
    assert advise(bad, _dataset(), "fp16").verdict == "unsafe"


def test_no_loss_scale_needed_says_how_many_gradients_are_subnormal():
    """A gradient flushed to zero needs a loss scale; a subnormal one does not, but keeps fewer
    bits, and the report plots it against the recommended scale: advise's reason says both,
    from the range profile's counts (judge's threshold: more than 10% subnormal)."""
    from lowprec.analysis.advise import SUBNORMAL_NOTE, gradient_subnormals, judge

    cert = {"n": 10, "certified": 1.0, "agreement": 1.0, "violations": 0}
    _, reasons = judge(cert, underflow_at_1=0.0051, loss_scale=262144.0, lr=0.1,
                       subnormal_at_1=0.94)
    assert reasons[1] == ("no loss scale needed: 0.51% of gradient values underflow at scale "
                          "1; 94.0% are subnormal there, with fewer significant bits: a loss "
                          "scale up to 262144 would lift them without overflow")
    for sub, scale in ((SUBNORMAL_NOTE, 262144.0), (0.94, 1.0), (None, 262144.0)):
        _, reasons = judge(cert, underflow_at_1=0.0051, loss_scale=scale, lr=0.1,
                           subnormal_at_1=sub)
        assert reasons[1].endswith("underflow at scale 1"), (sub, scale)
    # a network whose output is scaled by 1e-2: most of its gradients (a mean over 256 inputs)
    # lie in fp16's subnormal range, almost none below it
    model = nn.Sequential(random_mlp(4, [6, 16, 4], 1.0), Scale(1e-2))
    adv = advise(model, _dataset(), "fp16", lr=0.1)
    sub = gradient_subnormals(adv.ranges)
    rows = adv.ranges.role("activation_grads") + adv.ranges.role("weight_grads")
    assert sub == pytest.approx(sum(r.subnormal * r.n for r in rows) / sum(r.n for r in rows))
    assert sub > 0.5 and adv.underflow_at_1 <= 0.01
    assert f"{100 * sub:.1f}% are subnormal there" in " ".join(adv.reasons)
    assert f"up to {adv.loss_scale:g} would lift them" in " ".join(adv.reasons)


def test_advice_for_a_regime_is_judged_by_its_own_write_back_and_scale():
    """A new user's q6.10-sr advice: "loss scale 1 recommended: 92.5% ... underflow at scale 1,
    92.45% at 1" (no scale helps: said so, with what does), and "use stochastic rounding" for
    a regime that rounds stochastically (judged by its own write-back's column)."""
    from lowprec.analysis.advise import judge

    cert = {"n": 10, "certified": 1.0, "agreement": 1.0, "violations": 0}
    verdict, reasons = judge(cert, underflow_at_1=0.925, loss_scale=1.0, lr=0.1,
                             underflow_at_scale=0.9245)
    assert verdict == "needs care" and "recommended" not in reasons[1]
    assert reasons[1].startswith("92.5% of gradient values underflow at scale 1, and no loss "
                                 "scale lifts them") and "g=bf16" in reasons[1]
    lost = [{"layer": "fc", "nearest": 1.0, "stochastic": 0.75, "kahan": 0.0}]
    _, reasons = judge(cert, underflow_at_1=0.0, loss_scale=8.0, lr=0.1, lost=lost,
                       write_back="stochastic")
    assert reasons[-1] == ("layer fc loses 75% of its updates with one stochastic draw (the "
                           "regime's write-back) at lr 0.1 (100% with nearest rounding): keep "
                           "fp32 master weights (m=fp32)")
    verdict, reasons = judge(cert, underflow_at_1=0.0, loss_scale=8.0, lr=0.1, lost=lost,
                             write_back="kahan")
    assert verdict == "safe" and reasons[-1] == ("updates survive rounding: at most 0.0% lost "
                                                 "with Kahan summation (layer fc) at lr 0.1")
    _, reasons = judge(cert, underflow_at_1=0.0, loss_scale=8.0, lr=0.1, lost=lost)
    assert reasons[-1].endswith("use stochastic rounding or fp32 master weights")
    # a scale below 1 (the largest gradient beyond the format's range) is recommended as it
    # is; a scaled-GEMM recipe, which scales each operand itself, is told what would help it
    _, reasons = judge(cert, underflow_at_1=0.3, loss_scale=0.25, lr=0.1)
    assert reasons[1].startswith("loss scale 0.25 recommended: 30.0% of gradient values")
    _, reasons = judge(cert, underflow_at_1=0.3, loss_scale=1.0, lr=0.1, scaled=True)
    assert "after the recipe's own scaling" in reasons[1] and "g=bf16" not in reasons[1]


class Scale(nn.Module):
    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


def test_certify_and_advise_commands(capsys):
    from lowprec.cli import main

    code = main(["certify", "--data", "digits", "--model", "mlp", "--epochs", "1", "--quiet"])
    out = capsys.readouterr().out
    assert "certified" in out and "0 violations" in out and "per class" in out
    assert code in (0, 1)  # (1 where an input is uncertified: tests/test_cli.py)
    assert main(["advise", "--data", "digits", "--model", "mlp", "--epochs", "1", "--format",
                 "bf16", "--quiet"]) == 0
    assert "pure bf16:" in capsys.readouterr().out
    assert main(["certify", "--format", "fp7", "--quiet"]) == 2


# -- dynamic fixed point in the analyses (hostile-tester finding) -------------------------------

def _dfxp_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    return model, x, y


@pytest.mark.parametrize("what", ["advise", "find_loss_scale", "range_profile", "lost_updates",
                                  "certify-probs", "first_nonfinite"])
def test_dynamic_fixed_point_is_refused_where_a_static_grid_is_needed(what):
    """advise --format 'dfxp<10>' used to say only 'cannot convert float NaN to integer'."""
    model, x, y = _dfxp_case()
    loss = nn.functional.cross_entropy
    calls = {
        "advise": lambda: advise(model, (x, y), "dfxp<10>", batches=1),
        "find_loss_scale": lambda: find_loss_scale(model, (x, y), loss, "dfxp<10>"),
        "range_profile": lambda: range_profile(model, (x, y), loss, "dfxp<10>"),
        "lost_updates": lambda: lost_updates(model, (x, y), loss, "dfxp<10>"),
        "certify-probs": lambda: certify(model, (x, y), "dfxp<10>", outputs="probs"),
        "first_nonfinite": lambda: first_nonfinite(model, (x, y), loss, "dfxp-10-12"),
    }
    with pytest.raises(ValueError) as err:
        calls[what]()
    msg = str(err.value)
    assert "dfxp<10>" in msg and "dynamic fixed point" in msg and "static grid" in msg
    assert "\n" not in msg


def test_certify_of_logits_accepts_dynamic_fixed_point():
    model, x, y = _dfxp_case()
    cert = certify(model, (x, y), "dfxp<10>")
    assert cert.summary()["n"] == 16
