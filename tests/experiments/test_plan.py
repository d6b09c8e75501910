"""``lowprec.plan`` and ``lowprec plan``: per-module measurements against torch's own casts, the
plan on a model where pure fp16 overflows in two modules, its file, Precision(plan), compare
with plan:FILE, a forced repair, and the command end to end."""

import json
import math

import pytest
import torch
from torch import nn

import lowprec
from lowprec.analysis.plan_scores import ModuleProfile, judge_level, module_profile
from lowprec.cli import main
from lowprec.experiments.data import Dataset
from lowprec.experiments.demo_models import RawInputMLP
from lowprec.experiments.planner import (cheaper_uniform, parse_menu, plan, plan_markdown,
                                        summary_rows)
from lowprec.training.plan import Plan
from lowprec.training.policy import parse_policy


def _data(n_train=384, n_test=192, d=16, classes=4, seed=0):
    """Gaussian blobs: 4 classes in 16 dimensions, separable (a tiny MLP learns them in a few
    dozen steps)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d, generator=g) * 2.0

    def draw(n):
        y = torch.arange(n) % classes
        return centers[y] + torch.randn(n, d, generator=g), y

    xtr, ytr = draw(n_train)
    xte, yte = draw(n_test)
    return Dataset("blobs", xtr[:, None], ytr, xte[:, None], yte, classes)


def _model(seed=0, hidden=32):
    torch.manual_seed(seed)
    return RawInputMLP((1, 16), 4, hidden=hidden)


@pytest.fixture(scope="module")
def found():
    """The plan of the fp16-overflow model with the menu fp32, fp16 (the 16-true question:
    which modules must stay in fp32?)."""
    return plan(_model(), _data(), menu="fp32,fp16", steps=40, lr=0.05, tolerance=0.02,
                batch_size=32, seeds=(0,))


def test_judge_level_counts_overflow_as_torchs_fp16_cast_does():
    # the overflow fraction judge_level reports is the fraction torch's .half() turns to inf
    g = torch.Generator().manual_seed(1)
    out = torch.randn(4000, generator=g, dtype=torch.float64).float() * 40000.0
    prof = ModuleProfile("m", "Linear", torch.randn(100, generator=g), out,
                         torch.randn(100, generator=g) * 1e-3, torch.randn(50, generator=g),
                         torch.randn(50, generator=g) * 1e-3, 50, 100, 4000)
    j = judge_level(prof, parse_policy("p=fp16,c=fp16,g=fp16"), lr=0.01)
    expected = torch.isinf(out.half()).double().mean().item()
    assert expected > 0.05
    assert j["output_overflow"] == pytest.approx(expected, abs=1e-12)
    assert not j["ok"] and "overflow fp16" in j["reasons"][0]
    # bf16's range holds them: nothing overflows there, as torch's bfloat16 cast says
    jb = judge_level(prof, parse_policy("p=bf16,c=bf16,g=bf16"), lr=0.01)
    assert not torch.isinf(out.bfloat16()).any() and jb["output_overflow"] == 0.0 and jb["ok"]


def test_judge_level_gradient_flush_matches_torch_and_asks_for_a_loss_scale():
    g = torch.Generator().manual_seed(2)
    grads = torch.randn(5000, generator=g) * 1e-8  # most below fp16's smallest subnormal / 2
    prof = ModuleProfile("m", "Linear", torch.ones(10), torch.ones(10), grads, torch.ones(10),
                         torch.zeros(10), 10, 10, 10)
    j = judge_level(prof, parse_policy("p=fp16,c=fp16,g=fp16"), lr=0.01)
    flushed = ((grads.half() == 0) & (grads != 0)).double().mean().item()
    assert j["grad_flush"] == pytest.approx(flushed, abs=1e-12) and flushed > 0.5
    # a power-of-two scale brings them into range: the level passes, with a loss scale
    assert j["needs_loss_scale"] and j["ok"] and j["loss_scale"] > 1
    scaled = ((grads * j["loss_scale"]).half() == 0).double().mean().item()
    assert j["grad_flush_scaled"] == pytest.approx(scaled, abs=1e-12)


def test_module_profile_sees_each_modules_outputs_as_torch_computes_them():
    model, data = _model(), _data()
    x, y = data.x_train[:8], data.y_train[:8]
    prof = module_profile(model, (x, y), nn.functional.cross_entropy)
    assert list(prof) == ["inp", "norm", "fc", "head"]
    with torch.no_grad():
        ref = model.inp(x.flatten(1))
    torch.testing.assert_close(prof["inp"].outputs, ref.flatten(), rtol=0, atol=0)
    assert prof["inp"].n_params == sum(p.numel() for p in model.inp.parameters())
    assert all(p.grad is None for p in model.parameters())  # left as it was


def test_module_profile_keeps_what_each_module_saw_before_later_in_place_ops():
    """A batch norm followed by ``ReLU(inplace=True)``, a linear layer whose output is later
    changed in place (``z += h``): each module's inputs and outputs as torch computed them at
    the module (a new user's ResNet: the batch norm's kept outputs were the ReLU's)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.relu = nn.BatchNorm1d(6), nn.ReLU(inplace=True)
            self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            h = self.relu(self.bn(x))
            z = self.fc(h)
            z += h  # fc's output, changed after the module returned it
            return self.head(z)

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with torch.no_grad():
        bn = nn.BatchNorm1d(6)
        bn.load_state_dict(model.bn.state_dict())
        bn_out = bn(x)
        fc_in = torch.relu(bn_out)
        fc_out = model.fc(fc_in)
    prof = module_profile(model, (x, y), nn.functional.cross_entropy)
    torch.testing.assert_close(prof["bn"].outputs, bn_out.flatten(), rtol=0, atol=0)
    torch.testing.assert_close(prof["fc"].inputs, fc_in.flatten(), rtol=0, atol=0)
    torch.testing.assert_close(prof["fc"].outputs, fc_out.flatten(), rtol=0, atol=0)


def test_the_plans_table_shows_one_seed_as_n1_and_a_diverged_run():
    """One seed has no deviation: ``(n=1)``, as compare's tables say, never ``± 0.00`` (a new
    user's report); a non-finite mean reads "diverged"."""
    runs = {"fp32": {"accuracy": [0.9], "mean": 0.9, "std": 0.0, "cost": 4.0},
            "uniform fp16": {"accuracy": [math.nan], "mean": math.nan, "std": 0.0,
                             "cost": 2.0},
            "plan": {"accuracy": [0.88, 0.9], "mean": 0.89, "std": 0.01, "cost": 3.0}}
    _, rows = summary_rows(Plan("16-true", verification={"runs": runs},
                                meta={"tolerance": 0.02}))
    assert [r[1] for r in rows] == ["90.00 (n=1)", "diverged", "89.00 ± 1.00"]


def test_a_plan_settled_on_a_uniform_level_says_so_not_the_modules_remedies():
    """Where the plan became a uniform level, each module's "why" names that level and not the
    per-module remedies the uniform policy does not hold (a new user read "stochastic
    write-back; raised by repair" under a uniform fp8 plan with nearest write-back)."""
    from lowprec.experiments.planner.measure import why

    judged = {"bf16": {"reasons": [], "grad_flush": 0.0, "perturbation": 0.0,
                       "needs_loss_scale": True, "loss_scale": 1024.0,
                       "needs_stochastic": True, "lost_updates": 0.52,
                       "formats": {"params": "bf16"}}}
    per_module = why("bf16", ["bf16", "fp32"], judged, "the plan reached 80% < 85%")
    assert "stochastic write-back" in per_module and "loss scale" in per_module
    assert "raised by repair (the plan reached" in per_module
    settled = why("bf16", ["bf16", "fp32"], judged,
                  settled="uniform bf16 verified at no more cost than the per-module plan")
    assert "stochastic" not in settled and "loss scale" not in settled
    assert "raised by repair" not in settled and settled.endswith(
        "the plan is uniform bf16 verified at no more cost than the per-module plan")


def test_plan_keeps_exactly_the_overflowing_modules_high(found):
    model, data = _model(), _data()
    # the reference: where torch's own fp16 cast of the float32 activations overflows
    with torch.no_grad():
        z = model.inp(data.x_train[:32].flatten(1))
        assert torch.isinf(z.half()).any()  # inp's outputs (norm's inputs)
        h = model.fc(model.act(model.norm(z)))
        assert torch.isfinite(h.half()).all() and torch.isfinite(model.head(h).half()).all()
    assert found.meta["accepted"]
    assert set(found.overrides) == {"inp", "norm"}
    assert all(parse_policy(s).is_fp32 for s in found.overrides.values())
    assert parse_policy(found.policy).params == lowprec.parse_format("fp16")
    assert found.evidence["inp"]["level"] == "fp32" and found.evidence["fc"]["level"] == "fp16"
    assert "overflow fp16" in found.evidence["inp"]["why"]
    assert "overflow fp16" in found.evidence["norm"]["why"]
    assert found.meta["high"] == ["inp", "norm"]


def test_verification_trains_plan_fp32_and_uniform(found):
    runs = found.verification["runs"]
    tol = found.meta["tolerance"]
    assert runs["plan"]["mean"] >= runs["fp32"]["mean"] - tol
    # uniform fp16 overflows: its weights leave the finite range (accuracy nan)
    assert math.isnan(runs["uniform fp16"]["mean"])
    # the plan costs more than pure fp16 and less than fp32, close to fp16
    c16, c32, cp = (runs[k]["cost"] for k in ("uniform fp16", "fp32", "plan"))
    assert c16 < cp < c32 and cp / c16 < 1.6
    head, rows = summary_rows(found)
    assert [r[0] for r in rows] == ["fp32", "uniform fp16", "uniform mixed16", "plan"]
    assert rows[1][1] == "diverged" and rows[3][-1] == "yes"
    # 16-mixed (trained beside any menu holding fp16) cannot save it: inp's fp16 GEMM
    # output overflows in the forward pass, which no loss scale reaches; it keeps fp32
    # parameters, so it costs more than the plan
    mixed = runs["uniform mixed16"]
    assert mixed["policy"] == "16-mixed" and rows[2][-1] == "no"
    assert cp < mixed["cost"] < c32
    md = plan_markdown(found)
    assert "| inp | Linear |" in md and "Search log" in md
    # no uniform level of the menu that held the tolerance is cheaper than the plan
    target = runs["fp32"]["mean"] - tol
    assert all(r["cost"] >= cp for k, r in runs.items() if k.startswith("uniform")
               and math.isfinite(r["mean"]) and r["mean"] >= target)


def test_a_uniform_level_that_holds_at_no_more_cost_replaces_the_plan():
    # the rule that keeps a per-module plan from losing to a uniform policy the verification
    # trained anyway (resnet20 on Fashion-MNIST: pure fp16 held at 0.50x while the plan, fp16
    # plus stochastic write-back, first missed the tolerance and was repaired upwards)
    runs = {"uniform fp16": {"mean": 0.795, "cost": 100},
            "uniform bf16": {"mean": 0.788, "cost": 100},
            "uniform fp8": {"mean": 0.70, "cost": 60},          # did not hold
            "uniform mxfp8": {"mean": 0.80, "cost": 50, "block_refused": ["fc"]}}
    keys = list(runs)
    # the plan missed: the cheapest held level at no more cost (then the most accurate) wins
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.688, "cost": 100}, False) == "uniform fp16"
    # the plan held at the same cost: only a more accurate level replaces it
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.79, "cost": 100}, True) == "uniform fp16"
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.80, "cost": 100}, True) is None
    # a cheaper plan is never replaced here by a dearer level, held or not; when it missed
    # and its repairs ran out, plan() asks the same question of the fp32 run instead: the
    # cheapest level that held, not fp32, is then the answer
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.5, "cost": 99}, False) is None
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.8, "cost": 200}, True) == "uniform fp16"
    # a diverged run (nan) never holds
    runs["uniform fp16"]["mean"] = math.nan
    assert cheaper_uniform(runs, keys, 0.78, {"mean": 0.7, "cost": 100}, False) == "uniform bf16"


