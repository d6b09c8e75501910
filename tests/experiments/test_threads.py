"""The torch thread count is part of a comparison's configuration: stored, honoured by every
run (the caller's count given back), refused when --resume would change it, and absent from
a comparison stored before it existed without stopping its --resume."""

import pytest
import torch

from lowprec.cli import main
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments import runner
from lowprec.experiments.results import ResultsDB

CONFIG = dict(data="digits", model="mlp", policies=("32-true",), seeds=(0,), epochs=1,
              batch_size=64, train_subset=128, quiet=True)


@pytest.mark.timeout(300)
def test_threads_are_stored_honoured_and_refused_when_changed(tmp_path, monkeypatch, capsys):
    caller = torch.get_num_threads()
    threads = 1 if caller != 1 else 2
    seen = []
    evaluate = runner.evaluate

    def spy(*args, **kwargs):  # the count the run computes with
        seen.append(torch.get_num_threads())
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(runner, "evaluate", spy)
    out = run_compare(CompareConfig(out=str(tmp_path / "r"), threads=threads, **CONFIG))
    assert seen and set(seen) == {threads}
    assert torch.get_num_threads() == caller  # given back
    db = ResultsDB(out / "results.db", create=False)
    try:
        assert db.stored_config()["threads"] == threads
        run = db.runs()[0]
        assert run["config"]["threads"] == threads
        assert run["hardware"]["torch_threads"] == threads
        assert db.analysis(run["run_id"], "threads") == {"threads": threads}
    finally:
        db.close()

    base = ["compare", "--out", str(out), "--resume", "--quiet"]
    assert main(base + ["--threads", str(threads + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"threads: stored {threads}, given {threads + 1}" in err
    assert main(base) == 0  # the stored count, without the flag


@pytest.mark.timeout(300)
def test_a_comparison_stored_without_threads_resumes(tmp_path):
    out = run_compare(CompareConfig(out=str(tmp_path / "r"), **CONFIG))
    db = ResultsDB(out / "results.db", create=False)
    try:
        old = db.stored_config()
        assert old.pop("threads") == torch.get_num_threads()  # the default, resolved once
        db.set_meta("config", old)  # as lowprec stored it before the field existed
    finally:
        db.close()
    assert main(["compare", "--out", str(out), "--resume", "--quiet"]) == 0
    # the library as well, with the flag of an explicit count
    run_compare(CompareConfig(out=str(out), resume=True, threads=3, **CONFIG))


def test_threads_must_be_a_count():
    for bad in (0, -1, 2.5, True, 10**6):
        with pytest.raises(Exception, match="threads="):
            CompareConfig(threads=bad).validate()
