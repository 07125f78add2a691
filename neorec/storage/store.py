"""Row stores: the slow tiers behind the row cache (host DRAM, an SSD file).

A store holds one table as fixed-size float32 *records*: the row's weights followed by its
optimizer state, so a row and its state always move together (``record_fields``):

- sgd: ``[weight D]``; rowwise_adagrad: ``[weight D | momentum1 1]``;
  adam: ``[weight D | exp_avg D | exp_avg_sq D]``.

SSD file format (version 1), ``HEADER_BYTES`` of header then ``rows`` records in id order::

    magic b"NEORECRS" | u32 version | u32 json length | JSON {rows, dim, fields, record_bytes,
    table, clean} | zero padding to HEADER_BYTES

``clean`` is true when the records are exactly the state of the last ``flush()``; the first write
after a flush clears it (and is made durable before any record changes), so a file left by a crash
between flushes is recognised and refused by ``open``. ``create`` builds the file under a temporary
name and renames it into place, so a failed create (e.g. a full disk) leaves an existing store
untouched. Records are written in place into preallocated space, so steady-state write-backs need no
new disk blocks.

Reads and writes are copies to and from a shared ``mmap`` of the file (``cache_ops.copy_rows``, a C
loop that prefetches rows ahead; no Python per row). Measured on this machine (``neorec bench cache
--io``, random 260-byte records of a 1M-row file): the mapped copy moves ~4x more records per second
than ``pread`` in a C loop with two threads (``rowio``, kept as the measured alternative), and
``pwrite`` is slower still. The space is preallocated, so a mapped write cannot hit a full disk on
ext4/xfs. A mapped access past the end of the file would kill the process (SIGBUS), so every read
and write first checks the file's size (one ``fstat``) and a truncated file is a ``StoreError``.
Mapped pages count in the process's RSS, and far more of them than the records touched: a fault
maps the cached pages around it (fault-around) and, on this kernel, whole large page-cache folios
(measured: ~25 KiB per random record, up to 4 MB for a record of a freshly written file, which
``create`` therefore drops from the page cache; 10k random writes mapped a whole 2 GB file). So reads and writes copy in chunks of ``_IO_CHUNK`` records and
after each chunk read the process's file-backed RSS (``/proc/self/status``, ~30 us); above
``mapped_budget`` (default ``default_mapped_budget()``) every open store is unmapped
(``MADV_DONTNEED``). The RSS stays within about one chunk's mappings of the budget whatever the
files' size; the data stays in the page cache.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np
import torch
from torch import Tensor

from neorec.errors import NeorecError
from neorec.ops.memory import table_zeros
from neorec.storage import cache_ops

__all__ = [
    "StoreSettings",
    "StoreError",
    "RowStore",
    "DramStore",
    "SsdStore",
    "record_fields",
    "HEADER_BYTES",
    "default_mapped_budget",
    "MAGIC",
    "FORMAT_VERSION",
]

MAGIC = b"NEORECRS"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_INIT_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class StoreSettings:
    """Where and how a collection's dram / ssd tables keep their row stores (the run's
    ``[storage]``)."""

    dir: str | Path = ""
    """Folder of the SSD stores' files (``<table>.rows``); empty: none (an ssd table is refused)."""
    io_threads: int = 2
    """Threads copying records between an SSD store's mapping and the cache."""
    mapped_mb: int = 0
    """File-backed RSS (MiB) above which the stores' mapped pages are dropped; 0: the default
    (``default_mapped_budget``)."""


