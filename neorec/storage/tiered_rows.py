"""A cached table's rows by global id, wherever they sit: a point-in-time snapshot, and writes.

A dram/ssd table's current row is the cache's copy when the row is resident, else the store's.
Check-N-Run checkpoints of such tables (``neorec.checkpoint``) read and restore them through:

- ``RowSnapshot``: rows ``ids`` (or all) of one table as they are at one moment. In the
  checkpoint's pause the resident rows' records are copied from the cache (at most its capacity);
  the other rows stay in the store and the checkpoint's writer thread reads them later, chunk by
  chunk, while training goes on. Until a row is read, a write-back of it (the row was admitted
  again, updated and evicted) first copies its old record aside, under one lock with the reads
  (copy-on-write), so every row is read as it was at the snapshot.
- ``StoreField``: one field of a table's records (its weight, or an optimizer state) as the
  ``[rows, width]`` (``[rows]`` for ``momentum1``) array a restore writes into: read-modify-write
  of store records. The first write flushes and empties the cache: the store holds every row.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from neorec.storage.cache_table import CacheTable

__all__ = ["RowSnapshot", "StoreField", "split_records"]

READ_ROWS = 4096
"""Rows a snapshot reads from a store under its lock at once: a write-back that must wait for
the lock waits for at most this many rows."""


def split_records(fields: list[tuple[str, int]], rec: Tensor) -> dict[str, Tensor]:
    """Records [n, width] as one tensor per field (``momentum1``: [n])."""
    out, col = {}, 0
    for k, w in fields:
        part = rec[:, col : col + w]
        out[k] = part[:, 0] if k == "momentum1" else part
        col += w
    return out


class RowSnapshot:
    """Rows ``ids`` (sorted, distinct; None = every row) of cached table ``c`` of ``ebc`` (a
    ``CachedEmbeddingBagCollection``) as they are now; ``read`` them later (any thread), then
    ``close``."""

    def __init__(self, ebc: Any, c: CacheTable, ids: Tensor | None) -> None:
        self.c, self.store = c, c.store
        if ids is None:
            want = torch.ones(c.rows, dtype=torch.bool)
        else:
            want = torch.zeros(c.rows, dtype=torch.bool)
            want[ids] = True
        slots = (c.id_of >= 0).nonzero().flatten()  # (the cache's size, not the table's)
        rows = c.id_of[slots]
        keep = want[rows]
        rows, order = torch.sort(rows[keep])
        self.res_ids = rows
        self.res_rec = ebc.resident_records(c, slots[keep][order])
        want[rows] = False
        self.pending = want  # rows still to read from the store
        self.stash_ids = torch.zeros(0, dtype=torch.int64)  # copied aside before a write-back
        self.stash_rec = torch.zeros(0, self.store.width)
        self.lock = threading.Lock()
        c.write_guards.append(self._before_write)

    def _before_write(self, ids: Tensor) -> None:
        """Copy-on-write: the old records of rows about to be written that are not read yet."""
        with self.lock:
            ids = ids.to(torch.int64)
            sel = ids[self.pending[ids]]
            if sel.numel():
                self.stash_rec = torch.cat([self.stash_rec, self.store.read(sel)])
                self.stash_ids = torch.cat([self.stash_ids, sel])
                self.pending[sel] = False

    def read(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """(ids, records [n, width]) of the snapshot's rows in [lo, hi), ids sorted."""
        parts = []
        for a in range(lo, hi, READ_ROWS):
            z = min(hi, a + READ_ROWS)
            with self.lock:
                ids = self.pending[a:z].nonzero().flatten() + a
                if ids.numel():
                    parts.append((ids, self.store.read(ids)))
                    self.pending[ids] = False
        with self.lock:
            inr = (self.stash_ids >= lo) & (self.stash_ids < hi)
            if bool(inr.any()):
                parts.append((self.stash_ids[inr], self.stash_rec[inr]))
                self.stash_ids, self.stash_rec = self.stash_ids[~inr], self.stash_rec[~inr]
        a, z = (int(x) for x in torch.searchsorted(self.res_ids, torch.tensor([lo, hi])))
        parts.append((self.res_ids[a:z], self.res_rec[a:z]))
        ids = torch.cat([p[0] for p in parts])
        rec = torch.cat([p[1] for p in parts])
        order = torch.argsort(ids)
        return ids[order], rec[order]

    def close(self) -> None:
        """Stop guarding the store's writes (the snapshot is read, or abandoned)."""
        with self.lock:
            if self._before_write in self.c.write_guards:
                self.c.write_guards.remove(self._before_write)
            self.pending = torch.zeros(0, dtype=torch.bool)


class StoreField:
    """Field ``name`` of cached table ``c``'s store records as an array a restore writes into
    (``b[rows, cols] = x``, ``b[rows] = x``, ``zero_()``) and reads (``b[rows]``)."""

    def __init__(self, ebc: Any, c: CacheTable, name: str) -> None:
        self.ebc, self.c, self.name = ebc, c, name
        col = 0
        for k, w in c.store.fields:
            if k == name:
                break
            col += w
        else:
            raise KeyError(f"table '{c.name}': no record field '{name}'")
        self.cols = (col, col + w)
        self.one = name == "momentum1"
        self.shape = (c.rows,) if self.one else (c.rows, w)
        self.device = torch.device("cpu")

    def __getitem__(self, rows: Tensor) -> Tensor:
        self.ebc.flush()  # (the store holds every row then)
        rec = self.c.store.read(rows.to(torch.int64))
        return split_records(self.c.store.fields, rec)[self.name]

    def __setitem__(self, key: Any, value: Tensor) -> None:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        self.ebc.drop_cache()
        ids = rows.to(torch.int64)
        rec = self.c.store.read(ids)
        part = rec[:, self.cols[0] : self.cols[1]]
        if self.one:
            part[:, 0] = value
        else:
            part[:, cols] = value
        self.ebc.write_records(self.c, ids, rec)

    def zero_(self) -> StoreField:
        """Zero the field in every row."""
        self.ebc.drop_cache()
        for lo in range(0, self.c.rows, 65536):
            ids = torch.arange(lo, min(self.c.rows, lo + 65536))
            rec = self.c.store.read(ids)
            rec[:, self.cols[0] : self.cols[1]] = 0
            self.ebc.write_records(self.c, ids, rec)
        return self
