"""ShardedDynamicEmbeddingBagCollection: dynamic tables sharded row-wise by a hash of the raw id.

Rank r owns the raw ids x with ``owner_of(x, W) == r`` (``neorec.distributed.dynamic_reshard``:
the top 32 bits of SplitMix64(x) scaled to the world; seed- and table-independent). Each rank
holds a ``DynamicEmbeddingBagCollection`` (the unsharded module) of ``ceil(capacity / W)`` slots
per table over the ids it owns: its id map admits and evicts among them only. One forward::

    input_dist: each (bag, raw id[, weight]) of this rank's b samples goes to the id's owner
      (all-to-all of a header, then lengths + ids, then weights)
    compute:    the owner maps its ids to slots (admission / eviction) and pools its partial bag
                sums over the bags of all ranks' samples (sum pooling)
    output_dist: partial sums back to the samples' ranks (all-to-all), added in rank order;
                mean pooling divides by the full bag length (minus unadmitted ids dropped by
                ``zeros`` tables, counted by their owners)

Backward: each owner's partial sums get the pooled gradient of their bags (scaled by 1/W: the
global-batch semantics of ``ShardedEmbeddingBagCollection``) and the owner's fused update runs on
its rows. Initial rows and admission decisions depend on (seed, table, raw id) only, so W ranks
with b samples each train what one process trains on the W*b samples, as long as no rank's map
is full (eviction and the threshold sketch are per rank; see docs/dynamic.md).

``unadmitted = "default_row"``: the shared row is a replica on every rank (not in the local
collections, which drop unadmitted ids); owners add ``(summed weight of the bag's unadmitted
ids) x row`` to their partial sums, and the row's gradient is summed over ranks in rank order
before one fused update, so the replicas stay identical and train as the unsharded row does.

Tables on dram / ssd: a rank's part is a ``DynamicCachedEmbeddingBagCollection`` whose slot rows
live in the rank's own stores (``<storage.dir>/rank<r>``) behind a row cache over the rank's slots
(``neorec.distributed.dynamic_parts``); everything above is unchanged (bitwise the in-memory form).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from neorec.config import TableConfig
from neorec.distributed.comm import AllToAllPooled, CommStats, ScaleGrad, all_to_all
from neorec.distributed.dynamic_parts import build_parts, check_same_everywhere, parts_stats
from neorec.distributed.dynamic_reshard import (
    TableShard,
    as_global_state,
    owner_of,
    rank_state,
    saved_shards,
)
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec, EmbeddingCollection, UpdateHook
from neorec.modules.collection_parts import (
    as_device,
    check_tables,
    checked_batch,
    feature_maps,
    register_table_buffers,
)
from neorec.ops.tbe import PoolingMode, TBELayout, apply_row_grads
from neorec.sparse import SparseFeatureError, SparseFeatures
from neorec.storage.dynamic import (
    DynamicEmbeddingBagCollection,
    dynamic_init_rows,
    table_capacity,
)
from neorec.storage.dynamic_state import DynamicTableState
from neorec.storage.store import StoreSettings

__all__ = ["ShardedDynamicEmbeddingBagCollection", "DynamicLocalInput", "rank_capacity"]

_HEADER = 3  # per destination: local batch size, ids sent, per-id weights (0/1)
_COUNTS = ("admitted", "evicted", "unadmitted", "lookups")


def rank_capacity(capacity: int, world: int) -> int:
    """Slots of a table on each rank: ``ceil(capacity / world)``."""
    return -(-capacity // world)


@dataclass
class DynamicLocalInput:
    """What input_dist delivers to an owner: the bags of every rank's samples, its ids only."""

    sparse: SparseFeatures
    """Features in order; bags of source 0's samples, then source 1's, ... (N = sum of b)."""
    batch_sizes: list[int]
    """b of each source rank."""
    lengths: Tensor
    """[b, F] full bag lengths of this rank's own samples (for mean pooling)."""


