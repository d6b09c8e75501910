"""The results database: SQLite in WAL mode in the run folder.

One row per run (configuration as JSON, policy, seed, library versions, git revision, hardware,
status running / finished / diverged / failed), per-epoch metrics (with the epoch's wall time,
the process's CPU time and the machine's load while it ran), per-step metrics (loss, learning
rate, gradient norm), the memory ledger, the loss-scale trace and analysis results. Every write is one transaction, so an interrupted
process leaves the database as of its last complete write. The report reads this database,
never live objects.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

from .runfolder import temp_path

__all__ = ["ResultsDB", "CorruptDatabase", "SCHEMA_VERSION", "RUN_STATUSES", "NOT_REQUESTED",
           "read_stored_config", "read_run_statuses", "read_stored_plans", "check_config",
           "is_blank"]

SCHEMA_VERSION = 2
RUN_STATUSES = ("running", "finished", "diverged", "failed")
#: The error of an interrupted run that a resumed comparison no longer asked for; its checkpoint
#: is kept, and a later comparison that asks for it again continues it.
NOT_REQUESTED = "interrupted, then not requested by a resumed comparison (checkpoint kept)"
_TABLES = {"meta", "runs", "epochs", "steps", "memory", "scale_trace", "analysis"}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    policy_spec TEXT NOT NULL,
    seed INTEGER NOT NULL,
    config TEXT NOT NULL,
    versions TEXT NOT NULL,
    git TEXT,
    hardware TEXT NOT NULL,
    backend TEXT,
    status TEXT NOT NULL CHECK (status IN ('running', 'finished', 'diverged', 'failed')),
    diverged_step INTEGER,
    error TEXT,
    started REAL NOT NULL,
    finished REAL
);
CREATE TABLE IF NOT EXISTS epochs (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    epoch INTEGER NOT NULL,
    train_loss REAL,
    test_loss REAL,
    test_acc REAL,
    seconds REAL NOT NULL,
    skipped INTEGER NOT NULL,
    nonfinite INTEGER NOT NULL,
    loss_scale REAL NOT NULL,
    cpu_seconds REAL,
    load REAL,
    other_cpus REAL,
    ended REAL,
    PRIMARY KEY (run_id, epoch)
);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    loss REAL,
    lr REAL,
    grad_norm REAL,
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS memory (
    run_id TEXT PRIMARY KEY REFERENCES runs(run_id),
    params INTEGER NOT NULL, grads INTEGER NOT NULL, optimizer_state INTEGER NOT NULL,
    master INTEGER NOT NULL, activations INTEGER NOT NULL, total INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS scale_trace (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step INTEGER NOT NULL,
    scale REAL NOT NULL,
    skipped INTEGER NOT NULL,
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS analysis (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    PRIMARY KEY (run_id, kind)
);
"""


#: what turns a database of an older schema version into the next one (each step additive: new
#: nullable columns and new tables, so every row stored before keeps its meaning; the columns a
#: version did not record read as NULL)
_MIGRATIONS = {
    # 1 -> 2: per-epoch CPU time, machine load and end time; per-step metrics
    1: ["ALTER TABLE epochs ADD COLUMN cpu_seconds REAL",
        "ALTER TABLE epochs ADD COLUMN load REAL",
        "ALTER TABLE epochs ADD COLUMN other_cpus REAL",
        "ALTER TABLE epochs ADD COLUMN ended REAL",
        "CREATE TABLE IF NOT EXISTS steps (run_id TEXT NOT NULL REFERENCES runs(run_id), "
        "step INTEGER NOT NULL, epoch INTEGER NOT NULL, loss REAL, lr REAL, grad_norm REAL, "
        "PRIMARY KEY (run_id, step))"],
}


class CorruptDatabase(Exception):
    """The file is not a readable lowprec results database (nothing was written to it)."""


