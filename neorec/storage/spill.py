"""A batch whose distinct rows of a table outnumber its row cache: the batch in chunks that fit.

The row cache keeps a batch's rows resident from its forward to its update. A batch that needs
more distinct rows of a dram / ssd table than the table's cache holds (one rank's share of a
sharded dynamic table can, however large the cache looked when planned) runs through
``SpillBackend`` instead of stopping the run. Its distinct rows of each cached table, in id order,
are cut into chunks of at most the cache's capacity; chunk ``k`` takes every id whose row is in
the k-th cut of its table (ids of in-memory tables: chunk 0), bags kept whole in shape::

    forward   for each chunk: make its rows resident, pooled partial sums; output = their sum
    update    for each chunk: make its rows resident again (read back if evicted), the fused
              update of the chunk's rows with the whole batch's output gradient, marked dirty

Each row lives in one chunk, so its gradient sum (the same ids, in the same order) and its
optimizer update are those of the unchunked batch; only the pooled forward adds a bag's rows in
another order (mean pooling: as a sum with weights ``1 / bag length``), equal to the
specification within float rounding. The rows of one chunk may be evicted by the next and are read
back for the update: a spilled batch costs up to twice the store traffic, counted under
``spilled`` (batches) in the cache's counters. A store failure in the middle of the update leaves
the chunks before it updated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe import Lookup, TBELayout
from neorec.ops.tbe_types import PoolingMode

if TYPE_CHECKING:
    from neorec.storage.cached import CachedEmbeddingBagCollection

__all__ = ["SpillBackend", "batch_fits"]


def batch_fits(cache: CachedEmbeddingBagCollection, indices: Tensor, offsets: Tensor) -> bool:
    """Whether each cached table's distinct ids of the batch fit its cache (the count of ids
    decides when it is enough; else the distinct ones are counted)."""
    bounds = cache._feature_bounds(offsets, offsets.numel() - 1)
    for i, c in cache._cached.items():
        ids = cache._table_ids(i, indices, bounds)
        if ids.numel() > c.capacity and int(torch.unique(ids).numel()) > c.capacity:
            return False
    return True


def _chunk_of_ids(cache: CachedEmbeddingBagCollection, indices: Tensor, offsets: Tensor) -> Tensor:
    """[N] the chunk of each id: its distinct row's place in its table's sorted distinct rows,
    divided by the table's capacity (0 for in-memory tables)."""
    bounds = cache._feature_bounds(offsets, offsets.numel() - 1)
    chunk = torch.zeros(indices.numel(), dtype=torch.int64)
    for i, c in cache._cached.items():
        spans = [
            torch.arange(lo, hi)
            for f, (lo, hi) in enumerate(bounds)
            if cache.layout.feature_table[f] == i
        ]
        if not spans:
            continue
        pos = torch.cat(spans)
        distinct, inverse = torch.unique(indices[pos], return_inverse=True)
        chunk[pos] = inverse // c.capacity
        if distinct.numel() > c.capacity:
            c.counts["spilled"] += 1
    return chunk


class SpillBackend:
    """A TBE backend over ``cache`` for one batch that does not fit it: forward and fused update
    chunk by chunk (see the module doc). The ``layout`` and ``weights`` it is given are the
    cache's; the lookup's indices are table rows (not slots)."""

    name = "spill"

    def __init__(self, cache: CachedEmbeddingBagCollection) -> None:
        self.cache = cache
        self._chunks: list[Lookup] | None = None

    def _plan(self, lookup: Lookup) -> list[Lookup]:
        """The batch's chunks as lookups of table rows (sum pooling), made once per batch."""
        if self._chunks is not None:
            return self._chunks
        indices, offsets = lookup.indices.cpu(), lookup.offsets.cpu()
        lengths = offsets[1:] - offsets[:-1]
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        psw = lookup.per_sample_weights
        if PoolingMode(lookup.pooling) == PoolingMode.MEAN:
            scale = 1.0 / lengths.clamp(min=1).to(torch.float32)[bag]
            psw = scale if psw is None else psw.cpu() * scale
        chunk = _chunk_of_ids(self.cache, indices, offsets)
        out = []
        for k in range(int(chunk.max()) + 1 if chunk.numel() else 1):
            mine = chunk == k
            counts = torch.bincount(bag[mine], minlength=lengths.numel())
            sub = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=sub[1:])
            w = psw[mine] if psw is not None else None
            out.append(Lookup(indices[mine], sub, w, PoolingMode.SUM))
        self._chunks = out
        return out

    def _on_device(self, rows: Tensor, sub: Lookup) -> Lookup:
        dev = self.cache.weights.device
        w = sub.per_sample_weights
        return Lookup(
            rows.to(dev), sub.offsets.to(dev), w.to(dev) if w is not None else None, sub.pooling
        )

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total dim]: the chunks' partial sums added."""
        c = self.cache
        out: Tensor | None = None
        for sub in self._plan(lookup):
            rows, _ = c._prepare(sub.indices, sub.offsets, pin=False)
            part = c.backend.forward(layout, weights, self._on_device(rows, sub))
            out = part if out is None else out + part
        assert out is not None
        return out

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        lookup: Lookup,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """The fused update of every chunk's rows (each made resident, then marked dirty)."""
        c = self.cache
        for sub in self._plan(lookup):
            rows, used = c._prepare(sub.indices, sub.offsets, pin=True)
            written = False
            try:
                c.backend.backward_update(
                    layout, weights, state, self._on_device(rows, sub), grad_output, opt, step
                )
                written = True
            finally:
                c._release(used, dirty=written)
