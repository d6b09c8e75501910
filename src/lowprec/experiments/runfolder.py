"""The run folder's contract: one writer at a time, atomic files, no temp file left behind.

- :class:`FolderLock` holds an exclusive ``fcntl.flock`` on ``RUN/.lock`` for the whole command.
  The kernel drops the lock when the process dies (even by SIGKILL), so a stale lock never
  blocks a resume; a second process on the same folder fails at once, naming the holder's PID.
- :func:`atomic_write_bytes` / :func:`atomic_torch_save` write ``.NAME.lowprec-tmpPID`` beside
  ``NAME`` and rename it over ``NAME`` (POSIX ``rename`` is atomic): a reader sees the old or the
  new file, never half. On any failure, a full disk included, the temp file is removed and
  :class:`RunIOError` names the path and what was being written.
- :func:`remove_stale_temps` deletes the temp files a killed lowprec process left, and nothing
  else: only names of that one pattern whose PID is this process's or no live process's (the
  writer is provably gone), only in a folder that is already a run folder (it holds the lock
  file or results.db) and its own sub-folders (not recursively), only while holding the lock.
  A name that merely looks temporary (``model.pt.tmp3``, a live PID) is a user's file: kept,
  and it makes the folder foreign.
- :func:`foreign_entry` tells whether a folder holds anything but a run of lowprec's: a run folder
  is created empty, or continued, never shared with a user's files (``--out /`` or ``--out /etc``
  is refused, naming the first file found, before anything is written there).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path

__all__ = ["FolderLock", "FolderBusy", "busy_writer", "RunIOError", "atomic_write_bytes",
           "atomic_torch_save",
           "remove_stale_temps", "io_error", "foreign_entry", "temp_path", "RUN_FILES",
           "RUN_SUBFOLDERS", "MODELS_FOLDER_FILES", "SHARED_TOKEN", "EXPORT_FOLDER",
           "CONFIG_FILE", "MODELS_FILE", "WRITE_PROBE", "EXPORT_MARK", "read_models_list", "enclosing_run",
           "holds_results"]

LOCK_NAME = ".lock"
#: written by the Ray driver for its tasks to prove they see the run folder
SHARED_TOKEN = ".lowprec-shared-token"
#: the files of a run folder (``results.db`` and SQLite's companions, the reports)
RUN_FILES = frozenset({LOCK_NAME, "results.db", "results.db-wal", "results.db-shm",
                       "results.db-journal", "report.md", "report.html", SHARED_TOKEN,
                       "run.toml"})
#: its sub-folders, with the suffixes of the files lowprec writes there
RUN_SUBFOLDERS = {"checkpoints": (".pt", ".killed"), "report_files": (".png",)}
#: where ``lowprec export`` writes by default (RUN/export/FORMAT: csv, parquet, TensorBoard
#: event files, an MLflow store; lowprec's own output, whatever its inner layout)
EXPORT_FOLDER = "export"
#: the --config file a comparison was started with, as given (recorded in the run folder)
CONFIG_FILE = "run.toml"
#: the list of models of a comparison over several architectures (lowprec.experiments.multi)
MODELS_FILE = "models.json"
#: the file that marks a folder as an export of lowprec's: one written inside a run folder
#: (``lowprec export RUN --out RUN/mine``) is lowprec's own output, not a user's folder
EXPORT_MARK = ".lowprec-export"
#: the name of the file written (and removed) to check that a new run folder is writable
WRITE_PROBE = "write-test"
#: the files of a comparison over several models (each model's run folder is a sub-folder)
MODELS_FOLDER_FILES = frozenset({LOCK_NAME, MODELS_FILE, "report.md", "report.html",
                                 "run.toml"})
# ".NAME.lowprec-tmpPID@HOST": this module's temp files, the writer's PID and host in the name
# (a Ray task on another node writes checkpoints into the shared run folder); "-journal": the
# rollback journal SQLite keeps beside a database being created; no "@HOST": earlier versions'
_TEMP_RE = re.compile(r"^\..+\.lowprec-tmp([1-9]\d{0,9})(?:@([A-Za-z0-9._-]{1,64}))?(?:-journal)?$",
                      re.ASCII)


def _host() -> str:
    """This machine's name as temp names carry it (letters, digits, '.', '_', '-')."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "localhost")
    return name[:64] or "localhost"


