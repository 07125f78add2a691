"""CUDA TBE backend: PyTorch ops on the GPU, deterministic (no atomics anywhere).

- forward: ``F.embedding_bag`` per feature (each output element is summed by one GPU thread in
  bag order, no atomics); mean = sum / max(len, 1), as in the reference.
- backward_update: per table, a *stable* sort of the looked-up ids groups each row's occurrences
  in (feature, batch position) order; ``torch.segment_reduce`` sums each group (one thread per
  output element walks its segment sequentially) and ``row_optim.apply_rows`` updates the distinct
  rows, written back with an ``index_put`` of unique indices. No ``index_add_`` (atomic on CUDA),
  no cumsum-differences (they cancel catastrophically), so two runs give identical bits.

The ops are device-generic, so the same code also runs (slowly) on CPU tensors; tests use that to
check its logic on machines without a GPU. ``get_backend("cuda")`` insists on CUDA weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from neorec.ops.row_optim import RowOptimizer, state_shapes
from neorec.ops.tbe import PoolingMode, TBELayout, update_table_rows

__all__ = ["CudaBackend"]


class CudaBackend:
    """TBE with deterministic sort + segment-reduce PyTorch ops (meant for CUDA tensors)."""

    name = "cuda"

    def _bounds(self, layout: TBELayout, indices: Tensor, offsets: Tensor) -> tuple[int, list[int]]:
        """Batch size and each feature's [start, end) in ``indices`` (one host sync)."""
        nf = layout.num_features
        if indices.dim() != 1 or offsets.dim() != 1 or (offsets.numel() - 1) % max(nf, 1):
            raise ValueError(
                f"cuda TBE backend: need 1-D indices and F*B+1 offsets (F={nf}), got "
                f"{tuple(indices.shape)} and {tuple(offsets.shape)}"
            )
        b = (offsets.numel() - 1) // nf
        bounds = offsets[::b].tolist() if b > 0 else [int(offsets[0])] * (nf + 1)
        self._check_ids(layout, indices, bounds)
        return b, bounds

    def _check_ids(self, layout: TBELayout, indices: Tensor, bounds: list[int]) -> None:
        # An out-of-range id would be a device-side assert (or a silent wrong row): refuse first.
        dev = indices.device
        counts = torch.tensor(
            [bounds[f + 1] - bounds[f] for f in range(len(bounds) - 1)], device=dev
        )
        rows = torch.tensor([layout.rows[t] for t in layout.feature_table], device=dev)
        ids = indices[bounds[0] : bounds[-1]]
        limit = torch.repeat_interleave(rows, counts, output_size=ids.numel())
        bad = (ids < 0) | (ids >= limit)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0]) + bounds[0]
            f = max(i for i in range(len(bounds) - 1) if bounds[i] <= pos)
            t = layout.feature_table[f]
            raise IndexError(
                f"feature {f} (table {t}, rows {layout.rows[t]}): id {int(indices[pos])} at "
                f"position {pos} is out of range [0, {layout.rows[t]})"
            )

    def forward(
        self,
        layout: TBELayout,
        weights: Tensor,
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        pooling: PoolingMode,
    ) -> Tensor:
        """Pooled output [B, total_dim]."""
        indices, offsets = indices.long(), offsets.long()
        b, bounds = self._bounds(layout, indices, offsets)
        out = torch.empty(b, layout.total_dim, dtype=weights.dtype, device=weights.device)
        for f, t in enumerate(layout.feature_table):
            lo, hi = bounds[f], bounds[f + 1]
            seg = offsets[f * b : (f + 1) * b + 1] - lo  # [B+1], starts at 0
            psw = (
                per_sample_weights[lo:hi].to(weights.dtype)
                if per_sample_weights is not None
                else None
            )
            pooled = F.embedding_bag(
                indices[lo:hi],
                layout.table(weights, t),
                seg,
                mode="sum",
                per_sample_weights=psw,
                include_last_offset=True,
            )
            if PoolingMode(pooling) == PoolingMode.MEAN:
                lens = (seg[1:] - seg[:-1]).clamp(min=1).to(pooled.dtype)
                pooled = pooled / lens.unsqueeze(1)
            out[:, layout.out_offsets[f] : layout.out_offsets[f + 1]] = pooled
        return out

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        indices: Tensor,
        offsets: Tensor,
        per_sample_weights: Tensor | None,
        pooling: PoolingMode,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """Sum each distinct row's gradients in a fixed order, then apply the optimizer."""
        indices, offsets = indices.long(), offsets.long()
        b, bounds = self._bounds(layout, indices, offsets)
        if tuple(grad_output.shape) != (b, layout.total_dim):
            raise ValueError(
                f"cuda TBE backend: grad_output shape {tuple(grad_output.shape)}, "
                f"expected {(b, layout.total_dim)}"
            )
        for k in state_shapes(opt.kind, layout.total_rows, layout.total_elems):
            if k not in state:
                raise ValueError(f"cuda TBE backend: optimizer '{opt.kind}' needs state '{k}'")
        ids_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        grads_by_table: list[list[Tensor]] = [[] for _ in range(layout.num_tables)]
        arange_b = torch.arange(b, device=indices.device)
        for f, t in enumerate(layout.feature_table):
            lo, hi = bounds[f], bounds[f + 1]
            if hi == lo:
                continue
            seg = offsets[f * b : (f + 1) * b + 1] - lo
            lens = seg[1:] - seg[:-1]
            bag = torch.repeat_interleave(arange_b, lens, output_size=hi - lo)
            g = grad_output[:, layout.out_offsets[f] : layout.out_offsets[f + 1]][bag]  # [n, D]
            if PoolingMode(pooling) == PoolingMode.MEAN:
                g = g / lens.clamp(min=1).to(g.dtype)[bag].unsqueeze(1)
            if per_sample_weights is not None:
                g = g * per_sample_weights[lo:hi].unsqueeze(1).to(g.dtype)
            ids_by_table[t].append(indices[lo:hi])
            grads_by_table[t].append(g)
        for t in range(layout.num_tables):
            if not ids_by_table[t]:
                continue
            ids = torch.cat(ids_by_table[t])
            # Stable: equal ids keep (feature, position) order, the reference's summation order.
            sorted_ids, perm = torch.sort(ids, stable=True)
            uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
            g_sorted = torch.cat(grads_by_table[t])[perm]
            summed = torch.segment_reduce(g_sorted, "sum", lengths=counts, axis=0)
            update_table_rows(layout, weights, state, t, uniq, summed, opt, step)
