"""The planner's budgets and levels beyond the core (tests/experiments/test_plan.py): the
mixed16 level and the 16-mixed comparator, time on named hardware profiles (a roofline),
the nvfp4 / mxfp4 levels (block-scale overhead as torchao stores it, blocks along the
reduction axis as torchao requires them), the plan's section of compare's report, and each
module's parameters written back in its own format."""

import math
import sqlite3

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import lowprec
from lowprec.analysis.plan_costs import (MATMUL_KINDS, block_refusal, cast_bits, gemm_flops,
                                         role_bits)
from lowprec.analysis.plan_scores import judge_level, module_cost, module_profile
from lowprec.analysis.roofline import PROFILES, get_profile, roofline_seconds, runs_as
from lowprec.cli import main
from lowprec.experiments.data import Dataset
from lowprec.experiments.planner import (LEVELS, parse_compare_with, plan, plan_markdown,
                                         summary_rows)
from lowprec.training.plan import Plan
from lowprec.training.policy import parse_policy


def _blobs(n_train=384, n_test=192, d=32, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * 2.0

    def draw(n):
        y = torch.arange(n) % classes
        return centers[y] + torch.randn(n, d, generator=g), y

    xtr, ytr = draw(n_train)
    xte, yte = draw(n_test)
    return Dataset("blobs32", xtr, ytr, xte, yte, classes)


def _mlp(seed=0, head=4):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 32),
                         nn.ReLU(), nn.Linear(32, head))


def _profile(model, data, rows=32):
    return module_profile(model, (data.x_train[:rows], data.y_train[:rows]),
                          nn.functional.cross_entropy)


# ---------------------------------------------------------------- mixed16 and 16-mixed

def test_mixed16_runs_in_fp16_exactly_the_modules_torch_autocast_runs_in_it():
    # torch.autocast's own choice (CPU, bfloat16: the same op lists) is the reference for
    # which module kinds compute in the low format under a matmul-scoped level
    mods = {"Linear": nn.Linear(8, 8), "Conv1d": nn.Conv1d(8, 8, 1),
            "LayerNorm": nn.LayerNorm(8), "Embedding": nn.Embedding(10, 8),
            "BatchNorm1d": nn.BatchNorm1d(8).eval()}
    inputs = {"Conv1d": torch.randn(2, 8, 4), "Embedding": torch.tensor([[1, 2]])}
    for kind, m in mods.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(inputs.get(kind, torch.randn(2, 8)))
        assert (out.dtype == torch.bfloat16) == (kind in MATMUL_KINDS), kind


def test_mixed16_costs_fp32_parameters_and_fp16_matmul_activations():
    model, data = _mlp(), _blobs()
    prof = _profile(model, data)
    mixed = parse_policy(LEVELS["mixed16"])
    ref = parse_policy("16-mixed")  # the level is 16-mixed, the loss scale left to the plan
    assert (mixed.params, mixed.compute, mixed.grads, mixed.scope) == \
        (ref.params, ref.compute, ref.grads, ref.scope)
    f32 = torch.empty(0).element_size()
    f16 = torch.empty(0, dtype=torch.float16).element_size()
    lin, norm = prof["0"], prof["2"]
    assert module_cost(lin, mixed) == 2 * f32 * lin.n_params + f16 * lin.n_out
    # the LayerNorm computes in fp32 under autocast: its outputs are 4 bytes
    assert module_cost(norm, mixed) == 2 * f32 * norm.n_params + f32 * norm.n_out
    # and is not judged against fp16's range: a LayerNorm output beyond 65504 passes
    norm.outputs = norm.outputs * 1e6
    assert judge_level(norm, mixed, lr=0.01)["output_overflow"] == 0.0
    assert judge_level(norm, parse_policy(LEVELS["fp16"]), lr=0.01)["output_overflow"] > 0


