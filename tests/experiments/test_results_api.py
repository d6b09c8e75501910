"""``lowprec.results.load``: a run folder's results as DataFrames, checked row by row against
the SQLite database itself (the reference: what the runner wrote), with nothing written."""

import json
import math
import os
import re
import sqlite3

import pytest

import lowprec.results
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments.config import RunError
from lowprec.experiments.results import ResultsDB


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "run"
    # 16-mixed: a dynamic loss scale, so the trace holds more than ones
    run_compare(CompareConfig(data="digits", model="mlp", policies=("32-true", "16-mixed"),
                              seeds=(0, 1), epochs=2, batch_size=64, train_subset=256,
                              out=str(out), quiet=True))
    return out


def _rows(run, sql):
    c = sqlite3.connect(run / "results.db")
    c.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in c.execute(sql)]
    finally:
        c.close()


def _same(a, b):
    if a is None:
        return b is None or (isinstance(b, float) and math.isnan(b))
    return a == b


def _snapshot(folder):
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_tables_equal_the_database_and_nothing_is_written(run):
    before = _snapshot(run)
    res = lowprec.results.load(run)
    assert _snapshot(run) == before  # no -wal/-shm companion, no change of mtime
    assert list(res.runs.columns) == list(lowprec.results.RUN_COLUMNS)
    assert list(res.epochs.columns) == list(lowprec.results.EPOCH_COLUMNS)
    assert list(res.steps.columns) == list(lowprec.results.STEP_COLUMNS)
    assert list(res.analyses.columns) == list(lowprec.results.ANALYSIS_COLUMNS)
    runs = {r["run_id"]: r for r in _rows(run, "SELECT * FROM runs")}
    assert sorted(res.runs["run_id"]) == sorted(runs) and len(runs) == 4
    for row in res.runs.to_dict("records"):
        ref = runs[row["run_id"]]
        assert row["config"] == json.loads(ref["config"])
        for key in ("policy", "seed", "status", "backend", "policy_spec", "git"):
            assert row[key] == ref[key], key
    epochs = _rows(run, "SELECT * FROM epochs ORDER BY run_id, epoch")
    assert len(res.epochs) == len(epochs) == 8
    for got, ref in zip(res.epochs.to_dict("records"), epochs):
        assert got["policy"] == runs[ref["run_id"]]["policy"]
        for key, value in ref.items():
            assert _same(value, got[key]), key
    steps = _rows(run, "SELECT s.*, t.scale, t.skipped FROM steps s LEFT JOIN scale_trace t "
                       "USING (run_id, step) ORDER BY run_id, step")
    assert len(res.steps) == len(steps) > 0
    for got, ref in zip(res.steps.to_dict("records"), steps):
        assert (got["run_id"], got["step"], got["epoch"]) == (ref["run_id"], ref["step"],
                                                              ref["epoch"])
        assert _same(ref["loss"], got["loss"]) and _same(ref["scale"], got["loss_scale"])
    # the dynamic loss scale of 16-mixed is in the steps table, step by step
    mixed = res.steps[res.steps["policy"] == "16-mixed"]["loss_scale"]
    assert mixed.notna().all() and mixed.max() >= 2.0 ** 15
    analyses = _rows(run, "SELECT * FROM analysis")
    assert len(res.analyses) == len(analyses) > 0
    assert all(isinstance(p, dict) for p in res.analyses["payload"])
    assert list(res.memory.columns) == list(lowprec.results.MEMORY_COLUMNS)
    for got in res.memory.to_dict("records"):
        ref = _rows(run, f"SELECT * FROM memory WHERE run_id = '{got['run_id']}'")[0]
        assert got["policy"] == runs[got["run_id"]]["policy"]
        assert all(got[k] == v for k, v in ref.items())
    # one dtype whatever the data: no run diverged here, and every run has a ledger
    assert str(res.runs["diverged_step"].dtype) == "Int64" and res.runs["diverged_step"].isna().all()
    assert str(res.runs["memory_total"].dtype) == "Int64"
    assert res.runs["final_test_acc"].between(0, 1).all()  # fractions, not percent


