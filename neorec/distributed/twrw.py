"""Table-row-wise output distribution: partial sums reduced inside the host, then one sum per
sample across hosts (Neo, Mudigere et al. ISCA 2022; TorchRec's ``twrw_sharding``).

A table-row-wise (TWRW) table's row shards live on the ranks of one host ``h`` (ranks
``h*k .. h*k + k - 1``; ``k = plan.ranks_per_host``, ``H = W / k`` hosts). Each shard's lookup
gives partial sums for all ``W*b`` samples, rows in [destination rank][sample] order. The output
distribution of the TWRW columns runs in two stages::

    partial sums [W*b, D_r] on each host rank
      --stage 1: in-host reduce-scatter (``HostReduce``)-->
        host rank j holds the sums for the ranks q with q % k == j (one per host): [H, b, C_h]
      --stage 2: all-to-all between those peers (``AllToAllPooled``)-->
        rank q receives one [b, C_h] block from each host h: [b, sum_h C_h]

``D_r``: the columns of rank r's TWRW units; ``C_h``: the columns of the TWRW features placed on
host h. Stage 1 is an all-to-all over the collection's group in which only ranks of one host
exchange bytes (float32: exact partial sums); j adds each feature's partial sums in (owner rank,
unit) order, the order in which row-wise's output adds them (``neorec.distributed.columns``), so
the sums are bitwise row-wise's. Stage 2 sends each sum once, through the forward / backward
wire codecs (``comm.forward``, ``comm.backward``); on one host (``H == 1``) without codecs it is
skipped (rank q already holds its sums). The backward reverses both: stage 2's gradients come back,
and every shard gets its feature's columns of the sum's gradient.

Bytes that leave a host per TWRW feature and step: one [b, dim] block per sample rank on another
host (``(W - k) * b * dim`` floats, all hosts' ranks together) instead of one per shard per sample
rank, as row-wise sends: ``k`` times fewer with ``k`` shards. Counted by ``CommStats``
(``inter_host``, under ``fwd_pooled`` / ``bwd_grads``; the in-host stage under
``fwd_host_reduce`` / ``bwd_host_reduce``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from neorec.distributed.codecs import Codec
from neorec.distributed.comm import AllToAllPooled, CommStats, all_to_all

__all__ = ["TwrwLayout", "twrw_output_dist"]


class _UnitLike(Protocol):
    @property
    def feature(self) -> int: ...
    @property
    def table(self) -> int: ...
    @property
    def out_col(self) -> int: ...
    @property
    def dim(self) -> int: ...


@dataclass(frozen=True)
class _Feature:
    """One TWRW feature of a host: its columns in the host's block and its partial sums."""

    col: int  # first column in the host's block [., C_h]
    out_col: int  # first column in the collection's output
    width: int
    parts: tuple[tuple[int, int], ...]  # (host-local rank, first column in its [., D_r] block)


