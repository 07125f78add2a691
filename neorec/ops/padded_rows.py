"""Row gradients in blocks of host-known sizes: data-parallel tables without a host read.

``row_grads`` returns each table's distinct rows: a data-dependent size, so one host read per
step on a GPU. The GPU backends' ``row_grads_padded`` returns each table's rows in a block whose
size is known on the host (``bound``: at least the table's id count in the batch, which bounds its
distinct rows): the rows in id order, then zeros, with their count as a device tensor. The
data-parallel exchange all-gathers such blocks (``replicas.gather_dp_grads_padded``) and
``apply_padded_row_grads`` applies the valid (id, gradient) pairs, masked on the device: the same
sums in the same order as ``apply_row_grads`` of the valid pairs alone. ``put_valid`` and
``update_table_rows_padded`` write only a block's valid entries (column-wise tables under row-wise
Adagrad: ``distributed.cw_rowwise``). ``segments`` finds the runs of equal keys of a sorted
tensor, also without a host read (the GPU backends' and ``lowp_device``'s grouping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from neorec.ops.row_optim import RowOptimizer, apply_rows
from neorec.ops.tbe_rows import group_calls
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = [
    "PaddedRows",
    "pad_heads",
    "apply_padded_row_grads",
    "put_valid",
    "update_table_rows_padded",
    "segments",
]

PaddedRows = tuple[int, Tensor, Tensor, Tensor]
"""(table, ids [bound], row sums [bound, dim], count [1] int64): the first ``count`` are rows."""


def segments(sorted_key: Tensor, sentinel: int) -> tuple[Tensor, Tensor, Tensor]:
    """Runs of equal keys in ``sorted_key`` [n] without a host read: (the length of the run that
    starts at each position, 0 elsewhere; whether a position starts a run of a key below
    ``sentinel``; the start of each position's run). Lengths sum to n."""
    n = sorted_key.numel()
    pos = torch.arange(n, device=sorted_key.device)
    new = torch.ones(n, dtype=torch.bool, device=sorted_key.device)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    starts = torch.where(new, pos, n)
    nxt = torch.cat([starts[1:], starts.new_full((1,), n)]).flip(0).cummin(0).values.flip(0)
    count = torch.where(new, nxt - pos, 0)
    first = torch.where(new, pos, 0).cummax(0).values
    return count, new & (sorted_key < sentinel), first


def pad_heads(
    layout: TBELayout,
    key: Tensor | None,
    head: Tensor | None,
    summed: Tensor | None,
    bounds: Sequence[int],
    device: torch.device,
) -> list[PaddedRows]:
    """Per table t, a ``PaddedRows`` of ``bounds[t]`` rows from a batch's sorted occurrences:
    ``key`` [n] their global rows (ascending), ``head`` [n] whether one is the first occurrence of
    a row of the layout, ``summed`` [n, max dim] at each head its row's gradient sum (None: no
    occurrence). No host read: every size is a bound or n. A bound below the table's distinct rows
    is a device assert."""
    dims, nt = layout.dims, layout.num_tables
    if len(bounds) != nt:
        raise ValueError(f"pad_heads: {len(bounds)} bounds for {nt} tables")
    if key is None or head is None or summed is None or key.numel() == 0:
        return [
            (
                t,
                torch.zeros(bounds[t], dtype=torch.int64, device=device),
                torch.zeros(bounds[t], dims[t], device=device),
                torch.zeros(1, dtype=torch.int64, device=device),
            )
            for t in range(nt)
        ]
    n = key.numel()
    order = torch.argsort((~head).to(torch.uint8), stable=True)  # heads first, in key order
    pos = torch.arange(n, device=device)
    keys = torch.where(pos < head.sum(), key[order].long(), layout.total_rows)
    rows = summed[order]
    edges = torch.searchsorted(keys, layout.meta(device)["row_offsets"])  # each table's first
    out, fits = [], []
    for t in range(nt):
        k = torch.arange(bounds[t], device=device)
        count = (edges[t + 1] - edges[t]).reshape(1)
        valid = k < count
        p = (edges[t] + k).clamp(max=n - 1)
        ids = torch.where(valid, keys[p] - layout.row_offsets[t], 0)
        g = torch.where(valid.unsqueeze(1), rows[p, : dims[t]], 0)
        out.append((t, ids, g, count))
        fits.append(count <= bounds[t])
    torch._assert_async(
        torch.cat(fits).all(), "row_grads_padded: a table has more distinct rows than its bound"
    )
    return out


def rows_by_table(
    layout: TBELayout, key: Tensor, head: Tensor, summed: Tensor, tables: Sequence[int]
) -> list[tuple[int, Tensor, Tensor]]:
    """``row_grads``' result from the same sorted occurrences ``pad_heads`` takes: per table of
    ``tables``, (t, its distinct ids in order, their gradient sums [U, dim]). Its sizes are the
    data's: one host read (the per-table counts), where ``pad_heads`` has none."""
    meta = layout.meta(summed.device)
    key_c = key.clamp(0, max(layout.total_rows - 1, 0))
    u_t = torch.bucketize(key_c, meta["row_offsets"][1:], right=True)
    per_table = torch.bincount(u_t[head], minlength=layout.num_tables).tolist()  # the read
    heads = torch.argsort((~head).to(torch.uint8), stable=True)[: sum(per_table)]
    keys, grads = key[heads], summed[heads]
    out, lo = [], 0
    for t in range(layout.num_tables):
        hi = lo + per_table[t]
        if t in tables:
            ids = keys[lo:hi] - layout.row_offsets[t]
            out.append((t, ids, grads[lo:hi, : layout.dims[t]].contiguous()))
        lo = hi
    return out


def apply_padded_row_grads(
    backend: Any,
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    grads: Sequence[tuple[int, Tensor, Tensor, Tensor]],
    opt: RowOptimizer,
    step: int,
) -> None:
    """``apply_row_grads`` of (table, ids [n], grads [n, dim], valid [n] bool) where only the
    valid pairs count, in the order given, without a host read: a call's bags are the pairs
    (length 1 when valid, else 0) and a stable sort moves the valid ids to the front; the others
    lie past the last bag, never read (the backend must allow that: cuda, triton)."""
    dev = weights.device
    items = [it for it in grads if it[1].numel()]
    for grp in group_calls(layout, items):
        lay = TBELayout(
            rows=layout.rows, dims=layout.dims, feature_table=tuple(it[0] for it in grp)
        )
        bags = max(it[1].numel() for it in grp)
        lengths = torch.zeros(len(grp), bags, dtype=torch.int64, device=dev)
        grad_out = torch.zeros(bags, lay.total_dim, dtype=weights.dtype, device=dev)
        for f, (_, ids, g, valid) in enumerate(grp):
            lengths[f, : ids.numel()] = valid
            cols = slice(lay.out_offsets[f], lay.out_offsets[f + 1])
            grad_out[: ids.numel(), cols] = torch.where(valid.unsqueeze(1), g, 0)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths.view(-1), 0, out=offsets[1:])
        valid_all = torch.cat([it[3] for it in grp])
        order = torch.argsort((~valid_all).to(torch.uint8), stable=True)
        indices = torch.cat([it[1] for it in grp])[order]
        lookup = Lookup(indices, offsets, None, PoolingMode.SUM)
        backend.backward_update(lay, weights, state, lookup, grad_out, opt, step)