def default_mapped_budget() -> int:
    """File-backed RSS above which the stores' pages are unmapped: a quarter of physical memory
    (at least 256 MiB). Measured (``neorec bench cache``, 2 GB of stores): with a budget below the
    stores' size every record copy faults again after the unmapping, and a step took 218 ms
    instead of 95 ms; mapped pages are page cache, so keeping them costs no extra memory."""
    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        phys = 4 << 30
    return max(256 << 20, phys // 4)


_IO_CHUNK = 4096
"""Records copied between two looks at the process's file-backed RSS."""
_OPEN_STORES: weakref.WeakSet[SsdStore] = weakref.WeakSet()

RecordInit = Callable[[int, int], Tensor]
"""``init(lo, hi)`` -> initial records [hi - lo, width] of rows lo..hi-1."""
Records: TypeAlias = Tensor | Sequence[tuple[Tensor, Tensor]]
"""What ``RowStore.write`` stores: records [n, width], or per field a (buffer, rows) pair."""


class StoreError(NeorecError, RuntimeError):
    """A row store cannot be created, opened, read or written; the message names the file."""


def record_fields(optimizer: str, dim: int) -> list[tuple[str, int]]:
    """(name, floats) of each part of a record, in order: the weights, then the optimizer state."""
    state = {
        "sgd": [],
        "rowwise_adagrad": [("momentum1", 1)],
        "adam": [("exp_avg", dim), ("exp_avg_sq", dim)],
    }
    if optimizer not in state:
        raise ValueError(f"unknown embedding optimizer '{optimizer}'")
    return [("weight", dim), *state[optimizer]]


class RowStore:
    """Common shape and counters of a store; subclasses implement the I/O."""

    tier = "none"

    def __init__(self, rows: int, fields: list[tuple[str, int]], table: str = "") -> None:
        self.rows = rows
        self.fields = [(str(n), int(w)) for n, w in fields]
        self.width = sum(w for _, w in self.fields)
        self.dim = self.fields[0][1]
        self.table = table
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def record_bytes(self) -> int:
        """Bytes per record."""
        return 4 * self.width

    @property
    def nbytes(self) -> int:
        """Bytes of all records."""
        return self.rows * self.record_bytes

    def _check_ids(self, ids: Tensor) -> Tensor:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.rows):
            raise IndexError(
                f"{self.tier} store of table '{self.table}': ids in [{int(ids.min())}, "
                f"{int(ids.max())}] outside [0, {self.rows})"
            )
        return ids

    def read(self, ids: Tensor, out: Tensor | None = None) -> Tensor:
        """Records [n, width] of ``ids``."""
        raise NotImplementedError

    def write(self, ids: Tensor, records: Records) -> None:
        """Store records as rows ``ids``: a tensor [n, width], or per field a ``(buffer, rows)``
        pair whose ``buffer[rows[i]]`` is that field of record ``i`` (copied straight from, e.g.,
        the cache's buffers, without assembling the records first)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every write so far durable (no-op for DRAM)."""

    def close(self) -> None:
        """Release the store's resources."""


class DramStore(RowStore):
    """All records in one host-memory tensor [rows, width]."""

    tier = "dram"

    def __init__(
        self, rows: int, fields: list[tuple[str, int]], init: RecordInit | None, table: str = ""
    ) -> None:
        super().__init__(rows, fields, table)
        self.data = table_zeros(rows * self.width).view(rows, self.width)
        if init is not None:
            for lo in range(0, rows, _INIT_CHUNK_ROWS):
                hi = min(rows, lo + _INIT_CHUNK_ROWS)
                self.data[lo:hi] = init(lo, hi)

    def read(self, ids: Tensor, out: Tensor | None = None) -> Tensor:
        """Records [n, width] of ``ids``."""
        ids = self._check_ids(ids)
        if out is None:
            out = torch.empty(ids.numel(), self.width)
        cache_ops.copy_rows(self.data, ids, out, None)
        self.bytes_read += ids.numel() * self.record_bytes
        return out

    def write(self, ids: Tensor, records: Records) -> None:
        """Store records as rows ``ids`` (see ``RowStore.write``)."""
        ids = self._check_ids(ids)
        _scatter(self.data, ids, records, self.fields, 1)
        self.bytes_written += ids.numel() * self.record_bytes


