"""DynamicCachedEmbeddingBagCollection: dynamic tables (``kind = "dynamic"``) whose slot rows live
in a DRAM or SSD store behind the row cache: raw id -> slot (the id map, as in memory) -> row
cache -> store. The same results as ``DynamicEmbeddingBagCollection``, bitwise.

Composition: the id maps, admission, eviction, pins, stats and by-id state are those of
``DynamicEmbeddingBagCollection`` (this class derives from it); its slot buffer is a
``CachedEmbeddingBagCollection`` over "slot tables" of ``capacity`` (+1 default) rows each
(``_SlotCache``), whose ``cache_rows`` / ``cache_fraction`` / ``cache_policy`` are the dynamic
table's, so they apply to the slot space; a batch whose slots outnumber the cache runs through
``neorec.storage.spill`` (``_resident`` / ``_kernel``). A batch maps its ids to slots, makes those slots resident
(``prepare``), and runs the same fused TBE forward and update on the cache buffer.

Slot resets reach the tiers without a stale row ever winning: a reset slot resident in the cache
is overwritten there and marked dirty (its old row is never written back); a freed slot not
resident is written (zeros) to the store, invalidating any prefetched copy; a new slot not resident
is filled from its fresh initial row by the batch's ``prepare`` (no store read) and marked dirty.
Export, ``table_weight`` and the checkpoints read the store after ``flush()``.

Sharded: ``ShardedDynamicEmbeddingBagCollection`` builds one of these per rank (of the rank's
``ceil(capacity / W)`` slots, its stores in ``<storage.dir>/rank<r>``;
``neorec.distributed.dynamic_parts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.config.model import DYNAMIC_DEFAULTS
from neorec.modules.collection import CollectionSpec
from neorec.modules.collection_parts import checked_batch
from neorec.ops.id_map import RowTarget
from neorec.ops.tbe import TBEBackend, TBELayout
from neorec.sparse import SparseFeatures
from neorec.storage import cache_ops
from neorec.storage.cache_table import CacheTable, StagedRows, one_thread
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.dynamic import DynamicEmbeddingBagCollection, dynamic_init_rows
from neorec.storage.spill import SpillBackend, batch_fits
from neorec.storage.store import RowStore, StoreSettings, record_fields

__all__ = ["DynamicCachedEmbeddingBagCollection"]


class _SlotCache(CachedEmbeddingBagCollection):
    """The row cache over a dynamic collection's slot rows (one "table" of slots per dynamic
    table, ids = slots). Starts at zeros but for the default rows; takes the rows the id map resets
    (``put_rows``); fills new slots from their fresh rows instead of the store."""

    def __init__(
        self,
        defaults: dict[int, Tensor],
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str,
        storage: StoreSettings,
    ) -> None:
        self._defaults = defaults  # (plain attributes: set before the stores are initialised)
        self._fresh: dict[int, StagedRows] = {}
        self._filled: dict[int, tuple[Tensor, Tensor]] = {}
        super().__init__(tables, spec, device, storage)

    def _init_weights(self, i: int, lo: int, hi: int, out: Tensor) -> None:
        out.zero_()
        d = self._defaults.get(i)
        if d is not None and lo <= self.tables[i].rows - 1 < hi:
            out[self.tables[i].rows - 1 - lo] = d

    # ---- records ---------------------------------------------------------------------------------
    def _views(self, i: int) -> list[tuple[str, int, Tensor]]:
        """(field, width, fast-tier buffer [rows, w] or [rows]) of table ``i``'s records."""
        out = []
        for k, w in record_fields(self.optimizer.kind, self.tables[i].dim):
            v = self.layout.table(self.weights, i) if k == "weight" else None
            out.append((k, w, v if v is not None else self._state_view(k, getattr(self, k), i)))
        return out

    def read_slots(self, i: int, slots: Tensor) -> dict[str, Tensor]:
        """Copies on the CPU of every field of slot rows ``slots`` of table ``i`` (flushes the
        cache first when the table is on dram / ssd)."""
        views = self._views(i)
        if i in self._cached:
            self.flush()
            rec = self._cached[i].store.read(slots.to(torch.int64))
        else:
            s = slots.to(self.weights.device)
            rec = torch.cat([v[s].reshape(s.numel(), w).cpu() for _, w, v in views], 1)
        out, col = {}, 0
        for k, w, _ in views:
            part = rec[:, col : col + w]
            out[k] = part.flatten().clone() if k == "momentum1" else part.clone()
            col += w
        return out

    def put_rows(self, i: int, slots: Tensor, rec: Tensor, fresh: bool = False) -> None:
        """Slot rows ``slots`` (distinct) of table ``i`` = records ``rec`` [n, width] (weight,
        then the optimizer state): in the cache where resident (marked dirty, so the old row is
        never written back), else written to the store -- or, ``fresh``, held for the next
        ``prepare``, whose batch uses them, to fill without reading the store."""
        if slots.numel() == 0:
            return
        slots, order = torch.sort(slots.to(torch.int64))
        rec = rec[order].to(torch.float32).contiguous()
        self._wait_prefetch()  # (the prefetch thread reads the store and the staged rows)
        self._spill(i)  # (fresh rows of table i a failed batch left: older than these)
        with one_thread(), torch.no_grad():
            if i not in self._cached:
                col = 0
                for _, w, v in self._views(i):
                    s = slots.to(v.device)
                    v[s] = rec[:, col : col + w].to(v.device).reshape(v[s].shape)
                    col += w
                return
            c = self._cached[i]
            at = c.slot_of[slots].to(torch.int64)
            here = at >= 0
            if bool(here.any()):
                self._scatter_records(c, at[here], rec[here])
                c.dirty[at[here]] = True
            away = ~here
            if not bool(away.any()):
                return
            if fresh:
                n = int(away.sum())
                self._fresh[i] = StagedRows(slots[away], rec[away], torch.ones(n, dtype=torch.bool))
            else:
                self._write_store(c, slots[away], rec[away])

    def _write_store(self, c: CacheTable, slots: Tensor, rec: Tensor) -> None:
        """Records ``rec`` of non-resident ``slots`` (sorted) straight to the store."""
        c.store.write(slots, rec)
        self._invalidate_staged(c.index, slots)

    # ---- the fresh rows of new slots -------------------------------------------------------------
    def _fill(self, c: CacheTable, slots: Tensor, ids: Tensor) -> None:
        f = self._fresh.get(c.index)
        if f is None:
            super()._fill(c, slots, ids)
            return
        pos = cache_ops.match_sorted(ids, f.ids, f.valid)
        found = pos >= 0
        if bool(found.any()):
            self._scatter_records(c, slots, f.records, pos)
            self._filled[c.index] = (slots[found], pos[found])
        rest = ~found
        if bool(rest.any()):
            super()._fill(c, slots[rest], ids[rest])

    def _admit(self, c: CacheTable, ids: Tensor) -> Tensor:
        out = super()._admit(c, ids)
        done = self._filled.pop(c.index, None)
        if done is not None:  # committed: the store still holds the slot's old row
            c.dirty[done[0]] = True
            self._fresh[c.index].valid[done[1]] = False
        return out

    def _prepare(
        self, indices: Tensor, offsets: Tensor, pin: bool
    ) -> tuple[Tensor, dict[int, Tensor]]:
        try:
            return super()._prepare(indices, offsets, pin)
        finally:  # fresh rows a failed prepare did not take go to the store
            self._filled.clear()
            self._spill()

    def _spill(self, table: int | None = None) -> None:
        """Write the fresh rows (of ``table``, else all) no ``prepare`` took (its batch failed)
        to the store."""
        for i in [table] if table is not None else list(self._fresh):
            f = self._fresh.pop(i, None)
            if f is not None and bool(f.valid.any()):
                self._wait_prefetch()
                with one_thread():
                    self._write_store(self._cached[i], f.ids[f.valid], f.records[f.valid])

    def flush(self) -> None:
        self._wait_prefetch()
        self._spill()
        super().flush()


