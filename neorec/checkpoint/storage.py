"""Where checkpoint files live: a small protocol over fsspec (local path or object-store URL).

Writes are atomic per file: the bytes go to a temporary name, then a rename (local files: write,
fsync, ``os.replace``; object stores: one PUT, which is atomic by itself, then a server-side move).
A reader never sees a partial file under its final name, and a write that fails (a full disk) removes
its temporary file.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from typing import Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["Storage", "FsspecStorage", "open_storage", "TMP_MARK"]

TMP_MARK = ".tmp-"
"""Infix of temporary file names; such files are never part of a checkpoint."""


class Storage(Protocol):
    """The operations the checkpoint manager needs of a storage backend."""

    url: str

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` so that readers see all of it or nothing."""
        ...

    def read(self, rel: str) -> bytes:
        """All bytes of ``rel``."""
        ...

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists."""
        ...

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) directly under ``rel``; empty if it does not exist."""
        ...

    def remove(self, rel: str) -> None:
        """Remove a file or a directory tree (missing is fine)."""
        ...


class FsspecStorage:
    """``Storage`` on any fsspec filesystem; local paths get fsync + os.replace."""

    def __init__(self, url: str, fsync: bool = True) -> None:
        self.url = url
        fs, root = fsspec.core.url_to_fs(url)
        self.fs: Any = fs
        self.root: str = root.rstrip("/") or "/"
        self.local = isinstance(fs, LocalFileSystem)
        self.fsync = fsync

    def path(self, rel: str) -> str:
        """Full path of ``rel`` on the filesystem."""
        return posixpath.join(self.root, rel) if rel else self.root

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write to a temporary sibling, then rename it to ``rel``."""
        final = self.path(rel)
        tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        parent = posixpath.dirname(final)
        if self.local:
            os.makedirs(parent, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        # note: without it a power loss could leave a renamed but empty file
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:
                # a full disk gets the partial file's space back (a read-only one: nothing to do)
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
            return
        self.fs.makedirs(parent, exist_ok=True)
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
            raise

    def read(self, rel: str) -> bytes:
        """All bytes of ``rel``."""
        data: bytes = self.fs.cat_file(self.path(rel))
        return data

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists."""
        return bool(self.fs.exists(self.path(rel)))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (sorted); empty if missing."""
        p = self.path(rel)
        if not self.fs.exists(p):
            return []
        names = [posixpath.basename(str(e).rstrip("/")) for e in self.fs.ls(p, detail=False)]
        return sorted(names)

    def remove(self, rel: str) -> None:
        """Remove a file or directory tree; a missing one is not an error."""
        p = self.path(rel)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=True)


def open_storage(url: str, fsync: bool = True) -> FsspecStorage:
    """Storage for a local path or an fsspec URL (``memory://``, ``s3://``, ``gs://``, ...)."""
    return FsspecStorage(url, fsync=fsync)
