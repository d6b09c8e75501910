"""The documentation: the site builds with warnings as errors (mkdocs --strict: broken links,
missing pages, docstrings mkdocstrings cannot render), and the Python examples of the README
and of every guide run as written (each page in order, in one namespace that starts with the
getting-started page's; tests/integrations/test_docs.py runs the integrations guide's, which
need the optional dependencies)."""

import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: the pages whose Python blocks run here (integrations.md: tests/integrations/test_docs.py;
#: scaling.md's example runs under torchrun: tests/training/test_distributed.py)
#: the API reference's pages and the package each documents
REFERENCE = {"lowprec": "lowprec", "numerics": "lowprec.numerics", "training": "lowprec.training",
             "analysis": "lowprec.analysis", "optim": "lowprec.optim",
             "results": "lowprec.results", "integrations": "lowprec.integrations"}
PAGES = ["guides/formats.md", "guides/train.md", "guides/regimes.md", "guides/compare.md",
         "guides/analyse.md", "guides/certify.md", "guides/plan.md"]


def blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_blocks(path: Path, ns: dict) -> dict:
    for block in blocks(path):
        exec(compile(block, str(path), "exec"), ns)  # noqa: S102 - our own documentation
    return ns


def test_readme_examples_run():
    """(```py blocks are shown, not run: they need a run folder)"""
    ns = run_blocks(ROOT / "README.md", {})
    assert ns["prec"].steps == 1  # the quick start's one step


def test_readme_is_what_a_newcomer_reads_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    # it links to every guide of the site
    for page in PAGES + ["guides/integrations.md", "guides/scale-out.md", "guides/gpu.md"]:
        assert f"docs/{page}" in text, page


@pytest.mark.parametrize("page", PAGES)
def test_guide_examples_run(page, tmp_path, monkeypatch):
    assert blocks(DOCS / page), page
    monkeypatch.chdir(tmp_path)  # examples that write a run folder write it here
    run_blocks(DOCS / page, run_blocks(ROOT / "README.md", {}))


@pytest.mark.slow
def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site"), "--config-file", str(ROOT / "mkdocs.yml")],
                          capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1",
                                                                "PATH": "/usr/bin:/bin"},
                          cwd=tmp_path)  # the config's paths hold from any folder
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    for page in ["index.html", "guides/certify/index.html", "reference/results/index.html"]:
        assert (site / page).is_file(), page
    # the API reference was generated from the docstrings: every public name of every
    # package page has its entry (sub-modules have pages or guides of their own)
    ref = (site / "reference" / "lowprec" / "index.html").read_text()
    assert 'id="lowprec.Precision.setup"' in ref and 'id="lowprec.quantize"' in ref
    for page, name in REFERENCE.items():
        html = (site / "reference" / page / "index.html").read_text()
        ids = set(re.findall(r'id="([A-Za-z_][\w.]*)"', html))
        module = importlib.import_module(name)
        missing = [n for n in module.__all__ if not n.startswith("_")
                   and not isinstance(getattr(module, n), types.ModuleType)
                   and not any(i == f"{name}.{n}" or i.endswith("." + n) for i in ids)]
        assert not missing, f"{page}: {missing}"
        # docstrings' Sphinx roles are rendered as code (docs/griffe_roles.py), not shown raw
        assert not re.search(r":(func|class|mod|meth|attr|data):<", html), page
