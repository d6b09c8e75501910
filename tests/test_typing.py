"""The public API type-checks (mypy): the PEP 561 marker is shipped, the typed modules pass
mypy, and a user's script over the public API (tests/typecheck/public_api_usage.py) does."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "lowprec"
#: the modules whose every function is annotated (--disallow-untyped-defs holds there)
TYPED = ["results.py", "experiments/tables.py"]


def test_marker_is_shipped():
    assert (SRC / "py.typed").is_file()
    assert 'lowprec = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.slow
def test_public_api_type_checks(tmp_path):
    api = pytest.importorskip("mypy.api")
    # imports are followed silently: lowprec's internals are read for their types, errors are
    # reported in the files named here only
    common = ["--follow-imports=silent", "--no-error-summary", "--cache-dir",
              str(tmp_path / "cache"), "--python-version", "3.11"]
    out, err, code = api.run(common + ["--disallow-untyped-defs", "--ignore-missing-imports"]
                             + [str(SRC / f) for f in TYPED] + [str(SRC / "__init__.py")])
    assert code == 0, out + err
    out, err, code = api.run(common + ["--ignore-missing-imports", "--check-untyped-defs",
                                       str(ROOT / "tests" / "typecheck" / "public_api_usage.py")])
    assert code == 0, out + err
