"""The time-ratio flag (load while runs trained), the report's verdict rule, one-seed cells and
the schema migration of results.db."""

import sqlite3

import pytest

from lowprec.experiments.report import flagged_note
from lowprec.experiments.summary import acc_cell, time_cell
from lowprec.experiments.results import SCHEMA_VERSION, CorruptDatabase, ResultsDB
from lowprec.experiments.timing import (LOAD_DIFF_MAX, EpochMeter, compare_load,
                                        overlapping_runs)
from lowprec.experiments.verdict import recommend


def side(other_cpus=None, load=None, cpus=8, threads=2):
    return {"other_cpus": other_cpus, "load": load, "cpus": cpus, "threads": threads}


# -- the flag ---------------------------------------------------------------------------------

def test_same_light_load_is_comparable():
    c = compare_load(side(0.1), side(0.3), other_name="16-true")
    assert c.comparable and c.measure == "other_cpus" and "within 0.5" in c.reason


def test_load_differing_by_more_than_half_a_core_is_flagged():
    c = compare_load(side(0.1), side(0.1 + LOAD_DIFF_MAX + 0.05), other_name="16-mixed")
    assert not c.comparable and "differ by 0.55" in c.reason and "16-mixed" in c.reason
    # the bound itself is still comparable
    assert compare_load(side(0.1), side(0.1 + LOAD_DIFF_MAX)).comparable


def test_equal_load_that_takes_the_runs_cores_is_flagged():
    # 2 threads on 2 CPUs beside 1.35 cores of other work, the same on both sides: measured
    # here, the same run took 1.7 s once and 7.8 s the next time
    c = compare_load(side(1.35, cpus=2), side(1.35, cpus=2), other_name="bf16-true")
    assert not c.comparable and "took 1.35 cores" in c.reason
    # the same other work on a machine with cores to spare is not contention
    assert compare_load(side(1.35, cpus=8), side(1.35, cpus=8)).comparable
    # either side contended is enough
    assert not compare_load(side(1.35, cpus=2), side(0.0, cpus=2, threads=1)).comparable


def test_load_average_stands_in_where_other_cpus_was_not_measured():
    ok = compare_load(side(load=2.2), side(load=2.4))  # 2 threads of 8 CPUs: our own load
    assert ok.comparable and ok.measure == "load"
    bad = compare_load(side(load=2.2), side(load=3.4))
    assert not bad.comparable and bad.measure == "load"
    busy = compare_load(side(load=9.0, cpus=8), side(load=9.0, cpus=8))
    assert not busy.comparable  # the load average exceeds the CPUs by a core


def test_nothing_recorded_is_comparable_and_says_so():
    c = compare_load(side(), side())
    assert c.comparable and c.measure is None and "not recorded" in c.reason


def test_overlapping_runs_are_found():
    spans = {"a": (0, 10), "b": (10, 20), "c": (15, 16), "d": (30, 40), "e": (1, 2)}
    assert overlapping_runs(spans) == {"a", "e", "b", "c"}
    assert overlapping_runs({"a": (0, 1), "b": (1, 2)}) == set()


def test_epoch_meter_records_cpu_time_and_load():
    m = EpochMeter().start()
    x = 0
    for i in range(200_000):
        x += i * i
    m.sample()
    got = m.stop()
    assert got["seconds"] > 0 and got["cpu_seconds"] > 0 and got["ended"] > 1e9
    assert got["load"] is None or got["load"] >= 0
    assert got["other_cpus"] is None or got["other_cpus"] >= 0


# -- summary cells ----------------------------------------------------------------------------

def row(policy, acc, std=None, n=3, mem=1.0, time=1.0, comparable=True, backend="native",
        finished=None, runs=None, diverged=0):
    from lowprec.experiments.timing import LoadComparison

    runs = n if runs is None else runs
    return {"policy": policy, "backend": backend, "acc_mean": acc, "acc_std": std, "acc_n": n,
            "acc_delta": None, "memory_rel": mem, "memory": int(mem * 1e6), "time_rel": time,
            "cpu_rel": time, "time_comparable": comparable, "skipped": 0.0,
            "load_check": LoadComparison(comparable, "a reason", "other_cpus"),
            "finished": runs if finished is None else finished, "runs": runs,
            "diverged": diverged, "failed": 0}


def rows_of(*rows):
    base = rows[0]
    for r in rows:
        r["acc_delta"] = r["acc_mean"] - base["acc_mean"] if r["acc_mean"] is not None else None
    return list(rows)


def test_one_seed_shows_the_value_and_n_1():
    assert acc_cell(row("x", 0.9812, None, n=1)) == "98.12 (n=1)"
    assert acc_cell(row("x", 0.9812, 0.0005, n=3)) == "98.12 ± 0.05"
    assert time_cell(row("x", 0.9, time=0.28, comparable=False)) == "0.28x*"
    rows = [row("32-true", 0.9), row("16-mixed", 0.9, time=0.28, comparable=False)]
    assert "16-mixed: a reason" in flagged_note(rows)
    assert flagged_note(rows[:1]) is None


