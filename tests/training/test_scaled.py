"""Scaled-GEMM recipes as policies: the same bits as torchao's Float8Linear (emulate=True) and
MXFP8Linear (emulated), the policy grammar, delayed scaling's state, overrides, matmul/bmm, the
analyses and ``lowprec compare`` under a recipe."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from lowprec import POLICIES, Precision, parse_policy
from lowprec.numerics.scaling import scaled_cast
from lowprec.training.scaling import RECIPES, GemmScaling, parse_scaling

TORCHAO = "torchao==0.18.0 (test extra, pinned in constraints.txt) is the reference: " \
          "pip install -c constraints.txt torchao==0.18.0"


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 96, bias=False), nn.ReLU(),
                         nn.Linear(96, 10))


def step(model, x, y, opt):
    opt.zero_grad()
    x = x.clone().requires_grad_()
    out = model(x)
    nn.functional.cross_entropy(out.reshape(-1, 10), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return out.detach(), x.grad, grads


def batches(shape, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(*shape, generator=g) * 4
        yield x, torch.randint(0, 10, (x.numel() // shape[-1],), generator=g)


# -- the same bits as torchao -------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(32, 48), (4, 6, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe,name", [("tensorwise", "fp8-tensorwise"),
                                         ("rowwise", "fp8-rowwise"),
                                         ("rowwise_with_gw_hp", "fp8-rowwise-gw-hp")])
def test_fp8_recipes_train_bit_identically_to_torchao_float8_linear(recipe, name, shape):
    float8 = pytest.importorskip("torchao.float8", reason=TORCHAO)
    base = mlp()
    ref = copy.deepcopy(base)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    float8.convert_to_float8_training(ref, config=config)
    assert sum(type(m).__name__ == "Float8Linear" for m in ref.modules()) == 3
    ours = copy.deepcopy(base)
    prec = Precision(name)
    ours, _ = prec.setup(ours)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    first = True
    for x, y in batches(shape):
        if first:  # and fp8 is not fp32
            assert not torch.equal(base(x), ours(x))
            first = False
        out_r, gx_r, gp_r = step(ref, x, y, opt_ref)
        out_o, gx_o, gp_o = step(ours, x, y, opt_ours)
        assert torch.equal(out_r, out_o)          # outputs
        assert torch.equal(gx_r, gx_o)            # input gradients
        for k in gp_r:                            # weight and bias gradients
            assert torch.equal(gp_r[k], gp_o[k]), k
    for (k, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mx_recipe_equals_torchao_mxfp8_linear_emulated(mode):
    pytest.importorskip("torchao", reason=TORCHAO)
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(0)
    lin = nn.Linear(64, 96)
    ref = MXFP8Linear(64, 96, kernel_preference=KernelPreference.EMULATED,
                      scale_calculation_mode=ScaleCalculationMode(mode))
    ref.load_state_dict(lin.state_dict())
    c = f"e4m3fn@mx:{mode}"
    spec = "mxfp8" if mode == "floor" else f"i={c};w={c};go={c}"
    ours, _ = Precision(f"p=fp32,sc={spec}").setup(copy.deepcopy(lin))
    x = torch.randn(2, 32, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    oa, ob = ref(xa), ours(xb)
    oa.square().sum().backward()
    ob.square().sum().backward()
    assert torch.equal(oa, ob) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(ref.weight.grad, ours.weight.grad)
    assert torch.equal(ref.bias.grad, ours.bias.grad)


# -- what each GEMM sees ------------------------------------------------------------------------
def manual_linear(x, w, b, recipe, dy):
    """The three GEMMs written out with scaled_cast (delayed excluded)."""
    r = parse_scaling(recipe)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    out = scaled_cast(x2, r.input, -1) @ scaled_cast(w.t(), r.weight, -2) + b
    gx = scaled_cast(dy2, r.grad_output, -1) @ scaled_cast(w.t(), r.weight_gi, -1).t()
    gw = scaled_cast(dy2, r.grad_output_gw, -2).t() @ scaled_cast(x2, r.input_gw, -2)
    return out.reshape(*x.shape[:-1], -1), gx.reshape(x.shape), gw


@pytest.mark.parametrize("name", ["fp8-blockwise", "mxfp8", "mxfp4", "nvfp4",
                                  "fp8-rowwise-gw-hp"])
def test_each_gemm_casts_each_operand_along_its_reduction_axis(name):
    torch.manual_seed(0)
    lin = nn.Linear(256, 160)
    ours, _ = Precision(f"p=fp32,sc={name}").setup(copy.deepcopy(lin))
    x = torch.randn(3, 100, 256, requires_grad=True)
    out = ours(x)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref_out, ref_gx, ref_gw = manual_linear(x.detach(), lin.weight.detach(), lin.bias.detach(),
                                            RECIPES[name], dy)
    assert torch.allclose(out, ref_out, rtol=1e-5, atol=1e-5)  # another fp32 GEMM order
    assert torch.allclose(x.grad, ref_gx, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours.weight.grad, ref_gw, rtol=1e-5, atol=1e-4)
    plain_out = lin(x.detach())
    assert not torch.allclose(out, plain_out, rtol=1e-3, atol=1e-3)  # the casts did something


def test_matmul_and_bmm_are_scaled_when_the_recipe_covers_them():
    torch.manual_seed(0)

    class Attn(nn.Module):
        def forward(self, q, k):
            return torch.softmax(q @ k.transpose(-1, -2), -1) @ k

    q = torch.randn(2, 8, 64, requires_grad=True)
    k = torch.randn(2, 8, 64, requires_grad=True)
    model, _ = Precision("p=fp32,sc=fp8-tensorwise;ops=linear+matmul").setup(Attn())
    out = model(q, k)
    ref, _ = Precision("fp8-tensorwise").setup(Attn())  # linear only: no matmul scaled
    from lowprec.training.emulation.scaled import RecipeCoverageWarning
    with pytest.warns(RecipeCoverageWarning, match="ran none"):  # and it says so
        assert torch.equal(ref(q, k), Attn()(q, k))
    r = RECIPES["fp8-tensorwise"]
    kt = k.detach().transpose(-1, -2)
    s = torch.softmax(scaled_cast(q.detach(), r.input, -1) @ scaled_cast(kt, r.weight, -2), -1)
    expected = scaled_cast(s, r.input, -1) @ scaled_cast(k.detach(), r.weight, -2)
    assert torch.equal(out, expected)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(k.grad).all()


# -- policies, overrides, state -----------------------------------------------------------------
def test_recipes_are_named_policies_and_specs():
    for name in RECIPES:
        spec = f"p=fp32,sc={name}"
        pol = parse_policy(spec)
        assert pol.scaled == RECIPES[name] and parse_policy(pol.spec) == pol
        if name != "mxfp4":  # "mxfp4" is the OCP MX policy of the forward operands
            assert POLICIES[name] == pol and str(POLICIES[name]) == name
    assert parse_policy("mxfp4").scaled is None
    custom = parse_policy("p=fp32,sc=fp8-rowwise;go=e5m2@tensor")
    assert custom.scaled.grad_output_gw == custom.scaled.grad_output  # second use follows
    assert custom.scaled.input == RECIPES["fp8-rowwise"].input
    assert parse_policy(custom.spec) == custom and "sc=i=e4m3fn@axis:pow2;" in custom.spec
    assert parse_policy("32-true").scaled is None and "sc=" not in parse_policy("16-true").spec
    assert isinstance(parse_scaling("fp8-delayed"), GemmScaling)


@pytest.mark.parametrize("spec,needle", [
    ("p=fp32,sc=fp9-rowwise", "unknown scaled-GEMM recipe"),
    ("p=fp32,sc=fp8-rowwise;x=hp", "role 'x'"),
    ("p=fp32,sc=i=e4m3fn@tensor;i=hp", "given twice"),
    ("p=fp32,sc=i=e4m3fn@tensor;ops=all", "ops='all'"),
    ("p=fp32,sc=i=e4m3fn@tensor,w=hp", "unknown key 'w'"),
    ("p=fp32,sc=fp8-rowwise,b=native", "cannot run natively")])
def test_bad_recipes_are_one_line_errors(spec, needle):
    with pytest.raises(ValueError) as err:
        Precision(spec).setup(mlp())
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_recipes_run_emulated_and_everything_else_stays_fp32():
    prec = Precision("fp8-rowwise")
    model, _ = prec.setup(mlp())
    assert prec.backend == "emulated"
    seen = []
    prec.emulation.observers.append(lambda name, module, args, kwargs, out: seen.append(name))
    x = torch.randn(8, 48)
    ref = mlp()
    h = ref[1](ref[0](x))  # GELU of a scaled linear is the plain GELU of its output
    out0 = model[0](x)
    assert torch.equal(model[1](out0), nn.functional.gelu(out0))
    assert "linear" in seen and not torch.equal(out0, ref[0](x)) and h.shape == out0.shape


def test_overrides_turn_recipes_on_and_off_per_module():
    x = torch.randn(16, 48)
    base = mlp()
    off, _ = Precision("fp8-rowwise", overrides={"4": "32-true"}).setup(copy.deepcopy(base))
    full, _ = Precision("fp8-rowwise").setup(copy.deepcopy(base))
    h = full[3](full[2](full[1](full[0](x))))
    assert torch.equal(off(x), base[4](h))  # the last layer in plain fp32
    on, _ = Precision("32-true", overrides={"0": "fp8-rowwise"}).setup(copy.deepcopy(base))
    assert torch.equal(on(x), base[4](base[3](base[2](base[1](full[0](x))))))


def test_a_mixed_policy_rounds_the_scaled_gemm_output_to_its_compute_format():
    prec = Precision("p=fp32,c=bf16,s=matmul,sc=fp8-tensorwise")
    model, _ = prec.setup(mlp())
    x = torch.randn(8, 48)
    with prec.autocast():
        out = model[0](x)
    assert torch.equal(out, out.bfloat16().float())
    assert not torch.equal(model[0](x), out)  # outside autocast: fp32 output


def test_delayed_scaling_state_travels_with_precision_and_resumes_bit_identically():
    data = list(batches((16, 48), n=6))

    def train(prec, model, opt, part):
        outs = []
        for x, y in part:
            opt.zero_grad()
            out = model(x)
            prec.backward(nn.functional.cross_entropy(out, y))
            prec.step(opt)
            outs.append(out.detach())
        return outs

    base = mlp()
    a = Precision("fp8-delayed")
    ma, oa = a.setup(copy.deepcopy(base), None)
    opt_a = torch.optim.SGD(ma.parameters(), lr=0.05)
    whole = train(a, ma, opt_a, data)
    b = Precision("fp8-delayed")
    mb, _ = b.setup(copy.deepcopy(base))
    opt_b = torch.optim.SGD(mb.parameters(), lr=0.05)
    first = train(b, mb, opt_b, data[:3])
    state = copy.deepcopy((b.state_dict(), mb.state_dict(), opt_b.state_dict()))
    hist = state[0]["regimes"]["scaled"]["amax_history"]
    assert len(hist["0.linear.input"]) == 3 and len(hist["4.linear.grad_output"]) == 3
    c = Precision("fp8-delayed")
    mc, _ = c.setup(copy.deepcopy(base))
    opt_c = torch.optim.SGD(mc.parameters(), lr=0.05)
    c.load_state_dict(state[0])
    mc.load_state_dict(state[1])
    opt_c.load_state_dict(state[2])
    rest = train(c, mc, opt_c, data[3:])
    assert all(torch.equal(u, v) for u, v in zip(whole, first + rest))
    fresh = Precision("fp8-delayed")  # without the history the fourth step scales otherwise
    mf, _ = fresh.setup(copy.deepcopy(base))
    mf.load_state_dict(state[1])
    assert not torch.equal(mf(data[3][0]), rest[0])


# -- analyses and compare -----------------------------------------------------------------------
def test_the_analyses_run_under_a_recipe():
    from lowprec import find_loss_scale
    from lowprec.analysis import certify, layer_errors, lost_updates, range_profile
    from lowprec.analysis.advise import advise
    from lowprec.analysis.nonfinite import first_nonfinite
    from lowprec.experiments.data import Dataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 48, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    prec = Precision("fp8-tensorwise")
    model, opt = prec.setup(mlp(), None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(3):  # trained under the recipe first: its hooks must not leak into twins
        opt.zero_grad()
        prec.backward(nn.functional.cross_entropy(model(x[64 * i:64 * (i + 1)]),
                                                  y[64 * i:64 * (i + 1)]))
        prec.step(opt)
    ce = nn.functional.cross_entropy
    batch = (x[:64], y[:64])
    cert = certify(model, (x, y), "fp8-tensorwise")
    assert cert.format == "fp8-tensorwise" and cert.violations == 0 and cert.n == 256
    assert 0 < cert.delta.max() < 1
    assert certify(model, (x, y), "fp16").violations == 0
    prof = range_profile(model, batch, ce, "fp8-tensorwise")
    roles = {s.role for s in prof.stats}
    assert {"gemm:input", "gemm:weight", "gemm:grad_output"} <= roles
    assert prof.gradient_scale() == 1.0 and all(0 <= s.flush <= 1 for s in prof.stats)
    choice = find_loss_scale(model, batch, ce, "fp8-tensorwise")
    assert choice.scale == 1.0 and choice.format == "e5m2-sat" and "e5m2" in str(choice)
    assert lost_updates(model, batch, ce, "fp8-tensorwise")[0].nearest == 0.0  # fp32 params
    assert layer_errors(model, x[:16], "fp8-tensorwise")[-1].rel_error > 0
    nf = first_nonfinite(model, batch, ce, "fp8-tensorwise")
    assert nf.forward is None and nf.backward is None
    data = Dataset("toy", x, y, x[:128], y[:128], 4)
    adv = advise(model, data, "fp8-tensorwise", batches=2, batch_size=32)
    assert adv.verdict in ("safe", "needs care", "unsafe") and "certified" in adv.reasons[0]


def test_compare_runs_recipes(tmp_path):
    from lowprec.cli import main
    from lowprec.experiments.results import ResultsDB

    out = tmp_path / "r"
    assert main(["compare", "--data", "digits", "--model", "mlp", "--policies",
                 "fp8-tensorwise,p=fp32,sc=mxfp4", "--seeds", "1", "--epochs", "1",
                 "--train-subset", "600",
                 "--out", str(out), "--quiet"]) == 0
    db = ResultsDB(out / "results.db", create=False)
    runs = db.runs()
    assert [r["status"] for r in runs] == ["finished", "finished"]
    assert {r["policy_spec"].rpartition("sc=")[2] for r in runs} == {"fp8-tensorwise", "mxfp4"}
    assert all(db.epochs(r["run_id"])[0]["test_acc"] > 0.5 for r in runs)
    db.close()


# -- what a recipe covers: never nothing, silently --------------------------------------------
def convnet(seed=0):
    """A fully convolutional classifier (a UNet's kind of model: no nn.Linear anywhere)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 10, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8", "nvfp4"])
def test_a_recipe_on_a_model_without_linear_layers_warns_and_says_what_it_touched(name):
    from lowprec.training.emulation.scaled import RecipeCoverageWarning

    prec = Precision(name)
    model, _ = prec.setup(convnet())
    x = torch.randn(4, 3, 8, 8)
    with pytest.warns(RecipeCoverageWarning, match=f"recipe {name} covers linear .* ran none"
                      ) as caught:
        out = model(x)
    assert "no recipe defines a convolution" in str(caught[0].message)
    assert "(0, 2)" in str(caught[0].message)  # the convolutions it left alone, by name
    # what the warning says is true: the model computes exactly as the fp32 model does
    assert torch.equal(out, convnet()(x))
    cov = prec.recipe_coverage()
    assert cov["recipes"] == {name: {"touched": [], "uncovered": ["0", "2"]}}
    assert cov["uncovered"]["0"]["ops"] == ["conv2d"] and cov["forwards"] == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeCoverageWarning)  # once per model, not per step
        model(x)
    assert prec.recipe_coverage()["forwards"] == 2