#: the type SQLite must hold in each column a reader relies on (typeof(): 'integer', 'real',
#: 'text', 'null'); a value of another type is a damaged or foreign database
_COLUMN_TYPES = {
    "runs": {"run_id": ("text",), "policy": ("text",), "policy_spec": ("text",),
             "seed": ("integer",), "config": ("text",), "versions": ("text",),
             "git": ("text", "null"), "hardware": ("text",), "backend": ("text", "null"),
             "status": ("text",), "diverged_step": ("integer", "null"),
             "error": ("text", "null"), "started": ("real", "integer"),
             "finished": ("real", "integer", "null")},
    "epochs": {"run_id": ("text",), "epoch": ("integer",),
               **{k: ("real", "integer", "null") for k in ("train_loss", "test_loss",
                                                           "test_acc")},
               "seconds": ("real", "integer"), "skipped": ("integer",),
               "nonfinite": ("integer",), "loss_scale": ("real", "integer"),
               **{k: ("real", "integer", "null") for k in ("cpu_seconds", "load",
                                                           "other_cpus", "ended")}},
    "steps": {"run_id": ("text",), "step": ("integer",), "epoch": ("integer",),
              **{k: ("real", "integer", "null") for k in ("loss", "lr", "grad_norm")}},
    "memory": {"run_id": ("text",), **{k: ("integer",) for k in (
        "params", "grads", "optimizer_state", "master", "activations", "total")}},
    "scale_trace": {"run_id": ("text",), "step": ("integer",), "scale": ("real", "integer"),
                    "skipped": ("integer",)},
    "analysis": {"run_id": ("text",), "kind": ("text",), "payload": ("text",)},
}
#: the stored configuration's fields and their JSON types (older folders may lack some)
_CONFIG_TYPES = {"data": (str,), "model": (str,), "policies": (list,), "seeds": (list,),
                 "epochs": (int,), "batch_size": (int,), "lr": (int, float),
                 "optimizer": (str,), "momentum": (int, float), "weight_decay": (int, float),
                 "out": (str,), "train_subset": (int, type(None)), "schedule": (str,),
                 "threads": (int, type(None)), "compile": (bool,)}


def check_config(path, cfg) -> dict:
    """A stored configuration as a reader needs it (a JSON object whose known fields have their
    types), else CorruptDatabase naming the field."""
    if not isinstance(cfg, dict):
        raise CorruptDatabase(f"{path}: the stored configuration is not a JSON object; the "
                              "file was left untouched")
    for key, value in cfg.items():
        types = _CONFIG_TYPES.get(key)
        bad = types is not None and (not isinstance(value, types) or
                                     isinstance(value, bool) and bool not in types)
        if key == "policies" and not bad:
            bad = not all(isinstance(p, str) for p in value)
        if key == "seeds" and not bad:
            bad = not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if bad:
            raise CorruptDatabase(f"{path}: the stored configuration's {key!r} is "
                                  f"{str(value)[:60]!r}, not a {types[0].__name__}; the file "
                                  "was left untouched")
    return cfg


def _create_schema(path: Path) -> None:
    """Create a complete, empty database at ``path`` or nothing: the schema is written to a
    temp file beside it and renamed into place, so a full disk, a signal or a kill while it is
    created never leaves a results.db without its tables."""
    tmp = temp_path(path)
    try:
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute("BEGIN")
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    conn.execute(stmt)
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        finally:
            conn.close()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
        raise


def is_blank(path: Path) -> bool:
    """A results.db that holds no table at all (left by an earlier version interrupted while
    creating it): nothing to lose, so it is created anew."""
    try:
        if path.stat().st_size == 0:
            return True
        conn = _connect_read_only(Path(path))
        try:
            return conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
        finally:
            conn.close()
    except (OSError, sqlite3.Error, CorruptDatabase):
        return False


