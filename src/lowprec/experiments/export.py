"""``lowprec export RUN_DIR --to csv|parquet|tensorboard|mlflow``: a run folder's results
database in the formats other tools read, offline, with each library's own writer.

* ``csv``: one file per table of results.db (``runs.csv``, ``epochs.csv``, ``steps.csv``,
  ``memory.csv``, ``scale_trace.csv``, ``analysis.csv``, ``meta.csv``), a header row, floats
  written as Python's shortest round-trip repr, SQL NULL (a non-finite value) as an empty
  field; JSON columns (config, versions, hardware, analysis payloads) as their JSON text.
  Epochs are numbered from 0 (results.db's index; the terminal's progress counts from 1).
* ``parquet``: the same tables, one ``.parquet`` file each, written by pyarrow with the
  columns' SQL types (INTEGER int64, REAL float64, TEXT string, NULL as null).
* ``tensorboard``: one event-file folder per run (``torch.utils.tensorboard.SummaryWriter``):
  per optimizer step ``step/loss``, ``step/lr``, ``step/grad_norm``, ``step/loss_scale``; per
  epoch ``epoch/train_loss``, ``epoch/test_loss``, ``epoch/test_acc``, ``epoch/seconds``,
  ``epoch/cpu_seconds``, ``epoch/load``, ``epoch/other_cpus``, ``epoch/skipped``; the memory
  ledger's bytes ``memory/<role>`` and each certificate's fractions
  ``certificate/<format>/<certified|agreement>`` at step 0; the run's configuration and
  status as text. TensorBoard keeps scalars as float32.
* ``mlflow``: an MLflow file store (tracking URI ``file:OUT``), one experiment named after the
  run folder, one MLflow run per lowprec run (name: the run id): the configuration, policy
  and seed as params; policy, seed, status, backend, git revision as tags; the same metrics
  as TensorBoard's (``step_loss`` ..., ``epoch_test_acc`` ..., ``memory_<role>``) with their
  steps; the stored analyses as the artifact ``analysis.json``. MLflow 3 keeps its file store
  in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``: set here while
  writing; set it too when reading the store with MLflow's client (or run
  ``mlflow migrate-filestore`` to move it to a database).

Values of None (NULL: NaN or Inf in training) are left out of TensorBoard and MLflow, which
have no null. A comparison over several models (``OUT/models.json``) exports each model's run
folder into ``DIR/MODEL``.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import sqlite3
from contextlib import contextmanager
from pathlib import Path

from .config import RunError
from .results import ResultsDB
from .runfolder import (EXPORT_FOLDER, EXPORT_MARK, MODELS_FILE, io_error, read_models_list,
                        temp_path)

__all__ = ["export_run", "EXPORT_FORMATS", "EXPORT_TABLES", "ExportResult", "EXPORT_MARK"]

EXPORT_FORMATS = ("csv", "parquet", "tensorboard", "mlflow")
#: the tables of results.db, in the order written, each with the columns it is sorted by
EXPORT_TABLES = {"meta": ("key",), "runs": ("started", "run_id"), "epochs": ("run_id", "epoch"),
                 "steps": ("run_id", "step"), "memory": ("run_id",),
                 "scale_trace": ("run_id", "step"), "analysis": ("run_id", "kind")}
_EXTRA = {"csv": None, "parquet": "pyarrow", "tensorboard": "tensorboard", "mlflow": "mlflow"}
#: the folder of a run folder that ``lowprec export`` writes into by default
DEFAULT_FOLDER = EXPORT_FOLDER


class ExportResult(dict):
    """{"format", "out", "runs", "files"}: what was written (a dict, printed by --json)."""


def _needs(module: str, to: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = {"mlflow": "mlflow-skinny"}.get(_EXTRA[to], _EXTRA[to])
        raise RunError(f"--to {to} needs {package}: pip install 'lowprec[export]' (or pip "
                       f"install {package})") from None


def export_run(run_dir: str | Path, to: str, out: str | Path | None = None) -> ExportResult:
    """Export the results database of ``run_dir`` as ``to`` into ``out`` (default:
    ``RUN_DIR/export/FORMAT``), a folder that must be new or empty. ValueError for an unknown
    format; RunError for a folder without results, a non-empty ``out`` or a missing library."""
    if to not in EXPORT_FORMATS:
        raise ValueError(f"--to {to!r}; accepted: {', '.join(EXPORT_FORMATS)}")

    run_dir = Path(run_dir)
    db_path = run_dir / "results.db"
    several = not db_path.is_file() and (run_dir / MODELS_FILE).is_file()
    if not db_path.is_file() and not several:
        raise RunError(f"{str(run_dir)[:200]} has no results.db (run lowprec compare --out DIR "
                       "first)")
    out = Path(out) if out is not None else run_dir / DEFAULT_FOLDER / to
    _check_out(out)
    if _EXTRA[to]:
        _needs(_EXTRA[to], to)
    # every database is checked before anything is created (RUN/export included)
    for sub in ([run_dir / m for m in read_models_list(run_dir)] if several else [run_dir]):
        if (sub / "results.db").is_file():
            ResultsDB(sub / "results.db", create=False, readonly=True).close()
    if several:
        models = read_models_list(run_dir)
        result = ExportResult(format=to, out=str(out), runs=0, files=[])
        with _written_whole(out, in_place=to == "mlflow") as tmp:
            for model in models:
                if (run_dir / model / "results.db").is_file():
                    sub = _export_one(run_dir / model, to, tmp / model)
                    result["runs"] += sub[0]
                    result["files"] += [f"{model}/{f}" for f in sub[1]]
        result["files"].sort()
        return result
    with _written_whole(out, in_place=to == "mlflow") as tmp:
        runs, files = _export_one(run_dir, to, tmp)
    return ExportResult(format=to, out=str(out), runs=runs, files=files)


def _export_one(run_dir: Path, to: str, out: Path) -> tuple[int, list[str]]:
    """(runs, files relative to ``out``) of one run folder's export into the new ``out``.
    The database is read without a write (a read-only run folder can be exported)."""
    db = ResultsDB(run_dir / "results.db", create=False, readonly=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        writer = {"csv": _to_csv, "parquet": _to_parquet, "tensorboard": _to_tensorboard,
                  "mlflow": _to_mlflow}[to]
        runs = len(db.runs())
        files = writer(db, out, run_dir)
    finally:
        db.close()
    return runs, sorted(str(Path(f).relative_to(out)) for f in files
                        if Path(f).name != EXPORT_MARK)


@contextmanager
def _written_whole(out: Path, in_place: bool = False):
    """Yield a hidden temp folder beside ``out``; on success it is renamed to ``out`` (a new
    or empty folder, replaced at once), on any failure removed: no half export is left. A
    failed write (a full disk...) is a RunIOError naming ``out``, never the temp folder.
    ``in_place`` (an MLflow store, which records its absolute path): ``out`` itself, emptied
    again on a failure."""
    import shutil

    tmp = out if in_place else temp_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunError(f"--out {str(out)[:200]}: cannot create its folder "
                       f"({err.strerror or err})") from None
    existed = out.is_dir()
    try:
        # the mark first: a temp folder a kill leaves is then lowprec's (removed on --resume)
        tmp.mkdir(exist_ok=True)
        (tmp / EXPORT_MARK).write_text("lowprec export\n")
        yield tmp
        if not in_place:
            if out.is_dir():
                out.rmdir()  # empty (checked): the rename takes its place
            os.replace(tmp, out)
    except BaseException as err:
        if in_place and existed:
            for child in list(out.iterdir()) if out.is_dir() else []:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() \
                    else child.unlink()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error_in(err)
        if cause is not None and cause.errno not in _DISK_ERRNOS:  # the path, not the disk
            raise RunError(f"--out {str(out)[:200]}: cannot write there "
                           f"({cause.strerror or cause})") from None
        if cause is not None:
            raise io_error(out, "the export", cause) from None
        raise


#: the errors of a disk (exit code 1), not of the path a user named (2)
_DISK_ERRNOS = (None, errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind ``err`` (a writer library wraps a full disk in its own exception:
    MLflow's MlflowException, torch's RuntimeError), or None."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError):
            return err
        if isinstance(err, RuntimeError) and "write" in str(err).lower():
            return OSError(str(err))
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _check_out(out: Path) -> None:
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise RunError(f"--out {str(out)[:200]} already exists and is not an empty folder: "
                           "an export is written into a new or empty folder (remove it, or "
                           "choose another --out)")
    except OSError as err:
        raise RunError(f"--out {str(out)[:200]}: {err.strerror or err}") from None


# -- tables: csv and parquet -----------------------------------------------------------------

def _table(conn: sqlite3.Connection, table: str) -> tuple[list[str], list[str], list[tuple]]:
    """(column names, declared SQL types, rows) of one table, in a fixed order."""
    info = list(conn.execute(f"PRAGMA table_info({table})"))
    cols = [r[1] for r in info]
    types = [(r[2] or "").upper() for r in info]
    order = ", ".join(EXPORT_TABLES[table])
    rows = [tuple(r) for r in conn.execute(f"SELECT {', '.join(cols)} FROM {table} "
                                           f"ORDER BY {order}")]
    return cols, types, rows


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _to_csv(db: ResultsDB, out: Path, run_dir: Path) -> list[Path]:
    files = []
    for table in EXPORT_TABLES:
        cols, _, rows = _table(db.conn, table)
        path = out / f"{table}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(cols)
            w.writerows([_cell(v) for v in r] for r in rows)
        files.append(path)
    return files


def _to_parquet(db: ResultsDB, out: Path, run_dir: Path) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    kinds = {"INTEGER": pa.int64(), "REAL": pa.float64(), "TEXT": pa.string()}
    files = []
    for table in EXPORT_TABLES:
        cols, types, rows = _table(db.conn, table)
        schema = pa.schema([(c, kinds.get(t, pa.string())) for c, t in zip(cols, types)])
        arrays = [pa.array([r[i] for r in rows], type=schema.field(i).type)
                  for i in range(len(cols))]
        path = out / f"{table}.parquet"
        pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path)
        files.append(path)
    return files


# -- metrics: tensorboard and mlflow ---------------------------------------------------------

_EPOCH_METRICS = ("train_loss", "test_loss", "test_acc", "seconds", "cpu_seconds", "load",
                  "other_cpus", "skipped")
_MEMORY_ROLES = ("params", "grads", "optimizer_state", "master", "activations", "total")


def _metrics(db: ResultsDB, run: dict):
    """(group, name, value, step, unix time) of one run, None values left out."""
    run_id, t0 = run["run_id"], run["started"]
    for s in db.steps(run_id):
        for key in ("loss", "lr", "grad_norm"):
            if s[key] is not None:
                yield "step", key, s[key], s["step"], t0
    for t in db.trace(run_id):
        yield "step", "loss_scale", t["scale"], t["step"], t0
    for e in db.epochs(run_id):
        when = e.get("ended") or t0
        for key in _EPOCH_METRICS:
            if e.get(key) is not None:
                yield "epoch", key, e[key], e["epoch"], when
    mem = db.memory(run_id)
    for role in _MEMORY_ROLES if mem else ():
        yield "memory", role, mem[role], 0, t0
    for kind, payload in db.analyses_of(run_id, "certificate"):
        fmt = kind.split(":", 1)[1]
        for key in ("certified", "agreement"):
            v = (payload.get("summary") or {}).get(key)
            if v is not None:
                yield f"certificate/{fmt}", key, v, 0, t0


def _run_key(run_id: str) -> str:
    """A folder name for a run id ("16-true|seed=0" -> "16-true_seed_0")."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id).strip("_")


