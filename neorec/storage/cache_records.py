"""A cached table's records and its cache buffers: the store's fields (weight, then optimizer
state) read out of the cache's slots for a write-back, and written into slots after a read."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neorec.storage import cache_ops
from neorec.storage.store import Records

__all__ = ["record_sources", "scatter_records"]


def record_sources(views: Sequence[Tensor], slots: Tensor) -> Records:
    """The records of cache ``slots`` for ``RowStore.write``, from the table's buffers ``views``
    (one per record field): per field (buffer, slots) on the CPU, so the store copies them straight
    from the cache; assembled records otherwise."""
    if all(v.device.type == "cpu" for v in views):
        return [(v, slots) for v in views]
    dev_slots = slots.to(views[0].device)
    return torch.cat([v[dev_slots].reshape(slots.numel(), -1) for v in views], 1).cpu()


def scatter_records(
    fields: Sequence[tuple[str, int]],
    views: Sequence[Tensor],
    slots: Tensor,
    rec: Tensor,
    rows: Tensor | None = None,
) -> None:
    """Cache ``slots[i]`` = record ``rows[i]`` of ``rec`` (``i`` without ``rows``; a negative row
    skips the slot), field by field (``fields``: the store's (name, width)) into ``views``."""
    col = 0
    for (_, w), view in zip(fields, views, strict=True):
        part = rec[:, col : col + w]
        if view.device.type == "cpu":
            cache_ops.copy_rows(part, rows, view, slots)
        else:
            keep = slice(None) if rows is None else rows >= 0
            src = part if rows is None else part[rows[keep]]
            dev_slots = slots[keep].to(view.device)
            view[dev_slots] = src.to(view.device).reshape(view[dev_slots].shape)
        col += w