def test_plan_file_round_trips_and_precision_trains_it(found, tmp_path):
    path = found.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back.policy == found.policy and back.overrides == found.overrides
    assert back.meta["accepted"] and back.log == found.log
    json.loads(path.read_text())  # standard JSON (no NaN literals)
    # Precision(plan) and Precision("plan:FILE") are the base policy with the overrides
    for spec in (back, f"plan:{path}"):
        prec = lowprec.Precision(spec)
        assert prec.policy == parse_policy(found.policy) and prec.overrides == found.overrides
    model, data = _model(), _data()
    prec = lowprec.Precision(back, seed=0)
    opt = lowprec.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = prec.setup(model, opt)
    for i in range(3):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data.x_train[i * 32:(i + 1) * 32]),
                                           data.y_train[i * 32:(i + 1) * 32])
        prec.backward(loss)
        assert prec.step(opt)
        assert torch.isfinite(loss)
    # fc is stored in fp16 (on torch's float16 grid), inp in fp32
    w = model.fc.weight.detach()
    assert torch.equal(w.half().float(), w)
    assert not torch.equal(model.inp.weight.detach().half().float(), model.inp.weight.detach())
    with pytest.raises(ValueError, match="not both"):
        lowprec.Precision(back, overrides={"fc": "32-true"})


@pytest.mark.parametrize("base,mixed", [("p=fp16,c=fp16,g=fp16", False),
                                        ("p=fp32,c=fp16,g=fp16,s=matmul", True)],
                         ids=["pure-fp16", "mixed16"])
def test_certify_follows_the_plan_module_by_module(tmp_path, base, mixed):
    """certify(model, data, "plan:FILE"): the twin runs each module in the plan's formats, as
    Precision(plan) trains it (inside autocast for a mixed base); per input, δ and the
    prediction are those of the plan run, not of the uniform base format (whose fp16 overflows
    in ``inp``)."""
    import numpy as np

    from lowprec.analysis import certify, layer_errors
    from lowprec.analysis.common import fp32_twin

    model, data = _model(), _data()
    p32 = "p=fp32,c=fp32,g=fp32"
    path = Plan(policy=base, overrides={"inp": p32, "norm": p32}).save(tmp_path / "p.json")
    cert = certify(model, data, f"plan:{path}")
    # the plan as training runs it: Precision(plan) on a copy, its forward under autocast
    prec = lowprec.Precision(f"plan:{path}")
    twin, _ = prec.setup(fp32_twin(model))
    twin.eval()
    with torch.no_grad(), prec.autocast():
        o = twin(data.x_test).double()
    with torch.no_grad():
        o32 = fp32_twin(model).eval()(data.x_test).double()
    assert np.array_equal(cert.delta, (o - o32).abs().max(dim=1).values.numpy())
    assert np.array_equal(cert.pred16, o.argmax(dim=1).numpy())
    assert cert.format == f"plan:{path}" and cert.violations == 0
    assert cert.summary()["certified"] > 0.9  # inp and norm in fp32: nothing overflows
    # fc runs in fp16 under the plan: δ is not zero, and it is not fp16 everywhere either
    assert cert.delta.max() > 0
    uniform = certify(model, data, "fp16")
    if not mixed:  # uniform fp16 overflows in inp: the plan's certificate is another one
        assert uniform.summary()["certified"] < 0.5
    assert not np.array_equal(uniform.delta, cert.delta)
    # a Plan object works too, and so do the probabilities and the layer errors
    plan = Plan.load(path)
    assert str(certify(model, data, plan)).startswith("plan (logits)")
    assert certify(model, data, plan, outputs="probs").violations == 0
    errs = {e.name: e.rel_error for e in layer_errors(model, data.x_test[:64], plan)}
    # inp in fp32: only the model's input rounding (to the base's fp16) reaches it, no overflow
    assert errs["inp"] < 1e-3 and errs["fc"] > 0
    if not mixed:
        assert not math.isfinite({e.name: e.rel_error for e in layer_errors(
            model, data.x_test[:64], "fp16")}["inp"])


def test_a_plan_run_is_certified_as_the_plan_in_every_table():
    from lowprec.experiments.run_analyses import certificate_formats

    # a plan whose base is e4m3fn is not certified in e4m3fn: the plan never runs it uniformly
    assert certificate_formats("plan:plan.json") == ["plan"]
    assert certificate_formats(Plan(policy="p=bf16,c=e4m3fn,g=e5m2")) == ["plan"]
    assert certificate_formats("p=bf16,c=e4m3fn,g=e5m2") == ["e4m3fn"]
    assert certificate_formats(parse_policy("32-true")) == ["fp16", "bf16"]


def test_plan_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(bad)
    bad.write_text(json.dumps({"overrides": {}}))
    with pytest.raises(ValueError, match="needs a 'policy'"):
        Plan.load(bad)
    bad.write_text(json.dumps({"policy": "p=fp16", "overrides": {"fc": "p=fp99"}}))
    with pytest.raises(ValueError, match=r"overrides\['fc'\]"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="cannot be read"):
        lowprec.Precision(f"plan:{tmp_path / 'missing.json'}")
    toml = tmp_path / "p.toml"
    toml.write_text('policy = "p=fp16,c=fp16,g=fp16"\n[overrides]\n"inp" = "32-true"\n')
    assert Plan.load(toml).overrides == {"inp": "32-true"}


def test_bad_arguments_name_the_accepted_values():
    with pytest.raises(ValueError, match="accepted: fp32, bf16, fp16"):
        parse_menu("fp32,fp12")
    assert parse_menu("fp16") == ("fp16", "fp32")
    m, d = _model(), _data()
    with pytest.raises(ValueError, match="minimise='watts'; accepted: memory, bits, time"):
        plan(m, d, minimise="watts")
    with pytest.raises(ValueError, match="minimise='time' needs hardware=NAME; accepted: h100"):
        plan(m, d, minimise="time")
    with pytest.raises(ValueError, match="tolerance=-0.1"):
        plan(m, d, tolerance=-0.1)
    with pytest.raises(ValueError, match="steps=0"):
        plan(m, d, steps=0)


def test_forced_repair_raises_modules_until_training_holds():
    # 16-bit fixed point (q6.10) passes every per-module measurement here but does not train
    # this MLP as fp32 does within 0 points: the plan is repaired, module by module, and
    # re-verified until it holds; every repair is in the log
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    p = plan(model, _data(), menu="fp32,fixed16-sr", steps=30, lr=0.05, tolerance=0.0,
             batch_size=32, compare_uniform=False)
    repairs = [line for line in p.log if line.startswith("repair:")]
    assert repairs and p.meta["repairs"] == len(repairs)
    verifies = [line for line in p.log if line.startswith("verify: plan")]
    assert len(verifies) == len(repairs) + 1  # trained again after each repair
    runs = p.verification["runs"]
    assert p.meta["accepted"] and runs["plan"]["mean"] >= runs["fp32"]["mean"]
    assert len(p.verification["attempts"]) == len(repairs) + 1
    first = p.verification["attempts"][0]
    assert first["mean"] < runs["fp32"]["mean"] or math.isnan(first["mean"])
    raised = {line.split("raise ")[1].split(" ")[0] for line in repairs}
    assert all(p.evidence[n]["level"] == "fp32" for n in raised)
    assert all("raised by repair" in p.evidence[n]["why"] for n in raised)


def test_cli_plan_end_to_end_and_compare_takes_the_plan(tmp_path, capsys, monkeypatch):
    import lowprec.experiments.data as data_mod

    monkeypatch.setitem(data_mod.DATASETS, "blobs-test", _data)
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "lowprec.experiments.demo_models:raw_input_mlp", "--data",
               "blobs-test", "--menu", "fp32,fp16", "--steps", "30", "--lr", "0.05",
               "--batch-size", "32", "--tolerance", "0.02", "--out", str(out),
               "--report", str(tmp_path / "plan.md")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for text in ("per module", "inp", "uniform fp16", "diverged", "plan written to"):
        assert text in printed
    p = Plan.load(out)
    assert set(p.overrides) == {"inp", "norm"}
    assert "| norm | LayerNorm |" in (tmp_path / "plan.md").read_text()
    rc = main(["plan", "--data", "blobs-test", "--menu", "fp32,fp12", "--out", str(out)])
    assert rc == 2 and "accepted: fp32" in capsys.readouterr().err
    # compare accepts plan:FILE beside named policies
    run = tmp_path / "cmp"
    rc = main(["compare", "--model", "lowprec.experiments.demo_models:raw_input_mlp",
               "--data", "blobs-test", "--policies", f"32-true,plan:{out}", "--seeds", "1",
               "--epochs", "1", "--batch-size", "32", "--out", str(run), "--quiet"])
    assert rc == 0
    import sqlite3

    rows = sqlite3.connect(run / "results.db").execute(
        "SELECT policy, policy_spec, status FROM runs ORDER BY policy").fetchall()
    assert rows[1][0] == f"plan:{out}" and rows[1][1] == parse_policy(p.policy).spec
    assert all(r[2] == "finished" for r in rows)
    # the report's plan section, from the plan stored in the database (read back from JSON:
    # uniform fp16's non-finite accuracy is a string there, shown as diverged)
    page = (run / "report.html").read_text()
    assert f"Precision plan: plan:{out}" in page and "<td>uniform fp16</td><td>diverged" in page
    # the plan run is certified module by module, as the plan runs it: never in uniform fp16,
    # a format the plan does not run (issue 36: "unsafe" under its own "Use plan" verdict)
    from lowprec.experiments.report import summary_json
    from lowprec.experiments.results import ResultsDB

    db = ResultsDB(run / "results.db", create=False)
    plan_run = next(r["run_id"] for r in db.runs() if r["policy"] == f"plan:{out}")
    kinds = [k for k, _ in db.analyses_of(plan_run, "certificate")]
    stored = db.analysis(plan_run, "certificate:plan")
    db.close()
    assert kinds == ["certificate:plan"] and stored["summary"]["format"] == "plan"
    md = (run / "report.md").read_text()
    cert_rows = [line for line in md.splitlines() if line.startswith(f"| plan:{out} |")]
    assert any("| plan (each module in its format) |" in line for line in cert_rows)
    assert not any("| fp16 |" in line for line in cert_rows)
    verdict = summary_json(run)["verdict"]
    if verdict["policy"] == f"plan:{out}":
        assert [f["format"] for f in verdict["findings"]] == ["plan"]
    # a resume refuses a plan file edited since its runs started (they would train under two
    # plans), and continues once it is restored
    text = out.read_text()
    edited = json.loads(text)
    edited["overrides"] = {}
    out.write_text(json.dumps(edited))
    rc = main(["compare", "--out", str(run), "--resume", "--quiet"])
    assert rc == 2 and "another plan" in capsys.readouterr().err
    out.write_text(text)
    assert main(["compare", "--out", str(run), "--resume", "--quiet"]) == 0


