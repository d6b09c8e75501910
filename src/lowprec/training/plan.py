"""A per-layer precision plan as data: a base policy, per-module overrides, and the evidence.

:func:`lowprec.experiments.planner.plan` finds a plan; this module holds what it returns, so that
the training layer (``Precision(plan)``, ``Precision("plan:FILE")``, the integrations, which
build a ``Precision``) can use one without importing the experiments::

    plan = Plan.load("plan.json")
    prec = lowprec.Precision(plan)        # == Precision(plan.policy, overrides=plan.overrides)

A plan file is JSON (``.json``) or TOML (``.toml``, read only: written as JSON is written,
by hand or by another tool); ``save`` writes JSON through a temporary file and a rename, so a
reader sees the old file or the new one. The evidence (per-module measurements, the
verification runs, the repair log) is plain data carried along for the report; ``Precision``
reads only ``policy`` and ``overrides``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .policy import parse_policy

__all__ = ["Plan", "PLAN_PREFIX", "load_plan", "is_plan_spec"]

PLAN_PREFIX = "plan:"
_VERSION = 1


def _plain(obj):
    """Tuples to lists, non-finite floats to strings, so the JSON is standard and reloads."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return "nan"
    if isinstance(obj, float) and obj in (float("inf"), float("-inf")):
        return "inf" if obj > 0 else "-inf"
    return obj


@dataclass(frozen=True)
class Plan:
    """``policy``: the base policy's spec (every module not overridden, and ops outside
    modules); ``overrides``: module name -> policy spec (the modules kept higher or put lower);
    ``evidence``: module name -> the measurements that decided it; ``verification``: the
    training runs that accepted it; ``log``: each step of the search, repairs included;
    ``meta``: the budget, menu, tolerance and what the plan was found on."""

    policy: str
    overrides: dict = field(default_factory=dict)
    evidence: dict = field(default_factory=dict)
    verification: dict = field(default_factory=dict)
    log: tuple = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise TypeError(f"Plan.policy={self.policy!r:.60} must be a policy spec string")
        parse_policy(self.policy)  # a bad base policy is refused here, in one line
        if not isinstance(self.overrides, dict):
            raise TypeError(f"Plan.overrides={self.overrides!r:.60} must be a dict of module "
                            "name -> policy spec")
        for name, spec in self.overrides.items():
            if not isinstance(name, str) or not isinstance(spec, str):
                raise ValueError(f"Plan.overrides entry {name!r:.40}: {spec!r:.40}: module "
                                 "names and policy specs must be strings")
            try:
                parse_policy(spec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"Plan.overrides[{name!r}]: {err}") from None
        object.__setattr__(self, "log", tuple(self.log))

    def to_json(self) -> dict:
        return _plain({"lowprec_plan": _VERSION, "policy": self.policy,
                       "overrides": dict(self.overrides), "evidence": self.evidence,
                       "verification": self.verification, "log": list(self.log),
                       "meta": self.meta})

    @classmethod
    def from_json(cls, d: dict, source: str = "plan") -> "Plan":
        if not isinstance(d, dict) or "policy" not in d:
            raise ValueError(f"{source} is not a lowprec plan: it needs a 'policy' entry "
                             "(and optionally 'overrides')")
        version = d.get("lowprec_plan", _VERSION)
        if version != _VERSION:
            raise ValueError(f"{source}: lowprec_plan={version!r}; this lowprec reads version "
                             f"{_VERSION}")
        overrides = d.get("overrides") or {}
        if not isinstance(d["policy"], str) or not isinstance(overrides, dict) or \
                not all(isinstance(k, str) and isinstance(v, str) for k, v in overrides.items()):
            raise ValueError(f"{source} is not a lowprec plan: 'policy' must be a policy string "
                             "and 'overrides' a table of module pattern -> policy string "
                             f"(got policy={str(d['policy'])[:60]!r}, overrides of type "
                             f"{type(overrides).__name__})")
        return cls(policy=d["policy"], overrides=dict(overrides),
                   evidence=d.get("evidence") or {}, verification=d.get("verification") or {},
                   log=tuple(d.get("log") or ()), meta=d.get("meta") or {})

    @staticmethod
    def check_path(path: str | os.PathLike) -> Path:
        """The path a plan can be saved to, checked before any work is spent on the plan:
        a file name (not empty, not a folder), not ``.toml`` (plans are written as JSON), in
        an existing folder. ValueError in one line."""
        text = os.fspath(path)
        if not str(text).strip():
            raise ValueError("--out is empty: name the plan file (plan.json)")
        path = Path(text)
        if path.suffix.lower() == ".toml":
            raise ValueError(f"{str(path)[:200]}: plans are written as JSON (.json); TOML "
                             "plans are read only")
        if path.is_dir() or text.endswith(os.sep):
            raise ValueError(f"{str(path)[:200]} is a folder: name the plan file "
                             "(FOLDER/plan.json)")
        parent = path.parent
        if not parent.is_dir():
            raise ValueError(f"{str(path)[:200]}: the folder {str(parent)[:200]} does not exist")
        if not os.access(parent, os.W_OK):
            raise ValueError(f"{str(path)[:200]}: the folder {str(parent)[:200]} is not "
                             "writable")
        return path

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan as JSON through a temporary file and a rename; returns the path."""
        path = self.check_path(path)
        text = json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"
        tmp = path.with_name(f".{path.name}.lowprec-tmp{os.getpid()}")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read a plan file (JSON, or TOML with the same keys); ValueError in one line."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise ValueError(f"plan file {str(path)!r} cannot be read: {err.strerror or err}"
                             ) from None
        try:
            if path.suffix.lower() == ".toml":
                import tomllib

                d = tomllib.loads(raw.decode())
            else:
                d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise ValueError(f"plan file {str(path)!r} is not valid "
                             f"{'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: "
                             f"{' '.join(str(err).split())[:120]}") from None
        return cls.from_json(d, f"plan file {str(path)!r}")


def is_plan_spec(spec) -> bool:
    """Whether ``spec`` names a plan file: ``"plan:FILE"``."""
    return isinstance(spec, str) and spec.strip().startswith(PLAN_PREFIX)


def load_plan(spec) -> Plan:
    """A :class:`Plan` from ``"plan:FILE"``, a path, or a Plan (returned as is)."""
    if isinstance(spec, Plan):
        return spec
    s = str(spec).strip()
    if s.startswith(PLAN_PREFIX):
        s = s[len(PLAN_PREFIX):]
    if not s:
        raise ValueError(f"plan spec {spec!r} names no file; give plan:FILE")
    return Plan.load(s)
