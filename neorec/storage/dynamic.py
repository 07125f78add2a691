"""DynamicEmbeddingBagCollection: tables of raw 64-bit ids (any value) mapped to a fixed number
of slots by an id map with admission and eviction (``neorec.ops.id_map``), then looked up and
trained by the normal TBE on a slot buffer.

Per table (``kind = "dynamic"``) the buffer holds ``capacity`` slot rows (``capacity`` 0 =
``rows``), plus one shared default row when ``unadmitted = "default_row"``. A forward maps each
table's ids (features in order, then positions) through its ``IdMap``; a slot assigned in this
batch gets its row initialised from (seed, table, raw id) and its optimizer state zeroed, so a
re-admitted id starts fresh and deterministically; a slot evicted and not reassigned is zeroed.
Unadmitted ids read the default row (which trains like any row) or, with ``zeros``, are dropped
from their bags before the TBE (no contribution, no update; a mean bag averages the rest).

Training (grad enabled) maps with admission and eviction and pins the batch's slots until its
backward has updated them (a pipelined next batch cannot evict them); without grad (eval) the
maps are only read: ids without a slot are unadmitted and nothing changes.

Tables on dram / ssd keep their slot rows in a store behind the row cache:
``neorec.storage.dynamic_cached.DynamicCachedEmbeddingBagCollection`` (this class with its slot
buffer delegated: ``_make_rows``, ``_resident``, ``_fast``, ``_unhold``, ``_reset_rows`` and the
``_read_slots`` / ``_write_slots`` / ``_clear_slots`` of the by-id state).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.collection_parts import (
    as_device,
    check_memory,
    check_tables,
    checked_batch,
    feature_maps,
    register_table_buffers,
)
from neorec.ops.id_map import IdMap, RowTarget, _mix64_np, mix64
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
from neorec.storage.dynamic_state import (
    DynamicTableState,
    check_table_state,
    export_table_state,
    import_table_state,
)
from neorec.storage.mixed import MixedEmbeddingBagCollection

__all__ = [
    "DynamicEmbeddingBagCollection",
    "DynamicTableState",
    "MixedEmbeddingBagCollection",
    "dynamic_init_rows",
    "table_capacity",
]

_M64 = (1 << 64) - 1


def table_capacity(spec: TableConfig) -> int:
    """Slots of a dynamic table: ``capacity``, or ``rows`` when it is 0."""
    return int(getattr(spec, "capacity", 0) or spec.rows)


def _init_params(spec: TableConfig, seed: int, init_scale: float) -> tuple[float, int]:
    """(bound, salt) of a table's initial rows (see ``dynamic_init_rows``)."""
    bound = init_scale or math.sqrt(1.0 / table_capacity(spec))
    salt = mix64(((int(seed) & _M64) * 0x100000001B3 ^ zlib.crc32(spec.name.encode())) & _M64)
    return bound, salt


