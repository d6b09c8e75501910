"""The package's shape, checked: four layers with data flowing one way, no private names taken.

numerics (0) -> training and integrations (1) -> analysis (2) -> experiments (3) -> cli (4). A
module may import from its own layer or a lower one, never a higher one; and no module imports a name that
another module keeps private (a leading underscore). ``lowprec/__init__.py`` is the facade that
re-exports the public API, so it may import from every layer (and so may ``lowprec/optim.py``,
the optimizers' public module).

Inside a layer, imports form no circle: module A importing B (at the top or inside a function:
a lazy import only hides a circle) while B imports A, directly or through others, is refused
with the circle listed.
"""

import ast
from pathlib import Path

import pytest

import lowprec

ROOT = Path(lowprec.__file__).parent
LAYERS = {"numerics": 0, "training": 1, "integrations": 1, "analysis": 2, "experiments": 3,
          "cli": 4}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield path, ["lowprec", *parts], is_pkg


def _layer(mod: list[str]) -> int | None:
    if len(mod) < 2:
        return None  # the facade
    return LAYERS.get(mod[1])


def _imports(path: Path, mod: list[str], is_pkg: bool):
    """(absolute module, imported names) for every lowprec import of a file, lazy ones too."""
    tree = ast.parse(path.read_text(), str(path))
    package = mod if is_pkg else mod[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] != "lowprec":
                continue
            names = [a.name for a in node.names]
            if not node.module and node.level:  # "from . import kernel": submodules
                for n in names:
                    yield target + [n], [], node.lineno
            else:
                yield target, names, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lowprec":
                    yield a.name.split("."), [], node.lineno


ALL = list(_modules())


NAMES = {".".join(m) for _, m, _ in ALL}


def _module_of(target: list[str]) -> str | None:
    """The lowprec module an import loads: the longest prefix of ``target`` that is a module."""
    for k in range(len(target), 1, -1):
        name = ".".join(target[:k])
        if name in NAMES:
            return name
    return None


def _graph() -> dict[str, set[str]]:
    """Module -> the lowprec modules it imports (a name taken from a package counts as the
    package, a submodule imported from it as the submodule)."""
    graph: dict[str, set[str]] = {}
    for path, mod, is_pkg in ALL:
        here = ".".join(mod)
        edges = graph.setdefault(here, set())
        for target, names, _ in _imports(path, mod, is_pkg):
            found = next((m for m in (_module_of(target + [n]) for n in names)
                          if m is not None and m != ".".join(target)), None)
            found = found or _module_of(target)
            if found is not None and found != here:
                edges.add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as [a, b, ..., a], or None (depth-first, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph.get(root, ())))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_circle():
    cycle = find_cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_circle(tmp_path):
    """The test above can fail: a lazy import back from b to a is a circle, and a chain with
    no way back is none."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    pkg = tmp_path / "lowprec" / "experiments"
    pkg.mkdir(parents=True)
    (pkg / "runner.py").write_text("from .multi import run_models\n")
    (pkg / "multi.py").write_text("def f():\n    from .runner import run_compare\n")
    found = list(_imports(pkg / "multi.py", ["lowprec", "experiments", "multi"], False))
    assert found == [(["lowprec", "experiments", "runner"], ["run_compare"], 2)]


def test_the_four_layers_exist():
    found = {m[1] for _, m, _ in ALL if len(m) > 1}
    assert set(LAYERS) <= found


@pytest.mark.parametrize("path,mod,is_pkg", ALL, ids=[".".join(m) for _, m, _ in ALL])
def test_no_import_from_a_higher_layer_and_no_private_name(path, mod, is_pkg):
    own = _layer(mod)
    problems = []
    for target, names, line in _imports(path, mod, is_pkg):
        if own is not None:
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                problems.append(f"line {line}: {'.'.join(mod)} (layer {own}) imports "
                                f"{'.'.join(target)} (layer {theirs})")
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        if private and target != mod:
            problems.append(f"line {line}: takes private {private} from {'.'.join(target)}")
        if any(p.startswith("_") and p != "__init__" for p in target[1:]) and target[:-1] != \
                mod[:len(target) - 1]:
            problems.append(f"line {line}: imports the private module {'.'.join(target)}")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_violation(tmp_path):
    """The test above can fail: a numerics module importing training is caught."""
    bad = tmp_path / "lowprec" / "numerics" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..training.precision import Precision\nfrom .quantize import _x\n")
    found = list(_imports(bad, ["lowprec", "numerics", "bad"], False))
    assert (["lowprec", "training", "precision"], ["Precision"], 1) in found
    assert _layer(found[0][0]) > _layer(["lowprec", "numerics", "bad"])
    assert found[1][1] == ["_x"]


def test_public_api_is_importable_from_the_top():
    for name in ("quantize", "quantize_", "Quantizer", "Precision", "Policy", "parse_policy",
                 "parse_format", "Rounding", "find_loss_scale", "DynamicLossScale", "optim",
                 "binary", "analysis"):
        assert hasattr(lowprec, name), name
    assert callable(lowprec.analysis.certify)
    assert lowprec.optim.SGD.__module__.startswith("lowprec.training.optim")


def test_optim_is_a_module_users_can_import_from():
    """``from lowprec.optim import Adam`` (the docs' spelling) works in a fresh interpreter,
    with the very classes of ``lowprec.training.optim`` and the same ``__all__``."""
    import subprocess
    import sys

    code = ("from lowprec.optim import Adam, AdamW, SGD, FormatOptimizer\n"
            "import lowprec, lowprec.optim, lowprec.training.optim as t\n"
            "assert lowprec.optim.__name__ == 'lowprec.optim'\n"
            "assert (Adam, AdamW, SGD, FormatOptimizer) == (t.Adam, t.AdamW, t.SGD, "
            "t.FormatOptimizer)\n"
            "assert sorted(lowprec.optim.__all__) == sorted(t.__all__)\n"
            "assert all(getattr(lowprec.optim, n) is getattr(t, n) for n in t.__all__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT.parent)})
    assert r.returncode == 0, r.stderr[-2000:]


REGIME_MODULES = {"binary", "dynamic_fixed", "scaled"}
FACADES = {("lowprec",), ("lowprec", "training")}


@pytest.mark.parametrize("path,mod,is_pkg", ALL, ids=[".".join(m) for _, m, _ in ALL])
def test_regimes_plug_in_and_import_no_optimizer(path, mod, is_pkg):
    """Inside training: no module but the facades names a regime (binary, dynamic fixed point,
    scaled) by importing it: the engine, the optimizers and Precision reach regimes through
    the registry and ``resolve``; and a regime imports no optimizer (optim sits above them)."""
    here = tuple(mod)
    in_regimes = here[:3] == ("lowprec", "training", "regimes")
    problems = []
    for target, names, line in _imports(path, mod, is_pkg):
        named = {t for t in target[3:4] + names} if target[:3] == ["lowprec", "training",
                                                                    "regimes"] else set()
        if named & REGIME_MODULES and not in_regimes and here not in FACADES:
            problems.append(f"line {line}: imports the regime {sorted(named & REGIME_MODULES)}")
        if in_regimes and target[:3] == ["lowprec", "training", "optim"]:
            problems.append(f"line {line}: a regime imports {'.'.join(target)}")
    assert not problems, "\n".join(problems)
