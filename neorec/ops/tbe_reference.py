"""The reference TBE backend: plain PyTorch ops, the oracle every other backend is tested
against; and ``row_grads``, a backend's summed row gradients (its own, else the reference's)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe_checks import (
    TBEInputError,
    check_grad_shape,
    check_ids,
    check_offsets,
    check_per_sample_weights,
)
from neorec.ops.tbe_rows import update_table_rows
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = ["ReferenceBackend", "row_grads"]


def _bag_ids(offsets: Tensor, n: int) -> Tensor:
    """For each of the ``n`` ids, the index of the bag (segment of ``offsets``) holding it."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)[
        :n
    ]


class ReferenceBackend:
    """Plain PyTorch; the test oracle. Readable, not fast. Checks every input before it reads
    or writes anything (Python's negative indexing would otherwise wrap a bad id silently)."""

    name = "reference"

    def _check(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> None:
        indices, offsets = lookup.indices, lookup.offsets
        if weights.numel() != layout.total_elems:
            raise TBEInputError(
                f"weights has {weights.numel()} elements, expected {layout.total_elems}"
            )
        b = check_offsets(offsets, indices.numel(), layout.num_features)
        check_ids(layout, indices, offsets, b)
        check_per_sample_weights(lookup.per_sample_weights, indices, weights)

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim]."""
        self._check(layout, weights, lookup)
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        out = torch.zeros(b, layout.total_dim, dtype=weights.dtype, device=weights.device)
        for f, t in enumerate(layout.feature_table):
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            seg = offsets[f * b : (f + 1) * b + 1] - lo
            ids = indices[lo:hi]
            rows = layout.table(weights, t)[ids]  # [n, D]
            if per_sample_weights is not None:
                rows = rows * per_sample_weights[lo:hi].unsqueeze(1).to(rows.dtype)
            pooled = torch.zeros(b, layout.dims[t], dtype=weights.dtype, device=weights.device)
            pooled.index_add_(0, _bag_ids(seg, hi - lo), rows)
            if pooling == PoolingMode.MEAN:
                lens = (seg[1:] - seg[:-1]).clamp(min=1).to(pooled.dtype)
                pooled = pooled / lens.unsqueeze(1)
            out[:, layout.out_offsets[f] : layout.out_offsets[f + 1]] = pooled
        return out

    def row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per looked-up table: (t, sorted distinct ids [U], summed gradients [U, D])."""
        return [(t, u, g) for t, u, g, _ in self.counted_row_grads(layout, lookup, grad_output)]

    def counted_row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor, Tensor]]:
        """``row_grads`` with each distinct id's occurrences in the batch (counts [U])."""
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        ids_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        grads_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        for f, t in enumerate(layout.feature_table):
            lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
            seg = offsets[f * b : (f + 1) * b + 1] - lo
            bag = _bag_ids(seg, hi - lo)
            g = grad_output[:, layout.out_offsets[f] : layout.out_offsets[f + 1]][bag]  # [n, D]
            if pooling == PoolingMode.MEAN:
                lens = (seg[1:] - seg[:-1]).clamp(min=1).to(g.dtype)
                g = g / lens[bag].unsqueeze(1)
            if per_sample_weights is not None:
                g = g * per_sample_weights[lo:hi].unsqueeze(1).to(g.dtype)
            ids_by_table[t].append(indices[lo:hi])
            grads_by_table[t].append(g)
        out = []
        for t in range(layout.num_tables):
            if not ids_by_table[t]:
                continue
            ids = torch.cat(ids_by_table[t])
            g = torch.cat(grads_by_table[t])
            uniq, inv, counts = torch.unique(
                ids, sorted=True, return_inverse=True, return_counts=True
            )
            # index_add_ on CPU accumulates sequentially in occurrence order: deterministic.
            summed = torch.zeros(uniq.numel(), g.shape[1], dtype=g.dtype, device=g.device)
            summed.index_add_(0, inv, g)
            out.append((t, uniq, summed, counts))
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
        """Sum each distinct row's gradients, then apply the optimizer to those rows."""
        self._check(layout, weights, lookup)
        check_grad_shape(grad_output, layout, lookup.offsets)
        for t, uniq, g, counts in self.counted_row_grads(layout, lookup, grad_output):
            update_table_rows(layout, weights, state, t, uniq, g, opt, step, counts)


def row_grads(
    backend: Any, layout: TBELayout, lookup: Lookup, grad_output: Tensor
) -> list[tuple[int, Tensor, Tensor]]:
    """Per looked-up table (t, sorted distinct ids, summed gradients): ``backend``'s own when it
    has one (the cpu kernel), else the reference's; the same sums in the same order."""
    impl = getattr(backend, "row_grads", None) or ReferenceBackend().row_grads
    out: list[tuple[int, Tensor, Tensor]] = impl(layout, lookup, grad_output)
    return out