class DynamicCachedEmbeddingBagCollection(DynamicEmbeddingBagCollection):
    """``DynamicEmbeddingBagCollection`` whose slot rows (of dram / ssd tables; memory ones too,
    in the fast tier) live behind a row cache (see the module doc).

    Differences: ``optimizer_state()`` is the cache's (cache layout), ``table_weight`` a copy
    (flushes), ``stats()`` adds the cache's counters (per table under ``cache``, totals at the
    top level); plus ``flush``, ``close``, ``stores``, ``stats_line`` and ``prefetch`` as in
    ``CachedEmbeddingBagCollection``; ``storage``: where its stores go.
    """

    _cached_slots = True
    host_resident = True

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        native: bool | None = None,
        storage: StoreSettings | None = None,
    ) -> None:
        self._storage = storage or StoreSettings()
        self._deferred: SparseFeatures | None = None
        super().__init__(tables, spec, device, native)

    def _make_rows(self, spec: CollectionSpec, device: torch.device) -> None:
        slot_tables = [
            # a slot table is a fixed table: the dynamic fields at their defaults
            replace(t, kind="fixed", rows=c + int(d), precision="fp32", **DYNAMIC_DEFAULTS)
            for t, c, d in zip(self.tables, self.capacities, self.default_rows)
        ]
        defaults = {i: self._default_row(i) for i, d in enumerate(self.default_rows) if d}
        cache_spec = replace(spec, validate_ids=True)  # slots: always within the slot tables
        self.slot_cache = _SlotCache(defaults, slot_tables, cache_spec, device, self._storage)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.weights = torch.empty(0)  # dtype of pooled outputs for the batch checks: float32

    # ---- the slot rows ---------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Tensor]:
        """The fused optimizer's state over the cache (flat, cache layout)."""
        return self.slot_cache.optimizer_state()

    def table_weight(self, name: str) -> Tensor:
        """Copy of one table's slot rows [capacity (+1 default row), dim] (flushes)."""
        return self.slot_cache.table_weight(name)

    def _row_target(self, i: int) -> RowTarget | None:
        return None  # resets go through _reset_rows (the map returns the slots)

    def _reset_rows(self, i: int, slots: Tensor, ids: Tensor | None) -> None:
        if slots.numel() == 0:
            return
        width = sum(w for _, w in record_fields(self.optimizer.kind, self.tables[i].dim))
        n, dim = slots.numel(), self.tables[i].dim
        rec = torch.zeros(n, width)
        if ids is not None:
            rows, (bound, salt) = torch.empty(n, dim), self._init[i]
            none: list[Tensor | None] = [None, None, None]
            if not self.id_maps[i].reset_rows(torch.arange(n), ids, rows, none, salt, bound):
                rows = dynamic_init_rows(self.tables[i], self._seed, ids, self._init_scale)
            rec[:, :dim] = rows
        self.slot_cache.put_rows(i, slots, rec, fresh=ids is not None)

    def _resident(self, slots: Tensor, offsets: Tensor, training: bool) -> tuple[Tensor, Any]:
        out: tuple[Tensor, Any]
        if batch_fits(self.slot_cache, slots, offsets):
            out = self.slot_cache._prepare(slots, offsets, pin=training)
        else:  # more slots than the cache holds: in chunks (neorec.storage.spill)
            out = slots, SpillBackend(self.slot_cache)
        if self._deferred is not None:  # the next batch's slots, now that this one is mapped
            nxt, self._deferred = self._deferred, None
            try:
                self._start_prefetch(nxt)
            except BaseException:
                if training:
                    self._unhold(out[1], False)
                raise
        return out

    def _kernel(self, held: Any) -> TBEBackend:
        return held if isinstance(held, SpillBackend) else self.backend

    def _fast(self) -> tuple[TBELayout, Tensor, dict[str, Tensor]]:
        c = self.slot_cache
        return c.layout, c.weights, c.optimizer_state()

    def _unhold(self, held: Any, written: bool) -> None:
        if held is not None and not isinstance(held, SpillBackend):
            self.slot_cache._release(held, dirty=written)

    def _read_slots(self, i: int, slots: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        rec = self.slot_cache.read_slots(i, slots)
        return rec.pop("weight"), rec

    def _write_slots(self, i: int, slots: Tensor, rows: Tensor, states: dict[str, Tensor]) -> None:
        missing = [k for k in self.state_names if k not in states]
        old = self.slot_cache.read_slots(i, slots) if missing else {}
        parts = [rows.reshape(slots.numel(), -1)]
        for k in self.state_names:
            parts.append(states[k] if k in states else old[k])
        rec = torch.cat([p.reshape(slots.numel(), -1).to(torch.float32) for p in parts], 1)
        self.slot_cache.put_rows(i, slots, rec)

    def _clear_slots(self, i: int, live: Tensor) -> None:
        width = sum(w for _, w in record_fields(self.optimizer.kind, self.tables[i].dim))
        self.slot_cache.put_rows(i, live, torch.zeros(live.numel(), width))

    # ---- the row cache's interface ---------------------------------------------------------------
    def flush(self) -> None:
        """Write every dirty cached slot row back and make the stores durable."""
        self.slot_cache.flush()

    def close(self) -> None:
        """Flush, then release the stores (files)."""
        self.slot_cache.close()

    def stores(self) -> dict[str, RowStore]:
        """The store of each dram / ssd table, by table name."""
        return self.slot_cache.stores()

    def stats_line(self) -> str:
        """Short progress-line text of the cache: hit rate and MB moved per tier."""
        return self.slot_cache.stats_line()

    def cache_tables(self) -> list[CacheTable]:
        """The cache bookkeeping of each dram / ssd table (for ``cache_stats`` over several
        collections)."""
        return list(self.slot_cache._cached.values())

    def stats(self) -> dict[str, Any]:
        """Per table the id map's counters (``DynamicEmbeddingBagCollection.stats``) and, on
        dram / ssd, its cache's under ``cache``; the cache's totals (hits, misses, hit rates,
        bytes per tier) at the top level."""
        cache = self.slot_cache.stats()
        per_table = cache.pop("tables")
        out: dict[str, Any] = {**cache, **super().stats()}
        for name, v in per_table.items():
            out[name]["cache"] = v
        return out

    def prefetch(self, sparse: SparseFeatures, defer: bool = False) -> None:
        """Read, in the background, the slot rows of ``sparse``'s live ids that are not resident
        (``CachedEmbeddingBagCollection.prefetch``); changes no map or cache state. ``defer``:
        start once the next forward has mapped its own batch (the latest deferred batch wins)."""
        sparse = checked_batch(self, sparse)
        if defer:
            self._deferred = sparse
            return
        self._start_prefetch(sparse)

    def _start_prefetch(self, sparse: SparseFeatures) -> None:
        slots, offsets, _ = self._slot_batch(sparse, False, [])
        lengths = offsets[1:] - offsets[:-1]
        self.slot_cache.prefetch(SparseFeatures(sparse.keys, slots, lengths))
