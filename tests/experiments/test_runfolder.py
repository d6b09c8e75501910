"""The run folder contract: the lock, SIGTERM, --resume's configuration check, dropped runs,
runs that fail inside, a full disk (a real 3 MB tmpfs where this process may mount one, and
ENOSPC injected into the checkpoint and report writers everywhere)."""

import errno
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowprec.cli import main
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments.results import NOT_REQUESTED, ResultsDB
from lowprec.experiments.runfolder import EXPORT_MARK, RunIOError, _host, atomic_write_bytes

SRC = str(Path(__file__).resolve().parents[2] / "src")
ARGS = ["compare", "--data", "digits", "--model", "mlp", "--seeds", "1", "--epochs", "2",
        "--train-subset", "128", "--quiet"]


def _epochs(db_path):
    c = sqlite3.connect(db_path)
    try:
        return c.execute("SELECT run_id, epoch, train_loss, test_loss, test_acc, skipped, "
                         "loss_scale FROM epochs ORDER BY run_id, epoch").fetchall()
    finally:
        c.close()


def _integrity(db_path):
    c = sqlite3.connect(db_path)
    try:
        return c.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        c.close()


def test_the_lock_holders_half_written_file_names_the_holder(tmp_path, capsys):
    """A second command that meets the temp file the lock's holder is writing (a checkpoint
    half saved) says the folder is in use by that process, not that the file is foreign (CI
    met it: the holder was saving its first checkpoint); a live temp file of a process the
    lock does not name is still refused as not lowprec's."""
    out = tmp_path / "run"
    argv = ARGS + ["--policies", "32-true", "--out", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / ".lock").write_text(f"{holder.pid} (lowprec compare)\n")
        half = out / "checkpoints" / f".run1.pt.lowprec-tmp{holder.pid}@{_host()}"
        half.write_bytes(b"half")
        for extra in ([], ["--resume"]):
            assert main(argv + extra) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"in use by process {holder.pid} (lowprec compare)" in \
                err[0], err
        (out / ".lock").write_text(f"{os.getpid()} (lowprec compare)\n")  # not the writer
        assert main(argv + ["--resume"]) == 2
        err = capsys.readouterr().err
        assert half.name in err and "not part of a lowprec run folder" in err
        assert half.read_bytes() == b"half"  # a live writer's file is never deleted
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.timeout(3600)  # hang guards only: a loaded machine is slow, not hung
def test_lock_names_the_holder_and_sigterm_stops_resumably(tmp_path, capsys):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=SRC)
    argv = ARGS + ["--policies", "32-true,fixed16-sr", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "lowprec.cli", *argv],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = out / ".lock"
    deadline = time.time() + 1800
    while time.time() < deadline and not (lock.exists() and str(proc.pid) in lock.read_text()):
        time.sleep(0.05)
    assert str(proc.pid) in lock.read_text()
    for second in (argv, argv + ["--resume"]):
        t0 = time.time()
        assert main(second) == 2
        assert time.time() - t0 < 300
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"process {proc.pid}" in err
    while time.time() < deadline and proc.poll() is None:  # SIGTERM once training started
        try:
            # read-only: a plain connect would create an empty results.db before lowprec does
            c = sqlite3.connect(f"file:{out / 'results.db'}?mode=ro", uri=True, timeout=1)
            n = c.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
            c.close()
        except sqlite3.Error:
            n = 0
        if n:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=1200)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(argv + ["--resume"]) == 0  # the lock died with its process
    db = ResultsDB(out / "results.db", create=False)
    assert [r["status"] for r in db.runs()] == ["finished", "finished"]
    db.close()