def test_a_recipe_names_the_convolutions_it_leaves_and_is_quiet_where_it_covers_all():
    import warnings

    from lowprec.training.emulation.scaled import RecipeCoverageWarning

    torch.manual_seed(0)
    mixed = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 10))
    prec = Precision("fp8-rowwise")
    model, _ = prec.setup(mixed)
    with pytest.warns(RecipeCoverageWarning, match=r"cast the GEMMs of 1 module\(s\) \(2\); "
                      r"convolutions ran in 1 module\(s\) the recipe does not cover \(0\)"):
        model(torch.randn(2, 3, 8, 8))
    assert prec.recipe_coverage()["recipes"] == {
        "fp8-rowwise": {"touched": ["2"], "uncovered": ["0"]}}
    prec = Precision("fp8-rowwise")
    model, _ = prec.setup(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeCoverageWarning)
        model(torch.randn(2, 48))
    assert prec.recipe_coverage()["recipes"] == {
        "fp8-rowwise": {"touched": ["0", "2", "4"], "uncovered": []}}
    assert Precision("16-true").recipe_coverage() is None  # not set up
    p16 = Precision("p=fp16,c=fp16,g=fp16,b=emulated")
    p16.setup(mlp())
    assert p16.recipe_coverage() is None  # no recipe


