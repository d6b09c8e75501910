"""A run's checkpoint carries the epoch records it covers, and a resumed run replays them: a
results.db that lost rows its checkpoints cover (a Ray driver killed before it stored what a
task had sent) resumes to exactly the numbers of an uninterrupted comparison."""

import sqlite3

import pytest
import torch

from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments import runner

# 16-mixed: dynamic loss scaling, so the scale trace must come back too
CONFIG = dict(data="digits", model="mlp", policies=("32-true", "16-mixed"), seeds=(0,),
              epochs=3, batch_size=64, train_subset=128, quiet=True)


def stored(path):
    """Every stored column but wall-clock seconds and times."""
    c = sqlite3.connect(path / "results.db")
    out = {
        "runs": c.execute("SELECT run_id, policy, policy_spec, seed, backend, status, "
                          "diverged_step, error FROM runs ORDER BY run_id").fetchall(),
        "epochs": c.execute("SELECT run_id, epoch, train_loss, test_loss, test_acc, skipped, "
                            "nonfinite, loss_scale FROM epochs ORDER BY run_id, epoch"
                            ).fetchall(),
        "memory": c.execute("SELECT * FROM memory ORDER BY run_id").fetchall(),
        "trace": c.execute("SELECT * FROM scale_trace ORDER BY run_id, step").fetchall(),
        "steps": c.execute("SELECT * FROM steps ORDER BY run_id, step").fetchall(),
        "analysis": c.execute("SELECT * FROM analysis ORDER BY run_id, kind").fetchall(),
    }
    c.close()
    return out


@pytest.mark.timeout(600)
def test_rows_a_checkpoint_covers_are_replayed_on_resume(tmp_path, monkeypatch):
    reference = stored(run_compare(CompareConfig(out=str(tmp_path / "ref"), **CONFIG)))
    assert reference["trace"]  # the trace is part of what must come back

    out = tmp_path / "r"
    save = runner.atomic_save

    def save_then_stop(obj, path):  # stop in the second run, after its epoch-1 checkpoint
        save(obj, path)
        if "16-mixed" in path.name and obj["epoch"] == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_compare(CompareConfig(out=str(out), **CONFIG))
    monkeypatch.undo()
    # what a killed Ray driver leaves: the checkpoint of epoch 1 written by the task, its rows
    # (and the trace of its steps) never stored
    c = sqlite3.connect(out / "results.db")
    c.execute("DELETE FROM epochs WHERE run_id LIKE '16-mixed%'")
    c.execute("DELETE FROM scale_trace WHERE run_id LIKE '16-mixed%'")
    c.commit()
    c.close()
    run_compare(CompareConfig(out=str(out), resume=True, **CONFIG))
    got = stored(out)
    assert [r[:2] for r in got["epochs"]] == [r[:2] for r in reference["epochs"]]
    assert got == reference


@pytest.mark.timeout(600)
def test_16_bit_run_checkpoints_are_half_the_size_and_resume_identically(tmp_path, monkeypatch):
    """A run folder's checkpoint under emulated 16-true holds fp16 weights and fp16 momentum,
    as a native run's: about half the 32-true checkpoint (measured here on the MLP: 32-true
    422,921 B, native fp16 220,429 B, emulated 16-true 219,657 B, was 321,289 B). Interrupted
    after it, the run resumes to the uninterrupted run's numbers."""
    cfg = dict(CONFIG, policies=("32-true", "16-true"), epochs=2)
    reference = stored(run_compare(CompareConfig(out=str(tmp_path / "ref"), **cfg)))
    out = tmp_path / "r"
    save = runner.atomic_save
    seen = {}

    def save_then_stop(obj, path):
        save(obj, path)
        seen[path.name.split("_seed")[0]] = (path.stat().st_size, obj)
        if "16-true" in path.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "atomic_save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run_compare(CompareConfig(out=str(out), **cfg))
    monkeypatch.undo()
    (size32, _), (size16, ckpt) = seen["32-true"], seen["16-true"]
    assert size16 < 0.55 * size32, (size16, size32)
    assert {t.dtype for t in ckpt["model"].values()} == {torch.float16}
    assert {v.dtype for s in ckpt["optimizer"]["state"].values() for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0} == {torch.float16}
    assert "trace" not in ckpt["precision"]
    run_compare(CompareConfig(out=str(out), resume=True, **cfg))
    assert stored(out) == reference
