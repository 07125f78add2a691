"""The lock of a run folder: one writing run at a time.

The run that writes a folder holds an exclusive ``flock`` on ``<folder>/.lock`` for its whole life
(the file holds the holder's pid and host); the operating system drops the lock when the process
dies, however it dies, so a lock is never stale. A second ``neorec train`` on the folder is refused
with one line naming the folder and the holder's pid, before any heavy work.

Who holds it: the process that chose the folder (``neorec train``; the ``--nproc`` launcher for
its ranks, which take the folder from ``NEOREC_RUN_DIR``; rank 0 of a torchrun job without one).
Within one process the lock is re-entrant: sequential runs of the API on one folder are one
writer. The file stays in the folder (removing it on release would let two runs lock two files).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from neorec.errors import NeorecError

__all__ = [
    "LOCK_FILE",
    "RunFolderError",
    "acquire",
    "release",
    "held",
    "holder",
    "locked_by",
    "held_for_us",
]

LOCK_FILE = ".lock"
_HELD: dict[str, int] = {}
"""This process's locks: resolved folder path -> the locked file's descriptor."""


class RunFolderError(NeorecError):
    """A run folder that cannot be used (no run to resume, a file where a folder should be, a
    folder another run is writing)."""


def _key(path: Path) -> str:
    return str(Path(path).resolve())


def holder(path: Path) -> str:
    """Who wrote ``path``'s lock file last (``pid N on host H``), as far as it says."""
    try:
        words = (Path(path) / LOCK_FILE).read_text().split()
    except OSError:
        words = []
    if not words or not words[0].isdigit():
        return "pid unknown"
    return f"pid {words[0]}" + (f" on host {words[1]}" if len(words) > 1 else "")


def acquire(path: Path) -> None:
    """Lock the (existing) folder ``path`` for this process, or raise ``RunFolderError`` naming
    the folder and the holder's pid."""
    key = _key(path)
    if key in _HELD:
        return
    lock = Path(path) / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RunFolderError(
            f"run folder {path}: cannot create its lock file {LOCK_FILE}: {e.strerror or e}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunFolderError(
                f"run folder {path} is being written by another run ({holder(path)}); wait for "
                "it to end, or give this run its own folder (train.name or train.run_dir)"
            ) from None
        raise RunFolderError(
            f"run folder {path}: cannot lock {lock} ({e.strerror or e}); the run folder must be "
            "on a filesystem with file locks"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    except OSError:
        pass  # the lock holds without the note (a full disk): the error then says pid unknown
    _HELD[key] = fd


def release(path: Path) -> None:
    """Drop this process's lock of ``path`` (none held: nothing happens)."""
    fd = _HELD.pop(_key(path), None)
    if fd is not None:
        os.close(fd)


def held(path: Path) -> bool:
    """Whether this process holds the lock of ``path``."""
    return _key(path) in _HELD


def _locked_by_other(path: Path) -> bool:
    """Whether some other open file holds the lock of ``path`` now (a probe, released at once)."""
    try:
        fd = os.open(Path(path) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def locked_by(path: Path) -> str | None:
    """``pid N on host H`` of the live run that holds ``path``'s lock, None when none does."""
    return holder(path) if held(path) or _locked_by_other(path) else None


def held_for_us(path: Path) -> bool:
    """Whether this run owns ``path``: this process holds its lock, or the launcher that started
    this process (its parent) does. Nothing else writes the folder then."""
    if held(path):
        return True
    return _locked_by_other(path) and holder(path).split()[:2] == ["pid", str(os.getppid())]
