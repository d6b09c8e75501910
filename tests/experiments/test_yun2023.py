"""The yun2023 preset (Yun et al. 2023 across architectures), comparisons over several models,
the full Fashion-MNIST and the MobileNet-style model."""

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec.cli import main
from lowprec.experiments import CompareConfig, PRESETS, RunError, run_compare
from lowprec.experiments.data import (FASHION_MNIST_DIR, load_dataset, load_fashion_mnist,
                                      load_idx_dir)
from lowprec.experiments.models import MobileNetV2Small, build_model

needs_fashion = pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR).is_dir(),
    reason=f"Debian's dataset-fashion-mnist is not installed ({FASHION_MNIST_DIR}; make test "
           "installs it)")


def test_the_preset_is_the_papers_setup():
    p = PRESETS["yun2023"]
    assert p["data"] == "fashion-mnist"
    assert {"resnet20", "vgg", "transformer", "mobilenet"} <= set(p["model"].split(","))
    assert p["policies"] == ("32-true", "16-true", "16-mixed", "bf16-true")
    assert (p["optimizer"] if "optimizer" in p else "sgd") == "sgd"
    assert (p["lr"], p["momentum"], p["batch_size"]) == (0.01, 0.9, 256)
    CompareConfig(**p).validate()


@pytest.mark.slow  # 16 runs with their analyses: about 2 CPU-minutes
@pytest.mark.timeout(3600)  # a hang guard only: a loaded machine is slow, not hung
def test_preset_at_tiny_scale_has_every_architecture_and_policy(tmp_path, capsys):
    # the preset's models and policies at a size a test affords: 64 of the 8x8 digits, one
    # epoch, one seed (the structure, not the numbers: those are the table of docs/guides/compare.md)
    out = tmp_path / "yun"
    assert main(["compare", "--preset", "yun2023", "--data", "digits", "--train-subset", "64",
                 "--epochs", "1", "--seeds", "1", "--out", str(out)]) == 0
    p = PRESETS["yun2023"]
    models = p["model"].split(",")
    assert json.loads((out / "models.json").read_text())["models"] == models
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    printed = capsys.readouterr().out
    for model in models:
        c = sqlite3.connect(out / model / "results.db")
        runs = c.execute("SELECT policy, status, config FROM runs").fetchall()
        n_ep = c.execute("SELECT COUNT(*) FROM epochs").fetchone()[0]
        certs = c.execute("SELECT COUNT(*) FROM analysis WHERE kind LIKE 'certificate:%'"
                          ).fetchone()[0]
        c.close()
        assert sorted(r[0] for r in runs) == sorted(p["policies"])
        assert all(r[1] == "finished" for r in runs), runs
        cfg = json.loads(runs[0][2])
        assert (cfg["model"], cfg["lr"], cfg["batch_size"]) == (model, 0.01, 256)
        assert n_ep == len(p["policies"]) and certs == len(p["policies"]) + 1  # fp32: 2
        # one table per architecture: every policy a row, fp32 the baseline of the others
        section = md.split(f"## {model}\n", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in section.splitlines() if line.startswith("| ")][2:]
        assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(p["policies"])
        assert rows[0].split(" | ")[2] == "+0.00" and "(fp16)" in rows[0]
        assert "(bf16)" in rows[3] and "1.00x" in rows[0]
        assert f"<h2>{model}</h2>" in html and model in printed
        assert (out / model / "report.html").exists()
    # the combined report is rebuilt from the run folder alone
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == md


def test_several_models_resume_and_report(tmp_path, capsys):
    cfg = CompareConfig(data="digits", model="mlp, lenet5", policies=("32-true", "bf16-true"),
                        seeds=(0,), epochs=1, batch_size=64, out=str(tmp_path / "r"),
                        quiet=True)
    out = run_compare(cfg)
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"mlp", "lenet5"}
    first = (out / "report.md").read_text()
    assert "## mlp" in first and "## lenet5" in first
    with pytest.raises(RunError, match="already holds a comparison"):
        run_compare(CompareConfig(**{**cfg.__dict__, "resume": False}))
    # --resume with everything finished redoes nothing and gives the same tables
    c = sqlite3.connect(out / "lenet5" / "results.db")
    started = c.execute("SELECT run_id, started FROM runs ORDER BY run_id").fetchall()
    c.close()
    run_compare(CompareConfig(**{**cfg.__dict__, "resume": True}))
    c = sqlite3.connect(out / "lenet5" / "results.db")
    assert c.execute("SELECT run_id, started FROM runs ORDER BY run_id").fetchall() == started
    c.close()
    assert (out / "report.md").read_text() == first


@pytest.mark.parametrize("spec, needle", [(",", "no model given"),
                                          ("mlp,mlp", "names a model twice")])
def test_bad_model_lists(spec, needle, tmp_path):
    with pytest.raises(RunError, match=needle):
        run_compare(CompareConfig(data="digits", model=spec, out=str(tmp_path / "r")))


@needs_fashion
def test_full_fashion_mnist_equals_the_plain_idx_reader_and_is_cached(tmp_path, monkeypatch,
                                                                      capfd):
    monkeypatch.setenv("LOWPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal for rich: the bar is drawn
    first = load_fashion_mnist()
    bar = capfd.readouterr().err
    assert "reading fashion-mnist" in bar
    assert len(list((tmp_path / "cache").glob("idx-*.npz"))) == 1
    again = load_dataset("fashion-mnist")
    assert "reading" not in capfd.readouterr().err  # from the cache: no bar
    ref = load_idx_dir(FASHION_MNIST_DIR, "fashion-mnist")
    for d in (first, again):
        assert d.x_train.shape == (60000, 1, 28, 28) and d.x_test.shape == (10000, 1, 28, 28)
        assert d.num_classes == 10 and torch.bincount(d.y_train).tolist() == [6000] * 10
        for key in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(d, key), getattr(ref, key)), key
    # quiet: no bar even on a terminal
    monkeypatch.setenv("LOWPREC_CACHE_DIR", str(tmp_path / "cache2"))
    load_dataset("fashion-mnist", quiet=True)
    assert "reading" not in capfd.readouterr().err


def test_mobilenet_is_inverted_residual_with_depthwise_convolutions():
    m = build_model("mobilenet", (1, 28, 28), 10)
    assert isinstance(m, MobileNetV2Small)
    convs = [c for c in m.modules() if isinstance(c, nn.Conv2d)]
    depthwise = [c for c in convs if c.groups > 1]
    assert depthwise and all(c.groups == c.in_channels == c.out_channels for c in depthwise)
    assert sum(isinstance(x, nn.ReLU6) for x in m.modules()) > 10
    for shape in [(1, 28, 28), (3, 32, 32)]:
        net = build_model("mobilenet", shape, 7).eval()
        assert net(torch.zeros(2, *shape)).shape == (2, 7)
    # a residual block adds its input: with the block's output zeroed it is the identity
    block = next(b for b in m.blocks if b.residual)
    nn.init.zeros_(block.block[-1].weight)
    nn.init.zeros_(block.block[-1].bias)
    x = torch.randn(2, block.block[0].in_channels, 7, 7)
    assert torch.equal(block.eval()(x), x)
