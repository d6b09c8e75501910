"""Where a run's state lives between epochs: its key in results.db, its checkpoint file in the
run folder (written atomically), and whether a stored run continues from it."""

from __future__ import annotations

import hashlib
from pathlib import Path

from .results import NOT_REQUESTED
from .runfolder import atomic_torch_save

__all__ = ["run_id_of", "policy_of", "checkpoint_path", "atomic_save", "resumable"]


def run_id_of(policy, seed: int) -> str:
    """The key of a (policy, seed) run in results.db: the policy as the comparison was given it
    (a name or spec string, or a Policy, which prints as that name)."""
    return f"{policy}|seed={seed}"


def policy_of(run_id: str) -> str:
    """The policy as the comparison was given it, from a run id (:func:`run_id_of`'s inverse)."""
    return run_id.rsplit("|seed=", 1)[0]


def checkpoint_path(out: Path, run_id: str) -> Path:
    """Where a run's checkpoint lives in the run folder."""
    return out / "checkpoints" / f"{_run_key(run_id)}.pt"


def resumable(existing: dict | None) -> bool:
    """A stored run that continues (from its checkpoint) rather than starts afresh."""
    return existing is not None and (existing["status"] == "running" or (
        existing["status"] == "failed" and existing.get("error") == NOT_REQUESTED))


def _run_key(run_id: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)[:60]
    return f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file, then rename: a reader sees the old or the new file; on
    failure the temporary file is removed and RunIOError names the path."""
    atomic_torch_save(obj, path, "the checkpoint")