@pytest.mark.timeout(1800)  # a hang guard only
def test_resume_checks_the_configuration_marks_dropped_runs_and_records_force(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = dict(data="digits", model="mlp", seeds=(0,), epochs=1, batch_size=64, train_subset=64,
               out=str(out), quiet=True)
    run_compare(CompareConfig(policies=("32-true",), **cfg))
    db = ResultsDB(out / "results.db", create=False)
    # an interrupted run the resumed comparison does not ask for any more
    db.start_run("16-true|seed=0", policy="16-true", policy_spec="x", seed=0, config={},
                 versions={}, git=None, hardware={})
    db.close()
    assert main(["compare", "--out", str(out), "--resume", "--lr", "0.3", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "lr: stored 0.02, given 0.3" in err and len(err.strip().splitlines()) == 1
    # flags not given take the stored values: this resume only finishes the bookkeeping
    assert main(["compare", "--out", str(out), "--resume", "--quiet"]) == 0
    db = ResultsDB(out / "results.db", create=False)
    dropped = db.run("16-true|seed=0")
    assert dropped["status"] == "failed" and dropped["error"] == NOT_REQUESTED
    db.close()
    # a forced setting is refused for the finished 32-true run (trained with lr 0.02) ...
    assert main(["compare", "--out", str(out), "--resume", "--lr", "0.3", "--force-config",
                 "--policies", "32-true", "--quiet"]) == 2
    assert "would change lr of runs already finished (32-true|seed=0)" in \
        capsys.readouterr().err
    # ... even when only the interrupted 16-true run is asked for: the stored configuration is
    # the folder's, and the finished 32-true run's results were trained with lr 0.02
    assert main(["compare", "--out", str(out), "--resume", "--lr", "0.3", "--force-config",
                 "--policies", "16-true", "--quiet"]) == 2
    assert "would change lr of runs already finished (32-true|seed=0)" in \
        capsys.readouterr().err
    # a forced change of the list of policies is recorded, and runs what it asks for
    assert main(["compare", "--out", str(out), "--resume", "--force-config",
                 "--policies", "16-true", "--quiet"]) == 0
    db = ResultsDB(out / "results.db", create=False)
    forced = db.meta("forced_config")
    assert forced and sorted(forced[-1]["differences"]) == [
        "policies: stored ['32-true'], given ['16-true']"]
    assert db.stored_config()["lr"] == 0.02
    assert db.run("16-true|seed=0")["status"] == "finished"
    db.close()


@pytest.mark.timeout(1800)  # a hang guard only
def test_a_run_that_fails_inside_makes_compare_exit_1_with_one_line(tmp_path, capsys):
    mod = tmp_path / "lp_train_fail.py"
    mod.write_text(
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self, n):\n"
        "        super().__init__(); self.l = nn.Linear(64, n)\n"
        "    def forward(self, x):\n"
        "        if self.training: raise RuntimeError('dropout layer misconfigured')\n"
        "        return self.l(x.flatten(1))\n"
        "def build(shape, n):\n"
        "    return M(n)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(ARGS + ["--model", "lp_train_fail:build", "--policies", "32-true,16-true",
                            "--out", str(tmp_path / "run")])
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 2 and all("dropout layer misconfigured" in line for line in err)


def test_atomic_write_removes_its_temp_and_names_the_path(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    target.write_bytes(b"old")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(RunIOError, match="report.html: No space left on device"):
        atomic_write_bytes(target, b"new" * 1000, "the report")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


@pytest.mark.timeout(1800)  # a hang guard only
def test_checkpoint_and_report_write_failures_are_one_line_exit_1(tmp_path, capsys,
                                                                   monkeypatch):
    import torch

    out = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *a, **k):  # half a checkpoint, then the disk is full
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed "
                           "writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", save)
    assert main(ARGS + ["--policies", "32-true", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint" in err[0] and "checkpoints" in err[0], err
    assert not list(out.rglob("*tmp*")) and _integrity(out / "results.db") == "ok"
    monkeypatch.setattr(torch, "save", real_save)
    from lowprec.experiments import report

    def no_space(path, data, what="a file"):
        raise RunIOError(f"could not write {what} to {path}: No space left on device")

    monkeypatch.setattr(report, "atomic_write_bytes", no_space)
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 1
    assert main(["report", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("No space left on device" in line for line in err)
    monkeypatch.undo()
    assert main(["report", str(out)]) == 0


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.timeout(1800)  # a hang guard only
def test_a_full_3mb_disk_is_one_line_and_resumes_to_identical_numbers(tmp_path, capsys):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here (needs root); ENOSPC is injected in other tests")
    try:
        argv = ARGS + ["--policies", "32-true,fixed16-sr"]
        filler = disk / "filler"
        filler.write_bytes(b"\0" * (3 * 1024 - 1100) * 1024)  # 1.1 MB left: the second run fails
        out = disk / "run"
        assert main(argv + ["--out", str(out)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "disk is full" in err[0] and str(out) in err[0]
        assert _integrity(out / "results.db") == "ok"
        assert not list(out.rglob("*tmp*"))
        filler.unlink()
        assert main(argv + ["--out", str(out), "--resume"]) == 0
        assert main(argv + ["--out", str(tmp_path / "ref")]) == 0
        assert _epochs(out / "results.db") == _epochs(tmp_path / "ref" / "results.db")
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def _dead_pids(n: int) -> list[int]:
    """PIDs of processes that have exited (and been reaped): no process owns them now."""
    pids = []
    for _ in range(n):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        pids.append(child.pid)
    return pids


@pytest.mark.parametrize("names", [
    ["diagram.png.tmp1", "model.pt.tmp3", ".x.lowprec-tmp1", "checkpoints/best.pt.tmp2"],
    ["model.pt.tmp3"], [".x.lowprec-tmp1"], ["checkpoints/best.pt.tmp2"],
    ["report_files/diagram.png.tmp1"], ["DEAD"]])
def test_a_folder_of_temp_like_names_is_not_a_run_folder(tmp_path, capsys, names):
    """Names that only look like temp files, or lowprec's own pattern in a folder that holds no
    run (no lock file, no results.db), are a user's: refused, nothing deleted or written."""
    user = tmp_path / "mine"
    for name in names:
        if name == "DEAD":  # lowprec's pattern, writer gone, but no run here to have left it
            name = f".report.md.lowprec-tmp{_dead_pids(1)[0]}"
        (user / name).parent.mkdir(parents=True, exist_ok=True)
        (user / name).write_text("mine")
    before = _tree(user)
    for extra in ([], ["--resume"]):
        assert main(ARGS + ["--policies", "32-true", "--out", str(user), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "not part of a lowprec run folder" in err[0], err
        assert _tree(user) == before


def test_temp_like_names_in_a_run_folder_survive_a_resume(tmp_path, capsys):
    """In a run folder, a user's temp-like files (any sub-folder) are refused on --resume and
    kept; only a dead lowprec writer's temp files are removed."""
    out = tmp_path / "run"
    assert main(ARGS + ["--policies", "32-true", "--out", str(out)]) == 0
    for name in ("diagram.png.tmp1", "report_files/diagram.png.tmp1", "model.pt.tmp3",
                 "checkpoints/best.pt.tmp2", ".x.lowprec-tmp1"):
        (out / name).write_text("mine")
        assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 2
        assert name in capsys.readouterr().err
        assert (out / name).read_text() == "mine"
        (out / name).unlink()


@pytest.mark.timeout(1800)  # a hang guard only
def test_a_refused_resume_changes_nothing(tmp_path, capsys):
    """run.toml (the user's config, comments kept), models.json and the models' folders are
    untouched by a --resume that is refused; a forced change of a training setting is refused
    when the runs it would apply to already finished (they were trained with the stored
    value)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("# my comparison\n[compare]\ndata = \"digits\"\nmodel = \"mlp\"\n"
                   "policies = \"32-true\"\nepochs = 1\ntrain_subset = 64\nseeds = 1\n")
    out = tmp_path / "run"
    assert main(["compare", "--config", str(cfg), "--out", str(out), "--quiet"]) == 0
    before = _tree(out)
    other = tmp_path / "other.toml"
    other.write_text(cfg.read_text().replace("epochs = 1", "epochs = 2") + "# changed\n")
    for argv in (["--config", str(other), "--resume"],
                 ["--config", str(cfg), "--resume", "--lr", "0.5"],
                 ["--config", str(other), "--resume", "--force-config"],
                 ["--config", str(cfg), "--resume", "--force-config", "--epochs", "2"],
                 ["--config", str(cfg)]):
        assert main(["compare", *argv, "--out", str(out), "--quiet"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        after = _tree(out)
        after.pop(".lock"), before.pop(".lock", None)  # the lock file notes its holder's PID
        assert after == before, argv
    assert "runs already finished (32-true|seed=0)" in err[0] or "already exists" in err[0]
    db = ResultsDB(out / "results.db", create=False)
    assert db.stored_config()["epochs"] == 1 and db.meta("forced_config") is None
    db.close()

    several = tmp_path / "several"
    base = ARGS + ["--policies", "32-true", "--epochs", "1", "--out", str(several)]
    assert main(base + ["--model", "mlp,lenet5"]) == 0
    before = _tree(several)
    for models in ("mlp,vgg", "mlp", "lenet5,mlp"):
        assert main(base + ["--model", models, "--resume"]) == 2, models
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model: stored 'mlp,lenet5'" in err[0], err
        after = _tree(several)
        assert {k: v for k, v in after.items() if not k.endswith(".lock")} == \
            {k: v for k, v in before.items() if not k.endswith(".lock")}, models
    # flags not given take the stored values, the list of models included
    resumed = ["compare", "--out", str(several), "--resume", "--quiet"]
    assert main(resumed) == 0


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def test_a_run_folder_touches_only_its_own_files(tmp_path, capsys):
    """A user's files that look like temp files (backup.tmp1, sub/notes.tmp4242) are never
    deleted: a folder holding them is refused, naming the first one, with nothing written;
    lowprec's own stale temps (a killed writer's) are removed, and only those."""
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "backup.tmp1").write_text("backup")
    (user / "sub" / "notes.tmp4242").write_text("notes")
    before = _tree(user)
    for argv in (ARGS + ["--policies", "32-true", "--out", str(user)],
                 ARGS + ["--policies", "32-true", "--out", str(user), "--resume"],
                 ARGS + ["--policies", "32-true", "--out", str(user), "--model", "mlp,lenet5"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'backup.tmp1'" in err[0], err
        assert _tree(user) == before  # nothing deleted, nothing written (no .lock, no probe)
    root_before = sorted(os.listdir("/"))
    assert main(ARGS + ["--policies", "32-true", "--out", "/"]) == 2
    assert "not part of a lowprec run folder" in capsys.readouterr().err
    assert sorted(os.listdir("/")) == root_before

    out = tmp_path / "run"
    assert main(ARGS + ["--policies", "32-true", "--out", str(out)]) == 0
    dead = _dead_pids(3)  # writers that are provably gone
    stale = [out / f".report.md.lowprec-tmp{dead[0]}",
             out / "checkpoints" / f".x.pt.lowprec-tmp{dead[1]}",
             out / "report_files" / f".accuracy.png.lowprec-tmp{dead[2]}"]
    for p in stale:
        p.write_bytes(b"half")
    host = _host()
    stale += [out / f".results.db.lowprec-tmp{dead[0]}@{host}-journal",  # SQLite's, beside one
              out / "checkpoints" / f".y.pt.lowprec-tmp{os.getpid()}@another-node"]  # a Ray task's
    for p in stale:
        p.write_bytes(b"half")
    # an export a kill interrupted: its temp folder holds the export mark (written first)
    export_tmp = out / f".export.lowprec-tmp{dead[1]}@{host}"
    (export_tmp / "csv").mkdir(parents=True)
    (export_tmp / EXPORT_MARK).write_text("lowprec export\n")
    (export_tmp / "csv" / "runs.csv").write_text("half")
    stale.append(export_tmp)
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 0
    assert not any(p.exists() for p in stale)
    # a folder named like lowprec's temp but without the mark is a user's: refused, kept
    users = out / f".export.lowprec-tmp{dead[2]}@{host}"
    users.mkdir()
    (users / "notes.txt").write_text("a user's")
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 2
    assert users.name in capsys.readouterr().err and (users / "notes.txt").exists()
    shutil.rmtree(users)
    # lowprec's own pattern with a live PID (this test's parent): not provably a dead writer's
    live = out / "report_files" / f".accuracy.png.lowprec-tmp{os.getppid()}"
    live.write_bytes(b"someone's")
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 2
    assert live.name in capsys.readouterr().err and live.read_bytes() == b"someone's"
    live.unlink()
    (out / "checkpoints" / "notes.tmp3").write_text("a user's")  # not lowprec's: refused
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), "--resume"]) == 2
    assert "checkpoints/notes.tmp3" in capsys.readouterr().err
    assert (out / "checkpoints" / "notes.tmp3").read_text() == "a user's"


def test_the_schema_is_created_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """A signal (or a full disk) while results.db is created leaves no database and no temp
    file; a blank results.db that an earlier version left is created anew, with or without
    --resume."""
    from lowprec.experiments import results
    from lowprec.cli import _Terminated

    out = tmp_path / "run"
    argv = ARGS + ["--policies", "32-true", "--out", str(out)]

    def terminated(fd):
        raise _Terminated()

    monkeypatch.setattr(results.os, "fsync", terminated)
    assert main(argv) == 143
    assert not (out / "results.db").exists() and not list(out.rglob("*tmp*"))
    monkeypatch.undo()
    assert main(argv + ["--resume"]) == 0  # the message said: continue with --resume
    for blank in ("empty file", "no tables"):
        other = tmp_path / blank.replace(" ", "-")
        other.mkdir()
        if blank == "empty file":
            (other / "results.db").write_bytes(b"")
        else:
            sqlite3.connect(other / "results.db").execute("PRAGMA user_version = 0").close()
        flags = ["--resume"] if blank == "no tables" else []
        assert main(ARGS + ["--policies", "32-true", "--out", str(other), *flags]) == 0, \
            capsys.readouterr().err
        db = ResultsDB(other / "results.db", create=False)
        assert [r["status"] for r in db.runs()] == ["finished"]
        db.close()


def _ctrl_c_as_on_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a command typed at a terminal has
    it. A test run started in the background of a non-interactive shell (CI under ``&``)
    inherits SIGINT ignored, and a command rightly ignores Ctrl-C then (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_torch(pid: int) -> None:
    """Until the process has started loading torch's shared library (its imports under way)."""
    maps = Path(f"/proc/{pid}/maps")
    while True:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            return  # it ended already: the assertions say how
        time.sleep(0.01)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_is_one_line(tmp_path, sig, code):
    """Ctrl-C or SIGTERM while the command imports torch: exit 130 / 143 and one line, no
    traceback (was: a KeyboardInterrupt traceback, or a silent -15)."""
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc to see when torch is being loaded")
    env = dict(os.environ, PYTHONPATH=SRC)
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "lowprec_cmd", *ARGS, "--out",
                                 str(tmp_path / f"run{attempt}")], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_ctrl_c_as_on_a_terminal)
        _wait_for_torch(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate()
        # exit 0: the whole run finished before the signal landed (this test process starved
        # of CPU on a loaded machine while it polled); try again, a signal ignored fails 3 times
        if proc.returncode != 0:
            break
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_swallowed_by_an_import_still_ends_the_command(tmp_path, sig, code):
    """A library whose import catches everything (``try: ... except: pass`` around an optional
    import) swallows the KeyboardInterrupt a Ctrl-C raises there; the command still ends,
    130 / 143 and one line, instead of running on. Here a stand-in ``lowprec.cli`` signals
    itself during its import and swallows what that raises."""
    fake = tmp_path / "lowprec"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text(
        "import os, time\n"
        "try:\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    time.sleep(1)\n"
        "except BaseException:\n"
        "    pass\n"
        "def main(argv=None):\n"
        "    print('ran on')\n"
        "    return 0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), SRC]))
    proc = subprocess.run([sys.executable, "-c",
                           "import sys, lowprec_cmd; sys.exit(lowprec_cmd.main([]))"],
                          env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=_ctrl_c_as_on_a_terminal)
    assert (proc.returncode, proc.stdout, proc.stderr.strip()) == (code, "",
                                                                    "lowprec: interrupted")


def test_a_model_a_forced_resume_drops_keeps_its_folder(tmp_path, capsys):
    """--resume --force-config with fewer models: the dropped model's folder stays the run
    folder's own (models.json lists it as dropped), so later resumes accept the folder and
    nothing of it is deleted; listing the model again takes it back."""
    out = tmp_path / "several"
    base = ARGS + ["--policies", "32-true", "--epochs", "1", "--out", str(out)]
    assert main(base + ["--model", "mlp,lenet5"]) == 0
    kept = _tree(out / "lenet5")
    assert main(base + ["--model", "mlp", "--resume", "--force-config"]) == 0
    listing = json.loads((out / "models.json").read_text())
    assert listing == {"models": ["mlp"], "dropped": ["lenet5"]}
    for argv in (["compare", "--out", str(out), "--resume", "--quiet"], ["report", str(out)]):
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    after = _tree(out / "lenet5")
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == \
        {k: v for k, v in kept.items() if not k.endswith(".lock")}
    assert main(base + ["--model", "mlp,lenet5", "--resume", "--force-config"]) == 0
    assert json.loads((out / "models.json").read_text()) == {"models": ["mlp", "lenet5"]}


def test_only_a_run_folder_encloses_another(tmp_path):
    """--out below a lowprec run folder (its results.db beside its lock) is refused; below a
    user's folder that merely holds a results.db it is not."""
    from lowprec.experiments.runfolder import LOCK_NAME, enclosing_run

    user = tmp_path / "data"
    (user / "sub").mkdir(parents=True)
    sqlite3.connect(user / "results.db").close()  # someone else's database
    assert enclosing_run(user / "sub" / "run") is None
    (user / LOCK_NAME).write_text("")
    assert enclosing_run(user / "sub" / "run") == user.resolve()
    (user / "sub" / "results.db").write_text("")  # a run folder already: its place accepted
    assert enclosing_run(user / "sub") is None


@pytest.mark.parametrize("extra", [["--model", "mlp,nosuch"], ["--model", "nosuch"],
                                   ["--data", "nosuch"], ["--model", "mlp,lenet5",
                                                          "--data", "nosuch"]])
def test_a_refused_new_out_leaves_no_folder(tmp_path, capsys, extra):
    """What needs no folder (the dataset, each model) is checked before one is made."""
    out = tmp_path / "new" / "run"
    assert main(ARGS + ["--policies", "32-true", "--out", str(out), *extra]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()