class ShardedDynamicEmbeddingBagCollection(EmbeddingCollection):
    """The row-wise-by-id-hash sharded form of ``DynamicEmbeddingBagCollection``: same forward
    (pooled [b, sum of dims] for this rank's samples), same training (fused update in backward).

    Every rank of ``group`` builds it with the same tables, optimizer, pooling and seed (checked:
    one ``ConfigError`` on every rank otherwise). Without an initialized process group it runs
    as one rank, on the CPU. ``stats``: where its collectives count (default: its own);
    ``native``: the id maps' compiled form (None: when built); ``storage``: the row stores of
    dram / ssd tables (as ``DynamicCachedEmbeddingBagCollection``'s; this rank's in
    ``<storage.dir>/rank<r>``).
    """

    weights: Tensor
    default_weights: Tensor
    default_step: Tensor
    _perm: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        *,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        native: bool | None = None,
        storage: StoreSettings | None = None,
    ) -> None:
        who = type(self).__name__
        check_tables(tables, who)
        if as_device(device).type != "cpu":
            raise ConfigError(f"{who}: dynamic tables are sharded on the CPU only, got {device!r}")
        for t in tables:
            if not isinstance(t, TableConfig) or getattr(t, "kind", "fixed") != "dynamic":
                kind = getattr(t, "kind", type(t).__name__)
                raise ConfigError(
                    f"{who}: table '{getattr(t, 'name', t)}' has kind {kind!r}; only kind = "
                    "'dynamic' tables are sharded by id hash (fixed tables go to "
                    "ShardedEmbeddingBagCollection)"
                )
        super().__init__(tables, spec)
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.comm_stats = stats if stats is not None else CommStats()
        check_same_everywhere(who, self.tables, spec, self.group)
        self.validate_ids = False
        self.feature_dims = [t.dim for t in self.tables for _ in t.features]
        self.total_dim = sum(self.feature_dims)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables, table_capacity)
        self.weights = torch.empty(0)  # dtype of pooled outputs for the batch checks: float32
        self.capacities = [rank_capacity(table_capacity(t), self.world) for t in self.tables]
        # Local collections: per-rank capacity, unadmitted ids dropped (the default row is ours),
        # grouped by init bound so each id's initial row is the unsharded one.
        bounds = [spec.init_scale or math.sqrt(1.0 / table_capacity(t)) for t in self.tables]
        self.parts: list[DynamicEmbeddingBagCollection] = build_parts(
            self.tables, self.capacities, bounds, spec, native, self.rank, storage
        )
        self.host_resident = any(p.host_resident for p in self.parts)
        self._parts = nn.ModuleList(self.parts)  # registered: in state_dict, .to(), ...
        self._part_of = {t.name: p for p in self.parts for t in p.tables}
        col0 = [0]
        for d in self.feature_dims:
            col0.append(col0[-1] + d)
        cols = {f: range(col0[i], col0[i + 1]) for i, f in enumerate(self.feature_names)}
        order = [c for p in self.parts for f in p.feature_names for c in cols[f]]
        inv = torch.empty(len(order), dtype=torch.int64)
        inv[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
        self.register_buffer("_perm", inv, persistent=False)
        self._col0 = col0
        self._build_default_rows(spec.seed, spec.init_scale)
        self._global: Tensor | None = None  # [table, step counts + totals + occupancy] summed

    def _build_default_rows(self, seed: int, init_scale: float) -> None:
        self.default_tables = [
            i for i, t in enumerate(self.tables) if t.unadmitted == "default_row"
        ]
        dims = tuple(self.tables[i].dim for i in self.default_tables)
        self.default_layout = TBELayout(
            rows=(1,) * len(dims), dims=dims, feature_table=tuple(range(len(dims)))
        )
        rows = [
            dynamic_init_rows(self.tables[i], seed, torch.zeros(1), init_scale, default=True)[0]
            for i in self.default_tables
        ]
        w = torch.cat(rows) if rows else torch.zeros(0)
        register_table_buffers(
            self, self.default_layout, self.optimizer.kind, torch.device("cpu"), "default_", w
        )
        self._default_anchor = torch.empty(0, requires_grad=True)
        # per feature: its default table's index in default_tables (-1: none)
        dt = {ti: k for k, ti in enumerate(self.default_tables)}
        self._feature_default = [
            dt.get(ti, -1) for ti, t in enumerate(self.tables) for _ in t.features
        ]
        self._feature_zeros = [t.unadmitted == "zeros" for t in self.tables for _ in t.features]

    # ---- interface of a collection -------------------------------------------------------------
    @property
    def step(self) -> Tensor:
        """The fused updates applied so far."""
        return self.parts[0].step

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, slot_indices, offsets)`` after every local collection's update
        (its slot layout, this rank's slots)."""
        for p in self.parts:
            p.add_update_hook(hook)

    def local_part(self, name: str) -> DynamicEmbeddingBagCollection:
        """The local collection holding this rank's share of table ``name``."""
        if name not in self._part_of:
            raise ConfigError(
                f"{type(self).__name__}: no dynamic table '{name}' (tables: "
                f"{[t.name for t in self.tables]})"
            )
        return self._part_of[name]

    def table_weight(self, name: str) -> Tensor:
        """This rank's slot rows of table ``name`` (a view; a copy, flushed, on dram / ssd)."""
        return self.local_part(name).table_weight(name)

    def local_stats(self) -> dict[str, Any]:
        """Per table, this rank's map: ``DynamicEmbeddingBagCollection.stats`` (on dram / ssd
        with its cache's counters under ``cache``, this rank's cache totals at the top level)."""
        return parts_stats(self.parts)

    def flush(self) -> None:
        """Write every part's dirty cached slot rows back to its stores (nothing in memory)."""
        for p in self.parts:
            p.flush()

    def close(self) -> None:
        """Flush, then release the parts' stores (files)."""
        for p in self.parts:
            p.close()

    def stats(self) -> dict[str, Any]:
        """Per table, every rank's maps together (``DynamicEmbeddingBagCollection.stats``: last
        step's and running counts, occupancy and capacity summed over ranks, as of the last
        forward or import, which gather them); one rank: its map's. Row cache counters (dram /
        ssd) are this rank's, as in ``local_stats``."""
        local = self.local_stats()
        if self.world == 1 or self._global is None:
            return local
        out: dict[str, Any] = {k: v for k, v in local.items() if k not in self._part_of}
        for ti, t in enumerate(self.tables):
            row = [int(x) for x in self._global[ti].tolist()]
            n = len(_COUNTS)
            out[t.name] = {
                "step": dict(zip(_COUNTS, row[:n])),
                "total": dict(zip(_COUNTS, row[n : 2 * n])),
                "occupancy": row[2 * n],
                "capacity": self.capacities[ti] * self.world,
                **({"cache": local[t.name]["cache"]} if "cache" in local[t.name] else {}),
            }
        return out

    def _gather_stats(self) -> None:
        """Sum every rank's map counters (a collective over ``group``; every rank calls it at
        the same points: each forward, each import)."""
        if self.world == 1:
            return
        local = self.local_stats()
        rows = [
            [local[t.name]["step"][k] for k in _COUNTS]
            + [local[t.name]["total"][k] for k in _COUNTS]
            + [local[t.name]["occupancy"]]
            for t in self.tables
        ]
        x = torch.tensor(rows, dtype=torch.int64)
        dist.all_reduce(x, group=self.group)
        self.comm_stats.add("dyn_stats", x.numel() * 8 * (self.world - 1))
        self._global = x

    # ---- what checkpoints and restores use (``neorec.checkpoint.dynamic``) ----------------------
    def optimizer_state(self) -> dict[str, Tensor]:
        """This rank's parts' state tensors, ``<part>.<name>``."""
        return {
            f"{i}.{k}": v for i, p in enumerate(self.parts) for k, v in p.optimizer_state().items()
        }

    @property
    def id_maps(self) -> list[Any]:
        """This rank's id map of each table (table order)."""
        return [self.local_part(t.name).id_map(t.name) for t in self.tables]

    def id_map(self, name: str) -> Any:
        """This rank's id map of table ``name``."""
        return self.local_part(name).id_map(name)

    def slots_of(self, name: str, ids: Tensor) -> Tensor:
        """This rank's slot of each raw id of table ``name`` (-1 = none here), changing nothing."""
        return self.local_part(name).slots_of(name, ids)

    def take_touched(self, name: str) -> Tensor:
        """This rank's touched slots of table ``name`` since the last call (and start anew)."""
        return self.local_part(name).take_touched(name)

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Nothing to stage: the ids are routed in ``forward`` (what pipelines call before it)."""

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [b, sum of dims] of this rank's samples, features in order."""
        local = self.input_dist(sparse)
        computed = self.compute(local)
        self._gather_stats()
        return self.output_dist(computed, local)

    def _a2a(
        self, send: Tensor, send_splits: list[int], recv_splits: list[int], name: str
    ) -> Tensor:
        if self.world == 1:
            return send.clone()
        return all_to_all(send, send_splits, recv_splits, self.group, self.comm_stats, name).wait()

    def input_dist(self, sparse: SparseFeatures) -> DynamicLocalInput:
        """Send each (bag, id[, weight]) of this rank's samples to the id's owner; receive the
        bags of every rank's samples restricted to the ids this rank owns."""
        sparse = checked_batch(self, sparse)
        W, nf, b = self.world, len(self.feature_names), sparse.batch_size
        vals = sparse.values.to(torch.int64)
        lens = sparse.lengths.to(torch.int64)
        own = owner_of(vals, W)
        bag = torch.repeat_interleave(torch.arange(nf * b), lens)
        counts = torch.bincount(own * (nf * b) + bag, minlength=W * nf * b).view(W, nf * b)
        order = torch.argsort(own, stable=True)
        n_to = counts.sum(1)
        has_w = int(sparse.weights is not None)
        header = torch.stack([torch.full((W,), b), n_to, torch.full((W,), has_w)], dim=1).flatten()
        got = self._a2a(header, [_HEADER] * W, [_HEADER] * W, "dyn_header").view(W, _HEADER)
        flags = sorted(set(got[:, 2].tolist()))
        if len(flags) > 1:
            with_w = [r for r in range(W) if int(got[r, 2])]
            raise SparseFeatureError(
                f"{type(self).__name__}: ranks {with_w} of {W} sent per-id weights, the others "
                "none; every rank's batch must have weights or none"
            )
        bs, n_from = got[:, 0].tolist(), got[:, 1].tolist()
        by_dest = torch.split(vals[order], n_to.tolist())
        payload = torch.cat([torch.cat([counts[q], by_dest[q]]) for q in range(W)])
        recv = self._a2a(
            payload,
            [nf * b + int(n) for n in n_to.tolist()],
            [nf * bq + n for bq, n in zip(bs, n_from)],
            "dyn_ids",
        )
        w_recv = None
        if flags == [1]:
            assert sparse.weights is not None
            w_recv = self._a2a(sparse.weights[order], n_to.tolist(), n_from, "dyn_weights")
        # [source][feature][sample] -> [feature][source][sample]
        lens_parts, id_parts, feat_parts, src_parts = [], [], [], []
        pos = 0
        for src, (bq, n) in enumerate(zip(bs, n_from)):
            ls = recv[pos : pos + nf * bq].view(nf, bq)
            ids = recv[pos + nf * bq : pos + nf * bq + n]
            pos += nf * bq + n
            lens_parts.append(ls)
            id_parts.append(ids)
            feat_parts.append(torch.repeat_interleave(torch.arange(nf), ls.sum(1)))
            src_parts.append(torch.full((n,), src, dtype=torch.int64))
        key = torch.cat(feat_parts) * W + torch.cat(src_parts)
        perm = torch.argsort(key, stable=True)
        values = torch.cat(id_parts)[perm]
        lengths = torch.cat(lens_parts, dim=1).flatten()
        weights = w_recv[perm] if w_recv is not None else None
        local = SparseFeatures(self.feature_names, values, lengths, weights)
        return DynamicLocalInput(local, [int(x) for x in bs], lens.view(nf, b).t())

    def _unadmitted(self, sparse: SparseFeatures) -> tuple[Tensor, Tensor]:
        """Per (bag, feature) [N, F]: summed weight of the unadmitted ids of default-row tables'
        features, and count of the unadmitted ids of ``zeros`` tables' features."""
        n, nf = sparse.batch_size, len(self.feature_names)
        uw = torch.zeros(n, nf)
        dropped = torch.zeros(n, nf)
        need_zeros = self.pooling == PoolingMode.MEAN
        offs = sparse.offsets()
        for f, name in enumerate(self.feature_names):
            if not (self._feature_default[f] >= 0 or (need_zeros and self._feature_zeros[f])):
                continue
            lo, hi = int(offs[f * n]), int(offs[(f + 1) * n])
            if lo == hi:
                continue
            table = self._table_by_feature[name]
            miss = self.local_part(table).slots_of(table, sparse.values[lo:hi]) < 0
            seg = sparse.lengths[f * n : (f + 1) * n]
            bag = torch.repeat_interleave(torch.arange(n), seg)[miss]
            if self._feature_default[f] >= 0:
                w = sparse.weights[lo:hi][miss] if sparse.weights is not None else None
                uw[:, f] = torch.bincount(bag, weights=w, minlength=n).to(torch.float32)
            else:
                dropped[:, f] = torch.bincount(bag, minlength=n).to(torch.float32)
        return uw, dropped

    def compute(self, local: DynamicLocalInput) -> tuple[Tensor, Tensor]:
        """Partial pooled sums of this rank's ids over every rank's bags -> [N, sum of dims],
        and the count of dropped unadmitted ids per (bag, feature) [N, F]."""
        sp = local.sparse
        outs = [p(sp.select(p.feature_names)) for p in self.parts]
        pooled = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        if len(self.parts) > 1:
            pooled = pooled.index_select(1, self._perm)
        uw, dropped = self._unadmitted(sp)
        if self.default_tables:
            training = torch.is_grad_enabled()
            anchor = self._default_anchor if training else self._default_anchor.detach()
            pooled = pooled + _DefaultRows.apply(anchor, uw, self, sp.batch_size)
        return pooled, dropped

    def output_dist(self, computed: tuple[Tensor, Tensor], local: DynamicLocalInput) -> Tensor:
        """Partial sums to their samples' ranks, added in rank order -> [b, sum of dims]."""
        pooled, dropped = computed
        W, D, nf = self.world, self.total_dim, len(self.feature_names)
        b = local.lengths.shape[0]
        pooled = ScaleGrad.apply(pooled, 1.0 / W)
        send = [bq * D for bq in local.batch_sizes]
        if W == 1:
            recv = pooled.reshape(-1)
        else:
            recv = AllToAllPooled.apply(
                pooled.contiguous(), send, [b * D] * W, self.group, self.comm_stats, (None, None), 0
            )
        parts = recv.view(W, b, D)
        out = parts[0]
        for r in range(1, W):
            out = out + parts[r]
        if self.pooling == PoolingMode.MEAN:
            n = local.lengths.to(torch.float32)
            if any(self._feature_zeros):
                gone = self._a2a(
                    dropped.flatten(), [bq * nf for bq in local.batch_sizes], [b * nf] * W,
                    "dyn_dropped",
                ).view(W, b, nf)  # fmt: skip
                for r in range(W):
                    n = n - gone[r]
            scale = torch.where(n > 0, 1.0 / n.clamp(min=1), torch.zeros_like(n))
            out = out * scale.repeat_interleave(torch.tensor(self.feature_dims), dim=1)
        return out

    # ---- the replicated default rows -----------------------------------------------------------
    def _default_contrib(self, uw: Tensor) -> Tensor:
        out = torch.zeros(uw.shape[0], self.total_dim)
        lay = self.default_layout
        for f, k in enumerate(self._feature_default):
            if k >= 0:
                row = lay.table(self.default_weights, k)[0]
                out[:, self._col0[f] : self._col0[f + 1]] = uw[:, f : f + 1] * row
        return out

    def _default_update(self, uw: Tensor, grad: Tensor, n: int) -> None:
        """Sum the default rows' gradients over ranks (rank order), one fused update each."""
        if n == 0:  # every rank's batch is empty: nothing moves, not the step
            return
        k = len(self.default_tables)
        lay = self.default_layout
        g = torch.zeros(k, max(lay.dims))
        used = torch.zeros(k, 1)
        for f, d in enumerate(self._feature_default):
            if d >= 0:
                cols = grad[:, self._col0[f] : self._col0[f + 1]]
                g[d, : lay.dims[d]] += uw[:, f] @ cols
                used[d, 0] += float((uw[:, f] != 0).sum())
        mine = torch.cat([g, used], dim=1).contiguous()
        if self.world > 1:
            every = [torch.empty_like(mine) for _ in range(self.world)]
            self.comm_stats.add("dyn_default_grads", mine.numel() * 4 * (self.world - 1))
            dist.all_gather(every, mine, group=self.group)
        else:
            every = [mine]
        allg = torch.stack(every)  # [W, k, dim + 1]
        step = int(self.default_step) + 1
        items = []
        for d in range(k):
            if float(allg[:, d, -1].sum()) > 0:  # the row was read: updated like the unsharded
                ids = torch.zeros(self.world, dtype=torch.int64)
                items.append((d, ids, allg[:, d, : lay.dims[d]]))
        if items:
            apply_row_grads(
                self.parts[0].backend, lay, self.default_weights, self._default_state(), items,
                self.optimizer, step,
            )  # fmt: skip
        self.default_step.fill_(step)

    def _default_state(self) -> dict[str, Tensor]:
        names = ("momentum1", "exp_avg", "exp_avg_sq")
        return {k: getattr(self, "default_" + k) for k in names if hasattr(self, "default_" + k)}

    # ---- checkpoints by raw id -----------------------------------------------------------------
    def export_table(self, name: str) -> DynamicTableState:
        """This rank's ids of table ``name`` (ascending) with rows, optimizer state and map
        bookkeeping, and the table's default row (when it has one)."""
        st = self.local_part(name).export_table(name)
        ti = next(i for i, t in enumerate(self.tables) if t.name == name)
        if ti in self.default_tables:
            k = self.default_tables.index(ti)
            lay = self.default_layout
            st.default_row = lay.table(self.default_weights, k)[0].clone()
            st.default_states = {
                s: (v[k : k + 1] if s == "momentum1" else lay.table(v, k))[0].clone()
                for s, v in self._default_state().items()
            }
        return st

    def export_shard(self, name: str) -> TableShard:
        """``export_table(name)`` labelled with this rank and the world (what ``import_table``
        of any world size takes from every rank)."""
        return TableShard(self.rank, self.world, self.export_table(name))

    def import_table(
        self, name: str, source: DynamicTableState | TableShard | Sequence[TableShard]
    ) -> None:
        """Replace table ``name`` by the ids this rank owns of ``source``: an unsharded export,
        or the ``TableShard`` of every rank of a sharded one (any world size; the threshold
        sketch as ``dynamic_reshard.rank_sketch`` gives it: the rank's own on the saved world
        size). Refuses, with one ``ConfigError`` line, a source that is not one whole checkpoint
        of a table that fits."""
        part = self.local_part(name)
        ti = next(i for i, t in enumerate(self.tables) if t.name == name)
        whole, mine = self._mine(name, source, "import_table")
        part.import_table(name, mine)
        if ti in self.default_tables:
            assert whole.default_row is not None
            k = self.default_tables.index(ti)
            lay = self.default_layout
            with torch.no_grad():
                lay.table(self.default_weights, k)[0] = whole.default_row.to(torch.float32)
                for s, v in self._default_state().items():
                    if s in whole.default_states:
                        dst = v[k : k + 1] if s == "momentum1" else lay.table(v, k)
                        dst[0] = whole.default_states[s]
        self._gather_stats()

    def check_import_table(
        self, name: str, source: DynamicTableState | TableShard | Sequence[TableShard]
    ) -> None:
        """Raise what ``import_table(name, source)`` would refuse (``ConfigError``; the same on
        every rank for a whole state), changing nothing."""
        self._mine(name, source, "import_table")

    def _mine(
        self, name: str, source: DynamicTableState | TableShard | Sequence[TableShard], what: str
    ) -> tuple[DynamicTableState, DynamicTableState]:
        """(the whole table, the part this rank owns without the default row), checked."""
        where = f"{type(self).__name__}.{what} '{name}'"
        part = self.local_part(name)
        ti = next(i for i, t in enumerate(self.tables) if t.name == name)
        whole = as_global_state(source, where)  # checks the shards are one whole checkpoint
        if whole.dim != self.tables[ti].dim:
            raise ConfigError(
                f"{where}: the saved rows have dim {whole.dim}, the table has dim "
                f"{self.tables[ti].dim}; restore into a table of the same dim"
            )
        shards = saved_shards(source)  # each rank restores its own sketch from them
        mine = rank_state(whole, self.rank, self.world, self.capacities[ti], where, shards)
        if ti in self.default_tables and whole.default_row is None:
            raise ConfigError(
                f"{where}: the table has unadmitted = 'default_row' but the checkpoint has no "
                "default row (it was saved with unadmitted = 'zeros')"
            )
        mine = replace(mine, default_row=None, default_states={})
        part.check_import_table(name, mine)
        return whole, mine


class _DefaultRows(torch.autograd.Function):
    """Forward: ``uw[:, f] x default row`` in each default-row feature's columns; backward: the
    rank-ordered gradient sum and fused update of the default rows (a collective)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: Tensor, uw: Tensor, mod: ShardedDynamicEmbeddingBagCollection, n: int
    ) -> Tensor:
        ctx.meta = (uw, mod, n)
        return mod._default_contrib(uw)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        uw, mod, n = ctx.meta
        mod._default_update(uw, grad, n)
        return None, None, None, None