def test_compare_records_and_reports_what_each_recipe_touched(tmp_path, monkeypatch, capsys):
    import json

    from lowprec.cli import main
    from lowprec.training.emulation.scaled import RecipeCoverageWarning

    (tmp_path / "lp_convnet.py").write_text(
        "from torch import nn\n"
        "def net(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.ReLU(),\n"
        "                         nn.Conv2d(8, num_classes, 1), nn.AdaptiveAvgPool2d(1),\n"
        "                         nn.Flatten())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r"
    with pytest.warns(RecipeCoverageWarning, match="ran none"):
        assert main(["compare", "--data", "digits", "--model", "lp_convnet:net", "--policies",
                     "32-true,fp8-tensorwise", "--seeds", "1", "--epochs", "1",
                     "--train-subset", "200", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(out), "--json"]) == 0
    got = {p["policy"]: p for p in json.loads(capsys.readouterr().out)["policies"]}
    assert got["32-true"]["recipe_coverage"] is None
    assert got["fp8-tensorwise"]["recipe_coverage"] == {
        "fp8-tensorwise": {"touched": [], "uncovered": ["0", "2"]}}
    md = (out / "report.md").read_text()
    assert "## Scaled-GEMM recipes: modules touched" in md
    assert "| fp8-tensorwise | fp8-tensorwise | 0: none | 2: 0, 2 |" in md
    assert "cast no module of this model" in md