def _pid_gone(pid: int) -> bool:
    """True when no process has this PID (a signal-0 probe: nothing is sent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, OSError):
        return False  # alive under another user, or not a PID at all
    return False


def _is_temp(name: str) -> bool:
    """A temp file (or an export's temp folder) of this process, of a lowprec process of this
    machine that is no longer alive, or of another machine (a Ray task's: called only while
    holding the folder's lock, when no task of this folder runs): the only entries lowprec may
    delete without having been asked to."""
    m = _TEMP_RE.match(name)
    if not m:
        return False
    pid, host = int(m.group(1)), m.group(2)
    if host is not None and host != _host():
        return True
    return pid == os.getpid() or _pid_gone(pid)


def holds_results(folder: Path) -> bool:
    """Whether the run folder ``folder`` holds a comparison's results (its database, or the
    list of models of a comparison over several): what ``--resume`` continues."""
    return any(os.path.isfile(Path(folder) / n) for n in ("results.db", MODELS_FILE))


def _is_run_folder(folder: Path) -> bool:
    """The folder already holds a run of lowprec's (its lock file, or its results): only there
    are leftover temp files taken for a killed run's."""
    return os.path.isfile(folder / LOCK_NAME) or holds_results(folder)


def _is_temp_entry(entry: os.DirEntry) -> bool:
    """A leftover temp entry: a file, or an export's temp folder (it holds the export mark)."""
    if not _is_temp(entry.name):
        return False
    if entry.is_file(follow_symlinks=False):
        return True
    return entry.is_dir(follow_symlinks=False) and \
        os.path.isfile(os.path.join(entry.path, EXPORT_MARK))


def _is_probe(name: str) -> bool:
    """The write probe a killed ``lowprec`` left before it took the lock (its writer gone)."""
    return name.startswith(f".{WRITE_PROBE}.") and _is_temp(name)


class FolderBusy(Exception):
    """Another live process holds the run folder's lock (a user situation: exit code 2)."""


class RunIOError(Exception):
    """Writing to the run folder failed (disk full, permissions, I/O): exit code 1."""


def io_error(path, what: str, err: BaseException) -> RunIOError:
    """One line: what was being written, where, and the OS's reason."""
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return RunIOError(f"could not write {what} to {path}: {reason}")


def _busy_message(folder: Path, holder: str) -> str:
    who = f"process {holder}" if holder else "another process"
    return f"{folder} is in use by {who}; wait for it to finish or stop it, or choose another --out"


def busy_writer(folder: Path, entry: str) -> FolderBusy | None:
    """FolderBusy when ``entry`` (a path in ``folder``) is a temp file of a live lowprec process
    of this machine that the folder's lock note names as its holder: a second command met the
    holder's half-written file (read only: the lock itself is not probed, which could make the
    holder's own start fail)."""
    name = Path(entry).name
    m = _TEMP_RE.match(name)
    if not m or _is_temp(name):  # not lowprec's, or its writer gone, elsewhere or this one
        return None
    pid = int(m.group(1))
    try:
        note = (Path(folder) / LOCK_NAME).read_text("ascii", "replace")[:200].strip()
    except OSError:
        return None
    return FolderBusy(_busy_message(Path(folder), note)) if note.split(" ", 1)[0] == str(pid) \
        else None


class FolderLock:
    """Exclusive lock on a run folder for the life of a command (``with FolderLock(out):``)."""

    def __init__(self, folder: Path, command: str = "lowprec") -> None:
        self.path = Path(folder) / LOCK_NAME
        self.command = command
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise io_error(self.path, "the lock file", err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = ""
            try:
                holder = os.pread(fd, 200, 0).decode("ascii", "replace").strip()
            except OSError:
                pass
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderBusy(_busy_message(self.path.parent, holder)) from None
            raise io_error(self.path, "the lock", err) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} ({self.command})\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the note (a full disk must not stop a resume)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None

    def __enter__(self) -> "FolderLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def temp_path(path: Path) -> Path:
    """This process's temp file for ``path``: hidden, beside it, named as no user file is."""
    return path.with_name(f".{path.name}.lowprec-tmp{os.getpid()}@{_host()}")


def _replace_from_temp(path: Path, what: str, write) -> None:
    tmp = temp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        if isinstance(err, OSError):
            raise io_error(path, what, err) from None
        if isinstance(err, RuntimeError) and "write" in str(err).lower():
            # torch.save reports a failed write (ENOSPC...) as a RuntimeError from its writer
            raise io_error(path, what, err) from None
        raise


def atomic_write_bytes(path: Path, data: bytes, what: str = "a file") -> None:
    """Write ``data`` to ``path`` through a temp file and a rename."""
    _replace_from_temp(Path(path), what, lambda tmp: tmp.write_bytes(data))


def atomic_torch_save(obj, path: Path, what: str = "a checkpoint") -> None:
    """``torch.save`` through a temp file and a rename."""
    import torch

    _replace_from_temp(Path(path), what, lambda tmp: torch.save(obj, tmp))


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temp files killed lowprec processes left in ``folder`` and its own
    sub-folders (call only while holding the folder's lock). Nothing else is touched: no other
    name, no other folder, no recursion into what lowprec did not create."""
    folder = Path(folder)
    removed: list[Path] = []
    ours = _is_run_folder(folder)
    for where in [folder, *(folder / sub for sub in RUN_SUBFOLDERS)]:
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        for e in entries:
            if _is_probe(e.name) if not ours else _is_temp_entry(e):
                try:
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path)
                    else:
                        os.unlink(e.path)
                    removed.append(Path(e.path))
                except OSError:
                    pass
    return removed


def foreign_entry(folder: Path, *, models: bool = False, model_names=()) -> str | None:
    """The first entry of ``folder`` that lowprec did not write there (a path relative to it),
    or None when the folder is absent, empty or holds only a run of lowprec's.

    ``models``: the folder of a comparison over several models, whose sub-folders named in
    ``model_names`` (or listed in its models.json) are run folders themselves."""
    folder = Path(folder)
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        # absent (a file on the way there is mkdir's error to report), or a file itself
        return "." if folder.is_file() or folder.is_symlink() else None
    ours = _is_run_folder(folder)  # temp files count as lowprec's only in its own run folder
    for e in entries:
        name = e.name
        if (_is_probe(name) and e.is_file(follow_symlinks=False)) or (ours and _is_temp_entry(e)):
            continue
        if e.is_symlink():
            return name
        if e.is_dir() and (name == EXPORT_FOLDER or os.path.isfile(Path(e.path) / EXPORT_MARK)):
            continue
        if models:
            if name in MODELS_FOLDER_FILES and e.is_file():
                continue
            if name in model_names and e.is_dir():
                inner = foreign_entry(Path(e.path))
                if inner is None:
                    continue
                return f"{name}/{inner}"
            return name
        if name in RUN_FILES and e.is_file():
            continue
        if name in RUN_SUBFOLDERS and e.is_dir():
            suffixes = RUN_SUBFOLDERS[name]
            try:
                inner = sorted(os.scandir(e.path), key=lambda x: x.name)
            except OSError:
                return name
            for f in inner:
                if not ((ours and _is_temp_entry(f)) or (f.name.endswith(suffixes)
                                             and f.is_file(follow_symlinks=False))):
                    return f"{name}/{f.name}"
            continue
        return name
    return None


def read_models_list(folder: Path) -> list[str]:
    """The models of a comparison over several models, from ``FOLDER/models.json``;
    ValueError naming the file when it is damaged (it is left as it is)."""
    path = Path(folder) / MODELS_FILE
    try:
        models = json.loads(path.read_text())["models"]
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path} is damaged ({type(err).__name__}: {err}); expected "
                         '{"models": ["NAME", ...]}; the file was left untouched') from None
    if not isinstance(models, list) or not models or \
            not all(isinstance(m, str) and m and "/" not in m and m not in (".", "..")
                    for m in models):
        raise ValueError(f"{path} is damaged: models={str(models)[:100]!r} is not a list of "
                         "model names; the file was left untouched")
    return models


def enclosing_run(folder: Path) -> Path | None:
    """The run folder that ``folder`` would lie inside (an ancestor holding results.db), or
    None: a run written into another's ``checkpoints/`` or beside its files would make that
    run's folder foreign to its own ``--resume``."""
    try:
        here = Path(folder).resolve()
    except (OSError, RuntimeError):
        return None
    if (here / "results.db").is_file():
        return None  # a run folder already (resumed): where it lies was accepted when made
    for parent in here.parents:
        # lowprec's own run folder: its results database beside its lock file (a user's
        # results.db alone is not one)
        if (parent / "results.db").is_file() and (parent / LOCK_NAME).is_file():
            return parent
    return None
