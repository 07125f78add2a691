"""Which embedding rows changed, and where this rank's rows live in global table coordinates.

``local_blocks`` describes the rows a module holds as rectangles of global tables (views of its
flat buffers), for the unsharded ``EmbeddingBagCollection`` and the ``ShardedEmbeddingBagCollection``
alike; that is what makes checkpoints independent of the plan. ``DirtyRowTracker`` hooks the fused
update and marks every row a batch looked up (the rows the optimizer touched).

Tables behind the row cache (``CachedEmbeddingBagCollection``, dram / ssd) are tracked by table row,
not cache slot (``tracked_layout``): a row stays marked whether it is in the cache or was written
back to its store; their blocks are ``StoreField`` s, the rows by global id wherever they sit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.collection import optimizer_state_of
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.ops.lowp_rows import DecodedRows
from neorec.ops.tbe import TBELayout
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.tiered_rows import StoreField

__all__ = ["LocalBlock", "local_blocks", "DirtyRowTracker"]

MP, DP = "mp", "dp"  # the two flat row spaces of a module: its shards, its replicas


@dataclass
class LocalBlock:
    """Rows [row_start, row_end) x cols [col_start, col_end) of table ``table`` held here."""

    table: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    weight: Any  # view [rows, cols] (low-precision rows: DecodedRows; dram/ssd: StoreField)
    state: dict[str, Any]  # views: momentum1 [rows]; exp_avg, exp_avg_sq [rows, cols]
    space: str  # MP or DP: which tracker mask covers it
    space_offset: int  # first row of the block in that mask
    writer: bool  # this rank writes it (replicas: rank 0 only)

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return self.row_end - self.row_start


def _state_views(layout: TBELayout, state: dict[str, Tensor], t: int) -> dict[str, Tensor]:
    out = {}
    for k, s in state.items():
        if k == "momentum1":
            out[k] = s[layout.row_offsets[t] : layout.row_offsets[t + 1]]
        else:
            out[k] = layout.table(s, t)
    return out


def _weight_view(ebc: Any, lay: TBELayout, t: int) -> Any:
    """Table ``t``'s rows as an fp32 [rows, dim] view (low-precision tables: decoded on read,
    encoded on write)."""
    fmt = ebc.row_format
    if fmt is None or fmt.precision == "fp32":
        return lay.table(ebc.weights, t)
    return DecodedRows(fmt, ebc.weights, lay, t)


def _spaces(ebc: Any) -> dict[str, Any]:
    """The row spaces of an unsharded collection: one, or one per precision group."""
    if not isinstance(ebc, GroupedEmbeddingBagCollection):
        return {MP: ebc}
    return {f"{MP}.{p}": g for p, g in ebc.groups.items()}


def _cached_blocks(ebc: CachedEmbeddingBagCollection) -> list[LocalBlock]:
    """The tables of a row-cached collection: dram/ssd ones as ``StoreField`` s (their rows by
    global id in the store), memory ones as views of the cache buffer (which holds them whole);
    masks over the table-shaped layout."""
    out, lay, state = [], ebc.layout, optimizer_state_of(ebc)
    caches = ebc.cache_tables()
    for t, spec in enumerate(ebc.tables):
        c = caches.get(spec.name)
        if c is None:
            weight: Any = lay.table(ebc.weights, t)
            views: dict[str, Any] = _state_views(lay, state, t)
        else:
            weight = StoreField(ebc, c, "weight")
            views = {k: StoreField(ebc, c, k) for k, _ in c.store.fields if k != "weight"}
        offset = ebc.table_layout.row_offsets[t]
        out.append(
            LocalBlock(spec.name, 0, spec.rows, 0, spec.dim, weight, views, MP, offset, True)
        )
    return out


def tracked_layout(part: Any) -> TBELayout:
    """The layout whose rows a collection's update hooks report (a row cache's: the tables')."""
    return part.table_layout if isinstance(part, CachedEmbeddingBagCollection) else part.layout