class ResultsDB:
    def __init__(self, path: str | Path, *, create: bool = True, readonly: bool = False) -> None:
        """Open (``create``: or create) the results database at ``path``. ``readonly``: a copy
        in memory, read without writing anything to the run folder (a read-only folder can be
        exported; an older schema is upgraded in the copy only)."""
        self.path = Path(path)
        if (not create or readonly) and not self.path.exists():
            raise FileNotFoundError(f"no results database at {self.path}")
        try:
            if readonly:
                self.conn = self._memory_copy()
            else:
                if create and (not self.path.exists() or is_blank(self.path)):
                    _create_schema(self.path)
                self.conn = sqlite3.connect(str(self.path), timeout=30, isolation_level=None)
            self.conn.row_factory = sqlite3.Row
            ok = self.conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(ok)
            tables = {r[0] for r in self.conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                raise sqlite3.DatabaseError("empty database (no tables)")
            if "runs" not in tables:
                raise sqlite3.DatabaseError("not a lowprec results database")
            if "meta" in tables:
                tables = self._migrate(tables)
                self._check_version()
            if not _TABLES <= tables:
                missing = ", ".join(sorted(_TABLES - tables))
                raise sqlite3.DatabaseError(f"table(s) {missing} missing")
            self._check()
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.OperationalError as err:
            self._close_quietly()
            if "full" in str(err) or "disk" in str(err) or "I/O" in str(err):
                raise  # the disk, not the file: the caller reports it as an I/O error
            raise CorruptDatabase(f"{self.path}: {err}; the file was left untouched") from None
        except sqlite3.DatabaseError as err:
            self._close_quietly()
            raise CorruptDatabase(f"{self.path}: {err}; the file was left untouched") from None
        except CorruptDatabase:
            self._close_quietly()
            raise

    def _memory_copy(self) -> sqlite3.Connection:
        source = _connect_read_only(self.path)
        try:
            conn = sqlite3.connect(":memory:", isolation_level=None)
            source.backup(conn)
        finally:
            source.close()
        return conn

    def _close_quietly(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()

    def _migrate(self, tables: set[str]) -> set[str]:
        """Bring a database of an older schema version (written by an earlier lowprec) to this
        one: the additions of ``_MIGRATIONS`` and the new version number, then :meth:`_check`,
        all in one transaction, so a database the check refuses is rolled back, untouched. A
        version this lowprec does not know (newer, or not a number) is left to :meth:`_check`
        to refuse. Returns the tables after the migration."""
        r = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        text = None if r is None else str(r[0])
        version = int(text) if text is not None and text.isascii() and text.isdigit() else None
        old = {"meta", "runs", "epochs", "memory", "scale_trace", "analysis"}
        if version not in _MIGRATIONS or not old <= tables:
            return tables  # nothing to do, or damaged: __init__ and _check name the problem
        try:
            with self.transaction() as c:
                while version in _MIGRATIONS:
                    for stmt in _MIGRATIONS[version]:
                        c.execute(stmt)
                    version += 1
                c.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                          (str(version),))
                self._check()  # CorruptDatabase rolls the migration back
        except sqlite3.OperationalError as err:
            if "full" in str(err) or "disk" in str(err) or "I/O" in str(err):
                raise
            raise CorruptDatabase(f"{self.path}: schema version {text} could not be upgraded "
                                  f"to {SCHEMA_VERSION} ({err}); the file was left untouched"
                                  ) from None
        return {row[0] for row in self.conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}

    def _check_version(self) -> None:
        r = self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = None if r is None else r[0]
        if version != str(SCHEMA_VERSION):
            older = ", ".join(str(v) for v in sorted(_MIGRATIONS))
            raise CorruptDatabase(f"{self.path}: schema version {str(version)[:40]!r}, this "
                                  f"lowprec reads version {SCHEMA_VERSION} (and upgrades "
                                  f"{older}); the file was left untouched")

    def _check(self) -> None:
        """The schema version is this lowprec's, every column holds its type and the stored
        configuration is a JSON object of the known fields' types: a damaged or foreign file is
        refused in one line before anything reads (or writes) it."""
        self._check_version()
        for table, columns in _COLUMN_TYPES.items():
            for col, types in columns.items():
                allowed = ", ".join(f"'{t}'" for t in types)
                bad = self.conn.execute(
                    f"SELECT typeof({col}), {col} FROM {table} WHERE typeof({col}) NOT IN "
                    f"({allowed}) LIMIT 1").fetchone()
                if bad is not None:
                    raise CorruptDatabase(
                        f"{self.path}: column {table}.{col} holds {str(bad[1])[:40]!r} "
                        f"({bad[0]}), not {' or '.join(types)}; the file was left untouched")
        bad = self.conn.execute("SELECT status FROM runs WHERE status NOT IN "
                                f"({', '.join(repr(s) for s in RUN_STATUSES)}) LIMIT 1"
                                ).fetchone()
        if bad is not None:
            raise CorruptDatabase(f"{self.path}: a run has status {str(bad[0])[:40]!r}; the "
                                  "file was left untouched")
        for key in ("config", "forced_config"):
            r = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            if r is not None:
                value = _loads(self.path, r[0])
                if key == "config":
                    check_config(self.path, value)
                elif not isinstance(value, list):
                    raise CorruptDatabase(f"{self.path}: the stored forced_config is not a "
                                          "JSON list; the file was left untouched")
        for (text,) in self.conn.execute("SELECT config FROM runs"):
            check_config(self.path, _loads(self.path, text))
        for col in ("versions", "hardware"):
            for (text,) in self.conn.execute(f"SELECT {col} FROM runs"):
                if not isinstance(_loads(self.path, text), dict):
                    raise CorruptDatabase(f"{self.path}: a run's stored {col} is not a JSON "
                                          "object; the file was left untouched")

    @contextmanager
    def transaction(self):
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    # -- writes ------------------------------------------------------------------------------
    def start_run(self, run_id: str, *, policy: str, policy_spec: str, seed: int, config: dict,
                  versions: dict, git: str | None, hardware: dict) -> None:
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO runs (run_id, policy, policy_spec, seed, config, "
                      "versions, git, hardware, status, started) VALUES (?,?,?,?,?,?,?,?,?,?)",
                      (run_id, policy, policy_spec, seed, json.dumps(config, sort_keys=True),
                       json.dumps(versions, sort_keys=True), git,
                       json.dumps(hardware, sort_keys=True), "running", time.time()))
            for table in ("epochs", "steps", "memory", "scale_trace", "analysis"):
                c.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))

    def set_backend(self, run_id: str, backend: str) -> None:
        with self.transaction() as c:
            c.execute("UPDATE runs SET backend = ? WHERE run_id = ?", (backend, run_id))

    def record_memory(self, run_id: str, ledger) -> None:
        d = ledger.as_dict()
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO memory VALUES (?,?,?,?,?,?,?)",
                      (run_id, d["params"], d["grads"], d["optimizer_state"], d["master"],
                       d["activations"], d["total"]))

    def record_epoch(self, run_id: str, epoch: int, *, train_loss, test_loss, test_acc,
                     seconds: float, skipped: int, nonfinite: int, loss_scale: float,
                     trace: list[dict], steps: list[dict] = (), cpu_seconds=None, load=None,
                     other_cpus=None, ended=None) -> None:
        """One epoch's row, its steps (``{"step", "loss", "lr", "grad_norm"}``) and its part of
        the loss-scale trace, in one transaction. ``seconds`` is wall time, ``cpu_seconds`` the
        training process's CPU time over the same span, ``load`` the machine's 1-minute load
        average and ``other_cpus`` the cores other processes kept busy meanwhile
        (:mod:`lowprec.experiments.timing`); ``ended`` the epoch's end (Unix time). Records of an
        older lowprec (replayed from its checkpoints) lack the last five: stored as NULL."""
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO epochs (run_id, epoch, train_loss, test_loss, "
                      "test_acc, seconds, skipped, nonfinite, loss_scale, cpu_seconds, load, "
                      "other_cpus, ended) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                      (run_id, epoch, _num(train_loss), _num(test_loss), _num(test_acc), seconds,
                       skipped, nonfinite, loss_scale, _num(cpu_seconds), _num(load),
                       _num(other_cpus), _num(ended)))
            c.executemany("INSERT OR REPLACE INTO scale_trace VALUES (?,?,?,?)",
                          [(run_id, t["step"], t["scale"], int(t["skipped"])) for t in trace])
            c.executemany("INSERT OR REPLACE INTO steps VALUES (?,?,?,?,?,?)",
                          [(run_id, s["step"], epoch, _num(s["loss"]), _num(s["lr"]),
                            _num(s["grad_norm"])) for s in steps])

    def truncate(self, run_id: str, *, last_epoch: int, last_step: int) -> None:
        """Forget what a run recorded after its last checkpoint (it will be redone)."""
        with self.transaction() as c:
            c.execute("DELETE FROM epochs WHERE run_id = ? AND epoch > ?", (run_id, last_epoch))
            c.execute("DELETE FROM scale_trace WHERE run_id = ? AND step > ?", (run_id, last_step))
            c.execute("DELETE FROM steps WHERE run_id = ? AND step > ?", (run_id, last_step))
            c.execute("UPDATE runs SET status = 'running', diverged_step = NULL, error = NULL, "
                      "finished = NULL WHERE run_id = ?", (run_id,))

    def finish_run(self, run_id: str, status: str, *, diverged_step: int | None = None,
                   error: str | None = None) -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"status={status!r}; accepted: {', '.join(RUN_STATUSES)}")
        with self.transaction() as c:
            c.execute("UPDATE runs SET status = ?, diverged_step = ?, error = ?, finished = ? "
                      "WHERE run_id = ?", (status, diverged_step, error, time.time(), run_id))

    def record_analysis(self, run_id: str, kind: str, payload: dict) -> None:
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO analysis VALUES (?,?,?)",
                      (run_id, kind, json.dumps(payload)))

    def set_meta(self, key: str, value) -> None:
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                      (key, json.dumps(value, sort_keys=True)))

    # -- reads -------------------------------------------------------------------------------
    def meta(self, key: str):
        r = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return _loads(self.path, r[0]) if r else None

    def stored_config(self) -> dict | None:
        """The comparison's configuration: as recorded in meta, else (older folders) the
        first run's."""
        cfg = self.meta("config")
        if cfg is None:
            r = self.conn.execute("SELECT config FROM runs ORDER BY started LIMIT 1").fetchone()
            cfg = _loads(self.path, r[0]) if r else None
        return None if cfg is None else check_config(self.path, cfg)

    def run(self, run_id: str) -> dict | None:
        r = self.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return _decode(r) if r else None

    def runs(self) -> list[dict]:
        return [_decode(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY started")]

    def epochs(self, run_id: str) -> list[dict]:
        return [dict(r) for r in self.conn.execute(
            "SELECT * FROM epochs WHERE run_id = ? ORDER BY epoch", (run_id,))]

    def steps(self, run_id: str) -> list[dict]:
        """Per optimizer step: step, epoch, loss, lr, grad_norm (None where not finite)."""
        return [dict(r) for r in self.conn.execute(
            "SELECT step, epoch, loss, lr, grad_norm FROM steps WHERE run_id = ? ORDER BY step",
            (run_id,))]

    def memory(self, run_id: str) -> dict | None:
        r = self.conn.execute("SELECT * FROM memory WHERE run_id = ?", (run_id,)).fetchone()
        return dict(r) if r else None

    def trace(self, run_id: str) -> list[dict]:
        return [dict(r) for r in self.conn.execute(
            "SELECT step, scale, skipped FROM scale_trace WHERE run_id = ? ORDER BY step",
            (run_id,))]

    def analysis(self, run_id: str, kind: str) -> dict | None:
        r = self.conn.execute("SELECT payload FROM analysis WHERE run_id = ? AND kind = ?",
                              (run_id, kind)).fetchone()
        return _loads(self.path, r[0]) if r else None

    def analyses_of(self, run_id: str, prefix: str) -> list[tuple[str, dict]]:
        """(kind, payload) of a run's analyses whose kind starts with ``prefix:``."""
        out = []
        for kind, payload in self.conn.execute(
                "SELECT kind, payload FROM analysis WHERE run_id = ? AND kind LIKE ?",
                (run_id, f"{prefix}:%")):
            value = _loads(self.path, payload)
            if not isinstance(value, dict):
                raise CorruptDatabase(f"{self.path}: analysis {kind!r} of {run_id!r} is not a "
                                      "JSON object; the file was left untouched")
            out.append((kind, value))
        return out

    def analyses(self, kind: str) -> dict[str, dict]:
        return {r[0]: _loads(self.path, r[1]) for r in self.conn.execute(
            "SELECT run_id, payload FROM analysis WHERE kind = ?", (kind,))}


def _num(v):
    """NaN/Inf are stored as NULL (SQLite has no NaN) and read back as None."""
    if v is None:
        return None
    v = float(v)
    return v if v == v and abs(v) != float("inf") else None


def _loads(path, text: str):
    try:
        return json.loads(text)
    except (TypeError, ValueError) as err:
        raise CorruptDatabase(f"{path}: a stored JSON value is damaged ({err}); the file was "
                              "left untouched") from None


def _decode(row) -> dict:
    d = dict(row)
    for key in ("config", "versions", "hardware"):
        if d.get(key):
            d[key] = _loads("results.db", d[key])
    return d


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that writes nothing, not even SQLite's companions: a read-only open of a
    WAL database creates ``-wal`` and ``-shm`` files when they are absent; with no ``-wal``
    file every committed transaction is in the database itself, which is then opened as
    immutable (the caller holds the run folder's lock, or only reads)."""
    wal = path.with_name(path.name + "-wal")
    mode = "ro" if wal.exists() else "ro&immutable=1"
    try:
        return sqlite3.connect(f"file:{path}?mode={mode}", uri=True, timeout=30)
    except sqlite3.Error as err:
        raise CorruptDatabase(f"{path}: {err}; the file was left untouched") from None


def read_stored_config(path: str | Path) -> dict | None:
    """The stored configuration of a results database, read without writing to it (None when
    there is none yet); CorruptDatabase when it cannot be read."""
    path = Path(path)
    if is_blank(path):
        return None
    conn = _connect_read_only(path)
    try:
        try:
            r = conn.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
            if r is None:
                r = conn.execute("SELECT config FROM runs ORDER BY started LIMIT 1").fetchone()
        except sqlite3.DatabaseError as err:
            raise CorruptDatabase(f"{path}: {err}; the file was left untouched") from None
        return check_config(path, _loads(path, r[0])) if r else None
    finally:
        conn.close()


def _read_rows(path: Path, sql: str) -> list:
    """The rows of ``sql`` on the results database ``path``, read without writing to it (none
    for a blank file); CorruptDatabase when it cannot be read."""
    if is_blank(path):
        return []
    conn = _connect_read_only(path)
    try:
        return conn.execute(sql).fetchall()
    except sqlite3.DatabaseError as err:
        raise CorruptDatabase(f"{path}: {err}; the file was left untouched") from None
    finally:
        conn.close()


def read_stored_plans(path: str | Path) -> dict[str, dict]:
    """policy (``plan:FILE`` as given) -> the plan its runs read when they started (the first
    run's; every run of a comparison reads the same file), read without writing; CorruptDatabase
    when it cannot be read."""
    plans: dict[str, dict] = {}
    for policy, payload in _read_rows(Path(path), "SELECT r.policy, a.payload FROM analysis a "
                                      "JOIN runs r ON a.run_id = r.run_id WHERE a.kind = "
                                      "'plan' ORDER BY r.started"):
        plans.setdefault(policy, json.loads(payload))
    return plans


def read_run_statuses(path: str | Path) -> dict[str, str]:
    """run id -> status of a results database, read without writing to it; CorruptDatabase
    when it cannot be read."""
    return dict(_read_rows(Path(path), "SELECT run_id, status FROM runs"))
