"""The command line: tables, one-line errors with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec.cli import main


def test_formats_table(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for needle in ["fp16", "65504", "e4m3fn", "448", "mxfp4", "q2.14", "5.96046e-08"]:
        assert needle in out


def test_quantize_command(capsys):
    assert main(["quantize", "65520", "0.1", "-f", "fp16", "-f", "e4m3fn-sat"]) == 0
    out = capsys.readouterr().out
    assert "inf" in out and "448" in out and "0.0999755859" in out


def test_user_errors_are_one_line_exit_2(capsys):
    assert main(["formats", "fp7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fp7'" in err and "accepted" in err
    assert main(["quantize", "1", "-f", "fp16", "-r", "sideways"]) == 2
    assert "unknown rounding mode 'sideways'" in capsys.readouterr().err
    assert main(["quantize", "abc", "-f", "fp16"]) == 2
    assert "abc" in capsys.readouterr().err
    # the longest lists of accepted values, whole on their line (a cap of 400 characters cut
    # out their middle: the last policies' names and the spec's keys, a new user found)
    assert main(["train", "--policy", "17-true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and " ... " not in err
    assert "nvfp4-sr" in err and "'q6.10-sr'" in err and "keys p c g o m ls b s sc acc" in err
    assert main(["formats", "fp13"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and " ... " not in err and "dfxp<N" in err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "lowprec.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "formats" in out and "quantize" in out


# -- conventions: --version, --json, --config, completion, plain progress -------------------

SRC = str(Path(__file__).resolve().parent.parent / "src")
TINY = ["--data", "digits", "--model", "mlp", "--epochs", "1", "--batch-size", "64",
        "--train-subset", "128"]


def test_version(capsys):
    from lowprec import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lowprec {__version__}"


def test_compare_json_and_a_config_file_the_flags_override(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('data = "digits"\nmodel = "mlp"\nepochs = 3\nbatch-size = 64\n'
                   'train_subset = 128\npolicies = ["32-true", "bf16-true"]\n'
                   '[compare]\nseeds = 1\n[advise]\nbatches = 2\n')
    out = tmp_path / "r"
    assert main(["compare", "--config", str(cfg), "--epochs", "1", "--out", str(out),
                 "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is the JSON document alone
    assert [p["policy"] for p in doc["policies"]] == ["32-true", "bf16-true"]
    assert doc["policies"][0]["acc_n"] == 1 and doc["verdict"]["headline"].startswith("Use ")
    assert doc["runs"][0]["status"] == "finished" and doc["failed_runs"] == []
    assert "epoch 1/1" in captured.err  # progress went to stderr
    # the file is kept in the run folder; the command line won over it (--epochs 1)
    assert (out / "run.toml").read_text() == cfg.read_text()
    from lowprec.experiments.results import ResultsDB

    db = ResultsDB(out / "results.db", create=False)
    stored = db.stored_config()
    db.close()
    assert stored["epochs"] == 1 and stored["train_subset"] == 128 and stored["seeds"] == [0]
    # report --json reads the same summary back
    assert main(["report", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == doc["verdict"]


def test_json_from_a_config_file_or_an_abbreviation_covers_failures(tmp_path, capsys):
    """--json given by a config file (json = true) or abbreviated (--js): a failing command
    still prints exactly one JSON document, {"error", "exit"}, on stdout."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('[compare]\ndata = "digits"\nmodel = "mlp"\njson = true\n'
                   'policies = "no-such-policy"\n')
    for argv in (["compare", "--config", str(cfg), "--out", str(tmp_path / "a")],
                 ["compare", "--policies", "no-such-policy", "--js", "--out", str(tmp_path / "b")]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        doc = json.loads(captured.out)
        assert doc["exit"] == 2 and "no-such-policy" in doc["error"], doc
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_certify_and_advise_json(capsys):
    args = ["--data", "digits", "--model", "mlp", "--epochs", "0", "--json"]
    code = main(["certify", *args])
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "fp16" and doc["summary"]["violations"] == 0 and doc["per_class"]
    # exit code 1 exactly when an input is uncertified (docs/guides/certify.md)
    assert code == (0 if doc["summary"]["certified"] == 1.0 else 1), doc["summary"]
    assert main(["certify", *args, "--format", "e4m3fn"]) == 1  # (a new user's run exited 0)
    assert json.loads(capsys.readouterr().out)["summary"]["certified"] < 1.0
    assert main(["advise", *args, "--batches", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] in ("safe", "needs care", "unsafe") and doc["reasons"]
    assert doc["certificate"]["n"] > 0 and doc["loss_scale"] > 0


def test_certify_and_advise_take_what_their_functions_take(capsys):
    """``--format`` takes what certify() and advise() take: a scaled-GEMM recipe for both, a
    regime of one format (``q6.10-sr``, as docs/guides/analyse.md calls advise) for advise
    (a new user found them refused as unknown number formats); what a function refuses is one
    line naming what it takes, said before the model trains."""
    args = ["--data", "digits", "--model", "mlp", "--epochs", "0", "--json"]
    assert main(["advise", *args, "--batches", "1", "--format", "q6.10-sr"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "q6.10-sr" and doc["verdict"] in ("safe", "needs care", "unsafe")
    assert main(["advise", *args, "--batches", "1", "--format", "fp8-tensorwise"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "fp8-tensorwise"
    assert main(["certify", *args, "--format", "fp8-tensorwise"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "fp8-tensorwise" and doc["summary"]["n"] > 0
    for command, fmt, said in (("advise", "16-mixed", "holds several formats"),
                               ("certify", "q6.10-sr", "unknown number format 'q6.10-sr'")):
        assert main([command, "--format", fmt, "--epochs", "100000"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and ("accepted: fp32" in err or
                                                          "give a format (fp16" in err), err


def test_shell_completion_through_argcomplete(tmp_path):
    pytest.importorskip("argcomplete")
    result = tmp_path / "completions"
    env = dict(os.environ, PYTHONPATH=SRC, _ARGCOMPLETE="1", COMP_LINE="lowprec export x --to ",
               COMP_POINT="22", _ARGCOMPLETE_STDOUT_FILENAME=str(result))
    subprocess.run([sys.executable, "-m", "lowprec"], env=env, stdin=subprocess.DEVNULL,
                   capture_output=True, timeout=300)
    offered = result.read_text().replace("\x0b", " ").split()
    assert offered == ["csv", "parquet", "tensorboard", "mlflow"]


def test_needs_ray_is_said_before_a_folder_or_a_bar_exists(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    out = tmp_path / "r"
    assert main(["compare", "--executor", "ray", *TINY, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "--executor ray needs Ray" in captured.err and captured.out == ""
    assert not out.exists()


def test_a_warning_under_a_command_is_one_line_naming_the_command(tmp_path):
    """Python's framing of a warning (a file, a line number and the source line: the console
    script's own line, for a warning raised inside lowprec) becomes one line on stderr,
    ``lowprec CMD: Category: message`` (the format only: a caller recording warnings, as
    pytest.warns does, still records them; so in a process of its own here)."""
    import re

    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run(
        [sys.executable, "-m", "lowprec", "train", "--data", "digits", "--model", "mlp",
         "--policy", "p=fp16", "--epochs", "1", "--out", str(tmp_path / "r"), "--quiet"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert any(ln.startswith("lowprec train: BackendChoiceWarning: policy p=fp16") for ln in
               lines), lines
    assert not any(re.search(r"\.py:\d+: ", ln) for ln in lines), lines


def test_an_unknown_flag_is_named_by_its_command_with_the_closest_one(capsys):
    """``lowprec train --policies x`` said ``lowprec: error: unrecognized arguments ... (see
    lowprec --help)``: the command's own parser names it, with the flag meant."""
    assert main(["train", "--policies", "16-true"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lowprec train: error: unrecognized arguments: --policies 16-true (did you mean "
        "--policy?) (see lowprec train --help)")
    assert main(["formats", "fp16", "--zzz"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lowprec formats: error: unrecognized arguments: --zzz (see lowprec formats --help)")
    assert main(["--zzz", "formats"]) == 2  # given before the command: lowprec's own
    assert capsys.readouterr().err.strip() == (
        "lowprec: error: unrecognized arguments: --zzz (see lowprec --help)")
