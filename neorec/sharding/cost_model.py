"""Predicted time and memory of embedding shards on a ``Topology`` (a simulation, not a measurement).

Model, per shard and per training step with global batch ``B`` (the same for every method that is
scored, planner or baseline), following what ``neorec.distributed.sharded`` runs:

- touched rows: the distinct rows among a table's ``h`` ids, ``u = r (1 - exp(-h / r))`` for
  uniform ids, fewer under access skew (``TableSpec.zipf_alpha``, see ``distinct_rows``); a row
  shard gets its share of them (hot rows are spread over row ranges).
- compute: bytes moved by the forward lookups (ids, the touched rows gathered once, repeats hit in
  cache; pooled outputs) and by the backward (pooled grads, per-id grads, read/write of the touched
  rows and their optimizer state: sgd none, rowwise_adagrad 1 float per row, adam 2 floats per
  element). Row bytes move at the bandwidth of the tier the rows live in (``device`` HBM, or
  ``host`` DRAM over the host link); the rest at device bandwidth. The backward runs on the fused
  kernel (``device_bw_gbs``) or, for the shards the runtime updates outside it, at
  ``unfused_bw_gbs`` (the kernel's per-row gradient sums, then a torch update of the distinct
  rows): column-wise slices under row-wise Adagrad, each on its own rows (the cpu kernel emits
  their row sums in the pass that updates the rank's other shards, which stay fused; the
  reference backend, a fallback without a C compiler, is not modelled). Data-parallel tables
  take two kernel passes, per-row sums of the rank's ids, then (after the exchange) the fused
  update over every rank's pairs, at ``dp_update_bw_gbs``.
- communication on the owner: ids in, pooled outputs out, their gradients back in, split into
  intra-host and inter-host bytes by where the batch's samples live. Row-wise shards each send
  partial sums for all samples; the samples' ranks add them. Table-row-wise shards (on one host's
  ``k`` ranks, ``neorec.distributed.twrw``) reduce first inside the host: each sends the
  ``(k - 1) / k`` of its partial sums that other host ranks reduce (intra-host bandwidth), and the
  host's sums cross hosts once per sample (``(W - k) / W`` of ``B x dim``, a shard's share by its
  rows; inter-host bandwidth); the sample side receives the reducers' share of the partial sums
  (spread over all ranks) and one sum per sample from another host. Column-wise tables under row-wise
  Adagrad all-gather per-row sums of squares in their slices' subgroup (one collective per set of
  owner ranks, shared by the tables it owns).
  Data-parallel tables look up the rank's own samples, then all-gather every rank's (row id, row
  gradient sum) pairs and add them in rank order before the update; tables of at most
  ``DENSE_DP_MAX_ELEMS`` rows x dim (``types.dense_dp``) instead all-gather a dense block of the table's gradient (and
  a touch mark per row), one all-gather for all of them, and update the batch's distinct rows.
- sample side (the same on every rank): each rank sends its ids and receives pooled outputs of
  every sharded table; row-split tables multiply the outputs, column-wise ones the ids; row-split
  tables (RW, TWRW) first bucketize the rank's ids by row range (``row_split_bw_gbs``); plus the
  latency of the step's collectives.
- memory: weights and optimizer state (in the table's storage tier) plus id/output/grad buffers
  (always on the device).
- cached tiers (``dram`` / ``ssd``: rows in a store in host DRAM or on SSD behind a row cache of
  a fraction ``f`` of the shard's rows in device memory, as ``neorec.storage.cached`` runs one):
  device memory holds the cache (cache rows x (row + optimizer state)) and its bookkeeping (a
  4-byte slot per shard row, ~29 bytes per cache row); the store holds the rows with their state
  in host DRAM or on SSD. Lookups and updates run on the cache at device bandwidth as for a
  ``device`` shard; on top, each step moves its misses at the tier's bandwidth: the lookups x
  the miss rate (a missed row is read once per batch: at most the touched rows) x the record
  bytes, read in and (every resident row has been updated, so evictions are dirty) written
  back. The miss rate is ``1 - expected_hit_rate`` of ``neorec.sharding.hit_rate`` for the
  table's skew (``TableSpec.zipf_alpha``; the locality-calibrated distribution when unknown) and
  cache policy; a row shard sees the table's hit rate (hot rows are spread over row ranges).
  Plus the slot lookups of every id (bookkeeping at device bandwidth).

A rank's predicted time is the sum of its shards' times plus the sample-side term (every shard's
cost is its own: no shard changes how the others on its rank are updated); the step's
predicted embedding time is, per phase, the slowest rank's, summed. Constants come from the
``Topology`` and can be calibrated (``neorec plan --calibrate``, ``neorec.measure.calibrate``);
``neorec bench costcheck`` compares predictions with measured steps on this machine.

The predictions' types (``ShardCost``, ``RankCost``, ``PlanCost``, ``PHASES``) are in
``neorec.sharding.cost_types``; the cached tiers' hit rates in ``neorec.sharding.hit_rate``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

from neorec.sharding.cost_types import PlanCost, RankCost, ShardCost
from neorec.sharding.hit_rate import cache_hit_rates
from neorec.sharding.tables import (
    ID_DISTRIBUTIONS,
    OPTIMIZERS,
    ROW_BYTES,
    TableSpec,
    load_tables,
    tables_from_config,
)
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import (
    CACHED_STORAGES,
    ShardingPlan,
    ShardingType,
    dense_dp,
)

__all__ = [
    "OPTIMIZERS",
    "TableSpec",
    "CostModel",
    "load_tables",
    "tables_from_config",
    "distinct_rows",
    "cache_rows",
    "CACHE_MIN_BATCHES",
    "ID_DISTRIBUTIONS",
]

_UNFUSED_ID_WORDS = 8
"""Id-sized words the unfused update moves per id and per distinct row, besides row bytes: the
kernel's sort of the ids into distinct rows, and the index tensors of every gather / scatter of
the torch update (its time shrinks far less than its row bytes for narrow rows)."""
_ZIPF_HEAD = 64  # ranks summed exactly; the tail is integrated (as neorec.data.ids samples it)
_ZIPF_GRID = 96  # trapezoid points of the tail integral over log(rank)


@functools.lru_cache(maxsize=1 << 16)
def distinct_rows(rows: int, hits: float, zipf_alpha: float = 0.0) -> float:
    """Expected distinct rows among ``hits`` ids drawn from ``rows`` rows.

    Uniform ids (``zipf_alpha`` 0): ``rows (1 - exp(-hits / rows))``. Zipf ids (P(rank k) ~
    k^-alpha): ``sum_k 1 - exp(-hits p_k)``, exact over the first ranks and integrated over the
    tail (within ~1-2% of sampled ``neorec.data.ids.zipf_ids`` batches).
    """
    if hits <= 0 or rows <= 0:
        return 0.0
    if zipf_alpha <= 0:
        return rows * -math.expm1(-hits / rows)
    a = zipf_alpha
    k = min(rows, _ZIPF_HEAD)
    head = [(i + 1) ** -a for i in range(k)]
    lo, hi = k + 0.5, rows + 0.5
    tail = 0.0
    if rows > k:
        tail = math.log(hi / lo) if a == 1.0 else (hi ** (1 - a) - lo ** (1 - a)) / (1 - a)
    c = hits / (sum(head) + tail)
    u = sum(-math.expm1(-c * p) for p in head)
    if rows > k:
        x0, x1 = math.log(lo), math.log(hi)
        step = (x1 - x0) / _ZIPF_GRID
        acc = 0.0
        for i in range(_ZIPF_GRID + 1):
            x = math.exp(x0 + i * step)
            f = -math.expm1(-c * x**-a) * x  # d(rank) = x d(log x)
            acc += 0.5 * f if i in (0, _ZIPF_GRID) else f
        u += acc * step
    return min(u, float(rows), float(hits))


_CACHE_SLOT_MAP_BYTES = 4
"""Cache bookkeeping per row of the shard: the slot map (``slot_of``, int32)."""
_CACHE_ROW_BOOK_BYTES = 29
"""Cache bookkeeping per cache row: id (int64), eviction key (int64), free-slot stack entry
(int64), pin count (int32), dirty flag (bool), as ``neorec.storage.cached`` keeps them."""
_CACHE_ID_WORDS = 3
"""Id-sized words of bookkeeping per id and per touched row of a cached shard (slot lookup,
remap, recency / frequency update)."""
CACHE_MIN_BATCHES = 2.0
"""A cache must hold this many batches' distinct rows of its shard (a batch's rows stay pinned
until its backward; the next batch's are prefetched); smaller caches are not offered."""


