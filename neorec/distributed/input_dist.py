"""Input distribution of the sharded collection: each rank's bags to the owners of the shards.

Split out of ``neorec.distributed.sharded`` (``ShardedEmbeddingBagCollection`` inherits
``InputDist``). Everything that needs numbers on the host is prepared from the host copy of the
batch, before its step: the batch's checks (``checked_batch``: lengths, per-id weights, ids in
range), the split of the ids by shard (row-wise bucketing), the lengths all-to-all (over gloo: the
collection's group on the CPU, a gloo twin of it when the tables live on a GPU), every split size of
the ids all-to-all, the permutation of the received ids into unit-major order, and the id counts
per table (bounds of the device path's row blocks: ``LocalInput.dp_counts``, ``mp_counts``). The
device then only sends the ids and gathers them: no host sync in the step (``train.device``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neorec.distributed.comm import Awaitable, Chain, CommStats, all_to_all, unit_major_order
from neorec.modules.collection_parts import checked_batch
from neorec.ops.row_split import split_rows
from neorec.ops.tbe import PoolingMode, TBELayout
from neorec.sharding.types import Shard
from neorec.sparse import SparseFeatures

__all__ = ["InputDist", "LocalInput"]


def _to_device(t: Tensor | None, device: torch.device) -> Tensor | None:
    """``t`` on ``device``: itself on the CPU; a non-blocking copy from pinned memory on a GPU."""
    if t is None or device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class _Unit:
    """One (feature, shard) lookup: the bags of ``feature`` restricted to ``shard``."""

    feature: int  # index in the global feature order
    table: int  # index in the table list
    shard: Shard
    out_col: int  # first output column of this unit's slice
    row_split: bool  # ids are filtered to the shard's rows (RW, TWRW)

    @property
    def dim(self) -> int:
        return self.shard.cols


@dataclass
class LocalInput:
    """What input_dist delivers to this rank: bags of all W*b samples for its local units."""

    indices: Tensor
    offsets: Tensor
    weights: Tensor | None
    dp_indices: Tensor
    dp_offsets: Tensor
    dp_weights: Tensor | None
    inv_lengths: Tensor | None  # [b, F] 1/len for mean pooling
    batch_size: int  # local b
    dp_counts: tuple[int, ...] = ()  # ids per data-parallel table (host ints: distinct-row bounds)
    mp_counts: tuple[int, ...] = ()
    """Ids per local table (``layout``'s: model-parallel shards) in ``indices``: host ints, bounds
    of their distinct rows; a column-wise table's are equal on every slice owner (the same ids)."""


class InputDist:
    """The input distribution half of ``ShardedEmbeddingBagCollection`` (a mixin)."""

    units_by_owner: list[list[_Unit]]
    local_units: list[_Unit]
    layout: TBELayout  # the local tables: local_units in order
    world: int
    group: Any
    _host_group: Any
    comm_stats: CommStats
    device: torch.device
    pooling: PoolingMode
    dp: Any
    feature_names: list[str]
    _id_dtype: torch.dtype
    _staged: list[tuple[SparseFeatures, Chain[LocalInput]]]

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Prepare ``input_dist(sparse)`` now (from ``host``, the batch before its host-to-device
        copy, when given); a later ``forward`` of this same ``sparse`` object uses it."""
        self._staged.append((sparse, self.input_dist(sparse, host)))

    def _take_staged(self, sparse: SparseFeatures) -> Awaitable[LocalInput]:
        for i, (staged, pending) in enumerate(self._staged):
            if staged is sparse:
                del self._staged[i]
                return pending
        return self.input_dist(sparse)

    def input_dist(
        self, sparse: SparseFeatures, host: SparseFeatures | None = None
    ) -> Chain[LocalInput]:
        """Prepare this rank's bags for the shard owners on the host, then (``advance`` / ``wait``)
        send the ids from the device.

        Everything that needs numbers on the host is done here, from the host copy of the batch
        (``host``; else ``sparse`` itself on the CPU, or a copy of it): the batch's checks, the
        split of the ids by shard, the lengths all-to-all (on the host group), the split sizes of
        the ids all-to-all and the permutation into unit-major order. The returned chain then runs
        on the device without reading it back (no host sync): a pipeline calls this before the
        step (``stage_input_dist``), so the step itself never waits on the host.
        """
        if host is None:
            host = sparse if sparse.values.device.type == "cpu" else sparse.to("cpu")
        elif host is not sparse and (
            list(host.keys) != list(sparse.keys)
            or host.values.shape != sparse.values.shape
            or host.lengths.shape != sparse.lengths.shape
        ):  # (shapes only: nothing is read back from the device)
            raise ValueError("input_dist: the host copy of the batch is not the batch staged")
        host = checked_batch(self, host)
        b = host.batch_size
        per_unit = self._split_by_unit(host)
        lengths, values, weights = [], [], []
        for us in self.units_by_owner:
            for u in us:
                lens, vals, wts = per_unit[u]
                lengths.append(lens)
                values.append(vals)
                if wts is not None:
                    weights.append(wts)
        # Lengths and shard-local ids travel as int32 when every shard fits (lossless, half the bytes).
        send_len = (
            torch.cat(lengths).to(torch.int32) if lengths else torch.empty(0, dtype=torch.int32)
        )
        len_splits = [len(us) * b for us in self.units_by_owner]
        recv_len_splits = [len(self.local_units) * b] * self.world
        recv_len = all_to_all(
            send_len, len_splits, recv_len_splits, self._host_group, self.comm_stats, "lengths"
        ).wait()
        val_counts = [int(x.sum()) for x in torch.split(send_len, len_splits)]
        blocks = recv_len.to(torch.int64).view(self.world, len(self.local_units), b)
        recv_counts = blocks.sum(dim=(1, 2)).tolist()
        mp_counts = [0] * self.layout.num_tables
        for t, n in zip(self.layout.feature_table, blocks.sum(dim=(0, 2)).tolist(), strict=True):
            mp_counts[t] += n
        gather, offsets = unit_major_order(blocks)
        send_val = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        send_val = send_val.to(self._id_dtype)
        send_w = torch.cat(weights) if weights else None
        dp = self._dp_input(host)
        inv = self._inv_lengths(host) if self.pooling == PoolingMode.MEAN else None
        # One host-to-device copy of what the step reads (from pinned memory on a GPU).
        dev = [
            _to_device(t, self.device)
            for t in (send_val, send_w, gather, offsets, dp[0], dp[1], dp[2], inv)
        ]
        d_val, d_w, d_gather, d_off, dp_idx, dp_off, dp_w, d_inv = dev
        assert d_val is not None and d_gather is not None and d_off is not None
        assert dp_idx is not None and dp_off is not None

        def ids_phase() -> Awaitable[LocalInput]:
            a_val = all_to_all(d_val, val_counts, recv_counts, self.group, self.comm_stats, "ids")
            a_w = None
            if d_w is not None:
                a_w = all_to_all(
                    d_w, val_counts, recv_counts, self.group, self.comm_stats, "weights"
                )

            def finish() -> LocalInput:
                if self.device.type == "cuda":  # staged on a side stream, read on this one
                    now = torch.cuda.current_stream(self.device)
                    for t in dev:
                        if t is not None:
                            t.record_stream(now)
                recv_val = a_val.wait().to(torch.int64)
                recv_w = a_w.wait() if a_w is not None else None
                wts = recv_w[d_gather] if recv_w is not None else None
                return LocalInput(
                    recv_val[d_gather], d_off, wts, dp_idx, dp_off, dp_w, d_inv, b, dp[3],
                    tuple(mp_counts),
                )  # fmt: skip

            return Awaitable(finish)

        return Chain(ids_phase)

    def _split_by_unit(
        self, sparse: SparseFeatures
    ) -> dict[_Unit, tuple[Tensor, Tensor, Tensor | None]]:
        """For each unit: (lengths [b], ids local to its shard, weights) of this rank's bags."""
        b = sparse.batch_size
        offs = sparse.offsets()
        out: dict[_Unit, tuple[Tensor, Tensor, Tensor | None]] = {}
        by_feature: dict[int, list[_Unit]] = {}
        for us in self.units_by_owner:
            for u in us:
                by_feature.setdefault(u.feature, []).append(u)
        for f, units in by_feature.items():
            lo, hi = int(offs[f * b]), int(offs[(f + 1) * b])
            vals = sparse.values[lo:hi].to(torch.int64)
            lens = sparse.lengths[f * b : (f + 1) * b].to(torch.int64)
            wts = sparse.weights[lo:hi] if sparse.weights is not None else None
            if not units[0].row_split:
                for u in units:
                    out[u] = (lens, vals, wts)
                continue
            order = sorted(range(len(units)), key=lambda j: units[j].shard.row_start)
            starts = [units[j].shard.row_start for j in order]
            counts, pieces, wpieces = split_rows(vals, lens, starts, wts)
            for k, j in enumerate(order):
                w = wpieces[k] if wpieces is not None else None
                out[units[j]] = (counts[k], pieces[k], w)
        return out

    def _dp_input(
        self, sparse: SparseFeatures
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, ...]]:
        if self.dp is None:
            e = torch.empty(0, dtype=torch.int64)
            return e, torch.zeros(1, dtype=torch.int64), None, ()
        sub = sparse.select([self.feature_names[f] for f in self.dp.features])
        tables = self.dp.layout.feature_table
        per_f = sub.lengths.reshape(len(tables), sparse.batch_size).sum(1).tolist()
        counts = [0] * self.dp.layout.num_tables
        for f, t in enumerate(tables):
            counts[t] += per_f[f]
        return sub.values.to(torch.int64), sub.offsets(), sub.weights, tuple(counts)

    def _inv_lengths(self, sparse: SparseFeatures) -> Tensor:
        lens = sparse.lengths.view(len(self.feature_names), -1).t().to(torch.float32)  # [b, F]
        return torch.where(lens > 0, 1.0 / lens.clamp(min=1), torch.zeros_like(lens))
