"""Kill a comparison (SIGKILL, nothing runs after it) at chosen moments; resume; every stored
number equals an uninterrupted comparison's, and no temp file survives.

The child process patches one library function to SIGKILL itself at the chosen moment, so the
moment is exact and the library carries no test hook. Policies: fixed16-sr (stochastic rounding:
the generator's state must survive) and dfxp-10-12 (dynamic fixed point: the ranges must).
"""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec.experiments import CompareConfig, run_compare

SRC = str(Path(__file__).resolve().parents[2] / "src")
POLICIES = ("fixed16-sr", "dfxp-10-12")
CONFIG = dict(data="digits", model="mlp", policies=POLICIES, seeds=(0,), epochs=2,
              batch_size=64, train_subset=192, quiet=True)

# in the child: patch, then run the comparison; the patch kills the process at its moment
DRIVER = r"""
import os, signal, sys
import torch
from lowprec.experiments import CompareConfig, run_compare, runner, results, report, runfolder
from lowprec.training import precision

point, out, cfg = sys.argv[1], sys.argv[2], eval(sys.argv[3])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
calls = {"n": 0}

def count(n):
    calls["n"] += 1
    return calls["n"] == n

if point == "startup":  # first run: its row and memory ledger stored, no step taken
    orig = results.ResultsDB.record_memory
    def record_memory(self, *a, **k):
        orig(self, *a, **k); die()
    results.ResultsDB.record_memory = record_memory
elif point == "first_epoch":  # second run, a few steps into its first epoch
    orig_step = precision.Precision.step
    def step(self, *a, **k):
        r = orig_step(self, *a, **k)
        if count(6 + 2): die()   # 3 steps per epoch x 2 epochs of run 1, then 2 of run 2
        return r
    precision.Precision.step = step
elif point == "row_then_checkpoint":  # epoch row committed, its checkpoint not yet written
    orig_epoch = results.ResultsDB.record_epoch
    def record_epoch(self, *a, **k):
        orig_epoch(self, *a, **k)
        if count(1): die()
    results.ResultsDB.record_epoch = record_epoch
elif point == "checkpoint_write":  # half a checkpoint in its temp file
    orig_save = torch.save
    def save(obj, f, *a, **k):
        if count(2):
            with open(f, "wb") as fh:
                fh.write(b"PK\x03\x04 partial"); fh.flush()
            die()
        return orig_save(obj, f, *a, **k)
    torch.save = save
elif point == "report":  # a report figure half written
    orig_write = report.atomic_write_bytes
    def write(path, data, what="a file"):
        if count(2):
            tmp = runfolder.temp_path(path)  # the writer's own temp name
            tmp.write_bytes(data[: len(data) // 2]); die()
        return orig_write(path, data, what)
    report.atomic_write_bytes = write
run_compare(CompareConfig(out=out, **cfg))
print("NOT KILLED")
"""


def _stored(db_path: Path) -> dict:
    """Every stored number, without wall-clock times and the load (started, finished, seconds,
    cpu_seconds, load, other_cpus, ended)."""
    c = sqlite3.connect(db_path)
    try:
        out = {}
        cols = {t: [r[1] for r in c.execute(f"PRAGMA table_info({t})")]
                for t in ("runs", "epochs", "steps", "memory", "scale_trace", "analysis")}
        for table, names in cols.items():
            keep = [n for n in names if n not in ("started", "finished", "seconds", "cpu_seconds",
                                                  "load", "other_cpus", "ended")]
            rows = c.execute(f"SELECT {', '.join(keep)} FROM {table} ORDER BY 1, 2").fetchall()
            out[table] = [dict(zip(keep, r)) for r in rows]
        for r in out["runs"]:  # the folder's own path is not a result
            r["config"] = {k: v for k, v in json.loads(r["config"]).items() if k != "out"}
        return out
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_compare(CompareConfig(out=str(out), **CONFIG))
    return _stored(out / "results.db")


@pytest.mark.timeout(3600)  # hang guards only: a loaded machine is slow, not hung
@pytest.mark.parametrize("point", ["startup", "first_epoch", "row_then_checkpoint",
                                   "checkpoint_write", "report"])
def test_killed_anywhere_resumes_to_identical_numbers(tmp_path, reference, point):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=SRC)
    child = subprocess.run([sys.executable, "-c", DRIVER, point, str(out), repr(CONFIG)],
                           env=env, capture_output=True, text=True, timeout=1800)
    assert child.returncode == -9, (child.returncode, child.stdout, child.stderr[-2000:])
    temps = [p.name for p in out.rglob("*.lowprec-tmp*")]
    if point in ("checkpoint_write", "report"):
        assert temps, "the kill should have left a temp file behind"
    run_compare(CompareConfig(out=str(out), resume=True, **CONFIG))
    assert not list(out.rglob("*.lowprec-tmp*")), "a temp file survived the resume"
    assert not list((out / "checkpoints").iterdir()), "checkpoints of finished runs are removed"
    got = _stored(out / "results.db")
    assert [r["status"] for r in got["runs"]] == ["finished", "finished"]
    for table in reference:
        assert got[table] == reference[table], f"{point}: table {table} differs"
    assert (out / "report.html").stat().st_size > 1000