def cache_rows(rows: int, fraction: float) -> int:
    """Rows of a cache of ``fraction`` of ``rows`` (at least one, at most all), as the runtime."""
    return max(1, min(rows, math.ceil(fraction * rows)))


class CostModel:
    """Time and memory of shards and plans for one topology, batch size and optimizer."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        optimizer: str = "rowwise_adagrad",
        weight_bytes: int = 4,
        id_bytes: int = 8,
        comm_bytes: int = 4,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got '{optimizer}'")
        self.topo = topology
        self.batch = batch_size
        self.optimizer = optimizer
        self.weight_bytes = weight_bytes
        self.id_bytes = id_bytes
        self.comm_bytes = comm_bytes
        w, k = topology.world_size, topology.ranks_per_host
        # Share of a rank's all-to-all bytes that go to its own host / other hosts.
        self._intra_frac = (k - 1) / w
        self._inter_frac = (w - k) / w
        self._bw = {
            "device": topology.device_bw_gbs * GB,
            "host": topology.host_device_bw_gbs * GB,
            # cache misses of the cached tiers (records between the store and the cache)
            "dram": topology.host_device_bw_gbs * GB,
            "ssd": min(topology.ssd_bw_gbs, topology.host_device_bw_gbs) * GB,
        }
        self._intra_bw = topology.intra_host_bw_gbs * GB
        self._inter_bw = topology.inter_host_bw_gbs * GB
        self.cache_fractions: tuple[float, ...] = ()
        """Candidate cache fractions (set by the planner): hit rates are computed together."""

    # ---- pieces -------------------------------------------------------------------------------
    def state_bytes(self, table: TableSpec, rows: int, cols: int) -> float:
        """Optimizer state bytes of ``rows`` x ``cols`` of ``table``."""
        opt = table.optimizer or self.optimizer
        if opt == "rowwise_adagrad":
            return rows * 4.0
        if opt == "adam":
            return rows * cols * 8.0
        return 0.0

    def _a2a_s(self, nbytes: float) -> tuple[float, float]:
        """(intra, inter) seconds of all-to-all bytes exchanged with every rank's samples."""
        return (
            nbytes * self._intra_frac / self._intra_bw,
            nbytes * self._inter_frac / self._inter_bw,
        )

    def _twrw_out_s(self, nbytes: float, share: float) -> tuple[float, float]:
        """(intra, inter) seconds of a table-row-wise shard's ``nbytes`` of partial sums: the
        ``(k - 1) / k`` that other ranks of its host reduce, then its ``share`` (of the table's
        rows) of the host's sums, sent once to each sample rank on another host."""
        w, k = self.topo.world_size, self.topo.ranks_per_host
        return (
            nbytes * (k - 1) / k / self._intra_bw,
            share * nbytes * (w - k) / w / self._inter_bw,
        )

    def optimizer_of(self, table: TableSpec) -> str:
        """The table's fused optimizer (its own, else the model's default)."""
        return table.optimizer or self.optimizer

    def cw_unfused(self, table: TableSpec, sharding_type: ShardingType) -> bool:
        """Whether the runtime updates this table's shards on the exact unfused path: column-wise
        tables under row-wise Adagrad (each row's mean(g^2) sums over all column slices, so the
        slices' row sums leave the kernel for a collective and a torch update). Only the slices
        themselves: the other shards of their ranks keep the fused update."""
        return (
            sharding_type is ShardingType.COLUMN_WISE
            and self.optimizer_of(table) == "rowwise_adagrad"
        )

    def row_bytes(self, table: TableSpec, cols: int) -> float:
        """Bytes of one stored row of ``cols`` values (the table's precision, else
        ``weight_bytes`` a value); the optimizer state is extra (``state_bytes``)."""
        if table.precision:
            per, extra = ROW_BYTES[table.precision]
            return cols * per + extra
        return cols * self.weight_bytes

    def record_bytes(self, table: TableSpec, cols: int) -> float:
        """Bytes of one row with its optimizer state (a record of a cached tier's store)."""
        return self.row_bytes(table, cols) + self.state_bytes(table, 1, cols)

    def min_cache_fraction(self, table: TableSpec) -> float:
        """Smallest cache fraction the cached tiers may use for ``table``: the cache must hold
        ``CACHE_MIN_BATCHES`` batches' distinct rows (row shards get their share of both)."""
        touched = distinct_rows(table.rows, self.batch * table.pooling_factor, table.zipf_alpha)
        return min(1.0, CACHE_MIN_BATCHES * touched / table.rows)

    def hit_rate(self, table: TableSpec, fraction: float) -> float:
        """Expected per-lookup hit rate of a ``fraction`` row cache over ``table``
        (``cache_hit_rates``); computed with every fraction in ``self.cache_fractions`` at once."""
        fr = [fraction, *(f for f in self.cache_fractions if f != fraction)]
        return cache_hit_rates(table, fr)[0]

    def update_bytes(
        self, table: TableSpec, touched: float, cols: int, grad_rows: float
    ) -> tuple[float, float]:
        """(row bytes, gradient bytes) of a backward update: read + write of ``touched`` distinct
        rows and their optimizer state; ``grad_rows`` gradient rows read (pooled and per id)."""
        state = self.state_bytes(table, 1, cols) * touched
        rows_b = 2 * (touched * self.row_bytes(table, cols) + state)
        return rows_b, grad_rows * cols * self.comm_bytes

    def shard_cost(
        self,
        table: TableSpec,
        sharding_type: ShardingType,
        rows: int,
        cols: int,
        storage: str = "device",
        unfused: bool | None = None,
        cache_fraction: float = 0.0,
    ) -> ShardCost:
        """Per-step time and memory of a ``rows`` x ``cols`` shard of ``table`` on its rank.

        ``unfused``: whether the backward takes the unfused update path; ``None`` = what the
        runtime does for this shard (``cw_unfused``; ``evaluate`` always passes None). Forcing it
        prices another shape on that path (``neorec.measure.calibrate`` converts its measured
        unfused update to a bandwidth that way).
        ``cache_fraction``: the row cache of a cached ``storage`` (``dram`` / ``ssd``).
        """
        b, w = self.batch, self.topo.world_size
        c4 = self.comm_bytes
        st = sharding_type
        dp = st is ShardingType.DATA_PARALLEL
        alpha = table.zipf_alpha
        share = rows / table.rows
        out_rows = b / w if dp else b  # pooled rows this shard produces
        table_hits = out_rows * table.pooling_factor  # ids of the table this rank looks up
        hits = table_hits * share
        # Hot rows spread over row ranges (ids are scattered), so a row shard sees its share of
        # the table's distinct rows.
        touched = distinct_rows(table.rows, table_hits, alpha) * share
        state = self.state_bytes(table, rows, cols)
        if unfused is None:
            unfused = self.cw_unfused(table, st)
        cached = storage in CACHED_STORAGES
        if cached and (dp or not 0.0 < cache_fraction <= 1.0):
            raise ValueError(
                f"table '{table.name}': cached storage '{storage}' needs a model-parallel shard "
                f"and cache_fraction in (0, 1], got {st.value}, {cache_fraction}"
            )
        # Row traffic at the storage tier (a cached tier's rows are read and updated in the
        # cache, in device memory); ids, pooled outputs and grads at device bandwidth.
        sto_bw, dev_bw = self._bw["device" if cached else storage], self._bw["device"]
        unf_bw = self.topo.unfused_bw_gbs * GB
        overhead = self.topo.shard_overhead_us * 1e-6 / 2
        # Forward: read ids, gather rows (storage tier; repeats of a row within the batch hit in
        # cache, so distinct rows), write pooled outputs.
        fwd = (
            touched * self.row_bytes(table, cols) / sto_bw
            + (hits * self.id_bytes + out_rows * cols * c4) / dev_bw
            + overhead
        )
        if dp:
            # Per-id grads summed per row by the kernel, (ids, row sums) all-gathered from every
            # rank, then the kernel's fused update over those pairs: they are added per row in
            # rank order and the batch's distinct rows updated once. A small table gathers dense
            # blocks instead (its rows x (dim + 1) floats from every rank, added), then updates
            # one pair per distinct row.
            glob = distinct_rows(table.rows, b * table.pooling_factor, alpha)
            if dense_dp(table.rows, table.dim):
                block = table.rows * (cols + 1) * 4.0
                merged = glob  # one (id, summed row) pair per distinct row
                pairs = w * block  # gathered blocks this rank adds up
                extra = (w + 1) * block  # written, added, read back
            else:
                merged = w * touched  # gathered (id, row sum) pairs this rank adds up
                pairs = merged * (self.id_bytes + cols * c4)
                extra = 0.0
            rows_b, grad_b = self.update_bytes(table, glob, cols, out_rows + hits + merged)
            ids_b = _UNFUSED_ID_WORDS * self.id_bytes * (hits + merged + glob)
            bwd = (rows_b + grad_b + ids_b + extra) / (self.topo.dp_update_bw_gbs * GB)
            bwd += 2 * overhead
            ii, ie = self._a2a_s(pairs)
            fwd_comm, bwd_comm = 0.0, ii + ie
            inter = ie
            buffers = hits * self.id_bytes + 2 * out_rows * cols * c4 + pairs + glob * cols * c4
        else:
            # Backward: read pooled grads, per-id grads, read+write touched rows and their state.
            path_bw = unf_bw if unfused else dev_bw
            rows_b, grad_b = self.update_bytes(table, touched, cols, out_rows + hits)
            if unfused:
                grad_b += _UNFUSED_ID_WORDS * self.id_bytes * (hits + touched)
            bwd = rows_b / min(sto_bw, path_bw) + grad_b / path_bw + overhead
            ids = hits * self.id_bytes + b * 4  # ids + lengths in
            out = b * cols * c4  # pooled out (forward) = grads back (backward)
            ii, ie = self._a2a_s(ids)
            # Row-wise shards send their partial sums straight to the samples' ranks, which add
            # them; table-row-wise ones reduce inside the host first (``_twrw_out_s``).
            oi, oe = self._a2a_s(out)
            if st is ShardingType.TABLE_ROW_WISE:
                oi, oe = self._twrw_out_s(out, share)
            fwd_comm, bwd_comm = ii + ie + oi + oe, oi + oe
            inter = ie + 2 * oe
            if self.cw_unfused(table, st):
                # The slices' per-row sums of squares, all-gathered in the owners' subgroup:
                # n - 1 vectors of ``touched`` floats in (spread over peers like an all-to-all).
                # Its latency is paid once per owner set, not per table (``evaluate``).
                n = max(1, round(table.dim / cols))
                si, se = self._a2a_s((n - 1) * touched * 4.0 * w / max(1, w - 1))
                bwd_comm += si + se
                inter += se
            buffers = hits * self.id_bytes + 2 * out_rows * cols * c4
        weights = rows * (self.row_bytes(table, cols) + table.map_bytes_per_row) + state
        if cached:
            # Misses read from the store, and as many dirty evictions written back to it (each
            # resident row was updated by the step that touched it); slot lookups of every id.
            # A missed row is read once per batch however often the batch repeats it: the
            # lookups' misses, at most the touched rows.
            rec = self.record_bytes(table, cols)
            misses = min(touched, hits * (1.0 - self.hit_rate(table, cache_fraction)))
            fwd += 2 * misses * rec / self._bw[storage]
            fwd += _CACHE_ID_WORDS * self.id_bytes * (hits + touched) / dev_bw
            crows = cache_rows(rows, cache_fraction)
            book = rows * _CACHE_SLOT_MAP_BYTES + crows * _CACHE_ROW_BOOK_BYTES
            dev = buffers + crows * rec + book
            host = weights if storage == "dram" else 0.0
            ssd = weights if storage == "ssd" else 0.0
            return ShardCost(fwd_comm, fwd, bwd_comm, bwd, dev, host, inter, ssd)
        dev = buffers + (weights if storage == "device" else 0.0)
        host = weights if storage == "host" else 0.0
        return ShardCost(fwd_comm, fwd, bwd_comm, bwd, dev, host, inter)

    def sample_side_s(self, table: TableSpec, sharding_type: ShardingType, n_shards: int) -> float:
        """Per-rank time of sending ids of ``table`` and receiving its pooled outputs and grads
        (and of splitting the ids by row range first, for row-split tables)."""
        st = sharding_type
        if st is ShardingType.DATA_PARALLEL:
            return 0.0
        lb = self.batch / self.topo.world_size
        ids = lb * table.pooling_factor * self.id_bytes + lb * 4
        outs = 2 * lb * table.dim * self.comm_bytes
        split = 0.0
        if st is ShardingType.COLUMN_WISE:
            ids *= n_shards
        elif st in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE):
            ids += lb * 4 * (n_shards - 1)  # lengths go to every row shard
            split = lb * table.pooling_factor * self.id_bytes / (self.topo.row_split_bw_gbs * GB)
        if st is ShardingType.TABLE_ROW_WISE:
            # The reducers (the k ranks of the table's host; spread over all W ranks here) each
            # receive k - 1 shards' partial sums of B / k samples; then every rank receives one
            # sum per sample, from another host for (W - k) / W of the samples.
            w, k = self.topo.world_size, self.topo.ranks_per_host
            reduce = n_shards * outs * (k - 1) / k / self._intra_bw
            cross = outs * (w - k) / w / self._inter_bw
            intra, inter = self._a2a_s(ids)
            return intra + inter + split + reduce + cross
        if st is ShardingType.ROW_WISE:
            outs *= n_shards  # a partial sum from every row shard
        intra, inter = self._a2a_s(ids + outs)
        return intra + inter + split

    def fixed_s(
        self,
        sharded: bool = True,
        data_parallel: bool = False,
        dense_dp: bool = False,
        table_row_wise: bool = False,
    ) -> float:
        """Per-step latency of the embedding collectives (same on every rank): ~6 with sharded
        tables (lengths, ids, outputs, grads), 3 all-gathers (counts, ids, row sums) with
        data-parallel tables that exchange pairs (``data_parallel``), 1 with small ones summed
        as dense blocks (``dense_dp``), 4 with table-row-wise tables (the in-host reduction and
        the exchange between hosts, forward and backward; 2 on one host); plus the step's fixed
        host overhead."""
        n = (6 if sharded else 0) + (3 if data_parallel else 0) + (1 if dense_dp else 0)
        if table_row_wise:
            n += 4 if self.topo.num_hosts > 1 else 2
        overhead = self.topo.step_overhead_us if n else 0.0
        return (n * self.topo.collective_latency_us + overhead) * 1e-6

    # ---- plans --------------------------------------------------------------------------------
    def evaluate(self, plan: ShardingPlan, tables: Iterable[TableSpec]) -> PlanCost:
        """Predicted per-rank time and memory of ``plan`` (tables looked up by name)."""
        specs = {t.name: t for t in tables}
        ranks = [RankCost(r) for r in range(plan.world_size)]
        types = {t.sharding_type for t in plan.tables}
        sharded = any(t is not ShardingType.DATA_PARALLEL for t in types)
        dp_dense = {
            dense_dp(tp.rows, tp.dim)
            for tp in plan.tables
            if tp.sharding_type is ShardingType.DATA_PARALLEL
        }
        twrw = ShardingType.TABLE_ROW_WISE in types
        sample = self.fixed_s(sharded, False in dp_dense, True in dp_dense, twrw)
        cw_sets: set[tuple[int, ...]] = set()
        for tp in plan.tables:
            spec = specs.get(tp.name)
            if spec is None:
                raise KeyError(f"plan table '{tp.name}' has no spec; known: {sorted(specs)}")
            sample += self.sample_side_s(spec, tp.sharding_type, len(tp.shards))
            if self.cw_unfused(spec, tp.sharding_type):
                cw_sets.add(tuple(sorted({sh.rank for sh in tp.shards})))
            for s in tp.shards:
                c = self.shard_cost(
                    spec, tp.sharding_type, s.rows, s.cols, tp.storage, None, tp.cache_fraction
                )
                rc = ranks[s.rank]
                for p, v in enumerate(c.phases):
                    rc.phases[p] += v
                rc.device_bytes += c.device_bytes
                rc.host_bytes += c.host_bytes
                rc.ssd_bytes += c.ssd_bytes
                rc.shards.append((tp.name, s, c.time_s))
        # The runtime sums the column-wise tables' squares in one collective per owner set.
        sample += len(cw_sets) * self.topo.collective_latency_us * 1e-6
        return PlanCost(
            ranks,
            sample,
            self.topo.device_capacity_bytes,
            self.topo.host_capacity_bytes,
            self.topo.ssd_capacity_bytes,
        )