def local_blocks(ebc: Any, rank: int = 0) -> list[LocalBlock]:
    """Every rectangle of every table that ``ebc`` (sharded or not) holds, in global coordinates."""
    if isinstance(ebc, CachedEmbeddingBagCollection):
        return _cached_blocks(ebc)
    out = []
    if not isinstance(ebc, ShardedEmbeddingBagCollection):  # unsharded: whole tables
        for space, part in _spaces(ebc).items():
            lay, state = part.layout, optimizer_state_of(part)
            for t, spec in enumerate(part.tables):
                out.append(
                    LocalBlock(
                        spec.name,
                        0,
                        spec.rows,
                        0,
                        spec.dim,
                        _weight_view(part, lay, t),
                        _state_views(lay, state, t),
                        space,
                        lay.row_offsets[t],
                        True,
                    )
                )
        return out
    mp_lay: TBELayout = ebc.layout
    state = optimizer_state_of(ebc)
    for i, (ti, s) in enumerate(ebc.local_tables):
        out.append(
            LocalBlock(
                ebc.tables[ti].name,
                s.row_start,
                s.row_end,
                s.col_start,
                s.col_end,
                _weight_view(ebc, mp_lay, i),
                _state_views(mp_lay, state, i),
                MP,
                mp_lay.row_offsets[i],
                True,
            )
        )
    if ebc.dp is not None:
        dlay, dstate = ebc.dp.layout, optimizer_state_of(ebc, "dp_")
        for j, spec in enumerate(ebc.dp.tables):
            out.append(
                LocalBlock(
                    spec.name,
                    0,
                    spec.rows,
                    0,
                    spec.dim,
                    dlay.table(ebc.dp_weights, j),
                    _state_views(dlay, dstate, j),
                    DP,
                    dlay.row_offsets[j],
                    rank == 0,
                )
            )
    return out


class DirtyRowTracker:
    """Marks the rows each fused update touched, per row space (``mp`` shards, ``dp`` replicas)."""

    def __init__(self, ebc: Any) -> None:
        sharded = isinstance(ebc, ShardedEmbeddingBagCollection)
        self.layouts: dict[str, TBELayout] = (
            {MP: ebc.layout} if sharded else {k: tracked_layout(p) for k, p in _spaces(ebc).items()}
        )
        if sharded and ebc.dp is not None:
            self.layouts[DP] = ebc.dp.layout
        # The masks live where the tables do: the per-step hook marks rows without a host read
        # (a row cache's tables live in its host stores: masks of all their rows stay on the host).
        host = ebc.host_resident
        self.device = torch.device("cpu") if host else ebc.weights.device
        self._base = {
            k: torch.tensor(lay.row_offsets[:-1], dtype=torch.int64)[
                torch.tensor(lay.feature_table, dtype=torch.int64)
            ].to(self.device)
            for k, lay in self.layouts.items()
        }
        self.masks = self._empty()
        ebc.add_update_hook(self._hook)

    def _empty(self) -> dict[str, Tensor]:
        return {
            k: torch.zeros(lay.total_rows, dtype=torch.bool, device=self.device)
            for k, lay in self.layouts.items()
        }

    def _hook(self, layout: TBELayout, indices: Tensor, offsets: Tensor) -> None:
        key = next((k for k, lay in self.layouts.items() if lay is layout), MP)
        nf = layout.num_features
        if nf == 0 or indices.numel() == 0:
            return
        b = (offsets.numel() - 1) // nf
        dev = self.device
        counts = torch.diff(offsets[::b].to(dev))  # ids per feature
        base = torch.repeat_interleave(self._base[key], counts, output_size=indices.numel())
        self.masks[key][indices.to(dev) + base] = True

    def take(self) -> dict[str, Tensor]:
        """The masks of rows modified since the last ``take`` (and start new ones)."""
        out, self.masks = self.masks, self._empty()
        return out