# -- the verdict ------------------------------------------------------------------------------

class NoAnalyses:
    def runs(self):
        return []

    def analyses(self, kind):
        return {}


def test_verdict_picks_the_least_memory_within_noise_and_native_speed():
    rows = rows_of(row("32-true", 0.9813, 0.0006),
                   row("16-true", 0.9797, 0.0015, mem=0.59, time=1.17, backend="emulated"),
                   row("bf16-true", 0.9813, 0.0023, mem=0.59, time=0.66),
                   row("16-mixed", 0.9800, 0.0020, mem=0.81, time=1.22, backend="emulated"))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "bf16-true" and v.headline.startswith("Use bf16-true")
    assert any("0.59x" in e for e in v.evidence)
    assert any("also within seed noise: 16-true" in e for e in v.evidence)


def test_no_verdict_says_whether_the_baseline_is_missing_or_did_not_finish():
    """A comparison whose 32-true runs diverged has 32-true in --policies: the verdict says
    they diverged (it said "add 32-true to --policies"); a single policy's run (lowprec train,
    which has no --policies) is told the compare command that runs both."""
    rows = [row("32-true", None, finished=0, diverged=3), row("16-true", 0.9)]
    v = recommend(NoAnalyses(), rows)
    assert v.policy is None and "32-true" in v.headline and "3/3 runs diverged" in v.headline
    assert "--policies" not in v.headline
    v = recommend(NoAnalyses(), rows_of(row("16-true", 0.9)))
    assert v.policy is None and "lowprec compare --policies 32-true,16-true" in v.headline
    v = recommend(NoAnalyses(), rows_of(row("16-true", 0.9), row("bf16-true", 0.9)))
    assert "add 32-true to --policies" in v.headline
    rows = [row("32-true", None, finished=0, diverged=1), row("16-true", 0.9)]  # (1 failed)
    assert "1/3 runs diverged; 2/3 runs did not finish" in recommend(NoAnalyses(), rows).headline
    rows = [row("32-true", None), row("16-true", 0.9)]
    assert "no test accuracy was recorded" in recommend(NoAnalyses(), rows).headline


def test_verdict_ignores_time_that_is_not_comparable():
    rows = rows_of(row("32-true", 0.98, 0.001),
                   row("bf16-true", 0.98, 0.001, mem=0.59, time=0.3, comparable=False),
                   row("p=bf16:kahan", 0.98, 0.001, mem=0.59, time=0.2, comparable=False))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "bf16-true"  # equal memory, accuracy, no comparable time: the name
    assert v.tied == ["p=bf16:kahan"]
    assert any("not comparable" in e for e in v.evidence)


@pytest.mark.parametrize("order", [(1, 2), (2, 1)])
def test_verdict_tie_is_said_and_broken_whatever_the_order_of_policies(order):
    # two emulated policies of the same memory: rule 2 cannot tell them apart (an emulated
    # time counts as 32-true's); the tie is named and goes to the higher mean accuracy
    cands = {1: row("16-true", 0.9800, 0.001, mem=0.59, time=1.2, backend="emulated"),
             2: row("p=fp16:kahan", 0.9805, 0.001, mem=0.59, time=1.6, backend="emulated")}
    rows = rows_of(row("32-true", 0.9810, 0.001), *(cands[i] for i in order))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "p=fp16:kahan" and v.tied == ["16-true"]
    assert "a tie with 16-true" in v.headline and "higher mean test accuracy" in v.tie_break
    tie = next(e for e in v.evidence if e.startswith("tie: "))
    assert "p=fp16:kahan and 16-true" in tie and "does not depend on their order" in tie
    # the same accuracy: the lesser exact memory within the 5% band, then the name
    cands[1]["acc_mean"] = cands[2]["acc_mean"] = 0.9805
    cands[1]["memory_rel"], cands[1]["memory"] = 0.58, 580000
    rows = rows_of(row("32-true", 0.9810, 0.001), *(cands[i] for i in order))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "16-true" and v.tied == ["p=fp16:kahan"]
    assert "least memory" in v.tie_break and "0.58 MB against 0.59 MB" in v.tie_break
    cands[1]["memory_rel"], cands[1]["memory"] = 0.59, 590000
    rows = rows_of(row("32-true", 0.9810, 0.001), *(cands[i] for i in order))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "16-true" and "sorts first" in v.tie_break
    # no tie: no tie sentence
    rows = rows_of(row("32-true", 0.9810, 0.001), row("bf16-true", 0.98, 0.001, mem=0.5,
                                                        time=0.7))
    v = recommend(NoAnalyses(), rows)
    assert v.tied == [] and v.tie_break is None and "tie" not in v.headline
    assert not any(e.startswith("tie: ") for e in v.evidence)


