"""A run folder's results as pandas DataFrames (the typed results API, ``lowprec.results``).

``load(RUN_DIR)`` reads ``RUN_DIR/results.db`` without writing anything to the folder (an
in-memory copy, so a comparison still running, or a read-only folder, can be read) and returns
:class:`Results`: one DataFrame per kind of record, each row keyed by ``run_id`` and carrying
the run's ``policy`` and ``seed`` so that a ``groupby("policy")`` needs no join. A comparison
over several models (``RUN_DIR/models.json``) gives the rows of every model's folder with a
``model`` column first. Values that were not finite in training (stored as SQL NULL) read as
NaN, a missing integer (a run's ``diverged_step``, ``memory_total``) as pandas' ``<NA>``; JSON
columns (a run's config, versions and hardware, an analysis payload) read as dicts.
pandas is needed (``pip install lowprec[results]``); it is imported on first use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import RunError
from .results import ResultsDB
from .runfolder import MODELS_FILE, read_models_list

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Results", "load", "RUN_COLUMNS", "EPOCH_COLUMNS", "STEP_COLUMNS",
           "ANALYSIS_COLUMNS", "MEMORY_COLUMNS"]

#: the columns of :attr:`Results.runs`, in order (a ``model`` column first for several models)
RUN_COLUMNS = ("run_id", "policy", "seed", "status", "backend", "final_test_acc",
               "best_test_acc", "final_train_loss", "epochs", "seconds", "diverged_step",
               "error", "memory_total", "policy_spec", "started", "finished", "git", "config",
               "versions", "hardware")
#: the columns of :attr:`Results.epochs`
EPOCH_COLUMNS = ("run_id", "policy", "seed", "epoch", "train_loss", "test_loss", "test_acc",
                 "seconds", "cpu_seconds", "load", "other_cpus", "skipped", "nonfinite",
                 "loss_scale", "ended")
#: the columns of :attr:`Results.steps` (``loss_scale`` and ``skipped`` from the loss-scale
#: trace: 1.0 and 0 for a run without loss scaling; NaN where no trace was stored for a step)
STEP_COLUMNS = ("run_id", "policy", "seed", "step", "epoch", "loss", "lr", "grad_norm",
                "loss_scale", "skipped")
#: the columns of :attr:`Results.analyses`: one row per stored analysis, ``kind`` as the run
#: stored it (``certificate:fp16``, ``layers:fp16``, ``lost:bf16``, ``ranges:fp16``,
#: ``threads``, ``plan`` ...), ``payload`` a dict
ANALYSIS_COLUMNS = ("run_id", "policy", "seed", "kind", "payload")
#: the columns of :attr:`Results.memory`: the memory ledger's bytes by role
MEMORY_COLUMNS = ("run_id", "policy", "seed", "params", "grads", "optimizer_state", "master",
                  "activations", "total")


@dataclass(frozen=True)
class Results:
    """The results of one run folder (a comparison of regimes), as DataFrames.

    Attributes:
        path: the run folder that was read.
        runs: one row per run (``RUN_COLUMNS``): its regime, seed, status, final and best test
            accuracy, last training loss, the number of epochs recorded, their wall time in
            seconds, the memory ledger's total bytes and the stored configuration.
        epochs: one row per run and epoch (``EPOCH_COLUMNS``).
        steps: one row per run and optimizer step (``STEP_COLUMNS``).
        analyses: one row per run and analysis (``ANALYSIS_COLUMNS``).
        memory: one row per run (``MEMORY_COLUMNS``): the memory ledger's bytes by role.
        config: the comparison's configuration as stored (None when none was recorded).
    """

    path: Path
    runs: pd.DataFrame
    epochs: pd.DataFrame
    steps: pd.DataFrame
    analyses: pd.DataFrame
    memory: pd.DataFrame
    config: dict[str, Any] | None

    def __repr__(self) -> str:
        return (f"Results({str(self.path)!r}: {len(self.runs)} runs, {len(self.epochs)} "
                f"epochs, {len(self.steps)} steps, {len(self.analyses)} analyses)")

    def analysis(self, kind: str) -> pd.DataFrame:
        """The analyses of one ``kind`` flattened to columns (``pandas.json_normalize`` of the
        payloads), one row per run that stored it; ``run_id``, ``policy`` and ``seed`` first.
        ValueError naming the kinds stored when none has that kind."""
        import pandas as pd

        rows = self.analyses[self.analyses["kind"] == kind]
        if rows.empty:
            kinds = sorted(set(self.analyses["kind"]))
            raise ValueError(f"no analysis of kind {kind!r:.80} in {self.path}; stored: "
                             f"{', '.join(kinds) or 'none'}")
        keys = [c for c in ("model", "run_id", "policy", "seed") if c in rows.columns]
        flat = pd.json_normalize(list(rows["payload"]))
        flat = flat.drop(columns=[c for c in keys if c in flat.columns])
        return pd.concat([rows[keys].reset_index(drop=True), flat], axis=1)


def load(run_dir: str | Path) -> Results:
    """The results of the run folder ``run_dir`` (written by ``lowprec compare --out``; its
    ``results.db`` is accepted too) as DataFrames; nothing in the folder is written. RunError
    when the folder holds no results; ``CorruptDatabase`` when its database cannot be read;
    ImportError naming the extra when pandas is missing."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("lowprec.results needs pandas: pip install 'lowprec[results]'") \
            from None
    run_dir = Path(run_dir)
    if run_dir.name == "results.db" and run_dir.is_file():
        run_dir = run_dir.parent
    if (run_dir / "results.db").is_file():
        return _load_one(run_dir, pd)
    if (run_dir / MODELS_FILE).is_file():
        parts = [(m, _load_one(run_dir / m, pd)) for m in read_models_list(run_dir)
                 if (run_dir / m / "results.db").is_file()]
        if not parts:
            raise RunError(f"{str(run_dir)[:200]} lists models in {MODELS_FILE} but none has "
                           "results yet")

        def cat(name: str) -> pd.DataFrame:
            frames = [getattr(r, name).assign(model=m) for m, r in parts]
            out = pd.concat(frames, ignore_index=True)
            return out[["model"] + [c for c in out.columns if c != "model"]]

        return Results(path=run_dir, runs=cat("runs"), epochs=cat("epochs"), steps=cat("steps"),
                       analyses=cat("analyses"), memory=cat("memory"), config=parts[0][1].config)
    raise RunError(f"{str(run_dir)[:200]} has no results.db (run lowprec compare --out DIR "
                   "first)")