def test_run_summary_is_the_last_and_best_epoch(run):
    res = lowprec.results.load(run)
    for row in res.runs.to_dict("records"):
        mine = res.epochs[res.epochs["run_id"] == row["run_id"]].sort_values("epoch")
        assert row["epochs"] == len(mine) == 2
        assert row["final_test_acc"] == mine["test_acc"].iloc[-1]
        assert row["best_test_acc"] == mine["test_acc"].max()
        assert row["seconds"] == pytest.approx(mine["seconds"].sum())
        mem = _rows(run, f"SELECT total FROM memory WHERE run_id = '{row['run_id']}'")
        assert row["memory_total"] == mem[0]["total"]
    # a groupby needs no join: the policy is on every row
    assert set(res.epochs.groupby("policy")["test_acc"].max().index) == {"32-true", "16-mixed"}


def test_analysis_flattened_and_unknown_kind_named(run):
    res = lowprec.results.load(run)
    cert = res.analysis("certificate:fp16")
    stored = _rows(run, "SELECT run_id, payload FROM analysis WHERE kind = 'certificate:fp16'")
    assert sorted(cert["run_id"]) == sorted(r["run_id"] for r in stored)
    assert list(cert.columns[:3]) == ["run_id", "policy", "seed"]
    summary = json.loads(stored[0]["payload"])["summary"]  # nested keys as "summary.KEY"
    got = cert[cert["run_id"] == stored[0]["run_id"]].iloc[0]
    assert summary and all(got[f"summary.{k}"] == v for k, v in summary.items())
    with pytest.raises(ValueError, match=r"'nope'.*stored: .*certificate:fp16"):
        res.analysis("nope")


def test_non_finite_values_read_as_nan(tmp_path):
    db = ResultsDB(tmp_path / "results.db")
    db.start_run("a", policy="16-true", policy_spec="p=fp16", seed=0, config={}, versions={},
                 git=None, hardware={})
    db.record_epoch("a", 0, train_loss=float("nan"), test_loss=float("inf"), test_acc=0.1,
                    seconds=1.0, skipped=0, nonfinite=3, loss_scale=1.0, trace=[],
                    steps=[{"step": 0, "loss": float("inf"), "lr": 0.1, "grad_norm": None}])
    db.finish_run("a", "diverged", diverged_step=0)
    db.close()
    res = lowprec.results.load(tmp_path / "results.db")  # the database file names its folder
    assert res.path == tmp_path and "1 runs" in repr(res)
    e = res.epochs.iloc[0]
    assert math.isnan(e["train_loss"]) and math.isnan(e["test_loss"]) and e["test_acc"] == 0.1
    s = res.steps.iloc[0]
    assert math.isnan(s["loss"]) and math.isnan(s["grad_norm"]) and math.isnan(s["loss_scale"])
    r = res.runs.iloc[0]
    assert r["status"] == "diverged" and r["diverged_step"] == 0
    assert math.isnan(r["final_train_loss"]) and r["final_test_acc"] == 0.1
    assert r["memory_total"] is __import__("pandas").NA  # no ledger recorded


def test_several_models_get_a_model_column(tmp_path, run):
    # a comparison over several models: OUT/models.json and one run folder per model
    out = tmp_path / "multi"
    out.mkdir()
    for m in ("a", "b"):
        os.symlink(run, out / m)
    (out / "models.json").write_text(json.dumps({"models": ["a", "b", "c"]}))  # c: not yet run
    res = lowprec.results.load(out)
    one = lowprec.results.load(run)
    assert res.runs.columns[0] == "model" and len(res.runs) == 2 * len(one.runs)
    assert list(res.epochs.columns) == ["model"] + list(lowprec.results.EPOCH_COLUMNS)
    assert res.steps.groupby("model").size().to_dict() == {"a": len(one.steps),
                                                           "b": len(one.steps)}


def test_folder_without_results_is_named(tmp_path):
    assert lowprec.results.RunError is RunError
    with pytest.raises(RunError, match=re.escape(str(tmp_path)) + ".*has no results.db"):
        lowprec.results.load(tmp_path)
    (tmp_path / "results.db").write_bytes(b"not a database" * 100)
    with pytest.raises(lowprec.results.CorruptDatabase, match="results.db"):
        lowprec.results.load(tmp_path)
