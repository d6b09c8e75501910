"""`lowprec compare`: the runner, the results database, resume, divergence, bad input, report."""

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lowprec.cli import main
from lowprec.experiments.results import ResultsDB
from lowprec.experiments import CompareConfig, run_compare

SRC = str(Path(__file__).resolve().parents[2] / "src")


def small(out, **kw):
    base = dict(data="digits", model="mlp", policies=("32-true", "16-true"), seeds=(0,), epochs=2,
                batch_size=64, out=str(out), quiet=True)
    base.update(kw)
    return CompareConfig(**base)


def test_compare_stores_everything_and_writes_the_report(tmp_path):
    out = run_compare(small(tmp_path / "r"))
    db = ResultsDB(out / "results.db", create=False)
    runs = db.runs()
    assert [r["status"] for r in runs] == ["finished", "finished"]
    r = runs[0]
    assert r["config"]["data"] == "digits" and r["versions"]["torch"] and r["hardware"]["cpus"]
    assert r["policy_spec"].startswith("p=fp32")
    for run in runs:  # the backend each run took, why, and the facts auto decided by
        choice = run["hardware"]["backend_choice"]
        assert choice["backend"] == run["backend"] and choice["reason"]
        assert run["hardware"]["cpu"]["capability"] == torch.backends.cpu.get_cpu_capability()
        assert run["hardware"]["kernel_target"] == "cpu"  # the CPU's kernels on a CPU
    by_policy = {run["policy"]: run for run in runs}
    assert by_policy["16-true"]["hardware"]["backend_choice"]["automatic"]  # auto chose
    assert not by_policy["32-true"]["hardware"]["backend_choice"]["automatic"]
    for run in runs:
        ep = db.epochs(run["run_id"])
        assert [e["epoch"] for e in ep] == [0, 1]
        assert all(0 < e["test_acc"] <= 1 and e["seconds"] > 0 for e in ep)
        mem = db.memory(run["run_id"])
        assert mem["total"] == sum(mem[k] for k in ("params", "grads", "optimizer_state",
                                                    "master", "activations"))
        assert len(db.trace(run["run_id"])) == 2 * 23  # every optimizer step (1438 / 64)
        steps = db.steps(run["run_id"])  # loss, learning rate, gradient norm per step
        assert [s["step"] for s in steps] == list(range(2 * 23))
        assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps)
        assert steps[0]["lr"] == 0.02 and steps[-1]["lr"] == pytest.approx(0.01)  # cosine
        assert all(e["cpu_seconds"] > 0 and e["ended"] > e["seconds"] for e in ep)
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    for run in runs:  # the analyses of every finished run are stored for the report
        assert db.analysis(run["run_id"], "certificate:fp16")["summary"]["violations"] == 0
    db.close()
    md = (out / "report.md").read_text()
    assert "| 32-true |" in md and "report_files/accuracy.png" in md
    # the verdict comes first, with its evidence
    assert md.index("## Verdict") < md.index("## Summary")
    assert "**Use " in md and "test accuracy (%)" in md and "(n=1)" in md and "± 0.00" not in md
    assert "lowprec advise's findings" in md and "## Timing" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 7 and "<table" in html
    assert html.index("id='verdict'") < html.index("<h2>Summary</h2>")
    assert "The 16-bit certificate" in html and "Lost updates" in html
    for name in ("accuracy.png", "steps.png", "loss_scale.png", "memory.png", "certificate.png",
                 "layer_errors.png", "gradient_ranges.png"):
        assert (out / "report_files" / name).stat().st_size > 1000


def test_report_rebuilds_from_the_database_alone(tmp_path, capsys):
    out = run_compare(small(tmp_path / "r", policies=("32-true",)))
    (out / "report.html").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").exists()
    assert "32-true" in capsys.readouterr().out