def test_compare_with_defaults_to_16_mixed_beside_fp16_and_checks_names():
    assert parse_compare_with(None, ("fp16", "fp32")) == ("mixed16",)
    assert parse_compare_with(None, ("bf16", "fp32")) == ()
    assert parse_compare_with(None, ("fp16", "mixed16", "fp32")) == ()  # in the menu already
    assert parse_compare_with("16-mixed,bf16", ("fp8", "fp32")) == ("mixed16", "bf16")
    with pytest.raises(ValueError, match="compare_with level 'fp12'; accepted: 16-mixed, fp32"):
        parse_compare_with("fp12", ("fp16", "fp32"))


# ---------------------------------------------------------------- hardware and time

def test_profiles_and_the_roofline_fallback():
    with pytest.raises(ValueError, match="hardware='h200'; accepted: h100-sxm, a100, b200"):
        get_profile("h200")
    a100, h100, b200 = (get_profile(n) for n in ("a100", "h100-sxm", "b200"))
    # datasheets: no fp8 or fp4 tensor cores on an A100, fp8 but no fp4 on an H100
    assert runs_as(a100, "fp8") == "bf16" and runs_as(a100, "fp4") == "bf16"
    assert runs_as(h100, "fp4") == "fp8" and runs_as(b200, "fp4") == "fp4"
    assert runs_as(get_profile("cpu-avx2"), "bf16") == "fp32"
    for p in PROFILES.values():
        # dense peaks: each narrower tensor-core family at least as fast as the wider one
        fams = [f for f in ("fp32", "bf16", "fp8", "fp4") if f in p.peak]
        assert all(p.peak[a] <= p.peak[b] for a, b in zip(fams, fams[1:])), p.name
    # compute-bound: flops / peak; memory-bound: bytes / bandwidth
    r = roofline_seconds(1e15, 1.0, "fp8", a100)
    assert r["runs_as"] == "bf16" and r["bound"] == "compute"
    assert r["seconds"] == pytest.approx(1e15 / 312e12)
    r = roofline_seconds(1.0, 2039e9, "bf16", a100)
    assert r["bound"] == "memory" and r["seconds"] == pytest.approx(1.0)


def test_gemm_flops_match_torchs_flop_counter():
    # torch's FlopCounterMode counts the forward and both backward GEMMs of a training step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 16))
    x, y = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 3])
    prof = module_profile(model, (x, y), nn.functional.cross_entropy)
    counter = FlopCounterMode(display=False)
    with counter:
        nn.functional.cross_entropy(model(x), y).backward()
    counts = counter.get_flop_counts()
    per_module = {n: sum(counts.get(f"Sequential.{n}", {}).values()) for n in ("0", "3")}
    # the conv's input needs no gradient: its grad_input GEMM is not run (2 of 3 GEMMs)
    assert gemm_flops(prof["3"]) == per_module["3"]
    assert gemm_flops(prof["0"]) * 2 / 3 == per_module["0"]


def test_time_budget_plans_on_a_named_profile_and_says_what_the_device_lacks():
    model, data = _mlp(), _blobs()
    p = plan(model, data, menu="fp32,bf16,fp8", minimise="time", hardware="a100", steps=20,
             lr=0.05, batch_size=32, tolerance=0.05, compare_uniform=False)
    assert p.meta["hardware"]["name"] == "a100" and p.meta["minimise"] == "time"
    fp8 = [n for n, e in p.evidence.items() if e["level"] == "fp8"]
    # an A100 has no fp8 tensor cores: an fp8 module is timed as bf16, and says so
    assert fp8 and all("fp8 has no GEMMs on a100: timed as bf16" in p.evidence[n]["why"]
                       for n in fp8)
    prof = _profile(model, data)
    for n in fp8:  # the same roofline time as bf16 would have if its bytes were bf16's
        t8 = module_cost(prof[n], parse_policy(LEVELS["fp8"]), "time", hardware="a100")
        t16 = module_cost(prof[n], parse_policy(LEVELS["bf16"]), "time", hardware="a100")
        assert t8 <= t16
    head, rows = summary_rows(p)
    assert head[3] == "µs/step (a100)" and rows[-1][0] == "plan"
    assert "on a100" in plan_markdown(p)
    # another budget with hardware: the estimate is a column beside it
    q = plan(model, data, menu="fp32,bf16", hardware="h100-sxm", steps=5, lr=0.05,
             batch_size=32, tolerance=1.0, compare_uniform=False)
    head, rows = summary_rows(q)
    assert head[-1] == "est. µs/step (h100-sxm)" and all(float(r[-1]) > 0 for r in rows)


