"""Row updates of a table batch outside a backend's kernel: the optimizer applied to given rows
of one table (``update_table_rows``), gradients given as (table, ids, rows) applied with a
backend's fused update (``apply_row_grads``) in as few calls as ``group_calls`` makes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.row_optim import RowOptimizer, apply_rows
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

_Item = TypeVar("_Item", bound=tuple[Any, ...])

__all__ = ["update_table_rows", "apply_row_grads", "group_calls"]


def apply_row_grads(
    backend: Any,
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    grads: Sequence[tuple[int, Tensor, Tensor]],
    opt: RowOptimizer,
    step: int,
) -> None:
    """Apply gradients given as (table, ids [n], grads [n, dim]) with ``backend``'s fused update.

    Ids may repeat: a row's gradients are added to zero in the order given, then the optimizer
    updates each distinct row once, exactly as ``backward_update`` does for a batch's lookups
    (each (id, gradient) pair is passed as a bag of one id whose output gradient is that row).
    Tables go in as few calls as keep the padded output gradient within twice the payload (a
    call's bags per table are its largest table's pair count).
    """
    if opt.clips:  # a pair's gradient is already a sum: its count is not the batch's
        raise ConfigError(
            "CowClip (embedding.cowclip_ratio) needs each row's count in the batch, which "
            "gradients applied as (table, ids, rows) pairs do not carry (row-wise, column-wise "
            "and data-parallel sharding); use table-wise sharding or one process"
        )
    for grp in group_calls(layout, [it for it in grads if it[1].numel()]):
        lay = TBELayout(
            rows=layout.rows, dims=layout.dims, feature_table=tuple(t for t, _, _ in grp)
        )
        bags = max(ids.numel() for _, ids, _ in grp)
        lengths = torch.zeros(len(grp), bags, dtype=torch.int64)
        grad_out = torch.zeros(bags, lay.total_dim, dtype=weights.dtype, device=weights.device)
        for f, (_, ids, g) in enumerate(grp):
            lengths[f, : ids.numel()] = 1
            grad_out[: ids.numel(), lay.out_offsets[f] : lay.out_offsets[f + 1]] = g
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.view(-1), 0, out=offsets[1:])
        indices = torch.cat([ids for _, ids, _ in grp]).to(device=weights.device)
        lookup = Lookup(indices, offsets.to(weights.device), None, PoolingMode.SUM)
        backend.backward_update(lay, weights, state, lookup, grad_out, opt, step)


def group_calls(layout: TBELayout, items: Sequence[_Item]) -> list[list[_Item]]:
    """``items`` (table, ids, ...) grouped into fused-update calls (each in table order): as few
    as keep a call's padded output gradient (its largest pair count times its width) within twice
    the payload."""
    groups: list[list[_Item]] = []
    for it in sorted(items, key=lambda x: (-x[1].numel(), x[0])):
        if groups:
            grp = [*groups[-1], it]
            width = sum(layout.dims[x[0]] for x in grp)
            payload = sum(x[1].numel() * layout.dims[x[0]] for x in grp)
            if grp[0][1].numel() * width <= 2 * payload:
                groups[-1] = grp
                continue
        groups.append([it])
    return [sorted(grp, key=lambda x: x[0]) for grp in groups]


def update_table_rows(
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    t: int,
    ids: Tensor,
    grads: Tensor,
    opt: RowOptimizer,
    step: int,
    counts: Tensor | None = None,
) -> None:
    """Apply ``opt`` to distinct rows ``ids`` of table ``t`` (weights and state) in place
    (``counts``: each row's occurrences in the batch, for CowClip)."""
    w_t = layout.table(weights, t)
    w = w_t[ids]
    st = _gather_state(layout, state, t, ids)
    apply_rows(opt, w, grads.to(w.dtype), st, step, counts)
    w_t[ids] = w  # distinct ids: no write conflicts
    _scatter_state(layout, state, t, ids, st)


def _gather_state(layout: TBELayout, state: dict[str, Tensor], t: int, uniq: Tensor) -> dict:
    out = {}
    for k, s in state.items():
        if k == "momentum1":
            out[k] = s[layout.row_offsets[t] + uniq]
        else:
            out[k] = layout.table(s, t)[uniq]
    return out


def _scatter_state(
    layout: TBELayout, state: dict[str, Tensor], t: int, uniq: Tensor, st: dict[str, Tensor]
) -> None:
    for k, s in state.items():
        if k == "momentum1":
            s[layout.row_offsets[t] + uniq] = st[k]
        else:
            layout.table(s, t)[uniq] = st[k]