def dynamic_init_rows(
    spec: TableConfig, seed: int, ids: Tensor, init_scale: float = 0.0, default: bool = False
) -> Tensor:
    """Initial rows [len(ids), dim] of raw ``ids`` of a dynamic table (``default``: its shared
    default row, ``ids`` ignored but for their count).

    Element (id, c) is uniform in +-bound (``init_scale``, else sqrt(1/capacity)) from 24 bits
    of ``x = mix64(mix64(id ^ salt) + c // 2)`` (bits 40-63 for even c, 16-39 for odd c), salt
    from (seed, table name): the same row for the same id whenever and wherever it is admitted
    (the compiled map writes the same bits, ``im_reset_rows``).
    """
    bound, salt = _init_params(spec, seed, init_scale)
    if default:
        salt = mix64(salt ^ 0xDEFA017DEFA017)
    u = ids.to(torch.int64).contiguous().numpy().view(np.uint64)
    h = _mix64_np(u ^ np.uint64(salt))
    cols = np.arange(spec.dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _mix64_np(h[:, None] + (cols[None, :] >> np.uint64(1)))
    shift = np.where(cols % np.uint64(2) == 0, np.uint64(40), np.uint64(16))
    bits = (x >> shift[None, :]) & np.uint64(0xFFFFFF)
    vals = torch.from_numpy(bits.astype(np.float32)).mul_(2.0**-24)
    return vals.mul_(2 * bound).sub_(bound)


class DynamicEmbeddingBagCollection(EmbeddingCollection):
    """EmbeddingBagCollection over ``kind = "dynamic"`` tables: raw ids -> slots -> TBE.

    Same interface as ``EmbeddingBagCollection`` for forward / backward (the fused update),
    ``add_update_hook`` (hooks receive the slot layout and slot indices), ``optimizer_state``,
    ``table_weight`` (the slot rows); plus ``id_maps``, ``slots_of``, ``stats``. Raw ids are
    never refused (``spec.validate_ids`` does not apply); ``native``: the id maps' compiled form
    (None: when built).
    """

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        native: bool | None = None,
    ) -> None:
        who = type(self).__name__
        check_tables(tables, who)
        for t in tables:
            where = f"{who}: table '{t.name}'"
            if getattr(t, "kind", "fixed") != "dynamic":
                raise ConfigError(f"{where} has kind {getattr(t, 'kind', 'fixed')!r}, not dynamic")
            if (t.precision or "fp32") != "fp32":
                raise ConfigError(f"{where}: dynamic tables are fp32, got {t.precision!r}")
            if t.storage != "memory" and not self._cached_slots:
                raise ConfigError(
                    f"{where} has storage {t.storage!r}: dram/ssd dynamic tables need "
                    "DynamicCachedEmbeddingBagCollection (the sharded form builds one per rank)"
                )
        super().__init__(tables, spec)
        self.validate_ids = False  # raw ids: any int64
        feature_table = tuple(i for i, t in enumerate(self.tables) for _ in t.features)
        self.capacities = [table_capacity(t) for t in self.tables]
        self.default_rows = [t.unadmitted == "default_row" for t in self.tables]
        self.layout = TBELayout(
            rows=tuple(c + int(d) for c, d in zip(self.capacities, self.default_rows)),
            dims=tuple(t.dim for t in self.tables),
            feature_table=feature_table,
        )
        device = as_device(device)
        self.backend: TBEBackend = get_backend(spec.backend, device)
        seed, init_scale = spec.seed, spec.init_scale
        self._seed, self._init_scale = seed, init_scale
        self._make_rows(spec, device)
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables, table_capacity)
        self.id_maps = [
            IdMap(
                c, t.admission, t.admit_threshold, t.admit_probability, t.eviction,
                t.ttl_steps, seed=seed * 1_000_003 + zlib.crc32(t.name.encode()), native=native,
            )
            for c, t in zip(self.capacities, self.tables)
        ]  # fmt: skip
        self._pins = [torch.zeros(c, dtype=torch.int32) for c in self.capacities]
        self._touched = [torch.zeros(c, dtype=torch.bool) for c in self.capacities]
        self._init = [_init_params(t, seed, init_scale) for t in self.tables]
        self._targets: dict[int, tuple[tuple[int, ...], RowTarget | None]] = {}
        first = [self.layout.feature_table.index(i) for i in range(len(self.tables))]
        self._feature_span = [(f, f + len(t.features)) for f, t in zip(first, self.tables)]
        self._last: list[dict[str, int]] = [self._zero_counts() for _ in self.tables]

    _cached_slots = False
    """Whether the slot rows live behind a row cache (``DynamicCachedEmbeddingBagCollection``)."""

    def _make_rows(self, spec: CollectionSpec, device: torch.device) -> None:
        """The slot rows: one flat buffer of every table's slots (+ default row) and the optimizer
        state, zeros but for the default rows."""
        check_memory(self.tables, self.layout, self.optimizer.kind, device)
        weights = torch.zeros(self.layout.total_elems, device=device)
        register_table_buffers(self, self.layout, self.optimizer.kind, device, weights=weights)
        for i in range(len(self.tables)):
            if self.default_rows[i]:
                self._table(i)[self.capacities[i]] = self._default_row(i).to(device)

    def _default_row(self, i: int) -> Tensor:
        """The initial default row [dim] of table ``i``."""
        spec = self.tables[i]
        row = dynamic_init_rows(spec, self._seed, torch.zeros(1), self._init_scale, default=True)
        return row[0]

    # ---- inspection ----------------------------------------------------------------------------
    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {"admitted": 0, "evicted": 0, "unadmitted": 0, "lookups": 0}

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise ConfigError(
            f"{type(self).__name__}: no dynamic table '{name}' (tables: "
            f"{[t.name for t in self.tables]})"
        )

    def _table(self, i: int) -> Tensor:
        return self.layout.table(self.weights, i)

    def table_weight(self, name: str) -> Tensor:
        """One table's slot rows [capacity (+1 default row), dim] (a view)."""
        return self._table(self._table_index(name))

    def id_map(self, name: str) -> IdMap:
        """The id map of table ``name``."""
        return self.id_maps[self._table_index(name)]

    def slots_of(self, name: str, ids: Tensor) -> Tensor:
        """The slot of each raw id of table ``name`` (-1 = none), changing nothing."""
        return self.id_map(name).lookup(ids)

    def stats(self) -> dict[str, Any]:
        """Per table: admitted / evicted / unadmitted lookups / lookups in the last training
        step and in total, occupancy and capacity."""
        out: dict[str, Any] = {}
        for i, t in enumerate(self.tables):
            m = self.id_maps[i]
            out[t.name] = {
                "step": dict(self._last[i]),
                "total": dict(m.totals),
                "occupancy": m.occupancy,
                "capacity": m.capacity,
            }
        return out

    def export_table(self, name: str) -> DynamicTableState:
        """Table ``name`` by raw id: live ids (ascending), rows, optimizer state, the map's
        bookkeeping (see ``DynamicTableState``); copies on the CPU."""
        return export_table_state(self, self._table_index(name))

    def check_import_table(self, name: str, state: DynamicTableState) -> None:
        """Raise what ``import_table(name, state)`` would refuse (``ConfigError``), changing
        nothing (a restore checks every table before it changes any)."""
        check_table_state(self, self._table_index(name), state)

    def import_table(self, name: str, state: DynamicTableState) -> None:
        """Replace table ``name``'s map, rows and optimizer state by ``state`` (ids take new
        slots; later decisions are those of the exported map). Refuses (``ConfigError``) more
        ids than the capacity, another dim or another optimizer's state."""
        import_table_state(self, self._table_index(name), state)

    def take_touched(self, name: str) -> Tensor:
        """Slots of table ``name`` whose id, row, state or bookkeeping changed since the last
        call (bool [capacity]; training lookups and admissions), and start anew. A slot whose id
        was evicted and not reassigned is not marked: compare the live ids for deletions."""
        i = self._table_index(name)
        out = self._touched[i]
        self._touched[i] = torch.zeros_like(out)
        return out

    # ---- rows ------------------------------------------------------------------------------------
    def _state_views(self, i: int) -> list[Tensor | None]:
        """Table ``i``'s optimizer state: per-row, then up to two [rows, dim] views."""
        st = self.optimizer_state()
        states: list[Tensor | None] = [None, None, None]
        if "momentum1" in st:
            states[0] = self._state_rows(i, "momentum1", st["momentum1"])
        for j, k in enumerate(k for k in ("exp_avg", "exp_avg_sq") if k in st):
            states[1 + j] = self._state_rows(i, k, st[k])
        return states

    def _row_target(self, i: int) -> RowTarget | None:
        """Where the compiled map resets table ``i``'s rows (None: no C, not on the CPU); kept
        while the buffers stay where they are."""
        key = (self.weights.data_ptr(), *(t.data_ptr() for t in self.optimizer_state().values()))
        hit = self._targets.get(i)
        if hit is not None and hit[0] == key:
            return hit[1]
        w = self._table(i)
        states = self._state_views(i)
        ok = self.id_maps[i].native and all(
            t.device.type == "cpu" and t.is_contiguous() for t in [w, *states] if t is not None
        )
        target = None
        if ok:
            bound, salt = self._init[i]
            ptr = [0 if t is None else t.data_ptr() for t in states]
            target = RowTarget(
                w.data_ptr(), w.shape[1], ptr[0], ptr[1], ptr[2], salt, 2 * bound, bound
            )
        self._targets[i] = (key, target)
        return target

    def _reset_rows(self, i: int, slots: Tensor, ids: Tensor | None) -> None:
        """Rows ``slots`` of table ``i``: initial rows of ``ids`` (zeros when None); zero state."""
        if slots.numel() == 0:
            return
        bound, salt = self._init[i]
        if self.id_maps[i].reset_rows(
            slots, ids, self._table(i), self._state_views(i), salt, bound
        ):
            return  # compiled
        dev = self.weights.device
        s = slots.to(dev)
        spec = self.tables[i]
        if ids is None:
            self._table(i)[s] = 0.0
        else:
            self._table(i)[s] = dynamic_init_rows(spec, self._seed, ids, self._init_scale).to(dev)
        for k, st in self.optimizer_state().items():
            self._state_rows(i, k, st)[s] = 0.0

    def _map_table(self, i: int, ids: Tensor, training: bool) -> tuple[Tensor, Tensor]:
        """(slot of each id, the default row or -1 where unadmitted; the distinct slots used,
        pinned until the batch's update) of table ``i``."""
        m = self.id_maps[i]
        miss = self.capacities[i] if self.default_rows[i] else -1
        if not training:
            got = m.lookup(ids)
            if miss >= 0:
                got = torch.where(got >= 0, got, miss)
            return got, got[:0]
        rows = self._row_target(i)
        r = m.map(ids, self._pins[i], miss, pin_used=True, touched=self._touched[i], rows=rows)
        # (the map pinned the used slots and marked them touched for the checkpoints)
        if not r.rows_reset:
            self._reset_rows(i, r.freed_slots, None)
            self._reset_rows(i, r.new_slots, r.new_ids)
        self._last[i] = {
            "admitted": r.admitted,
            "evicted": r.evicted,
            "unadmitted": r.unadmitted,
            "lookups": ids.numel(),
        }
        return r.slots, r.used

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order.

        The batch must be well formed (lengths, per-id weights); ids are any int64. A batch
        refused here changes nothing.
        """
        sparse = checked_batch(self, sparse)
        dev = self._anchor.device
        samples = sparse.batch_size
        training = torch.is_grad_enabled() and self._anchor.requires_grad
        used: list[Tensor] = []  # distinct map slots per table (pinned until the update)

        def release() -> None:
            for i, u in enumerate(used):  # (numpy indexing: far cheaper than torch's here)
                self._pins[i].numpy()[u.numpy()] -= 1

        try:
            slots, offsets, psw = self._slot_batch(sparse, training, used)
            rows, held = self._resident(slots, offsets, training)
        except BaseException:
            release()
            raise
        indices, offsets = slots.to(dev), offsets.to(dev)
        rows = indices if rows is slots else rows.to(dev)
        psw = psw.to(dev) if psw is not None else None
        layout, weights, state = self._fast()
        backend = self._kernel(held)
        lookup = Lookup(rows, offsets, psw, self.pooling)

        def update(grad_output: Tensor) -> None:
            written = False
            try:
                if samples == 0:
                    return
                check_grad_output(grad_output, layout)
                check_finite_weights(psw)
                step = int(self.step) + 1
                backend.backward_update(
                    layout, weights, state, lookup, grad_output, self.optimizer, step
                )
                self.step.fill_(step)
                written = True
            finally:
                self._unhold(held, written)
                release()
            for hook in self._hooks:
                hook(self.layout, indices, offsets)

        try:
            return tbe_lookup(self._anchor, backend, layout, weights, lookup, update)
        except BaseException:
            if training:
                self._unhold(held, False)
                release()
            raise

    def _slot_batch(
        self, sparse: SparseFeatures, training: bool, used: list[Tensor]
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(slots, offsets, per-id weights) of a checked batch: its ids mapped (``training``:
        with admission and eviction, each table's distinct slots pinned and appended to
        ``used``) or looked up; unadmitted ids without a default row dropped from their bags."""
        raw = sparse.values.to(torch.int64)
        offsets = sparse.offsets()
        psw = sparse.weights
        b, nf = sparse.batch_size, len(self.feature_names)
        cuts = offsets[:: max(b, 1)].tolist() if b else [0] * (nf + 1)
        slots = torch.empty_like(raw)
        for i, (f0, f1) in enumerate(self._feature_span):  # a table's features: contiguous
            got, u = self._map_table(i, raw[cuts[f0] : cuts[f1]], training)
            used.append(u)
            slots[cuts[f0] : cuts[f1]] = got
        keep = slots >= 0
        if not bool(keep.all()):  # zeros: drop unadmitted ids, keep the bags
            bag = torch.repeat_interleave(
                torch.arange(sparse.lengths.numel()), sparse.lengths.to(torch.int64)
            )
            lengths = torch.bincount(bag[keep], minlength=sparse.lengths.numel())
            slots = slots[keep]
            psw = psw[keep] if psw is not None else None
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
        return slots, offsets, psw

    # ---- where the slot rows are (a row cache overrides these) ---------------------------------
    def _resident(self, slots: Tensor, offsets: Tensor, training: bool) -> tuple[Tensor, Any]:
        """(the kernel's row of each slot in ``slots``, what ``_unhold`` releases): the slots."""
        return slots, None

    def _fast(self) -> tuple[TBELayout, Tensor, dict[str, Tensor]]:
        """The kernel's layout, weights and optimizer state."""
        return self.layout, self.weights, self.optimizer_state()

    def _kernel(self, held: Any) -> TBEBackend:
        """The backend that runs a batch (``held``: what ``_resident`` returned)."""
        return self.backend

    def _unhold(self, held: Any, written: bool) -> None:
        """After a batch's update (``written``) or its failure: release what ``_resident`` held."""

    def _read_slots(self, i: int, slots: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Copies on the CPU of table ``i``'s rows [n, dim] and optimizer state at ``slots``."""
        cpu, s = torch.device("cpu"), slots.to(self.weights.device)
        st = {
            k: self._state_rows(i, k, v)[s].to(cpu).clone()
            for k, v in self.optimizer_state().items()
        }
        return self._table(i)[s].to(cpu).clone(), st

    def _state_rows(self, i: int, k: str, st: Tensor) -> Tensor:
        """Table ``i``'s rows of state ``k`` ([rows] for momentum1, else [rows, dim])."""
        if k == "momentum1":
            return st[self.layout.row_offsets[i] : self.layout.row_offsets[i + 1]]
        return self.layout.table(st, i)

    def _write_slots(self, i: int, slots: Tensor, rows: Tensor, states: dict[str, Tensor]) -> None:
        """Table ``i``'s rows at ``slots`` = ``rows``; its state there = ``states`` (those
        given)."""
        s = slots.to(self.weights.device)
        with torch.no_grad():
            self._table(i)[s] = rows.to(self.weights.device, torch.float32)
            for k, st in self.optimizer_state().items():
                if k in states:
                    self._state_rows(i, k, st)[s] = states[k].to(st.device, st.dtype)

    def _clear_slots(self, i: int, live: Tensor) -> None:
        """Zero table ``i``'s slot rows and state (at least the ``live`` slots: the others are
        zeros already), not its default row."""
        cap = self.capacities[i]
        with torch.no_grad():
            self._table(i)[:cap] = 0.0
            for k, st in self.optimizer_state().items():
                self._state_rows(i, k, st)[:cap] = 0.0