def _header(meta: dict) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    head = MAGIC + struct.pack("<II", FORMAT_VERSION, len(body)) + body
    if len(head) > HEADER_BYTES:
        raise StoreError(f"row store header of {len(head)} bytes exceeds {HEADER_BYTES}")
    return head + b"\0" * (HEADER_BYTES - len(head))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _disk_full_hint(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free space (or point storage.dir elsewhere) and retry"
    return "check the device and the file's permissions"


class SsdStore(RowStore):
    """Records in a file, read and written with pread/pwrite; RAM use is O(1) in the rows."""

    tier = "ssd"

    def __init__(
        self,
        path: Path,
        fd: int,
        rows: int,
        fields: list[tuple[str, int]],
        table: str,
        threads: int,
    ) -> None:
        super().__init__(rows, fields, table)
        self.path = path
        self.fd = fd
        self.threads = max(1, threads)
        self.clean = True
        size = HEADER_BYTES + rows * self.record_bytes
        # Writes go through a shared mapping (see the module docstring for the measurement).
        self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        # Rows are touched at random: without this, each page fault on a file larger than RAM
        # reads ahead ~128 KiB for one 260-byte record (measured: ~1 GB/s of disk reads for
        # ~1,000 samples/s on configs/ssd_large.toml).
        self._mm.madvise(mmap.MADV_RANDOM)
        self._records = np.frombuffer(self._mm, np.float32, rows * self.width, HEADER_BYTES)
        self._records = self._records.reshape(rows, self.width)
        self._tensor = torch.from_numpy(self._records)
        self.mapped_budget = default_mapped_budget()
        _OPEN_STORES.add(self)

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | Path,
        rows: int,
        fields: list[tuple[str, int]],
        init: RecordInit,
        table: str = "",
        threads: int = 1,
    ) -> SsdStore:
        """Write a new store file (under a temporary name, renamed into place) and open it."""
        path = Path(path)
        width = sum(w for _, w in fields)
        size = HEADER_BYTES + rows * width * 4
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"row store folder {path.parent} cannot be created ({e.strerror or e}); point "
                "storage.dir at a writable directory"
            ) from None
        free = shutil.disk_usage(path.parent).free
        if size > free:
            raise StoreError(
                f"row store {path} needs {size / 2**30:.2f} GiB but {path.parent} has "
                f"{free / 2**30:.2f} GiB free; free space or point storage.dir elsewhere"
            )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        meta = cls._meta(rows, fields, table, clean=False)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _allocate(fd, size)
                _pwrite_all(fd, memoryview(_header(meta)), 0)
                _fill(fd, rows, width, init)
                os.fsync(fd)
                _pwrite_all(fd, memoryview(_header({**meta, "clean": True})), 0)
                os.fsync(fd)
                # Drop the new file from the page cache: its large folios would otherwise be
                # mapped whole by the first random reads (MBs per record, measured), and a store
                # of many GB should not evict everything else.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(
                f"creating row store {path} ({size / 2**30:.2f} GiB) failed: {e}; "
                f"{_disk_full_hint(e)}; any existing store at that path is unchanged"
            ) from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return cls.open(path, fields, threads=threads)

    @staticmethod
    def _meta(rows: int, fields: list[tuple[str, int]], table: str, clean: bool) -> dict:
        width = sum(w for _, w in fields)
        return {
            "rows": rows,
            "dim": fields[0][1],
            "fields": [[n, w] for n, w in fields],
            "record_bytes": 4 * width,
            "table": table,
            "clean": clean,
        }

    @classmethod
    def open(
        cls,
        path: str | Path,
        fields: list[tuple[str, int]] | None = None,
        allow_unclean: bool = False,
        threads: int = 1,
    ) -> SsdStore:
        """Open an existing store file, checking its header, layout and size."""
        path = Path(path)
        if not path.exists():
            raise StoreError(f"row store file not found: {path}")
        fd = os.open(path, os.O_RDWR)
        try:
            meta = _read_header(fd, path)
            got = [(str(n), int(w)) for n, w in meta["fields"]]
            if fields is not None and got != [(n, w) for n, w in fields]:
                raise StoreError(
                    f"row store {path} holds records {got}, but {fields} were expected "
                    f"(another optimizer or dim?)"
                )
            expect = HEADER_BYTES + meta["rows"] * meta["record_bytes"]
            size = os.fstat(fd).st_size
            if size != expect:
                raise StoreError(
                    f"row store {path} is truncated or damaged: {size} bytes, expected {expect} "
                    f"({meta['rows']} rows x {meta['record_bytes']} bytes + {HEADER_BYTES} header)"
                )
            if not meta["clean"] and not allow_unclean:
                raise StoreError(
                    f"row store {path} was written after its last flush (the process stopped "
                    f"between flushes?); its rows mix two states. Restore it from a checkpoint, "
                    f"or open with allow_unclean=True to use it anyway"
                )
        except BaseException:
            os.close(fd)
            raise
        store = cls(path, fd, int(meta["rows"]), got, str(meta["table"]), threads)
        store.clean = bool(meta["clean"])
        return store

    def close(self) -> None:
        """Close the file (without flushing: call ``flush`` first to keep the writes)."""
        _OPEN_STORES.discard(self)
        if self.fd >= 0:
            del self._records, self._tensor
            if self._mm is not None:
                self._mm.close()
                self._mm = None
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass

    # ---- I/O ---------------------------------------------------------------------------------
    def _check_size(self, what: str) -> None:
        """A mapped access beyond the end of the file would kill the process (SIGBUS): refuse
        one while the file is shorter than its rows (truncated since it was opened)."""
        size = os.fstat(self.fd).st_size
        expect = HEADER_BYTES + self.rows * self.record_bytes
        if size < expect:
            raise StoreError(
                f"{what} table '{self.table}' in {self.path}: the file is truncated or damaged "
                f"({size} bytes, expected {expect})"
            )

    def read(self, ids: Tensor, out: Tensor | None = None) -> Tensor:
        """Records [n, width] of ``ids`` (copied from the mapping; safe in a prefetch thread)."""
        ids = self._check_ids(ids)
        if out is None:
            out = torch.empty(ids.numel(), self.width)
        self._check_size("reading")
        for lo in range(0, ids.numel(), _IO_CHUNK):
            hi = min(ids.numel(), lo + _IO_CHUNK)
            _read_mapped(self._tensor, ids[lo:hi], out[lo:hi], self.threads)
            self._bound_rss()
        self.bytes_read += ids.numel() * self.record_bytes
        return out

    def write(self, ids: Tensor, records: Records) -> None:
        """Store records as rows ``ids`` (see ``RowStore.write``; in place, durable at the next
        flush)."""
        ids = self._check_ids(ids)
        try:
            if self.clean:
                # Durable "unclean" mark before any record changes: a crash from here until the
                # next flush leaves a file that open() recognises as mixed.
                self._write_header(clean=False)
            self._check_size("writing")
            for lo in range(0, ids.numel(), _IO_CHUNK):
                hi = min(ids.numel(), lo + _IO_CHUNK)
                part: Records
                if isinstance(records, Tensor):
                    part = records[lo:hi]
                else:
                    part = [(buf, rows[lo:hi]) for buf, rows in records]
                _write_mapped(self._tensor, ids[lo:hi], part, self.fields, self.threads)
                self._bound_rss()
        except OSError as e:
            raise StoreError(
                f"writing {ids.numel()} rows of table '{self.table}' to {self.path} failed: {e}; "
                f"{_disk_full_hint(e)}. The cache keeps these rows dirty, so nothing is lost "
                f"and flush() can be retried"
            ) from e
        self.bytes_written += ids.numel() * self.record_bytes

    def _bound_rss(self) -> None:
        """Above the budget of file-backed RSS, unmap every open store's pages: for a shared file
        mapping the data stays in the page cache (written back by the kernel), only the
        process's RSS drops."""
        if _file_rss_bytes() > self.mapped_budget:
            for store in list(_OPEN_STORES):
                store.drop_mapped_pages()

    def drop_mapped_pages(self) -> None:
        """Unmap this store's resident pages (they stay in the page cache)."""
        if self._mm is not None:
            self._mm.madvise(mmap.MADV_DONTNEED)

    def flush(self) -> None:
        """fsync the records, then mark the file clean (a complete, consistent store)."""
        if self.clean:
            return
        try:
            if self._mm is not None:
                self._mm.flush()
            os.fsync(self.fd)
            self._write_header(clean=True)
        except OSError as e:
            raise StoreError(f"flushing row store {self.path} failed: {e}") from e

    def _write_header(self, clean: bool) -> None:
        meta = self._meta(self.rows, self.fields, self.table, clean)
        _pwrite_all(self.fd, memoryview(_header(meta)), 0)
        os.fsync(self.fd)
        self.clean = clean


