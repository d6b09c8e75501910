"""`lowprec export`: every format round-trips the database's numbers, read back with the
readers of each tool (pandas, TensorBoard's EventAccumulator, MLflow's client)."""

import json
import math
import sqlite3

import numpy as np
import pytest

from lowprec.cli import main
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments.export import EXPORT_TABLES


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "run"
    # 16-mixed: a dynamic loss scale, so the scale trace holds more than ones
    run_compare(CompareConfig(data="digits", model="mlp", policies=("32-true", "16-mixed"),
                              seeds=(0,), epochs=2, batch_size=64, train_subset=256,
                              out=str(out), quiet=True))
    return out


def tables(run):
    c = sqlite3.connect(run / "results.db")
    out = {}
    for t, order in EXPORT_TABLES.items():
        cur = c.execute(f"SELECT * FROM {t} ORDER BY {', '.join(order)}")
        out[t] = ([d[0] for d in cur.description], cur.fetchall())
    c.close()
    return out


def same(a, b):
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    if isinstance(b, (np.integer, np.floating)):
        b = b.item()
    return a == b


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_tables_round_trip_through_pandas(run, tmp_path, fmt, capsys):
    import pandas as pd

    out = tmp_path / fmt
    assert main(["export", str(run), "--to", fmt, "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["runs"] == 2 and said["format"] == fmt and len(said["files"]) == 7
    for table, (cols, rows) in tables(run).items():
        path = out / f"{table}.{fmt}"
        df = pd.read_csv(path, keep_default_na=False, na_values=[""]) if fmt == "csv" else \
            pd.read_parquet(path)
        assert list(df.columns) == cols, table
        assert len(df) == len(rows) and rows, table
        for row, got in zip(rows, df.itertuples(index=False)):
            for name, a, b in zip(cols, row, got):
                if fmt == "csv" and isinstance(a, str) and not isinstance(b, str):
                    b = str(b)  # a text column pandas read as numbers ('1' in meta)
                assert same(a, b), (table, name, a, b)


def test_tensorboard_events_hold_the_steps_and_epochs(run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert main(["export", str(run), "--to", "tensorboard", "--out", str(out)]) == 0
    c = sqlite3.connect(run / "results.db")
    for run_id, folder in (("32-true|seed=0", "32-true_seed_0"),
                           ("16-mixed|seed=0", "16-mixed_seed_0")):
        ea = EventAccumulator(str(out / folder), size_guidance={"scalars": 0})
        ea.Reload()
        for tag, sql in (("step/loss", "SELECT step, loss FROM steps"),
                         ("step/grad_norm", "SELECT step, grad_norm FROM steps"),
                         ("step/lr", "SELECT step, lr FROM steps"),
                         ("step/loss_scale", "SELECT step, scale FROM scale_trace"),
                         ("epoch/test_acc", "SELECT epoch, test_acc FROM epochs"),
                         ("epoch/cpu_seconds", "SELECT epoch, cpu_seconds FROM epochs")):
            want = c.execute(f"{sql} WHERE run_id = ? ORDER BY 1", (run_id,)).fetchall()
            got = [(e.step, e.value) for e in ea.Scalars(tag)]
            # TensorBoard stores float32
            assert got == [(s, float(np.float32(v))) for s, v in want], tag
        total = c.execute("SELECT total FROM memory WHERE run_id = ?", (run_id,)).fetchone()[0]
        assert ea.Scalars("memory/total")[0].value == float(np.float32(total))
        assert "certificate/fp16/certified" in ea.Tags()["scalars"]
    c.close()


def test_mlflow_file_store_holds_runs_params_and_metrics(run, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "mlruns"
    assert main(["export", str(run), "--to", "mlflow", "--out", str(out)]) == 0
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to read it
    client = MlflowClient(tracking_uri=out.resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name.startswith("lowprec:")]
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"32-true|seed=0", "16-mixed|seed=0"}
    c = sqlite3.connect(run / "results.db")
    for run_id, r in runs.items():
        assert r.data.tags["policy"] == run_id.split("|")[0] and r.info.status == "FINISHED"
        assert r.data.params["epochs"] == "2" and r.data.params["seed"] == "0"
        for key, sql in (("step_loss", "SELECT step, loss FROM steps"),
                         ("step_grad_norm", "SELECT step, grad_norm FROM steps"),
                         ("epoch_test_acc", "SELECT epoch, test_acc FROM epochs"),
                         ("step_loss_scale", "SELECT step, scale FROM scale_trace")):
            want = c.execute(f"{sql} WHERE run_id = ? ORDER BY 1", (run_id,)).fetchall()
            got = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id,
                                                                               key))
            assert got == want, key  # float64, exactly
        path = client.download_artifacts(r.info.run_id, "analysis.json", str(tmp_path / "a"))
        payload = json.loads(open(path).read())
        assert payload["certificate:fp16"]["summary"]["violations"] == 0
    c.close()


def test_an_export_never_writes_over_a_folder(run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    assert main(["export", str(run), "--to", "csv", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not an empty folder" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_the_default_export_folder_stays_part_of_the_run_folder(run, capsys):
    assert main(["export", str(run), "--to", "csv"]) == 0
    assert (run / "export" / "csv" / "epochs.csv").is_file()
    from lowprec.experiments.runfolder import foreign_entry

    assert foreign_entry(run) is None  # --resume still accepts the folder


def test_an_export_inside_the_run_folder_keeps_it_resumable(run, tmp_path, capsys):
    """--out RUN/mine (not the default RUN/export): the folder is marked as lowprec's export,
    so --resume does not take it for a user's folder; a folder the user made there is."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for fmt in ("csv", "mlflow"):
        assert main(["export", str(copy), "--to", fmt, "--out", str(copy / f"mine-{fmt}")]) == 0
    capsys.readouterr()
    assert main(["compare", "--out", str(copy), "--resume", "--quiet"]) == 0
    (copy / "notes").mkdir()
    assert main(["compare", "--out", str(copy), "--resume", "--quiet"]) == 2
    assert "'notes'" in capsys.readouterr().err


def test_a_read_only_run_folder_can_be_exported(run, tmp_path, capsys):
    import os
    import shutil
    import stat

    copy = tmp_path / "ro"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export"))
    paths = [copy, *copy.rglob("*")]
    try:
        for p in paths:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        before = sorted(os.listdir(copy))
        assert main(["export", str(copy), "--to", "csv", "--out", str(tmp_path / "csv")]) == 0
        assert sorted(os.listdir(copy)) == before  # not even SQLite's -wal or -shm
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    import pandas as pd

    assert len(pd.read_csv(tmp_path / "csv" / "epochs.csv")) == len(tables(run)["epochs"][1])


@pytest.mark.parametrize("fmt", ["csv", "parquet", "tensorboard", "mlflow"])
def test_a_full_disk_leaves_no_half_export(run, tmp_path, monkeypatch, capsys, fmt):
    """ENOSPC after the first file (however the writer library wraps it): exit 1, one line
    naming --out and not the temp folder, and nothing left: no --out, no temp folder."""
    import errno
    import builtins

    from lowprec.experiments import export

    real_open, calls = builtins.open, {"n": 0}

    def full_after_one(file, mode="r", *a, **k):
        if any(c in mode for c in "wa") and str(tmp_path) in str(file):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *a, **k)

    real_writer = {"csv": export._to_csv, "parquet": export._to_parquet,
                   "tensorboard": export._to_tensorboard, "mlflow": export._to_mlflow}[fmt]

    def writer(db, out, run_dir):  # the writers' own file opens fail from the second one
        monkeypatch.setattr(builtins, "open", full_after_one)
        try:
            files = real_writer(db, out, run_dir)
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
        # a writer that opens its files another way (pyarrow, TensorBoard's C++ writer...)
        raise OSError(errno.ENOSPC, "No space left on device") if calls["n"] <= 1 else \
            AssertionError("unreachable")

    monkeypatch.setattr(export, f"_to_{fmt}", writer)
    out = tmp_path / "out"
    assert main(["export", str(run), "--to", fmt, "--out", str(out), "--json"]) == 1
    std, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(out) in lines[0]
    assert "lowprec-tmp" not in lines[0]
    assert json.loads(std) == {"error": lines[0], "exit": 1}
    assert list(tmp_path.iterdir()) == []  # no --out, no temp folder


def test_export_takes_to_from_its_config_file(run, tmp_path, capsys):
    cfg = tmp_path / "export.toml"
    cfg.write_text('to = "csv"\n')
    out = tmp_path / "csv"
    assert main(["export", str(run), "--config", str(cfg), "--out", str(out)]) == 0
    assert (out / "runs.csv").is_file()


def test_report_on_a_full_disk_is_one_line_and_leaves_no_half_file(run, tmp_path,
                                                                    monkeypatch, capsys):
    """The disk fills while report.html is written (report.md and the figures made it): exit
    1, one line naming the file, the JSON error document, every file whole (the old
    report.html kept), no temp file."""
    import errno
    import shutil

    from lowprec.experiments import runfolder

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    old_html = (copy / "report.html").read_bytes()
    real_replace = runfolder.os.replace

    def full(src, dst):
        if str(dst).endswith("report.html"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(runfolder.os, "replace", full)
    assert main(["report", str(copy), "--json"]) == 1
    std, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "report.html" in lines[0] and "No space left" in lines[0]
    assert json.loads(std) == {"error": lines[0], "exit": 1}
    assert (copy / "report.html").read_bytes() == old_html
    assert not list(copy.rglob("*lowprec-tmp*"))
