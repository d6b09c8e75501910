"""The command line: tables, one-line errors with exit code 2."""

import subprocess
import sys

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


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "lowprec.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "formats" in out and "quantize" in out