# ---------------------------------------------------------------- fp4 levels

def test_fp4_bits_per_element_are_torchaos_storage():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    x = torch.randn(64, 128, dtype=torch.bfloat16)
    nv = NVFP4Tensor.to_nvfp4(x)
    mx = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, block_size=32)

    def bits(t):
        return 8 * (t.qdata.numel() * t.qdata.element_size()
                    + t.scale.numel() * t.scale.element_size()) / x.numel()

    nvfp4 = parse_policy(LEVELS["nvfp4"]).scaled
    mxfp4 = parse_policy(LEVELS["mxfp4"]).scaled
    assert cast_bits(nvfp4.input) == bits(nv) == 4.5
    assert cast_bits(mxfp4.input) == bits(mx) == 4.25
    # the fp32 per-tensor scale of NVFP4: 32 bits over the tensor
    assert cast_bits(nvfp4.input, 1024) == pytest.approx(4.5 + 32 / 1024)


def test_block_refusal_where_torchao_refuses_the_shape():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    torch.manual_seed(0)
    x = torch.randn(32, 48)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 4))
    prof = module_profile(model, (x, torch.arange(32) % 4), nn.functional.cross_entropy)
    nvfp4, mxfp4 = parse_policy(LEVELS["nvfp4"]), parse_policy(LEVELS["mxfp4"])

    def torchao_ok(k, quant):
        try:
            quant(torch.randn(4, k, dtype=torch.bfloat16))
            return True
        except AssertionError:
            return False

    nv = lambda t: NVFP4Tensor.to_nvfp4(t)  # noqa: E731
    mx = lambda t: MXTensor.to_mx(t, torch.float4_e2m1fn_x2, block_size=32)  # noqa: E731
    # forward reduction K = 48: whole 16-blocks, not whole 32-blocks, as torchao says
    assert torchao_ok(48, nv) and not torchao_ok(48, mx)
    assert block_refusal(prof["0"], nvfp4) is None
    assert "input features (forward) 48" in block_refusal(prof["0"], mxfp4)
    # the head's grad_input GEMM reduces over its 4 outputs
    assert not torchao_ok(4, nv)
    assert "output features (grad_input) 4" in block_refusal(prof["2"], nvfp4)
    j = judge_level(prof["2"], nvfp4, lr=0.01)
    assert not j["ok"] and "16-element blocks" in j["reasons"][0]
    # a judged linear layer reports its operands' block casts and its gradient's direction
    j = judge_level(prof["0"], nvfp4, lr=0.01, generator=torch.Generator().manual_seed(0))
    assert set(j["block_casts"]) == {"input", "weight", "grad_output"}
    assert 0.9 < j["grad_cosine"] <= 1.0 and j["ok"]
    # memory: activations at 4.5 bits in both blockings, bf16 parameters and gradients
    r = role_bits(prof["0"], nvfp4)
    assert r["family"] == "fp4" and r["saved"] == pytest.approx(2 * (4.5 + 32 / (32 * 48)))
    assert r["params"] == 16


