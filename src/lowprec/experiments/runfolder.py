"""The run folder's contract: one writer at a time, atomic files, no temp file left behind.

- :class:`FolderLock` holds an exclusive ``fcntl.flock`` on ``RUN/.lock`` for the whole command.
  The kernel drops the lock when the process dies (even by SIGKILL), so a stale lock never
  blocks a resume; a second process on the same folder fails at once, naming the holder's PID.
- :func:`atomic_write_bytes` / :func:`atomic_torch_save` write ``NAME.tmpPID`` and rename it
  over ``NAME`` (POSIX ``rename`` is atomic): a reader sees the old or the new file, never half.
  On any failure, a full disk included, the temp file is removed and :class:`RunIOError` names
  the path and what was being written.
- :func:`remove_stale_temps` deletes the ``*.tmpPID`` files a killed process left (only while
  holding the lock, so no live writer owns them).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

__all__ = ["FolderLock", "FolderBusy", "RunIOError", "atomic_write_bytes", "atomic_torch_save",
           "remove_stale_temps", "io_error"]

LOCK_NAME = ".lock"
_TEMP_RE = re.compile(r"\.tmp\d+$")


class FolderBusy(Exception):
    """Another live process holds the run folder's lock (a user situation: exit code 2)."""


class RunIOError(Exception):
    """Writing to the run folder failed (disk full, permissions, I/O): exit code 1."""


def io_error(path, what: str, err: BaseException) -> RunIOError:
    """One line: what was being written, where, and the OS's reason."""
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return RunIOError(f"could not write {what} to {path}: {reason}")


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
                who = f"process {holder}" if holder else "another process"
                raise FolderBusy(f"{self.path.parent} is in use by {who}; wait for it to "
                                 "finish or stop it, or choose another --out") from None
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


def _temp_path(path: Path) -> Path:
    return path.with_name(path.name + f".tmp{os.getpid()}")


def _replace_from_temp(path: Path, what: str, write) -> None:
    tmp = _temp_path(path)
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
    """Delete ``*.tmpPID`` files under ``folder`` (call only while holding the folder's lock)."""
    removed = []
    for p in Path(folder).rglob("*.tmp*"):
        if _TEMP_RE.search(p.name) and p.is_file():
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed
