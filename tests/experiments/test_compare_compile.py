"""``lowprec compare --compile``: the emulated runs compiled, with the numbers of the eager
comparison (compiled emulation gives eager emulation's bits), fp32 eager, the flag stored."""

import warnings

import pytest

from lowprec.cli import main
from lowprec.experiments import CompareConfig, run_compare
from lowprec.experiments import runner
from lowprec.experiments.results import ResultsDB

CONFIG = dict(data="digits", model="mlp", policies=("32-true", "16-true"), seeds=(0,),
              epochs=1, batch_size=64, train_subset=128, quiet=True)


def _epochs(out):
    db = ResultsDB(out / "results.db", create=False)
    try:
        return db.stored_config(), {r["run_id"]: [(e["train_loss"], e["test_loss"],
                                                    e["test_acc"]) for e in db.epochs(r["run_id"])]
                                    for r in db.runs()}
    finally:
        db.close()


@pytest.mark.timeout(600)
def test_compare_compile_gives_the_eager_numbers(tmp_path, monkeypatch):
    made = []
    precision = runner.Precision

    def spy(*args, **kwargs):  # what each run's Precision was asked
        made.append((str(args[0]), kwargs.get("compile", False)))
        return precision(*args, **kwargs)

    monkeypatch.setattr(runner, "Precision", spy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = run_compare(CompareConfig(out=str(tmp_path / "eager"), **CONFIG))
        assert main(["compare", "--data", "digits", "--model", "mlp", "--policies",
                     "32-true,16-true", "--seeds", "1", "--epochs", "1", "--batch-size", "64",
                     "--train-subset", "128", "--quiet", "--compile",
                     "--out", str(tmp_path / "compiled")]) == 0
    assert not [w for w in caught if "runs this model eagerly" in str(w.message)]
    runs = [m for m in made if m[0] in ("32-true", "16-true")]
    assert ("16-true", True) in runs and ("32-true", True) not in runs
    cfg_e, eager_epochs = _epochs(eager)
    cfg_c, compiled_epochs = _epochs(tmp_path / "compiled")
    assert cfg_e["compile"] is False and cfg_c["compile"] is True
    assert compiled_epochs == eager_epochs and len(compiled_epochs) == 2


def test_compile_must_be_a_bool():
    with pytest.raises(Exception, match="compile="):
        CompareConfig(compile="yes").validate()
