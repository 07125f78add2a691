"""ShardedEmbeddingBagCollection: an EmbeddingBagCollection executed under a ShardingPlan.

One forward, as three awaitable steps (so a pipeline can overlap them)::

    local batch (b samples) --input_dist--> every shard owner gets the bags of all W*b samples
      that touch its shard (all-to-all of lengths, then ids and weights)
    --compute--> one fused TBE call over all model-parallel shards on this rank -> [W*b, D_local]
    --output_dist--> pooled vectors back to the rank owning each sample (all-to-all);
      row-wise partial sums are added, column slices placed side by side -> [b, sum(dims)];
      table-row-wise partial sums are first reduced inside the host (``twrw``)

Data-parallel tables are a full replica on every rank, looked up locally; their row gradients are
summed over ranks in rank order (deterministic) before the fused optimizer runs, so replicas stay
bitwise identical.

Global-batch semantics: the loss on each rank is the mean over its b samples, as under DDP, so the
gradients of pooled outputs are scaled by 1/W; W ranks with b samples each train the same model as
one process with W*b samples (up to float reassociation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.config import TableConfig
from neorec.distributed.codecs import Codec
from neorec.distributed.columns import column_runs, place_columns
from neorec.distributed.comm import (
    AllToAllPooled,
    Awaitable,
    Chain,
    CommStats,
    Done,
    ScaleGrad,
)
from neorec.distributed.cw_rowwise import build_cw_groups, update_with_cw_rowwise
from neorec.distributed.input_dist import InputDist, LocalInput, _Unit
from neorec.distributed.replicas import (
    Replicas,
    dense_dp_tables,
    dp_bounds,
    gather_dp_grads,
    gather_dp_grads_dense,
    gather_dp_grads_padded,
)
from neorec.distributed.twrw import TwrwLayout, twrw_output_dist
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec, EmbeddingCollection, optimizer_state_of
from neorec.modules.collection_parts import feature_maps, init_rows, register_table_buffers
from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat, table_key
from neorec.ops.padded_rows import PaddedRows, apply_padded_row_grads
from neorec.ops.tbe import (
    Lookup,
    PoolingMode,
    TBELayout,
    apply_row_grads,
    get_backend,
    row_grads,
    tbe_lookup,
)
from neorec.ops.tbe_checks import on_device
from neorec.phases import NO_MARKS, Marks
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.types import DENSE_DP_MAX_ELEMS, Shard, ShardingPlan, ShardingType
from neorec.sparse import SparseFeatures

__all__ = ["ShardedEmbeddingBagCollection", "LocalInput"]


_ROW_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
_TWRW = ShardingType.TABLE_ROW_WISE


def _columns(pooled: Tensor, cols: Tensor) -> Tensor:
    """Columns ``cols`` of ``pooled`` (itself when they are all of them, in order)."""
    if cols.numel() == pooled.shape[1]:
        return pooled
    return pooled.index_select(1, cols)


class ShardedEmbeddingBagCollection(InputDist, EmbeddingCollection):
    """The model-parallel form of ``EmbeddingBagCollection``; same outputs, same updates.

    ``plan``: where each table's shards live (its world size: ``group``'s); ``stats``: where
    its collectives count their bytes and waits (default: its own); ``codecs``: the pooled
    all-to-all's wire codecs (forward values, backward gradients); ``dp_codec``: that of the
    data-parallel tables' (id, row gradient) all-gather (``comm.allreduce``: every rank, the
    sender included, decodes the same bytes, so replicas stay identical). None: float32.
    """

    weights: Tensor
    step: Tensor
    dp_weights: Tensor
    dp_step: Tensor
    _feature_dims: Tensor
    _twrw_cols: Tensor  # this rank's table-row-wise columns of its lookup (with ``twrw``)
    _mp_cols: Tensor  # and the others

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        *,
        plan: ShardingPlan,
        group: dist.ProcessGroup | None = None,
        stats: CommStats | None = None,
        codecs: tuple[Codec | None, Codec | None] = (None, None),
        dp_codec: Codec | None = None,
    ) -> None:
        super().__init__(tables, spec)
        self.device = torch.device(device)
        self.rounding = spec.rounding
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        if plan.world_size != self.world:
            raise ValueError(f"plan is for {plan.world_size} ranks, running on {self.world}")
        validate_plan(plan)
        self.plan = plan
        self.comm_stats = stats if stats is not None else CommStats()
        self.backend = get_backend(spec.backend, self.device)
        self.feature_dims = [t.dim for t in self.tables for _ in t.features]
        self.total_dim = sum(self.feature_dims)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self._build_units()
        self._build_local(spec.seed, spec.init_scale)
        # Owner subgroups of the column-wise tables, for exact row-wise Adagrad (cw_rowwise).
        self._cw_groups, self._cw_ranks = build_cw_groups(self)
        # Input metadata (lengths) is exchanged on the host: over this group on a gloo group,
        # over a gloo twin of it when the tables live on a GPU (NCCL groups carry device tensors).
        self._host_group = group
        if self.device.type != "cpu" and dist.is_initialized() and self.world > 1:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._host_group = dist.new_group(ranks=ranks, backend="gloo")
        fdims = torch.tensor(self.feature_dims, dtype=torch.int64)
        self.register_buffer("_feature_dims", fdims, persistent=False)
        self.to(self.device)  # built on the host (seeded rows), then moved: one device copy
        self._anchor = torch.empty(0, requires_grad=True, device=self.device)
        self._dp_anchor = torch.empty(0, requires_grad=True, device=self.device)
        self._host_steps: dict[str, tuple[int, int]] = {}
        self.codecs = codecs
        """Wire codecs of the pooled all-to-all: (forward values, backward gradients)."""
        self.dp_codec = dp_codec
        """Wire codec of data-parallel tables' (id, row gradient) all-gather."""
        self.dp_dense_max_elems = DENSE_DP_MAX_ELEMS
        """Data-parallel tables of at most this many rows x dim are summed as dense blocks in one
        all-gather (without a codec); larger ones exchange (id, row) pairs. 0: pairs for all."""
        self._staged: list[tuple[SparseFeatures, Chain[LocalInput]]] = []
        self.marks: Marks = NO_MARKS
        """Receives the end of each phase of a step (``neorec bench step --breakdown --nproc``
        attaches its timer); the trainer's: the null object, one call per mark."""

    def optimizer_state(self) -> dict[str, Tensor]:
        """The local shards' state tensors, and the data-parallel replicas' as ``dp_<name>``."""
        return {**optimizer_state_of(self), **{f"dp_{k}": v for k, v in self.dp_state().items()}}

    def dp_state(self) -> dict[str, Tensor]:
        """The data-parallel replicas' state tensors (empty without data-parallel tables)."""
        return optimizer_state_of(self, "dp_") if self.dp is not None else {}

    def fused_steps(self) -> int:
        """Fused updates so far: the shards' or the data-parallel replicas' count, the larger."""
        return max(int(self.step), int(self.dp_step) if self.dp is not None else 0)

    def table_weight(self, name: str) -> Tensor:
        """The whole table [rows, dim] from every rank's shards: ``gather_table`` (a collective:
        every rank calls it)."""
        return self.gather_table(name)

    # ---- setup -----------------------------------------------------------------------------
    def _build_units(self) -> None:
        plans = {t.name: t for t in self.plan.tables}
        missing = [t.name for t in self.tables if t.name not in plans]
        if missing:
            raise ValueError(f"sharding plan has no entry for table(s) {missing}")
        for t in self.tables:
            p = plans[t.name]
            if (p.rows, p.dim) != (t.rows, t.dim):
                raise ValueError(
                    f"table '{t.name}': plan says {p.rows}x{p.dim}, config says {t.rows}x{t.dim}"
                )
        col0 = [0]
        for d in self.feature_dims:
            col0.append(col0[-1] + d)
        self.units_by_owner: list[list[_Unit]] = [[] for _ in range(self.world)]
        dp_tables: list[TableConfig] = []
        dp_features: list[int] = []
        f = 0
        for ti, t in enumerate(self.tables):
            p = plans[t.name]
            if p.sharding_type is ShardingType.DATA_PARALLEL:
                dp_tables.append(t)
                dp_features.extend(range(f, f + len(t.features)))
                f += len(t.features)
                continue
            for _ in t.features:
                for s in p.shards:
                    unit = _Unit(f, ti, s, col0[f] + s.col_start, p.sharding_type in _ROW_SPLIT)
                    self.units_by_owner[s.rank].append(unit)
                f += 1
        self.local_units = self.units_by_owner[self.rank]
        max_rows = max((u.shard.rows for us in self.units_by_owner for u in us), default=0)
        self._id_dtype = torch.int32 if max_rows < 2**31 else torch.int64
        self._dp_spec = (dp_tables, dp_features)
        # Table-row-wise tables' outputs: reduced in the host first (``twrw``), not all-to-all.
        twrw = {i for i, t in enumerate(self.tables) if plans[t.name].sharding_type is _TWRW}
        self.twrw = (
            TwrwLayout.build(self.units_by_owner, twrw, self.plan.ranks_per_host) if twrw else None
        )
        self.dims_by_owner = [
            sum(u.dim for u in us if u.table not in twrw) for us in self.units_by_owner
        ]
        # The sample side's assembly (``output_dist``): owner blocks, then the table-row-wise
        # host blocks, then the data-parallel block.
        pieces = [
            (0, o, u.out_col, u.dim)
            for o, us in enumerate(self.units_by_owner)
            for u in us
            if u.table not in twrw
        ]
        self._col_widths = [tuple(self.dims_by_owner)]
        if self.twrw is not None:
            pieces += self.twrw.pieces(1)
            self._col_widths.append(self.twrw.widths)
            mine = self.twrw.local_cols[self.rank]
            width = sum(u.dim for u in self.local_units)
            taken = set(mine)
            other = [c for c in range(width) if c not in taken]
            self.register_buffer("_twrw_cols", torch.tensor(mine, dtype=torch.int64), False)
            self.register_buffer("_mp_cols", torch.tensor(other, dtype=torch.int64), False)
        dp = len(self._col_widths)
        pieces += [(dp, 0, col0[fi], col0[fi + 1] - col0[fi]) for fi in dp_features]
        self._col_runs = column_runs(pieces)
        self._col_widths.append((sum(p[3] for p in pieces if p[0] == dp),))

    def _build_local(self, seed: int, init_scale: float) -> None:
        # Local TBE tables: distinct (table, shard) pairs among this rank's units.
        keys: list[tuple[int, Shard]] = []
        feature_table = []
        for u in self.local_units:
            key = (u.table, u.shard)
            if key not in keys:
                keys.append(key)
            feature_table.append(keys.index(key))
        self.local_tables = keys
        self.layout = TBELayout(
            rows=tuple(s.rows for _, s in keys),
            dims=tuple(s.cols for _, s in keys),
            feature_table=tuple(feature_table),
        )
        cpu = torch.device("cpu")
        self.row_format = RowFormat(self._precision())
        fmt = self.row_format
        packed = None if fmt.precision == "fp32" else fmt.empty(self.layout)
        register_table_buffers(self, self.layout, self.optimizer.kind, cpu, weights=packed)
        for i, (ti, s) in enumerate(keys):
            rows = init_rows(self.tables[ti], seed, s.row_start, s.row_end, init_scale)
            fmt.encode(self.weights, self.layout, i, None, rows[:, s.col_start : s.col_end])
        if packed is not None:
            gkeys = [(table_key(self.tables[ti].name), s.row_start, s.col_start, self.tables[ti].dim)
                     for ti, s in keys]  # fmt: skip
            self.backend = LowpRowsBackend(self.backend, fmt, self.rounding, seed, gkeys)
        self.dp: Replicas | None = None
        if self._dp_spec[0]:
            self.dp = Replicas(*self._dp_spec, seed, init_scale)
            register_table_buffers(
                self, self.dp.layout, self.optimizer.kind, cpu, "dp_", self.dp.weights
            )

    def _precision(self) -> str:
        """The one stored precision of the tables; low precision (fp16 / bf16 / fp8) is for
        model-parallel shards updated by the fused kernel (not data-parallel replicas, nor
        column-wise slices under row-wise Adagrad, which leave the kernel)."""
        precs = sorted({t.precision or "fp32" for t in self.tables})
        if len(precs) > 1:
            raise ConfigError(
                f"sharded tables must share one precision, got {precs}; set embedding.precision "
                "(mixed precisions run in one process)"
            )
        if precs[0] == "fp32":
            return "fp32"
        for p in self.plan.tables:
            cw_adagrad = (
                p.sharding_type is ShardingType.COLUMN_WISE
                and self.optimizer.kind == "rowwise_adagrad"
            )
            if p.sharding_type is ShardingType.DATA_PARALLEL or cw_adagrad:
                raise ConfigError(
                    f"table '{p.name}': {precs[0]} rows cannot be sharded "
                    f"{p.sharding_type.value}{' under rowwise_adagrad' if cw_adagrad else ''}; "
                    "use table_wise, row_wise or table_row_wise (sharding.types)"
                )
        return precs[0]

    def _state(self, prefix: str = "") -> dict[str, Tensor]:
        return optimizer_state_of(self, prefix)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [b, sum of dims] for this rank's samples, in feature order.

        Update hooks receive ``self.layout`` (local shards, shard-local ids) or ``self.dp.layout``
        (replicas; every row any rank's batch changed)."""
        marks = self.marks
        local = self._take_staged(sparse).wait()
        marks.mark("input_dist")
        pooled = self.compute(local)
        marks.mark("tbe_forward")
        # A pipeline's next batch had this lookup's time to receive its lengths: start its ids.
        for _, pending in self._staged:
            pending.advance()
        marks.mark("input_dist")
        out = self.output_dist(pooled, local).wait()
        marks.mark("output_dist")
        marks.watch_backward(pooled, out)
        return out

    def compute(self, local: LocalInput) -> Tensor:
        """One fused TBE call over all local model-parallel shards -> [W*b, D_local]."""
        lookup = Lookup(local.indices, local.offsets, local.weights, PoolingMode.SUM)

        def update(grad: Tensor) -> None:
            if local.batch_size == 0:  # every rank's slice is empty: nothing moves, not the step
                return
            step = self._next_step("step")
            if self._cw_groups:
                update_with_cw_rowwise(self, local, lookup, grad, step)
            else:
                self.backend.backward_update(
                    self.layout, self.weights, self._state(), lookup, grad, self.optimizer, step
                )
            self._set_step("step", step)  # counted once the update went through
            for hook in self._hooks:
                hook(self.layout, local.indices, local.offsets)

        if self.layout.num_features == 0:
            # Still in the autograd graph: every rank must join the backward all-to-all.
            empty = torch.zeros(local.batch_size * self.world, 0, device=self.device)
            return empty + self._anchor.sum() if torch.is_grad_enabled() else empty
        return tbe_lookup(self._anchor, self.backend, self.layout, self.weights, lookup, update)

    def output_dist(self, pooled: Tensor, local: LocalInput) -> Awaitable[Tensor]:
        """Send pooled rows back to their samples' ranks; combine into [b, sum(dims)]."""
        b = local.batch_size
        pooled = ScaleGrad.apply(pooled, 1.0 / self.world)
        mine = pooled
        if self.twrw is not None:  # its columns leave by the two-stage path (``twrw``)
            mine = _columns(pooled, self._mp_cols)
        send_splits = [b * mine.shape[1]] * self.world
        recv_splits = [b * d for d in self.dims_by_owner]
        recv = AllToAllPooled.apply(
            mine, send_splits, recv_splits, self.group, self.comm_stats, self.codecs, b
        )
        sources = [recv]
        if self.twrw is not None:
            twrw = _columns(pooled, self._twrw_cols)
            sources.append(
                twrw_output_dist(
                    twrw, self.twrw, self.rank, b, self.group, self.comm_stats, self.codecs
                )
            )
        if self.dp is not None:
            sources.append(ScaleGrad.apply(self._dp_lookup(local), 1.0 / self.world))
        out = place_columns(
            sources, self._col_widths[: len(sources)], self._col_runs, b, self.total_dim
        )
        if local.inv_lengths is not None:
            scale = local.inv_lengths.repeat_interleave(
                self._feature_dims, dim=1, output_size=self.total_dim
            )
            out = out * scale
        return Done(out)

    def _next_step(self, name: str) -> int:
        """``self.<name> + 1`` from a host copy of the (device) counter: read once, and again
        only after something else wrote it (a restore: the buffer's version counter moved)."""
        buf: Tensor = getattr(self, name)
        seen = self._host_steps.get(name)
        if seen is None or seen[0] != buf._version:
            seen = (buf._version, int(buf))  # a host read: first step, or after a restore
            self._host_steps[name] = seen
        return seen[1] + 1

    def _set_step(self, name: str, step: int) -> None:
        buf: Tensor = getattr(self, name)
        buf.fill_(step)
        self._host_steps[name] = (buf._version, step)

    # ---- data-parallel replicas ------------------------------------------------------------
    def _dp_lookup(self, local: LocalInput) -> Tensor:
        assert self.dp is not None
        dp = self.dp
        lookup = Lookup(local.dp_indices, local.dp_offsets, local.dp_weights, PoolingMode.SUM)

        def update(grad: Tensor) -> None:
            if local.batch_size:  # an empty batch moves nothing, not the step
                self._dp_update(local, lookup, grad)

        return tbe_lookup(self._dp_anchor, self.backend, dp.layout, self.dp_weights, lookup, update)

    def _dp_update(self, local: LocalInput, lookup: Lookup, grad: Tensor) -> None:
        """Sum row gradients over ranks (rank order), then the fused optimizer on touched rows.

        Ranks exchange the rows their batch touched: small tables as dense blocks (one
        all-gather), larger ones as ids + summed gradients (all-gathered). Every rank adds the
        contributions to zero in rank order, so replicas stay bitwise equal.
        """
        assert self.dp is not None
        lay = self.dp.layout
        padded = getattr(self.backend, "row_grads_padded", None)  # (the GPU backends')
        if padded is not None and on_device(local.dp_indices) and local.dp_counts:
            self._dp_update_padded(local, lookup, grad, padded)
            return
        grads = row_grads(self.backend, lay, lookup, grad)
        # Small tables as dense blocks in one all-gather, the rest as (id, row) pairs; a codec
        # (``comm.allreduce``) encodes pairs, so with one every table goes as pairs.
        dense = dense_dp_tables(lay, self.dp_dense_max_elems) if self.dp_codec is None else []
        per_table: list[tuple[Tensor, Tensor]] = []
        if len(dense) < lay.num_tables:
            per_table = gather_dp_grads(
                lay, [g for g in grads if g[0] not in dense], self.dp_codec, self.world,
                self.group, self.comm_stats, self.device, self._host_group,
            )  # fmt: skip
        if dense:
            summed = gather_dp_grads_dense(
                lay, dense, grads, self.world, self.group, self.comm_stats
            )
            per_table = [summed[t] if t in summed else per_table[t] for t in range(lay.num_tables)]
        step = self._next_step("dp_step")
        # Every rank's (id, row sum) pairs in rank order, added per row in that order and
        # applied once: the fused update of the backend, over all DP tables in a call or a few.
        apply_row_grads(
            self.backend, lay, self.dp_weights, self._state("dp_"),
            [(t, ids, g) for t, (ids, g) in enumerate(per_table)], self.optimizer, step,
        )  # fmt: skip
        self._set_step("dp_step", step)  # counted once the update went through
        if self._hooks:
            touched = [torch.unique(ids) for ids, _ in per_table]
            # Report every row any rank's batch changed: one bag per feature, a table's rows on
            # its first feature (row trackers map features to tables through the layout).
            first = {t: f for f, t in reversed(list(enumerate(lay.feature_table)))}
            bags = [
                touched[t] if first[t] == f else touched[t][:0]
                for f, t in enumerate(lay.feature_table)
            ]
            offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(torch.tensor([b.numel() for b in bags]), 0)
            offsets = offsets.to(self.device)
            indices = torch.cat(bags) if bags else torch.empty(0, dtype=torch.int64)
            for hook in self._hooks:
                hook(lay, indices, offsets)

    def _dp_update_padded(
        self,
        local: LocalInput,
        lookup: Lookup,
        grad: Tensor,
        padded: Callable[..., list[PaddedRows]],
    ) -> None:
        """``_dp_update`` without a host read (the device path: GPU backends): each rank's rows
        of a table travel in a block sized by the largest id count of any rank's batch (host ints
        from the staged input), with their count; receivers mask the padding. The same pairs in
        the same order as ``_dp_update``, so the same update."""
        assert self.dp is not None
        lay = self.dp.layout
        bounds = dp_bounds(local.dp_counts, self.world, self._host_group)
        grads = padded(lay, lookup, grad, bounds)
        per_table = gather_dp_grads_padded(
            lay, grads, self.dp_codec, self.world, self.group, self.comm_stats
        )
        step = self._next_step("dp_step")
        apply_padded_row_grads(
            self.backend, lay, self.dp_weights, self._state("dp_"), per_table, self.optimizer, step
        )
        self._set_step("dp_step", step)
        if self._hooks:
            # Every row any rank's batch changed (as ``_dp_update``), duplicates allowed: a
            # table's block on its first feature, the padding replaced by its first valid row
            # (a table with a block has a row: a rank that sent ids sent one).
            first = {t: f for f, t in reversed(list(enumerate(lay.feature_table)))}
            bags: list[Tensor] = []
            for f, t in enumerate(lay.feature_table):
                _, ids, _, valid = per_table[t]
                if first[t] != f or not ids.numel():
                    bags.append(ids[:0])
                    continue
                a = torch.argmax(valid.to(torch.uint8)).reshape(1)
                bags.append(torch.where(valid, ids, ids[a]))
            offsets = torch.zeros(len(bags) + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(torch.tensor([b.numel() for b in bags]), 0)
            indices = torch.cat(bags)
            for hook in self._hooks:
                hook(lay, indices, offsets.to(self.device))

    # ---- inspection ------------------------------------------------------------------------
    def gather_table(self, name: str) -> Tensor:
        """The full table [rows, dim] assembled from every rank's shards (a collective)."""
        ti = next(i for i, t in enumerate(self.tables) if t.name == name)
        spec = self.tables[ti]
        if self.dp is not None and spec in self.dp.tables:
            table = self.dp.layout.table(self.dp_weights, self.dp.tables.index(spec))
            return table.to("cpu", copy=True)
        mine = [
            (s, self.row_format.decode(self.weights, self.layout, i).cpu())
            for i, (t, s) in enumerate(self.local_tables)
            if t == ti
        ]
        parts: list[list[tuple[Shard, Tensor]]] = [[] for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather_object(parts, mine, group=self.group)
        else:
            parts = [mine]
        full = torch.empty(spec.rows, spec.dim)
        for shard_list in parts:
            for s, w in shard_list:
                full[s.row_start : s.row_end, s.col_start : s.col_end] = w
        return full