def test_nvfp4_plan_puts_the_whole_block_gemms_in_fp4_and_trains():
    model, data = _mlp(), _blobs()
    p = plan(model, data, menu="fp32,bf16,nvfp4", steps=30, lr=0.05, batch_size=32,
             tolerance=0.05, seeds=(0,))
    assert p.meta["accepted"]
    levels = {n: e["level"] for n, e in p.evidence.items()}
    # 32 -> 32 linear layers in NVFP4; the 4-way head cannot have whole blocks: bf16
    assert levels["0"] == levels["3"] == "nvfp4" and levels["5"] == "bf16"
    assert "not a multiple of the 16-element blocks" in p.evidence["5"]["why"]
    assert "nvfp4-sr GEMMs" in p.evidence["0"]["formats"]["compute"]
    runs = p.verification["runs"]
    assert runs["plan"]["mean"] >= runs["fp32"]["mean"] - 0.05
    assert runs["plan"]["cost"] < runs["uniform bf16"]["cost"]
    # uniform nvfp4 trains in emulation, but no hardware runs the head's blocks
    assert runs["uniform nvfp4"]["block_refused"] == ["5"]
    assert p.meta["best_uniform"] != "uniform nvfp4"
    # Precision(plan) runs the head outside the recipe, the rest under it
    prec = lowprec.Precision(p, seed=0)
    assert "5" in prec.overrides and parse_policy(prec.overrides["5"]).scaled is None
    assert str(prec.policy.scaled) == "nvfp4-sr"
    from lowprec.training.emulation.scaled import record_casts

    twin, _ = prec.setup(_mlp())
    with record_casts() as casts:
        with prec.autocast():
            out = twin(prec.convert_input(data.x_train[:32]))
        prec.backward(nn.functional.cross_entropy(out.float(), data.y_train[:32]))
    assert {c["layer"] for c in casts} == {"0.linear", "3.linear"}


# ---------------------------------------------------------------- the report and the CLI

def test_cli_time_budget_and_compare_report_shows_the_stored_plan(tmp_path, capsys,
                                                                  monkeypatch):
    import lowprec.experiments.data as data_mod

    monkeypatch.setitem(data_mod.DATASETS, "blobs32-test", _blobs)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "mlp", "--data", "blobs32-test", "--menu", "fp32,bf16,fp8",
               "--minimise", "time", "--hardware", "h100-sxm", "--steps", "10", "--lr", "0.05",
               "--batch-size", "32", "--tolerance", "1", "--compare-with", "16-mixed",
               "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "µs/step (h100-sxm)" in printed and "uniform mixed16" in printed
    assert Plan.load(out).verification["runs"]["uniform mixed16"]["policy"] == "16-mixed"
    rc = main(["plan", "--data", "blobs32-test", "--minimise", "time", "--hardware", "tpu",
               "--out", str(out)])
    assert rc == 2 and "accepted: h100-sxm" in capsys.readouterr().err
    stored = Plan.load(out)
    # compare stores the plan each run read; the report's section comes from the database
    run = tmp_path / "cmp"
    rc = main(["compare", "--model", "mlp", "--data", "blobs32-test", "--policies",
               f"32-true,plan:{out}", "--seeds", "1", "--epochs", "1", "--batch-size", "32",
               "--out", str(run), "--quiet"])
    assert rc == 0
    out.unlink()  # the report is rebuilt from the database, not the file
    db = sqlite3.connect(run / "results.db")
    kinds = db.execute("SELECT run_id, kind FROM analysis WHERE kind = 'plan'").fetchall()
    assert len(kinds) == 1
    from lowprec.experiments.report import write_report

    md, page = write_report(run)
    text = page.read_text()
    assert f"Precision plan: plan:{out}" in text
    for name, e in stored.evidence.items():
        assert f"<td>{name}</td><td>{e['kind']}</td>" in text
    assert "µs/step (h100-sxm)" in md.read_text()


# ---------------------------------------------------------------- per-module write-back

def test_each_module_is_written_back_in_its_own_format():
    # a plan-like Precision: fp16 base, one module overridden to fp32; one SGD step (no
    # momentum) writes fc's new weights on torch's float16 grid and inp's in float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    prec = lowprec.Precision("p=fp16,c=fp16,g=fp16,o=fp16", overrides={"0": "32-true"})
    opt = lowprec.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    model, opt = prec.setup(model, opt)
    x, y = torch.randn(16, 8), torch.arange(16) % 4
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    prec.backward(nn.functional.cross_entropy(model(x), y))
    g = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    assert prec.step(opt)
    for n, p in model.named_parameters():
        new = w0[n].float().add(g[n], alpha=-0.1)  # torch.optim.SGD's update, in float32
        if n.startswith("0."):
            assert torch.equal(p.detach().float(), new), n  # fp32: the exact fp32 update
        else:
            assert torch.equal(p.detach().float(), new.half().float()), n
            assert not torch.equal(new.half().float(), new)  # rounding did something
    with torch.no_grad():
        assert math.isfinite(float(model(x).float().sum()))