def _scatter(
    dst: Tensor, ids: Tensor, records: Records, fields: list[tuple[str, int]], threads: int
) -> None:
    """``dst[ids[i]] = record i`` (see ``RowStore.write`` for the two forms of ``records``)."""
    if isinstance(records, Tensor):
        cache_ops.copy_rows(records.to(torch.float32).contiguous(), None, dst, ids, threads)
        return
    if len(records) != len(fields):
        raise ValueError(f"{len(records)} field sources for {len(fields)} fields {fields}")
    col = 0
    for (_, w), (buf, rows) in zip(fields, records, strict=True):
        cache_ops.copy_rows(buf, rows, dst[:, col : col + w], ids, threads)
        col += w


def _file_rss_bytes() -> int:
    """File-backed resident bytes of this process (Linux); 0 where unknown (never unmaps)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _write_mapped(
    mapped: Tensor, ids: Tensor, records: Records, fields: list[tuple[str, int]], threads: int
) -> None:
    """Scatter rows into the mapped records (the one place an SSD store writes records)."""
    _scatter(mapped, ids, records, fields, threads)


def _read_mapped(records: Tensor, ids: Tensor, out: Tensor, threads: int) -> None:
    """Gather rows from the mapped records."""
    cache_ops.copy_rows(records, ids, out, None, threads)


def _allocate(fd: int, size: int) -> None:
    """Reserve the file's blocks now, so a full disk fails here and not in a later write-back."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # filesystems without fallocate: the fill below writes every byte