@dataclass(frozen=True)
class TwrwLayout:
    """Where every TWRW unit's columns are, on its owner and in its host's reduced block."""

    world: int
    k: int  # ranks per host
    dims: tuple[int, ...]  # D_r: TWRW columns of each rank's units
    local_cols: tuple[tuple[int, ...], ...]  # per rank: its TWRW units' columns of its lookup
    features: tuple[tuple[_Feature, ...], ...]  # per host, in feature order
    widths: tuple[int, ...]  # C_h per host

    @property
    def hosts(self) -> int:
        """``H``: hosts of the plan."""
        return self.world // self.k

    @staticmethod
    def build(
        units_by_owner: Sequence[Sequence[_UnitLike]], twrw_tables: set[int], k: int
    ) -> TwrwLayout:
        """The layout of the units of ``twrw_tables`` (table indices) among ``units_by_owner``."""
        world = len(units_by_owner)
        if k < 1 or world % k:
            raise ValueError(f"{world} ranks do not split into hosts of {k} ranks")
        dims, local_cols = [], []
        parts: dict[int, list[tuple[int, int]]] = {}  # feature -> its partial sums, owner order
        shape: dict[int, tuple[int, int, int]] = {}  # feature -> (host, out_col, width)
        for o, us in enumerate(units_by_owner):
            col, at, mine = 0, 0, list[int]()
            for u in us:
                if u.table in twrw_tables:
                    parts.setdefault(u.feature, []).append((o % k, at))
                    shape[u.feature] = (o // k, u.out_col, u.dim)
                    mine.extend(range(col, col + u.dim))
                    at += u.dim
                col += u.dim
            dims.append(at)
            local_cols.append(tuple(mine))
        features: list[list[_Feature]] = [[] for _ in range(world // k)]
        widths = [0] * (world // k)
        for f in sorted(parts):
            h, out_col, width = shape[f]
            features[h].append(_Feature(widths[h], out_col, width, tuple(parts[f])))
            widths[h] += width
        return TwrwLayout(
            world, k, tuple(dims), tuple(local_cols), tuple(tuple(fs) for fs in features),
            tuple(widths),
        )  # fmt: skip

    def pieces(self, source: int) -> list[tuple[int, int, int, int]]:
        """``column_runs`` pieces of the received sums: segment h is host h's [b, C_h] block."""
        return [(source, h, f.out_col, f.width) for h, fs in enumerate(self.features) for f in fs]


class HostReduce(torch.autograd.Function):
    """Stage 1: this host's partial sums [W*b, D_r] -> the sums for this rank's peers [H*b*C_h]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, lay: TwrwLayout, rank: int, b: int, group: Any, stats: CommStats
    ) -> Tensor:
        ctx.meta = (lay, rank, b, group, stats)
        hosts, k = lay.hosts, lay.k
        h = rank // k
        send = x.reshape(hosts, k, b, lay.dims[rank]).transpose(0, 1).reshape(-1)
        send_splits = _in_host(lay, h, hosts * b * lay.dims[rank])
        recv_splits = [hosts * b * lay.dims[g] if g // k == h else 0 for g in range(lay.world)]
        got = all_to_all(send, send_splits, recv_splits, group, stats, "fwd_host_reduce").wait()
        blocks = torch.split(got, recv_splits)
        parts = [
            blocks[h * k + i].view(hosts, b, lay.dims[h * k + i]) for i in range(k)
        ]  # per host rank i: its partial sums for this rank's peers
        out = x.new_empty(hosts, b, lay.widths[h])
        for f in lay.features[h]:
            dst = out[:, :, f.col : f.col + f.width]
            for n, (i, c) in enumerate(f.parts):
                src = parts[i][:, :, c : c + f.width]
                # The order row-wise's output adds them in: owner rank, then unit.
                if n:
                    dst.add_(src)
                else:
                    dst.copy_(src)
        return out.reshape(-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        lay, rank, b, group, stats = ctx.meta
        hosts, k = lay.hosts, lay.k
        h = rank // k
        g = grad.reshape(hosts, b, lay.widths[h])
        blocks = [grad.new_empty(hosts, b, lay.dims[h * k + i]) for i in range(k)]
        for f in lay.features[h]:
            for i, c in f.parts:  # each partial sum's gradient is the sum's
                blocks[i][:, :, c : c + f.width] = g[:, :, f.col : f.col + f.width]
        send = torch.cat([t.reshape(-1) for t in blocks])
        send_splits = [hosts * b * lay.dims[q] if q // k == h else 0 for q in range(lay.world)]
        recv_splits = _in_host(lay, h, hosts * b * lay.dims[rank])
        got = all_to_all(send, send_splits, recv_splits, group, stats, "bwd_host_reduce").wait()
        back = got.view(k, hosts, b, lay.dims[rank]).transpose(0, 1)
        return back.reshape(lay.world * b, lay.dims[rank]), None, None, None, None, None


def _in_host(lay: TwrwLayout, h: int, n: int) -> list[int]:
    """Splits of ``n`` elements to every rank of host ``h``, none elsewhere."""
    return [n if q // lay.k == h else 0 for q in range(lay.world)]


def twrw_output_dist(
    pooled: Tensor,
    lay: TwrwLayout,
    rank: int,
    b: int,
    group: Any,
    stats: CommStats,
    codecs: tuple[Codec | None, Codec | None],
) -> Tensor:
    """This rank's TWRW lookups [W*b, D_r] -> the sums of its b samples' TWRW features, host
    blocks in host order (flat: [b, C_0], [b, C_1], ...; ``TwrwLayout.pieces``)."""
    sums = HostReduce.apply(pooled, lay, rank, b, group, stats)
    k = lay.k
    if lay.hosts == 1 and codecs == (None, None):
        return sums  # this rank's own sums, already here
    j, h = rank % k, rank // k
    send_splits = [b * lay.widths[h] if q % k == j else 0 for q in range(lay.world)]
    recv_splits = [b * lay.widths[q // k] if q % k == j else 0 for q in range(lay.world)]
    return AllToAllPooled.apply(sums, send_splits, recv_splits, group, stats, codecs, b)