def put_valid(dst: Tensor, idx: Tensor, vals: Tensor, valid: Tensor) -> None:
    """``dst[idx[valid]] = vals[valid]`` (along dim 0; ``idx`` [n], n > 0, distinct where valid)
    without a host read: an invalid entry rewrites the first valid entry's row with that entry's
    value (with none valid, row ``idx[0]`` with its own value), so every write to a row carries
    the same value and the result is deterministic. A 1-D ``dst`` (a flat buffer) takes entries
    of any equal shapes, element by element."""
    if dst.dim() == 1:  # a flat buffer: any shape of entries, element by element
        idx, vals, valid = idx.reshape(-1), vals.reshape(-1), valid.reshape(-1)
    a = torch.argmax(valid.to(torch.uint8)).reshape(1)  # (1 element: a 0-dim index is a read)
    tgt_a = idx[a]
    row = (-1,) + (1,) * (vals.dim() - 1)  # valid [n] against rows [n, ...]
    val_a = torch.where(valid[a].view(row), vals[a], dst[tgt_a])
    dst.index_put_((torch.where(valid, idx, tgt_a),), torch.where(valid.view(row), vals, val_a))


def update_table_rows_padded(
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    t: int,
    ids: Tensor,
    grads: Tensor,
    valid: Tensor,
    opt: RowOptimizer,
    step: int,
) -> None:
    """``tbe.update_table_rows`` of the valid entries of a block (ids [n], n > 0, grads [n, dim],
    valid [n]) without a host read: every entry is computed, only the valid ones are written
    (``put_valid``); the valid entries' values are ``update_table_rows``' own."""
    w_t = layout.table(weights, t)
    w = w_t[ids]
    rows = layout.row_offsets[t] + ids
    st = {k: s[rows] if k == "momentum1" else layout.table(s, t)[ids] for k, s in state.items()}
    apply_rows(opt, w, grads.to(w.dtype), st, step)
    put_valid(w_t, ids, w, valid)
    for k, s in state.items():
        if k == "momentum1":
            put_valid(s, rows, st[k], valid)
        else:
            put_valid(layout.table(s, t), ids, st[k], valid)