def test_verdict_rejects_policies_beyond_the_noise_and_diverged_ones():
    rows = rows_of(row("32-true", 0.98, 0.001),
                   row("bf16-true", 0.96, 0.001, mem=0.5),
                   row("16-true", None, None, n=0, mem=0.5, finished=0, runs=3, diverged=3))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "32-true" and v.headline.startswith("Use 32-true")
    rejected = next(e for e in v.evidence if e.startswith("not within seed noise"))
    assert "bf16-true (Δ -2.00 pts" in rejected and "16-true (3/3 runs diverged)" in rejected


def test_verdict_with_one_seed_assumes_half_a_point_and_says_so():
    rows = rows_of(row("32-true", 0.980, None, n=1), row("bf16-true", 0.977, None, n=1, mem=0.5))
    v = recommend(NoAnalyses(), rows)
    assert v.policy == "bf16-true"
    assert any("one seed gives no spread" in e and "n=1" in e for e in v.evidence)
    rows = rows_of(row("32-true", 0.980, None, n=1), row("bf16-true", 0.970, None, n=1, mem=0.5))
    assert recommend(NoAnalyses(), rows).policy == "32-true"


def test_no_baseline_no_recommendation():
    v = recommend(NoAnalyses(), [row("bf16-true", 0.98)])
    assert v.policy is None and "has no 32-true run" in v.headline


# -- schema -----------------------------------------------------------------------------------

V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE runs (run_id TEXT PRIMARY KEY, policy TEXT NOT NULL, policy_spec TEXT NOT NULL,
    seed INTEGER NOT NULL, config TEXT NOT NULL, versions TEXT NOT NULL, git TEXT,
    hardware TEXT NOT NULL, backend TEXT, status TEXT NOT NULL, diverged_step INTEGER,
    error TEXT, started REAL NOT NULL, finished REAL);
CREATE TABLE epochs (run_id TEXT NOT NULL, epoch INTEGER NOT NULL, train_loss REAL,
    test_loss REAL, test_acc REAL, seconds REAL NOT NULL, skipped INTEGER NOT NULL,
    nonfinite INTEGER NOT NULL, loss_scale REAL NOT NULL, PRIMARY KEY (run_id, epoch));
CREATE TABLE memory (run_id TEXT PRIMARY KEY, params INTEGER NOT NULL, grads INTEGER NOT NULL,
    optimizer_state INTEGER NOT NULL, master INTEGER NOT NULL, activations INTEGER NOT NULL,
    total INTEGER NOT NULL);
CREATE TABLE scale_trace (run_id TEXT NOT NULL, step INTEGER NOT NULL, scale REAL NOT NULL,
    skipped INTEGER NOT NULL, PRIMARY KEY (run_id, step));
CREATE TABLE analysis (run_id TEXT NOT NULL, kind TEXT NOT NULL, payload TEXT NOT NULL,
    PRIMARY KEY (run_id, kind));
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO runs VALUES ('32-true|seed=0', '32-true', 'p=fp32', 0, '{}', '{}', NULL, '{}',
    'native', 'finished', NULL, NULL, 1.0, 2.0);
INSERT INTO epochs VALUES ('32-true|seed=0', 0, 0.5, 0.4, 0.9, 1.5, 0, 0, 1.0);
"""


def test_a_version_1_database_is_migrated_keeping_its_rows(tmp_path):
    path = tmp_path / "results.db"
    c = sqlite3.connect(path)
    c.executescript(V1)
    c.close()
    db = ResultsDB(path, create=False)
    assert db.meta("schema_version") == SCHEMA_VERSION == 2
    (ep,) = db.epochs("32-true|seed=0")
    assert ep["test_acc"] == 0.9 and ep["cpu_seconds"] is None and ep["other_cpus"] is None
    assert db.steps("32-true|seed=0") == []
    db.record_epoch("32-true|seed=0", 1, train_loss=0.3, test_loss=0.3, test_acc=0.95,
                    seconds=1.0, skipped=0, nonfinite=0, loss_scale=1.0, trace=[],
                    steps=[{"step": 7, "loss": 0.25, "lr": 0.01, "grad_norm": float("inf")}],
                    cpu_seconds=0.9, load=1.0, other_cpus=0.1, ended=3.0)
    assert db.steps("32-true|seed=0") == [{"step": 7, "epoch": 1, "loss": 0.25, "lr": 0.01,
                                           "grad_norm": None}]
    db.close()


def test_a_damaged_version_1_database_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "results.db"
    c = sqlite3.connect(path)
    c.executescript(V1 + "UPDATE epochs SET test_acc = 'high';")
    c.close()
    before = path.read_bytes()
    with pytest.raises(CorruptDatabase, match="test_acc"):
        ResultsDB(path, create=False)
    assert path.read_bytes() == before


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "results.db"
    c = sqlite3.connect(path)
    c.executescript(V1.replace("'schema_version', '1'", "'schema_version', '3'"))
    c.close()
    with pytest.raises(CorruptDatabase, match="schema version '3'"):
        ResultsDB(path, create=False)