def _load_one(run_dir: Path, pd: Any) -> Results:
    db = ResultsDB(run_dir / "results.db", create=False, readonly=True)
    try:
        config = db.stored_config()

        def query(sql: str) -> pd.DataFrame:
            return pd.read_sql_query(sql, db.conn)

        runs = query("SELECT * FROM runs ORDER BY started, run_id")
        for col in ("config", "versions", "hardware"):
            runs[col] = [json.loads(v) if v else None for v in runs[col]]
        epochs = query("SELECT * FROM epochs ORDER BY run_id, epoch")
        steps = query("SELECT s.run_id, s.step, s.epoch, s.loss, s.lr, s.grad_norm, "
                      "t.scale AS loss_scale, t.skipped FROM steps s LEFT JOIN scale_trace t "
                      "ON s.run_id = t.run_id AND s.step = t.step ORDER BY s.run_id, s.step")
        analyses = query("SELECT run_id, kind, payload FROM analysis ORDER BY run_id, kind")
        analyses["payload"] = [json.loads(p) for p in analyses["payload"]]
        memory = query("SELECT * FROM memory ORDER BY run_id")
    finally:
        db.close()
    keys = runs[["run_id", "policy", "seed"]]

    def keyed(frame: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
        merged = keys.merge(frame, on="run_id", how="right", sort=False)
        return merged[list(columns)].reset_index(drop=True)

    epochs = keyed(epochs, EPOCH_COLUMNS).astype({"test_acc": float, "train_loss": float,
                                                  "test_loss": float})
    memory = keyed(memory, MEMORY_COLUMNS)
    steps = keyed(steps, STEP_COLUMNS).astype({"loss": float, "lr": float, "grad_norm": float,
                                               "loss_scale": float})
    return Results(path=run_dir, runs=_run_table(runs, epochs, memory), epochs=epochs,
                   steps=steps, analyses=keyed(analyses, ANALYSIS_COLUMNS), memory=memory,
                   config=config)


def _run_table(runs: pd.DataFrame, epochs: pd.DataFrame, memory: pd.DataFrame) -> pd.DataFrame:
    """One row per run: the runs table with each run's summary of its epochs and memory."""
    ordered = epochs.sort_values(["run_id", "epoch"])
    # the last epoch's values as recorded (NaN when it was not finite), not the last finite one
    last = ordered.drop_duplicates("run_id", keep="last")[["run_id", "test_acc", "train_loss"]]
    last = last.rename(columns={"test_acc": "final_test_acc", "train_loss": "final_train_loss"})
    summary = ordered.groupby("run_id", sort=False).agg(
        best_test_acc=("test_acc", "max"), epochs=("epoch", "count"),
        seconds=("seconds", "sum")).reset_index().merge(last, on="run_id")
    out = runs.merge(summary, on="run_id", how="left")
    out = out.merge(memory[["run_id", "total"]].rename(columns={"total": "memory_total"}),
                    on="run_id", how="left")
    out["epochs"] = out["epochs"].fillna(0).astype(int)
    # integers that may be missing keep one dtype whatever the data: pandas' nullable Int64
    # (pd.NA where a run did not diverge or recorded no ledger)
    out = out.astype({"diverged_step": "Int64", "memory_total": "Int64"})
    return out[list(RUN_COLUMNS)].reset_index(drop=True)
