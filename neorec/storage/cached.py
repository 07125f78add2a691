"""CachedEmbeddingBagCollection: embedding tables whose rows live in a slower store (DRAM or SSD)
behind a software row cache in the fast tier; the same results as EmbeddingBagCollection, bitwise.

Per table (storage ``dram`` or ``ssd``) the fast tier holds ``capacity`` rows with their optimizer
state (one TBE layout over all tables, ``capacity`` rows each) and a slot map ``slot_of[id]``.
A batch goes through three stages::

    prefetch(sparse)   optional, any time before: a background thread reads the rows the batch
                       will miss into a staging area (no cache state changes)
    prepare(sparse)    at forward: make every id of the batch resident -- evict LRU/LFU victims
                       the batch does not use (dirty ones written back with their state), fill
                       the missing rows (staged, else read now), remap ids to slots
    TBE                the normal backend and kernel on the cache buffer, as if it were the table

Only ``prepare`` mutates the cache, in batch order, so runs are deterministic. The kernel sees the
same rows in the same order with slot numbers instead of ids, so each row's gradient sum and its
optimizer update are computed exactly as in the all-in-memory module. Slots used by a batch stay
pinned until its backward has updated them. ``flush()`` writes every dirty row back and makes the
stores durable (exports call it); ``stats()`` reports hits, misses, evictions and bytes moved.

A batch that needs more distinct rows of a table than its cache holds runs in chunks that fit
(``neorec.storage.spill``: the same updates; pooled outputs to float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.collection_parts import (
    as_device,
    check_memory,
    check_tables,
    checked_batch,
    feature_maps,
    init_rows,
    register_table_buffers,
)
from neorec.ops.tbe import (
    Lookup,
    TBEBackend,
    TBELayout,
    check_finite_weights,
    check_grad_output,
    get_backend,
    tbe_lookup,
)
from neorec.sparse import SparseFeatures
from neorec.storage import cache_ops
from neorec.storage.cache_records import record_sources, scatter_records
from neorec.storage.cache_table import (
    DEFAULT_CACHE_FRACTION,
    EVICT_CHUNK,
    POLICIES,
    CacheCapacityError,
    CacheTable,
    StagedRows,
    cache_capacity,
    cache_stats,
    one_thread,
)
from neorec.storage.spill import SpillBackend, batch_fits
from neorec.storage.store import (
    DramStore,
    Records,
    RowStore,
    SsdStore,
    StoreSettings,
    record_fields,
)

__all__ = [
    "CachedEmbeddingBagCollection", "CacheCapacityError", "cache_capacity", "POLICIES",
    "DEFAULT_CACHE_FRACTION",
]  # fmt: skip


class CachedEmbeddingBagCollection(EmbeddingCollection):
    """EmbeddingBagCollection whose dram/ssd tables train through a row cache over a store
    (``storage``: the stores' folder, I/O threads and mapped budget). Update hooks receive the
    tables' layout and ids."""

    host_resident = True

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        storage: StoreSettings | None = None,
    ) -> None:
        check_tables(tables, type(self).__name__)
        super().__init__(tables, spec)
        storage = storage or StoreSettings()
        feature_table = tuple(i for i, t in enumerate(self.tables) for _ in t.features)
        # The table-shaped layout (for hooks and callers) and the cache-shaped one the kernel runs.
        self.table_layout = TBELayout(
            rows=tuple(t.rows for t in self.tables),
            dims=tuple(t.dim for t in self.tables),
            feature_table=feature_table,
        )
        self.layout = TBELayout(
            rows=tuple(cache_capacity(t) for t in self.tables),
            dims=self.table_layout.dims,
            feature_table=feature_table,
        )
        device = as_device(device)
        self.backend: TBEBackend = get_backend(spec.backend, device)
        check_memory(self.tables, self.layout, self.optimizer.kind, device, self._host_bytes())
        # Zeroed: free cache slots hold zeros, not garbage, in state_dict().
        register_table_buffers(
            self,
            self.layout,
            self.optimizer.kind,
            device,
            weights=torch.zeros(self.layout.total_elems, device=device),
        )
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self._init_scale, self._seed = spec.init_scale, spec.seed
        self._tick = 0
        self._staged: dict[int, StagedRows] = {}
        self._prefetcher: ThreadPoolExecutor | None = None
        """One reader thread for the run (made at the first prefetch; a thread per step cost
        ~1 ms of every step to start, more on a busy machine)."""
        self._prefetch: Future[None] | None = None
        self._deferred: SparseFeatures | None = None
        self._cached: dict[int, CacheTable] = {}
        self._io_threads = storage.io_threads
        self._mapped_mb = storage.mapped_mb
        for i, t in enumerate(self.tables):
            where = getattr(t, "storage", "memory")
            if where == "memory":
                self._init_weights(i, 0, t.rows, self.layout.table(self.weights, i))
            else:
                self._cached[i] = self._make_table(i, t, where, str(storage.dir))

    # ---- construction ------------------------------------------------------------------------
    def _host_bytes(self) -> int:
        """Host memory of the dram/ssd tables beyond the cache: slot maps, DRAM row stores."""
        total = 0
        for t in self.tables:
            storage = getattr(t, "storage", "memory")
            if storage != "memory":
                total += 4 * t.rows  # slot_of
            if storage == "dram":
                total += 4 * t.rows * sum(w for _, w in record_fields(self.optimizer.kind, t.dim))
        return total

    def _init_weights(self, i: int, lo: int, hi: int, out: Tensor) -> None:
        """Initial weights of rows ``lo .. hi-1`` of table ``i`` into ``out``."""
        init_rows(self.tables[i], self._seed, lo, hi, self._init_scale, out=out)

    def _make_table(self, i: int, spec: TableConfig, storage: str, root: str) -> CacheTable:
        fields = record_fields(self.optimizer.kind, spec.dim)
        width = sum(w for _, w in fields)

        def init(lo: int, hi: int) -> Tensor:
            rec = torch.zeros(hi - lo, width)
            self._init_weights(i, lo, hi, rec[:, : spec.dim])
            return rec

        store: RowStore
        if storage == "dram":
            store = DramStore(spec.rows, fields, init, table=spec.name)
        elif storage == "ssd":
            if not root:  # (not Path(""): that is ".")
                raise ValueError(f"table '{spec.name}' has storage = 'ssd' but no storage.dir")
            path = Path(root) / f"{spec.name}.rows"
            store = SsdStore.create(path, spec.rows, fields, init, spec.name, self._io_threads)
            if self._mapped_mb > 0:  # else the store's default (a quarter of the RAM)
                store.mapped_budget = self._mapped_mb << 20
        else:
            raise ValueError(
                f"table '{spec.name}': storage must be memory, dram or ssd, got '{storage}'"
            )
        cap = self.layout.rows[i]
        policy = getattr(spec, "cache_policy", "lru")
        if policy not in POLICIES:
            raise ValueError(f"table '{spec.name}': cache_policy must be one of {POLICIES}")
        return CacheTable(
            index=i,
            name=spec.name,
            rows=spec.rows,
            dim=spec.dim,
            capacity=cap,
            policy=policy,
            store=store,
            slot_of=torch.full((spec.rows,), -1, dtype=torch.int32),
            id_of=torch.full((cap,), -1, dtype=torch.int64),
            key=torch.zeros(cap, dtype=torch.int64),
            dirty=torch.zeros(cap, dtype=torch.bool),
            pins=torch.zeros(cap, dtype=torch.int32),
            free=torch.arange(cap - 1, -1, -1, dtype=torch.int64),  # pop from the end: slot 0 first
            n_free=cap,
            counts=dict.fromkeys(
                (
                    "hits",
                    "misses",
                    "lookups",
                    "lookup_hits",
                    "evictions",
                    "writebacks",
                    "staged",
                    "spilled",
                ),
                0,
            ),
        )

    # ---- public API ----------------------------------------------------------------------------
    def stores(self) -> dict[str, RowStore]:
        """The store of each dram/ssd table, by table name."""
        return {c.name: c.store for c in self._cached.values()}

    def read_table(self, name: str) -> dict[str, Tensor]:
        """Complete copy of a table: ``weight`` [rows, dim] and its optimizer state (flushes first).

        For tests and small tables: it materializes the whole table in memory.
        """
        i = self._table_index(name)
        spec = self.tables[i]
        if i not in self._cached:
            out = {"weight": self.layout.table(self.weights, i).clone()}
            for k, s in self.optimizer_state().items():
                out[k] = self._state_view(k, s, i).clone()
            return out
        self.flush()
        c = self._cached[i]
        rec = c.store.read(torch.arange(spec.rows))
        out, col = {}, 0
        for k, w in c.store.fields:
            part = rec[:, col : col + w]
            out[k] = part.squeeze(1) if k == "momentum1" else part.contiguous()
            col += w
        return out

    def table_weight(self, name: str) -> Tensor:
        """Copy [rows, dim] of one table's current weights (flushes dram/ssd tables)."""
        return self.read_table(name)["weight"]

    def flush(self) -> None:
        """Write every dirty cached row (with its state) back and make the stores durable."""
        self._wait_prefetch()
        with one_thread():
            self._flush_locked()

    def _flush_locked(self) -> None:
        for c in self._cached.values():
            slots = torch.nonzero(c.dirty & (c.id_of >= 0)).flatten()
            if slots.numel():
                ids, order = torch.sort(c.id_of[slots])  # id order: sequential store writes
                slots = slots[order]
                self.write_records(c, ids, self._record_sources(c, slots))
                c.dirty[slots] = False
                c.counts["writebacks"] += slots.numel()
            c.store.flush()

    def write_records(self, c: CacheTable, ids: Tensor, records: Records) -> None:
        """``c.store.write``, after the table's write guards (checkpoints being read)."""
        for guard in list(c.write_guards):
            guard(ids)
        c.store.write(ids, records)

    def cache_tables(self) -> dict[str, CacheTable]:
        """The row cache of each dram/ssd table, by table name."""
        return {c.name: c for c in self._cached.values()}

    def resident_records(self, c: CacheTable, slots: Tensor) -> Tensor:
        """Records [n, width] (row and optimizer state) of cache ``slots`` of table ``c``."""
        on = slots.to(self.weights.device)
        return torch.cat([v[on].reshape(slots.numel(), -1) for v in self._field_views(c)], 1).cpu()

    def drop_cache(self) -> None:
        """Flush, then empty every table's cache: the stores hold every row, and the next batch
        reads them as after a start (a restore writes into the stores)."""
        self._wait_prefetch()
        if all(c.n_free == c.capacity for c in self._cached.values()) and not self._staged:
            return
        self.flush()
        with one_thread():
            for c in self._cached.values():
                if int(c.pins.sum()):
                    raise RuntimeError(f"table '{c.name}': cache slots in use by a batch")
                c.slot_of.fill_(-1)
                c.id_of.fill_(-1)
                c.key.zero_()
                c.dirty.zero_()
                c.free.copy_(torch.arange(c.capacity - 1, -1, -1))
                c.n_free = c.capacity
                for v in self._field_views(c):
                    v.zero_()
            self._staged, self._tick = {}, 0

    def close(self) -> None:
        """Flush, then release the stores (files) and the reader thread."""
        self.flush()
        for c in self._cached.values():
            c.store.close()
        if self._prefetcher is not None:
            self._prefetcher.shutdown()
            self._prefetcher = None

    def stats(self) -> dict[str, Any]:
        """Cache counters: totals, hit rates, bytes per tier, and the same per table."""
        return cache_stats(list(self._cached.values()))

    def stats_line(self) -> str:
        """Short progress-line text: hit rate and MB moved per tier."""
        s = self.stats()
        parts = [f"hit {100 * float(s['hit_rate']):.1f}%"]
        for tier in ("dram", "ssd"):
            if f"{tier}_bytes_read" in s:
                r, w = s[f"{tier}_bytes_read"], s[f"{tier}_bytes_written"]
                parts.append(f"{tier} r/w {float(r) / 2**20:.0f}/{float(w) / 2**20:.0f} MB")
        return "  ".join(parts)

    def prepare(self, sparse: SparseFeatures) -> None:
        """Make every row ``sparse`` reads resident now (forward does this itself; a pipeline or a
        cache simulation may call it on its own)."""
        sparse = checked_batch(self, sparse, ids=True)
        self._prepare(sparse.values.to(torch.int64), sparse.offsets(), pin=False)

    # ---- prefetch ------------------------------------------------------------------------------
    def prefetch(self, sparse: SparseFeatures, defer: bool = False) -> None:
        """Start reading, in the background, the rows ``sparse`` needs that are not resident.

        Pipeline stage: call it for batch i+1 while batch i computes. It changes no cache state;
        ``prepare`` (at forward) takes the staged rows that are still valid.

        ``defer``: start it at the end of the next forward's ``prepare`` instead (the latest
        deferred batch wins). A pipeline that stages batch i+1 *before* running step i uses it:
        started at once, the reads would hold up batch i's own ``prepare`` (which waits for the
        prefetch thread); deferred, they overlap step i's dense compute and backward.
        """
        sparse = checked_batch(self, sparse, ids=True)
        if defer:
            self._deferred = sparse
            return
        self._start_prefetch(sparse)

    def _start_prefetch(self, sparse: SparseFeatures) -> None:
        self._wait_prefetch()
        indices = sparse.values.to(torch.int64)
        bounds = self._feature_bounds(sparse.offsets(), sparse.lengths.numel())
        self._staged = {}

        def work() -> None:
            # Safe in the background: every user of the slot maps (prepare, flush) waits for
            # this read first, and backward does not touch them.
            for i, c in self._cached.items():
                ids = cache_ops.classify(self._table_ids(i, indices, bounds), c.slot_of)[0]
                rec = c.store.read(ids)
                self._staged[i] = StagedRows(ids, rec, torch.ones(ids.numel(), dtype=torch.bool))

        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="neorec-prefetch")
        self._prefetch = self._prefetcher.submit(work)

    def _wait_prefetch(self) -> None:
        """Wait for the background read; its error is raised here, in the training thread."""
        fut, self._prefetch = self._prefetch, None
        if fut is None:
            return
        try:
            fut.result()
        except BaseException:
            self._staged = {}
            raise

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order.

        Ids are always range-checked (whatever ``validate_ids`` says): the slot maps are indexed
        by id. A batch refused here or in backward leaves the tables, their state and the step
        as they were (its cache slots are released, not marked dirty).
        """
        sparse = checked_batch(self, sparse, ids=True)
        dev = self.weights.device
        indices = sparse.values.to(torch.int64)
        offsets = sparse.offsets()
        psw = sparse.weights.to(dev) if sparse.weights is not None else None
        samples = sparse.batch_size
        training = torch.is_grad_enabled() and self._anchor.requires_grad
        backend: TBEBackend = self.backend
        if batch_fits(self, indices, offsets):
            slots, used = self._prepare(indices, offsets, pin=training)
        else:  # in chunks that fit (neorec.storage.spill)
            slots, used, backend = indices, {}, SpillBackend(self)
        slots, offsets_dev = slots.to(dev), offsets.to(dev)
        lookup = Lookup(slots, offsets_dev, psw, self.pooling)

        def update(grad_output: Tensor) -> None:
            written = False
            try:
                if samples:
                    check_grad_output(grad_output, self.layout)
                    check_finite_weights(psw)
                    step = int(self.step) + 1
                    backend.backward_update(
                        self.layout,
                        self.weights,
                        self.optimizer_state(),
                        lookup,
                        grad_output,
                        self.optimizer,
                        step,
                    )
                    self.step.fill_(step)  # counted once the update went through
                    written = True
            finally:
                self._release(used, dirty=written)
            if written:
                for hook in self._hooks:
                    hook(self.table_layout, indices, offsets)

        try:
            return tbe_lookup(self._anchor, backend, self.layout, self.weights, lookup, update)
        except BaseException:
            if training:
                self._release(used, dirty=False)
            raise

    def _release(self, used: dict[int, Tensor], dirty: bool) -> None:
        """Unpin a batch's slots (marked dirty if its update was written)."""
        with one_thread():
            for i, s in used.items():
                c = self._cached[i]
                if dirty:
                    c.dirty[s] = True
                c.pins[s] -= 1

    # ---- the cache -----------------------------------------------------------------------------
    def _feature_bounds(self, offsets: Tensor, bags: int) -> list[tuple[int, int]]:
        b = bags // max(1, len(self.feature_names))
        cuts = offsets[:: max(b, 1)].tolist() if b else [0] * (len(self.feature_names) + 1)
        return [(cuts[f], cuts[f + 1]) for f in range(len(self.feature_names))]

    def _table_ids(self, i: int, indices: Tensor, bounds: list[tuple[int, int]]) -> Tensor:
        segs = [
            indices[lo:hi] for f, (lo, hi) in enumerate(bounds) if self.layout.feature_table[f] == i
        ]
        return segs[0] if len(segs) == 1 else torch.cat(segs) if segs else indices[:0]

    def _prepare(
        self, indices: Tensor, offsets: Tensor, pin: bool
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Make every id resident; returns (slot indices for the kernel, distinct slots per table)."""
        self._wait_prefetch()
        with one_thread():
            out = self._prepare_locked(indices, offsets, pin)
        if self._deferred is not None:
            nxt, self._deferred = self._deferred, None
            self._start_prefetch(nxt)
        return out

    def _prepare_locked(
        self, indices: Tensor, offsets: Tensor, pin: bool
    ) -> tuple[Tensor, dict[int, Tensor]]:
        self._tick += 1
        bounds = self._feature_bounds(offsets, offsets.numel() - 1)
        used: dict[int, Tensor] = {}
        slot_of_table: dict[int, Tensor] = {}
        for i, c in self._cached.items():
            used[i] = self._admit(c, self._table_ids(i, indices, bounds))
            if pin:
                c.pins[used[i]] += 1
            slot_of_table[i] = c.slot_of
        if not self._cached:
            return indices, used
        out = torch.empty_like(indices)
        for f, (lo, hi) in enumerate(bounds):
            t = self.layout.feature_table[f]
            if t in slot_of_table:
                cache_ops.remap(indices[lo:hi], slot_of_table[t], out[lo:hi])
            else:
                out[lo:hi] = indices[lo:hi]
        return out, used

    def _admit(self, c: CacheTable, ids: Tensor) -> Tensor:
        """Make ``ids`` of table ``c`` resident; returns their distinct slots (any order)."""
        mark = torch.zeros(c.capacity, dtype=torch.bool)
        lfu = c.policy == "lfu"
        missing, hit_slots, lookup_hits, fits = cache_ops.classify(
            ids, c.slot_of, mark, c.key, self._tick, lfu
        )
        n_hit, n_miss = hit_slots.numel(), missing.numel()
        if not fits:  # (the misses are not all counted then: count the distinct ids here)
            need = int(torch.unique(ids).numel())
            raise CacheCapacityError(
                f"table '{c.name}': a batch needs {need} distinct rows but its cache "
                f"holds {c.capacity}; raise cache_rows / cache_fraction or lower the batch size"
            )
        if n_miss:
            if n_miss > c.n_free:
                self._evict(c, n_miss - c.n_free, mark)
            new = c.free[c.n_free - n_miss : c.n_free].clone()
            c.n_free -= n_miss
            self._fill(c, new, missing)
            cache_ops.fill_commit(
                new, missing, c.slot_of, c.id_of, c.dirty, c.key, mark, self._tick, lfu
            )
        c.counts["hits"] += n_hit
        c.counts["misses"] += n_miss
        c.counts["lookups"] += ids.numel()
        c.counts["lookup_hits"] += lookup_hits
        return torch.cat([hit_slots, new]) if n_miss else hit_slots

    def _evict(self, c: CacheTable, need: int, keep: Tensor) -> None:
        """Evict at least ``need`` resident slots not in ``keep`` nor pinned (dirty ones written
        back); up to capacity / EVICT_CHUNK when that many are evictable. Victims are the
        smallest (key, slot): LRU/LFU order, ties to the lower slot."""
        victims, evictable = cache_ops.select_victims(
            c.key, c.pins, c.id_of, keep, need, c.capacity // EVICT_CHUNK
        )
        if evictable < need:
            raise CacheCapacityError(
                f"table '{c.name}': {need} rows must be evicted but only {evictable} are not "
                f"used by this batch or by batches still awaiting backward; raise cache_rows"
            )
        dirty = c.dirty[victims]
        n_dirty = int(dirty.sum())
        if n_dirty:
            w_slots = victims[dirty]
            w_ids, order = torch.sort(c.id_of[w_slots])
            # Written before any bookkeeping changes: if the store fails, the cache is untouched.
            self.write_records(c, w_ids, self._record_sources(c, w_slots[order]))
            self._invalidate_staged(c.index, w_ids)
            c.counts["writebacks"] += n_dirty
        c.n_free = cache_ops.evict_commit(victims, c.id_of, c.slot_of, c.dirty, c.free, c.n_free)
        c.counts["evictions"] += victims.numel()

    def _fill(self, c: CacheTable, slots: Tensor, ids: Tensor) -> None:
        """Load rows ``ids`` (sorted, distinct) into ``slots``: staged records first, else read."""
        st = self._staged.get(c.index)
        todo = slice(None)
        if st is not None and st.ids.numel():
            pos = cache_ops.match_sorted(ids, st.ids, st.valid)
            found = pos >= 0
            n_found = int(found.sum())
            if n_found:
                self._scatter_records(c, slots, st.records, pos)
                c.counts["staged"] += n_found
                if n_found == ids.numel():
                    return
                todo = ~found  # type: ignore[assignment]
        t_ids, t_slots = ids[todo], slots[todo]
        self._scatter_records(c, t_slots, c.store.read(t_ids))

    def _invalidate_staged(self, i: int, written: Tensor) -> None:
        """A staged copy of a row written since it was read is stale (``written`` sorted)."""
        st = self._staged.get(i)
        if st is not None and st.ids.numel():
            cache_ops.invalidate_sorted(written, st.ids, st.valid)

    # ---- records <-> cache buffers ---------------------------------------------------------------
    def _state_view(self, k: str, s: Tensor, i: int) -> Tensor:
        if k == "momentum1":
            return s[self.layout.row_offsets[i] : self.layout.row_offsets[i + 1]]
        return self.layout.table(s, i)

    def _field_views(self, c: CacheTable) -> list[Tensor]:
        """The cache buffers of table ``c``, one per record field ([capacity, w] or [capacity])."""
        views = []
        for k, _ in c.store.fields:
            if k == "weight":
                views.append(self.layout.table(self.weights, c.index))
            else:
                views.append(self._state_view(k, getattr(self, k), c.index))
        return views

    def _record_sources(self, c: CacheTable, slots: Tensor) -> Records:
        """The records of cache ``slots`` for ``RowStore.write`` (``cache_records``)."""
        return record_sources(self._field_views(c), slots)

    def _scatter_records(
        self, c: CacheTable, slots: Tensor, rec: Tensor, rows: Tensor | None = None
    ) -> None:
        """Cache ``slots[i]`` = record ``rows[i]`` of ``rec`` (``cache_records``)."""
        scatter_records(c.store.fields, self._field_views(c), slots, rec, rows)

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")