def _fill(fd: int, rows: int, width: int, init: RecordInit) -> None:
    for lo in range(0, rows, _INIT_CHUNK_ROWS):
        hi = min(rows, lo + _INIT_CHUNK_ROWS)
        block = init(lo, hi).to(torch.float32).contiguous()
        if tuple(block.shape) != (hi - lo, width):
            raise ValueError(
                f"init({lo}, {hi}) gave {tuple(block.shape)}, expected {(hi - lo, width)}"
            )
        _pwrite_all(fd, memoryview(block.numpy().data).cast("B"), HEADER_BYTES + lo * width * 4)


def _read_header(fd: int, path: Path) -> dict:
    head = os.pread(fd, HEADER_BYTES, 0)
    if len(head) < 16:
        raise StoreError(f"row store {path} is truncated: {len(head)} bytes, no header")
    if head[:8] != MAGIC:
        raise StoreError(f"{path} is not a neorec row store (magic {head[:8]!r})")
    version, n = struct.unpack("<II", head[8:16])
    if version != FORMAT_VERSION:
        raise StoreError(
            f"row store {path} has format version {version}, expected {FORMAT_VERSION}"
        )
    try:
        meta: dict = json.loads(head[16 : 16 + n])
    except ValueError as e:
        raise StoreError(f"row store {path} has a damaged header: {e}") from e
    return meta
