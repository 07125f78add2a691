"""Data-parallel tables of a sharded collection: full replicas on every rank, kept identical by
all-gathering each rank's touched rows' gradients and adding them in rank order: small tables
(``DENSE_DP_MAX_ELEMS``) as dense blocks in one all-gather, larger ones as (id, row) pairs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.config import TableConfig
from neorec.distributed.codecs import Codec
from neorec.distributed.comm import CommStats, all_gather, host_transport
from neorec.modules.collection_parts import init_rows
from neorec.ops.memory import table_empty
from neorec.ops.padded_rows import PaddedRows
from neorec.ops.tbe import TBELayout
from neorec.sharding.types import DENSE_DP_MAX_ELEMS, dense_dp

__all__ = [
    "Replicas",
    "gather_dp_grads",
    "gather_dp_grads_padded",
    "dp_bounds",
    "dense_dp_tables",
    "gather_dp_grads_dense",
]


class Replicas:
    """Full copies of the data-parallel tables, kept identical across ranks."""

    def __init__(self, tables: list[TableConfig], features: list[int], seed: int, scale: float):
        self.tables = tables
        self.layout = TBELayout(
            rows=tuple(t.rows for t in tables),
            dims=tuple(t.dim for t in tables),
            feature_table=tuple(i for i, t in enumerate(tables) for _ in t.features),
        )
        self.features = features  # global feature indices, in layout feature order
        self.weights = table_empty(self.layout.total_elems)
        for i, t in enumerate(tables):
            init_rows(t, seed, 0, t.rows, scale, out=self.layout.table(self.weights, i))


def gather_dp_grads(
    lay: TBELayout,
    grads: list[tuple[int, Tensor, Tensor]],
    codec: Codec | None,
    world: int,
    group: dist.ProcessGroup | None,
    stats: CommStats,
    device: torch.device | None = None,
    host_group: dist.ProcessGroup | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """Per DP table: (ids, grads) of every rank's touched rows, concatenated in rank order (the
    gradient rows sent as float32, or as ``codec``'s bytes). Buffers live on ``device`` (the
    tables'). The row counts are shapes here and go to the other ranks as Python ints over
    ``host_group`` (a gloo group; default ``group``): no device tensor is read back."""
    dev = device if device is not None else torch.device("cpu")
    t_count = lay.num_tables
    mine = {t: (ids, g) for t, ids, g in grads}
    counts = [mine[t][0].numel() if t in mine else 0 for t in range(t_count)]
    ids_flat = (
        torch.cat([mine[t][0] for t in sorted(mine)])
        if mine
        else torch.empty(0, dtype=torch.int64, device=dev)
    )
    dims = lay.dims
    # Per table, its gradient rows as sent: float32 values, or the codec's bytes of the block
    # (tables without rows send nothing).
    sent = [t for t in sorted(mine) if mine[t][0].numel()]
    if codec is None:
        vals_flat = torch.cat(
            [mine[t][1].reshape(-1) for t in sent] or [torch.empty(0, device=dev)]
        )
    else:
        vals_flat = torch.cat(
            [codec.encode(mine[t][1], "data-parallel row gradients") for t in sent]
            or [torch.empty(0, dtype=torch.uint8, device=dev)]
        )

    def block_sizes(c: list[int]) -> list[int]:
        """Elements (or codec bytes) of each table's block in a rank's buffer."""
        if codec is None:
            return [n * d for n, d in zip(c, dims)]
        return [codec.nbytes(n, d) if n else 0 for n, d in zip(c, dims)]

    if world > 1:
        all_counts: list[list[int]] = [[] for _ in range(world)]
        if host_transport(host_group or group) is not None:  # one host: a CPU tensor
            got = all_gather(torch.tensor(counts, dtype=torch.int64), host_group or group)
            all_counts = [g.tolist() for g in got]
        else:
            dist.all_gather_object(all_counts, counts, group=host_group or group)
        n_ids = [sum(c) for c in all_counts]
        n_vals = [sum(block_sizes(c)) for c in all_counts]
        all_ids = all_gather(ids_flat, group, n_ids)
        all_vals = all_gather(vals_flat, group, n_vals)
        item = 4 if codec is None else 1
        stats.add(
            "dp_allgather",
            (world - 1) * (8 * max(n_ids) + item * max(n_vals) + 8 * t_count),
        )
    else:  # a codec still rounds: one rank decodes its own bytes like a group would
        all_counts, all_ids, all_vals = [counts], [ids_flat], [vals_flat]
    out_ids: list[list[Tensor]] = [[] for _ in range(t_count)]
    out_g: list[list[Tensor]] = [[] for _ in range(t_count)]
    for c, ids_r, vals_r in zip(all_counts, all_ids, all_vals):
        id_parts = torch.split(ids_r, c)
        val_parts = torch.split(vals_r, block_sizes(c))
        for t in range(t_count):
            out_ids[t].append(id_parts[t])
            if codec is None or not c[t]:
                out_g[t].append(val_parts[t].view(-1, dims[t]))
            else:
                out_g[t].append(codec.decode(val_parts[t], c[t], dims[t]))
    return [(torch.cat(out_ids[t]), torch.cat(out_g[t])) for t in range(t_count)]


def dense_dp_tables(lay: TBELayout, max_elems: int = DENSE_DP_MAX_ELEMS) -> list[int]:
    """The DP tables whose gradients are summed as dense blocks (``gather_dp_grads_dense``): the
    ones of at most ``max_elems`` rows x dim, in table order. A function of the layout alone, so
    every rank agrees without a word."""
    return [t for t, (r, d) in enumerate(zip(lay.rows, lay.dims)) if dense_dp(r, d, max_elems)]


def gather_dp_grads_dense(
    lay: TBELayout,
    tables: Sequence[int],
    grads: list[tuple[int, Tensor, Tensor]],
    world: int,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> dict[int, tuple[Tensor, Tensor]]:
    """Per table of ``tables``: (sorted ids any rank touched, their gradient summed over ranks),
    from one all-gather of a float32 buffer holding each table's dense [rows, dim] gradient of
    this rank's touched rows (``grads``: ``row_grads``' sorted distinct ids and sums) and a
    per-row touch mark. Every rank adds the buffers to zero in rank order: a row's sum is then
    bitwise ``gather_dp_grads``' (its pairs added to zero in rank order; an untouched rank adds
    +0.0), so the update is the same and replicas stay equal.
    (Not an all-reduce: gloo's has a slow tail on small buffers here, and its order is its own.)"""
    mine = {t: (ids, g) for t, ids, g in grads}
    sizes = [lay.rows[t] * (lay.dims[t] + 1) for t in tables]
    dev = next((g.device for _, g in mine.values()), torch.device("cpu"))
    buf = torch.zeros(sum(sizes), dtype=torch.float32, device=dev)
    parts = torch.split(buf, sizes)
    for t, part in zip(tables, parts):
        if t in mine and mine[t][0].numel():
            ids, g = mine[t]
            r, d = lay.rows[t], lay.dims[t]
            part[: r * d].view(r, d).index_copy_(0, ids, g.to(torch.float32))
            part[r * d :].index_fill_(0, ids, 1.0)
    every = [buf]
    if world > 1:
        every = all_gather(buf, group)
        stats.add("dp_allgather", (world - 1) * 4 * buf.numel())
    # From zero, as the fused update adds pairs: a zero partial sum is +0.0, so an untouched
    # rank's +0.0 changes nothing and the sums are bitwise the pairs'.
    buf = torch.zeros_like(buf)
    for other in every:
        buf += other
    parts = torch.split(buf, sizes)
    out: dict[int, tuple[Tensor, Tensor]] = {}
    for t, part in zip(tables, parts):
        r, d = lay.rows[t], lay.dims[t]
        ids = torch.nonzero(part[r * d :]).view(-1)
        out[t] = (ids, part[: r * d].view(r, d).index_select(0, ids))
    return out


def dp_bounds(mine: tuple[int, ...], world: int, host_group: dist.ProcessGroup | None) -> list[int]:
    """Per DP table, the largest id count of any rank's batch (host ints, exchanged over the
    gloo ``host_group``): the block size every rank sends in ``gather_dp_grads_padded``."""
    if world == 1:
        return list(mine)
    every: list[tuple[int, ...]] = [() for _ in range(world)]
    dist.all_gather_object(every, mine, group=host_group)
    return [max(c) for c in zip(*every)]


def gather_dp_grads_padded(
    lay: TBELayout,
    grads: list[PaddedRows],
    codec: Codec | None,
    world: int,
    group: dist.ProcessGroup | None,
    stats: CommStats,
) -> list[tuple[int, Tensor, Tensor, Tensor]]:
    """``gather_dp_grads`` without a host read (the device path): every rank sends each DP table t
    as one block of the same host-known size (``PaddedRows`` of ``dp_bounds``: its distinct rows,
    then zeros; the count rides with the ids), so both all-gathers have equal sizes and the
    receivers mask the padding with the counts. Per table: (t, ids, grads, valid), every rank's
    block in rank order; the valid pairs are ``gather_dp_grads``' (the padding's zero rows do not
    change any codec's scales), for ``apply_padded_row_grads``."""
    t_count, dims = lay.num_tables, lay.dims
    bounds = [ids.numel() for _, ids, _, _ in grads]
    if [t for t, *_ in grads] != list(range(t_count)):
        raise ValueError("gather_dp_grads_padded: one block per table, in table order")
    ids_flat = torch.cat([ids for _, ids, _, _ in grads] + [c for *_, c in grads])
    sent = [g for _, ids, g, _ in grads if ids.numel()]
    if codec is None:
        vals_flat = torch.cat([g.reshape(-1) for g in sent] or [ids_flat.new_zeros(0).float()])
        sizes = [n * d for n, d in zip(bounds, dims)]
    else:
        vals_flat = torch.cat(
            [codec.encode(g, "data-parallel row gradients") for g in sent]
            or [ids_flat.new_zeros(0).to(torch.uint8)]
        )
        sizes = [codec.nbytes(n, d) if n else 0 for n, d in zip(bounds, dims)]
    if world > 1:
        all_ids = all_gather(ids_flat, group)
        all_vals = all_gather(vals_flat, group)
        item = 4 if codec is None else 1
        stats.add("dp_allgather", (world - 1) * (8 * ids_flat.numel() + item * vals_flat.numel()))
    else:
        all_ids, all_vals = [ids_flat], [vals_flat]
    out_ids: list[list[Tensor]] = [[] for _ in range(t_count)]
    out_g: list[list[Tensor]] = [[] for _ in range(t_count)]
    out_ok: list[list[Tensor]] = [[] for _ in range(t_count)]
    for ids_r, vals_r in zip(all_ids, all_vals):
        id_parts = torch.split(ids_r, [*bounds, t_count])
        counts = id_parts[-1]
        val_parts = torch.split(vals_r, sizes)
        for t in range(t_count):
            n = bounds[t]
            out_ids[t].append(id_parts[t])
            out_ok[t].append(torch.arange(n, device=ids_r.device) < counts[t : t + 1])
            if codec is None or not n:
                out_g[t].append(val_parts[t].view(n, dims[t]))
            else:
                out_g[t].append(codec.decode(val_parts[t], n, dims[t]))
    return [
        (t, torch.cat(out_ids[t]), torch.cat(out_g[t]), torch.cat(out_ok[t]))
        for t in range(t_count)
    ]