def _run_text(run: dict) -> str:
    keep = {k: run.get(k) for k in ("run_id", "policy", "policy_spec", "seed", "status",
                                    "backend", "diverged_step", "error", "git")}
    return json.dumps({**keep, "config": run["config"], "versions": run["versions"],
                       "hardware": run["hardware"]}, indent=2, sort_keys=True)


def _to_tensorboard(db: ResultsDB, out: Path, run_dir: Path) -> list[Path]:
    from torch.utils.tensorboard import SummaryWriter

    files = []
    for run in db.runs():
        folder = out / _run_key(run["run_id"])
        w = SummaryWriter(log_dir=str(folder))
        try:
            for group, name, value, step, when in _metrics(db, run):
                w.add_scalar(f"{group}/{name}", float(value), step, walltime=when)
            # four spaces: TensorBoard renders text as markdown, this keeps the JSON as code
            w.add_text("run", "    " + _run_text(run).replace("\n", "\n    "), 0,
                       walltime=run["started"])
        finally:
            w.close()
        files += [p for p in folder.iterdir() if p.is_file()]
    return files


@contextmanager
def _file_store_allowed():
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE is true: set it while
    lowprec writes one (the user's own setting is restored afterwards)."""
    had = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if had is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = had


_MLFLOW_STATUS = {"finished": "FINISHED", "diverged": "FAILED", "failed": "FAILED",
                  "running": "KILLED"}


def _to_mlflow(db: ResultsDB, out: Path, run_dir: Path) -> list[Path]:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    with _file_store_allowed():
        client = MlflowClient(tracking_uri=out.resolve().as_uri())
        name = f"lowprec:{run_dir.resolve().name}"
        experiment = client.create_experiment(name)
        for run in db.runs():
            tags = {"lowprec.run_id": run["run_id"], "policy": run["policy"],
                    "policy_spec": run["policy_spec"], "seed": str(run["seed"]),
                    "status": run["status"], "backend": run.get("backend") or "",
                    "git": run.get("git") or ""}
            if run.get("error"):
                tags["error"] = run["error"][:5000]
            mr = client.create_run(experiment, start_time=int(run["started"] * 1000),
                                   tags=tags, run_name=run["run_id"])
            rid = mr.info.run_id
            params = {k: json.dumps(v) if isinstance(v, (list, dict)) else str(v)
                      for k, v in run["config"].items()}
            params.update(policy=run["policy"], seed=str(run["seed"]))
            metrics = [Metric(f"{group.replace('/', '_')}_{key}", float(value),
                              int(when * 1000), int(step))
                       for group, key, value, step, when in _metrics(db, run)]
            plist = [Param(k, v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(plist), 100):  # MLflow's limits per batch
                client.log_batch(rid, params=plist[i:i + 100])
            for i in range(0, len(metrics), 1000):
                client.log_batch(rid, metrics=metrics[i:i + 1000])
            analyses = {kind: payload for kind, payload in db.conn.execute(
                "SELECT kind, payload FROM analysis WHERE run_id = ? ORDER BY kind",
                (run["run_id"],))}
            if analyses:
                client.log_dict(rid, {k: json.loads(v) for k, v in analyses.items()},
                                "analysis.json")
            client.set_tag(rid, "lowprec.config", json.dumps(run["config"], sort_keys=True)[:5000])
            client.set_terminated(rid, status=_MLFLOW_STATUS.get(run["status"], "FINISHED"),
                                  end_time=int((run.get("finished") or run["started"]) * 1000))
    return [p for p in out.rglob("*") if p.is_file()]