def test_the_guides_own_data_and_model_functions_run(tmp_path):
    """docs/guides/compare.md's example of your own data and model functions, written to
    mymods.py as it says, runs under ``lowprec compare --data mymods:data --model
    mymods:model`` (a new user had to find these signatures in the source)."""
    import re

    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "compare.md"
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
                if "def model(input_shape, num_classes)" in b]
    (tmp_path / "mymods.py").write_text(block)
    out = tmp_path / "run"
    # as the guide says: the console script, run in mymods.py's folder (which it does not put
    # on sys.path itself: the review found the module not found)
    script = Path(sys.executable).parent / "lowprec"
    if not script.exists():
        pytest.skip("no lowprec console script beside this Python (not installed)")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    done = subprocess.run([str(script), "compare", "--data", "mymods:data", "--model",
                           "mymods:model", "--policies", "32-true", "--seeds", "1", "--epochs",
                           "1", "--out", str(out), "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    db = ResultsDB(out / "results.db", create=False)
    (run,) = db.runs()
    assert run["status"] == "finished" and db.epochs(run["run_id"])[-1]["test_acc"] > 0.5


def test_resume_says_when_there_is_nothing_to_resume(tmp_path, capsys, monkeypatch):
    """--resume on a folder that holds nothing starts it (make demo's first run), and says so;
    an interrupt before anything was stored does not name a folder to resume (a new user was
    told to resume a folder that was never created)."""
    from lowprec.experiments import compare

    out = tmp_path / "new"
    assert main(["compare", "--data", "digits", "--model", "mlp", "--policies", "32-true",
                 "--seeds", "1", "--epochs", "1", "--out", str(out), "--resume", "--quiet"]) == 0
    # (what it starts named: a user whose first start was interrupted resumed with no flags
    # and got the default experiment, unnamed)
    assert f"nothing stored in {out} yet: starting it: mlp on digits, 1 policy x 1 seed, 1 " \
        "epoch" in capsys.readouterr().err
    assert main(["compare", "--out", str(out), "--resume", "--quiet"]) == 0  # all finished
    assert "nothing stored" not in capsys.readouterr().err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run_compare", interrupted)
    assert main(["compare", "--out", str(tmp_path / "never"), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted before anything was stored" in err and "--resume" not in err
    assert main(["compare", "--out", str(out), "--resume", "--quiet"]) == 130
    assert f"finished runs are stored in {out}; continue with --resume" in \
        capsys.readouterr().err


def test_a_diverging_run_is_recorded_and_the_comparison_goes_on(tmp_path):
    out = run_compare(small(tmp_path / "r", lr=1e6, schedule="constant", momentum=0.0,
                            policies=("32-true", "bf16-true")))
    db = ResultsDB(out / "results.db", create=False)
    statuses = {r["policy"]: r for r in db.runs()}
    assert set(statuses) == {"32-true", "bf16-true"}  # the second run ran after the first
    for r in statuses.values():
        assert r["status"] == "diverged" and r["diverged_step"] is not None
    db.close()
    assert "diverged" in (out / "report.md").read_text()


def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "lowprec.cli", *args], capture_output=True,
                          text=True, env=env, **kw)


def _final(db_path):
    c = sqlite3.connect(db_path)
    rows = c.execute("SELECT run_id, epoch, train_loss, test_acc FROM epochs ORDER BY run_id, "
                     "epoch").fetchall()
    started = dict(c.execute("SELECT run_id, started FROM runs").fetchall())
    c.close()
    return rows, started


# killed at chosen moments and resumed: tests/experiments/test_kill_resume.py


def test_existing_folder_needs_resume(tmp_path):
    run_compare(small(tmp_path / "r", policies=("32-true",)))
    res = _cli(["compare", "--data", "digits", "--model", "mlp", "--policies", "32-true",
                "--seeds", "1", "--epochs", "1", "--out", str(tmp_path / "r"), "--quiet"])
    assert res.returncode == 2 and "--resume" in res.stderr and res.stderr.count("\n") == 1


@pytest.mark.parametrize("args,needle", [
    (["--policies", "17-true"], "unknown policy '17-true'"),
    (["--model", "alexnet"], "unknown model 'alexnet'"),
    (["--data", "imagenet"], "unknown dataset 'imagenet'"),
    (["--epochs", "0"], "--epochs: '0' is not in [1, 100000]"),
    (["--optimizer", "lion"], "optimizer='lion'"),
    (["--data", "cifar10:/nonexistent"], "cifar10"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    res = _cli(["compare", "--out", str(tmp_path / "r"), "--quiet", "--epochs", "1", *args])
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = _cli(["compare", "--out", str(blocker / "sub"), "--quiet", "--epochs", "1"])
    assert res.returncode == 2 and "not writable" in res.stderr
    assert res.stderr.count("\n") == 1


def test_corrupted_database_is_reported_and_left_untouched(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    garbage = b"this is not sqlite" * 100
    (out / "results.db").write_bytes(garbage)
    res = _cli(["compare", "--data", "digits", "--model", "mlp", "--policies", "32-true",
                "--seeds", "1", "--epochs", "1", "--out", str(out), "--resume", "--quiet"])
    assert res.returncode == 2 and "results.db" in res.stderr and "Traceback" not in res.stderr
    assert (out / "results.db").read_bytes() == garbage
    res = _cli(["report", str(out)])
    assert res.returncode == 2 and (out / "results.db").read_bytes() == garbage


def test_train_command_and_help():
    for cmd in (["compare", "--help"], ["train", "--help"], ["report", "--help"],
                ["formats", "--help"]):
        res = _cli(cmd)
        assert res.returncode == 0 and "usage" in res.stdout


def test_train_runs_one_policy(tmp_path, capsys):
    rc = main(["train", "--policy", "bf16-true", "--seed", "3", "--data", "digits", "--model",
               "mlp", "--epochs", "1", "--out", str(tmp_path / "t")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bf16-true" in out and "report" in out
    db = ResultsDB(tmp_path / "t" / "results.db", create=False)
    assert [(r["policy"], r["seed"]) for r in db.runs()] == [("bf16-true", 3)]
    db.close()


def test_progress_is_shown_and_quiet_silences_it(tmp_path):
    res = _cli(["compare", "--data", "digits", "--model", "mlp", "--policies", "32-true",
                "--seeds", "1", "--epochs", "1", "--out", str(tmp_path / "a")])
    assert res.returncode == 0 and "all runs: 1/1 done" in res.stdout and "test acc" in res.stdout
    # stdout is a pipe here: one plain line per finished epoch, not rich's bars
    assert "32-true seed 0: epoch 1/1, train loss " in res.stdout and "━" not in res.stdout.split(
        "all runs")[0]
    res = _cli(["compare", "--data", "digits", "--model", "mlp", "--policies", "32-true",
                "--seeds", "1", "--epochs", "1", "--out", str(tmp_path / "b"), "--quiet"])
    assert res.returncode == 0 and res.stdout == ""


@pytest.mark.browser
def test_report_displays_in_a_real_headless_chromium(tmp_path):
    import shutil

    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test "
                    "installs them)")
    from io import BytesIO

    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    out = run_compare(small(tmp_path / "r"))
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,1600",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get((out / "report.html").resolve().as_uri())
        table = driver.find_element(By.CSS_SELECTOR, "table.summary")
        assert table.is_displayed()
        cells = [td.text for td in table.find_elements(By.TAG_NAME, "td")]
        assert "32-true" in cells and "16-true" in cells
        verdict = driver.find_element(By.ID, "verdict")  # the recommendation, first
        assert verdict.is_displayed() and verdict.location["y"] < table.location["y"]
        assert "Use " in verdict.text and "test accuracy" in verdict.text
        images = driver.find_elements(By.TAG_NAME, "img")
        assert len(images) == 7
        for img in images:
            ok = driver.execute_script(
                "return arguments[0].complete && arguments[0].naturalWidth > 100", img)
            assert ok, "broken image"
            assert img.is_displayed()
        png = driver.get_screenshot_as_png()
    finally:
        driver.quit()
    shot = Image.open(BytesIO(png)).convert("L")
    hist = shot.histogram()
    assert sum(1 for h in hist if h > 0) > 20  # not a blank page
    assert hist[255] < 0.98 * sum(hist)


def test_resume_before_the_first_checkpoint_redoes_the_run_in_place(tmp_path):
    """Killed after epoch 0's row was written but before its checkpoint: resume keeps the run
    (same start time) and recomputes the same numbers."""
    cfg = small(tmp_path / "r", policies=("32-true",), epochs=2)
    out = run_compare(cfg)
    rows, started = _final(out / "results.db")
    c = sqlite3.connect(out / "results.db")
    c.execute("UPDATE runs SET status = 'running', finished = NULL")
    c.execute("DELETE FROM epochs WHERE epoch > 0")
    c.commit()
    c.close()
    assert not list((out / "checkpoints").iterdir())
    run_compare(replace(cfg, resume=True))
    rows_after, started_after = _final(out / "results.db")
    assert rows_after == rows and started_after == started


def _interrupted_after_epoch_0(out, backend_choice=None):
    """The run folder as a run killed after epoch 0's checkpoint leaves it; ``backend_choice``
    replaces the backend choice stored with the run."""
    c = sqlite3.connect(out / "results.db")
    c.execute("UPDATE runs SET status = 'running', finished = NULL")
    c.execute("DELETE FROM epochs WHERE epoch > 0")
    if backend_choice is not None:
        hw = json.loads(c.execute("SELECT hardware FROM runs").fetchone()[0])
        hw["backend_choice"] = backend_choice
        c.execute("UPDATE runs SET hardware = ?", (json.dumps(hw),))
    c.commit()
    c.close()


def test_a_resumed_run_keeps_the_backend_it_started_on(tmp_path, monkeypatch):
    """A run resumes on the backend stored with it, even where ``auto`` would choose another
    now (a new lowprec's rule, another CPU): the same numbers as the run never interrupted."""
    from lowprec.experiments import runner
    from lowprec.training.backends import choice as choice_mod

    cfg = small(tmp_path / "r", policies=("16-true",), epochs=2)
    out = run_compare(cfg)
    rows, _ = _final(out / "results.db")
    assert ResultsDB(out / "results.db", create=False).runs()[0]["backend"] == "emulated"
    _interrupted_after_epoch_0(out)
    # auto would now run fp16 natively
    monkeypatch.setattr(choice_mod, "native_speed", lambda fmt, facts: (True, "fast"))
    used = []
    set_up = runner._set_up

    def spy(*args, **kwargs):  # the backend each set-up of the resumed run took
        made = set_up(*args, **kwargs)
        used.append(made[2].backend)
        return made

    monkeypatch.setattr(runner, "_set_up", spy)
    run_compare(replace(cfg, resume=True))
    after, _ = _final(out / "results.db")
    assert used == ["emulated"] and after == rows
    assert ResultsDB(out / "results.db", create=False).runs()[0]["backend"] == "emulated"


def test_a_run_stored_on_a_backend_that_cannot_run_its_policy_is_redone(tmp_path, monkeypatch):
    """A stochastic-rounding run an older lowprec ran natively (torch rounds to nearest) is
    not continued natively: it is redone from its start, emulated, with a warning, and gives
    the numbers of a run that was emulated from the start."""
    from lowprec.experiments import runner

    policy = "p=bf16,c=bf16:sr,g=bf16"
    cfg = small(tmp_path / "r", policies=(policy,), epochs=2)
    out = run_compare(cfg)
    rows, started = _final(out / "results.db")
    _interrupted_after_epoch_0(out, {"backend": "native", "reason": "fast", "automatic": True})
    from lowprec.experiments.checkpoints import checkpoint_path

    run_id = ResultsDB(out / "results.db", create=False).runs()[0]["run_id"]
    old = checkpoint_path(out, run_id)  # the native run's epoch 0
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(b"a checkpoint of the run stored native")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # the redo killed before its first checkpoint: the old
        m.setattr(runner, "_run_epoch", killed)  # run's checkpoint is not left to be loaded
        with pytest.warns(UserWarning, match="redone"), pytest.raises(KeyboardInterrupt):
            run_compare(replace(cfg, resume=True))
    assert not old.exists()
    _interrupted_after_epoch_0(out, {"backend": "native", "reason": "fast", "automatic": True})
    with pytest.warns(UserWarning, match="redone from its start: .*nearest-even"):
        run_compare(replace(cfg, resume=True))
    after, started_after = _final(out / "results.db")
    assert after == rows and started_after != started
    run = ResultsDB(out / "results.db", create=False).runs()[0]
    assert run["status"] == "finished" and run["backend"] == "emulated"
    assert run["hardware"]["backend_choice"]["backend"] == "emulated"
    db = ResultsDB(out / "results.db", create=False)
    assert "nearest-even" in db.analysis(run["run_id"], "redone")["reason"]


def test_built_in_cnns_train_channels_last_and_a_user_model_as_built(tmp_path, monkeypatch):
    """The runner lays its own convolutional models out channels-last (recorded per run); a
    user's model keeps its layout: its forward may .view() a convolution's output, which
    NHWC refuses."""
    (tmp_path / "viewnet.py").write_text(
        "import torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, classes):\n"
        "        super().__init__()\n"
        "        self.conv, self.fc = nn.Conv2d(1, 4, 3), nn.Linear(4 * 6 * 6, classes)\n"
        "    def forward(self, x):\n"
        "        h = self.conv(x)\n"
        "        return self.fc(h.view(h.size(0), -1))\n"
        "def net(shape, classes):\n"
        "    return Net(classes)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for model, layout in (("lenet5", "channels_last"), ("viewnet:net", "contiguous")):
            out = run_compare(small(tmp_path / model.replace(":", "_"), model=model,
                                    policies=("32-true",), epochs=1))
            db = ResultsDB(out / "results.db", create=False)
            runs = db.runs()
            assert [r["status"] for r in runs] == ["finished"], runs[0].get("error")
            assert runs[0]["hardware"]["layout"] == layout, model
    finally:
        sys.modules.pop("viewnet", None)
