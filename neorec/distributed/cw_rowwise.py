"""Column-wise tables under row-wise Adagrad: the full row's mean(g^2) over its column slices.

Row-wise Adagrad needs mean(g^2) over the whole row, but a column slice sees only its columns:
the slice owners add their partial sums of squares of each distinct row (every slice receives
every bag of its table, so every owner has the same distinct rows, in the same sorted order),
rank-ordered over a subgroup of the owners, then update their slices from the full-row mean.

Two paths, the same sums in the same order:

- host path (the cpu kernel: the other local tables take its fused update and only the
  column-wise slices come back as row sums; other backends on host tensors: every table's
  distinct rows, ``row_grads``, a data-dependent size);
- device path (a backend with ``row_grads_padded``, tensors on the device: cuda, triton): each
  local table's rows in a block of host-known size (its id count in the batch, from the host copy
  of the input: ``LocalInput.mp_counts``, equal on every slice owner), the padded sums of squares
  all-reduced (equal shapes on every owner; the padding adds zeros), and masked writes
  (``padded_rows.put_valid``): no host read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.distributed.comm import ordered_all_reduce
from neorec.distributed.input_dist import LocalInput
from neorec.ops.cpu import CpuBackend
from neorec.ops.padded_rows import PaddedRows, put_valid, update_table_rows_padded
from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe import Lookup, row_grads, update_table_rows
from neorec.ops.tbe_checks import on_device
from neorec.sharding.types import ShardingType

if TYPE_CHECKING:
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection

__all__ = ["build_cw_groups", "update_with_cw_rowwise"]


def build_cw_groups(
    ebc: ShardedEmbeddingBagCollection,
) -> tuple[dict[int, dist.ProcessGroup | None], dict[int, tuple[int, ...]]]:
    """Per column-wise table of this rank (by table index): the subgroup of its owners (None:
    one owner, or no process group) and their ranks, for exact row-wise Adagrad; none under
    another optimizer. Collective: every rank calls it (``new_group``), in table order."""
    groups: dict[int, dist.ProcessGroup | None] = {}
    owners: dict[int, tuple[int, ...]] = {}
    if ebc.optimizer.kind != "rowwise_adagrad":
        return groups, owners
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for ti, t in enumerate(ebc.tables):
        p = ebc.plan.table(t.name)
        if p.sharding_type is not ShardingType.COLUMN_WISE:
            continue
        ranks = tuple(sorted(set(p.ranks())))
        if ranks not in made:  # one group per owner set, shared by its tables
            made[ranks] = None
            if len(ranks) > 1 and dist.is_initialized():
                made[ranks] = dist.new_group(ranks=list(ranks), backend=dist.get_backend(ebc.group))
        if ebc.rank in ranks:
            groups[ti] = made[ranks]
            owners[ti] = ranks
    return groups, owners


def update_with_cw_rowwise(
    ebc: ShardedEmbeddingBagCollection, local: LocalInput, lookup: Lookup, grad: Tensor, step: int
) -> None:
    """The fused update of ``ebc``'s local tables (``lookup``: ``local``'s model-parallel bags)
    whose column-wise ones use the full row's mean(g^2): on the device path without a host
    read, else on the host path."""
    padded = getattr(ebc.backend, "row_grads_padded", None)  # (the GPU backends')
    if (
        padded is not None
        and on_device(lookup.indices)
        and len(local.mp_counts) == ebc.layout.num_tables
    ):
        _update_padded(ebc, local, lookup, grad, step, padded)
    else:
        _update_host(ebc, lookup, grad, step)


def _update_host(
    ebc: ShardedEmbeddingBagCollection, lookup: Lookup, grad: Tensor, step: int
) -> None:
    lay, opt, state = ebc.layout, ebc.optimizer, ebc._state()
    cw_local = [lt for lt, (t, _) in enumerate(ebc.local_tables) if t in ebc._cw_groups]
    if isinstance(ebc.backend, CpuBackend):
        grads = ebc.backend.backward_update(
            lay, ebc.weights, state, lookup, grad, opt, step, emit_tables=cw_local
        )
    else:
        grads = row_grads(ebc.backend, lay, lookup, grad)
    eff: dict[int, tuple[Tensor, Tensor]] = {}
    for lt, ids, g in grads:
        w = lay.table(ebc.weights, lt)[ids]
        eff[lt] = (ids, g + opt.weight_decay * w if opt.weight_decay else g)
    mean_sq = _full_row_mean_sq(ebc, {lt: g for lt, (_, g) in eff.items()})
    s_all = state["momentum1"]
    for lt, (ids, g) in eff.items():
        ti = ebc.local_tables[lt][0]
        w_t = lay.table(ebc.weights, lt)
        rows = lay.row_offsets[lt] + ids
        if ti in mean_sq:
            s = s_all[rows] + mean_sq[ti]
            w_t[ids] = w_t[ids] - opt.lr * g / (s.sqrt() + opt.eps).unsqueeze(1)
            s_all[rows] = s
        else:  # weight decay is already in g
            update_table_rows(lay, ebc.weights, state, lt, ids, g, _no_decay(opt), step)


def _update_padded(
    ebc: ShardedEmbeddingBagCollection,
    local: LocalInput,
    lookup: Lookup,
    grad: Tensor,
    step: int,
    padded: Callable[..., list[PaddedRows]],
) -> None:
    """``_update_host`` without a host read: the same values at the valid entries of each
    table's block; the padding's entries are computed, never written (``put_valid``)."""
    lay, opt, state = ebc.layout, ebc.optimizer, ebc._state()
    grads = padded(lay, lookup, grad, list(local.mp_counts))
    eff: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
    for lt, ids, g, count in grads:
        valid = torch.arange(ids.numel(), device=ids.device) < count
        w = lay.table(ebc.weights, lt)[ids]
        eff[lt] = (ids, g + opt.weight_decay * w if opt.weight_decay else g, valid)
    mean_sq = _full_row_mean_sq(ebc, {lt: g for lt, (_, g, _) in eff.items()})
    s_all = state["momentum1"]
    no_wd = _no_decay(opt)  # weight decay is already in g
    for lt, (ids, g, valid) in eff.items():
        if not ids.numel():  # (a host-known size: no id of this table in the batch)
            continue
        ti = ebc.local_tables[lt][0]
        if ti in mean_sq:
            w_t = lay.table(ebc.weights, lt)
            rows = lay.row_offsets[lt] + ids
            s = s_all[rows] + mean_sq[ti]
            put_valid(w_t, ids, w_t[ids] - opt.lr * g / (s.sqrt() + opt.eps).unsqueeze(1), valid)
            put_valid(s_all, rows, s, valid)
        else:
            update_table_rows_padded(lay, ebc.weights, state, lt, ids, g, valid, no_wd, step)


@functools.lru_cache(maxsize=8)
def _no_decay(opt: RowOptimizer) -> RowOptimizer:
    """``opt`` without weight decay, made once (its checks read a host tensor: not in a step)."""
    return replace(opt, weight_decay=0.0)


def _full_row_mean_sq(
    ebc: ShardedEmbeddingBagCollection, eff: dict[int, Tensor]
) -> dict[int, Tensor]:
    """Per column-wise table, mean(g^2) over the full row of each of its rows in this rank's
    slices' order (``eff``: local table -> effective row gradients of its slice): this rank's
    partial sums of squares, summed over the owners in rank order; the tables of one owner set
    share one all-reduce (equal shapes on every owner: the same rows, or the same bounds)."""
    parts: dict[int, Tensor] = {}
    for ti in ebc._cw_groups:
        mine = [lt for lt, (t, _) in enumerate(ebc.local_tables) if t == ti and lt in eff]
        part = sum((eff[lt] ** 2).sum(1) for lt in mine)
        parts[ti] = part if isinstance(part, Tensor) else torch.zeros(0, device=ebc.device)
    by_ranks: dict[tuple[int, ...], list[int]] = {}
    for ti in ebc._cw_groups:
        by_ranks.setdefault(ebc._cw_ranks[ti], []).append(ti)
    mean_sq: dict[int, Tensor] = {}
    for tis in by_ranks.values():
        group = ebc._cw_groups[tis[0]]
        flat = torch.cat([parts[ti] for ti in tis])
        total = ordered_all_reduce(flat, group, ebc.comm_stats) if group is not None else flat
        for ti, tot in zip(tis, torch.split(total, [parts[ti].numel() for ti in tis])):
            mean_sq[ti] = tot / ebc.tables[ti].dim
    return mean_sq