def test_module_cost_counts_torchs_elements_and_profile_leaves_batchnorm_alone():
    from lowprec.analysis.plan_scores import module_cost

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(5, 1, 16), torch.tensor([0, 1, 2, 3, 0])
    prof = module_profile(model, (x, y), nn.functional.cross_entropy)
    for k, v in model.state_dict().items():  # running statistics untouched
        assert torch.equal(v, before[k]), k
    p = prof["1"]
    n_w = sum(t.numel() for t in model[1].parameters())
    assert (p.n_params, p.n_in, p.n_out) == (n_w, 5 * 16, 5 * 8)
    # params + grads at the parameter width, outputs at the compute width (fp16: 2 bytes,
    # e4m3fn: 1 byte, as torch's element sizes)
    fp16 = parse_policy("p=fp16,c=fp16,g=fp16")
    fp8 = parse_policy("p=bf16,c=e4m3fn,g=e5m2")
    e16 = torch.empty(0, dtype=torch.float16).element_size()
    e8 = torch.empty(0, dtype=torch.float8_e4m3fn).element_size()
    assert module_cost(p, fp16) == 2 * n_w * e16 + 5 * 8 * e16
    assert module_cost(p, fp8) == 2 * n_w * e16 + 5 * 8 * e8
    assert module_cost(p, fp8, "bits") < module_cost(p, fp16, "bits")
    with pytest.raises(ValueError, match="cost='watts'; accepted: memory, bits, time"):
        module_cost(p, fp16, "watts")
    with pytest.raises(ValueError, match="cost='time' needs hardware=NAME"):
        module_cost(p, fp16, "time")


def test_lightning_plugin_takes_a_plan(found):
    pytest.importorskip("lightning")
    from lowprec.integrations.lightning import LowprecPrecision

    plugin = LowprecPrecision(found)
    assert plugin.lowprec.overrides == found.overrides
    assert plugin.lowprec.policy == parse_policy(found.policy)


def test_assign_takes_the_cheapest_passing_level_and_falls_back_to_the_last():
    from lowprec.analysis.plan_scores import assign

    order = ["fp8", "fp16", "fp32"]
    costs = {"a": {"fp8": 1, "fp16": 2, "fp32": 4}, "b": {"fp8": 1, "fp16": 2, "fp32": 4},
             "c": {"fp8": 1, "fp16": 2, "fp32": 4}}
    passes = {"a": {"fp8": True, "fp16": True, "fp32": True},
              "b": {"fp8": False, "fp16": True, "fp32": True},
              "c": {"fp8": False, "fp16": False, "fp32": False}}
    assert assign(costs, passes, order) == {"a": "fp8", "b": "fp16", "c": "fp32"}
    assert lowprec.plan is plan and lowprec.Plan is Plan  # the facade's names
