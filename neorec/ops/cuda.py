"""CUDA TBE backend: PyTorch ops on the GPU, deterministic (no atomics anywhere), and no host read
on the per-step path (every size is a shape: the batch's id count, F*B bags, the widest table).

- forward: every id's row is gathered into an [n, max dim] block (columns past its table's dim are
  zeros) and ``torch.segment_reduce`` sums each bag in position order from zero (one thread per
  output element walks its bag, no atomics); mean = sum / max(len, 1), as in the reference. Ids
  outside ``offsets[0] .. offsets[-1]`` fall in two extra segments that are dropped.
- backward_update: each id's global row key (ids outside the bags sort last); a *stable* sort
  groups each row's occurrences in (feature, batch position) order, the reference's summation
  order; ``segment_reduce`` sums each group. Every occurrence then applies the optimizer to its
  row from that sum (the duplicates of a row compute the same bits) and all are written back with
  one ``index_put_`` per tensor: writes to one element carry identical values, so the result does
  not depend on which lands last. No ``index_add_`` (atomic on CUDA), no cumsum-differences (they
  cancel catastrophically), no ``unique`` (its size is a host read), so two runs give identical
  bits.

Checks: shapes on the host; the values of CUDA tensors by device asserts
(``tbe_checks.assert_inputs_async``), of CPU tensors by the reference's host checks (they name
the position). The ops are device-generic, so the same code also runs (slowly) on CPU tensors;
tests use that to check its logic on machines without a GPU. ``get_backend("cuda")`` insists on
CUDA weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.padded_rows import PaddedRows, pad_heads, put_valid, rows_by_table, segments
from neorec.ops.row_optim import RowOptimizer, apply_rows, state_shapes
from neorec.ops.tbe_checks import (
    TBEInputError,
    assert_inputs_async,
    bag_of_ids,
    check_grad_shape,
    check_ids,
    check_offsets,
    check_shapes,
    on_device,
)
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = ["CudaBackend"]


class CudaBackend:
    """TBE with deterministic sort + segment-reduce PyTorch ops (meant for CUDA tensors)."""

    name = "cuda"

    def _check(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> tuple[int, Tensor]:
        """B and each id's bag (``bag_of_ids``), once the inputs are checked."""
        indices, offsets = lookup.indices, lookup.offsets
        b = check_shapes(layout, weights, indices, offsets, lookup.per_sample_weights)
        if on_device(indices):
            return b, assert_inputs_async(layout, indices, offsets, b, self.name)
        check_offsets(offsets, indices.numel(), layout.num_features)
        check_ids(layout, indices, offsets, b)
        return b, bag_of_ids(offsets, indices.numel())

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim]."""
        b, bag = self._check(layout, weights, lookup)
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf, n = layout.num_features, indices.numel()
        out = torch.zeros(b, layout.total_dim, dtype=weights.dtype, device=weights.device)
        if n == 0 or b == 0:
            return out
        meta = layout.meta(weights.device)
        bag_c = bag.clamp(0, nf * b - 1)
        inside = (bag >= 0) & (bag < nf * b)
        t = meta["feature_table"][bag_c // b]
        dim = meta["dims"][t]
        dmax = max(layout.dims[t] for t in layout.feature_table)
        cols = torch.arange(dmax, device=weights.device)
        base = meta["elem_offsets"][t] + torch.where(inside, indices.long(), 0) * dim
        valid = inside.unsqueeze(1) & (cols < dim.unsqueeze(1))
        eidx = (base.unsqueeze(1) + cols).clamp(0, max(weights.numel() - 1, 0))
        rows = torch.where(valid, weights[eidx], 0)  # [n, dmax]
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.to(rows.dtype).unsqueeze(1)
        off = offsets.long()
        lengths = torch.cat([off[:1], off[1:] - off[:-1], n - off[-1:]])
        pooled = torch.segment_reduce(rows, "sum", lengths=lengths, unsafe=True)[1:-1]
        pooled = pooled.view(nf, b, dmax)
        if PoolingMode(pooling) == PoolingMode.MEAN:
            lens = (off[1:] - off[:-1]).clamp(min=1).to(pooled.dtype)
            pooled = pooled / lens.view(nf, b, 1)
        for f, t_f in enumerate(layout.feature_table):
            out[:, layout.out_offsets[f] : layout.out_offsets[f + 1]] = pooled[
                f, :, : layout.dims[t_f]
            ]
        return out

    def _summed(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor, bag: Tensor, b: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The occurrences' row keys sorted (stable; past-the-rows keys for ids outside the
        bags), each one's row sum [n, max dim] (zero-padded) and which start a row's run."""
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf, dev = layout.num_features, grad_output.device
        meta = layout.meta(dev)
        bag_c = bag.clamp(0, nf * b - 1)
        inside = (bag >= 0) & (bag < nf * b)
        f = bag_c // b
        t = meta["feature_table"][f]
        dim = meta["dims"][t]
        cols = torch.arange(max(layout.dims[t] for t in layout.feature_table), device=dev)
        # Each occurrence's gradient row: grad_output[sample, out_offsets[f] + cols].
        gcol = ((bag_c - f * b) * layout.total_dim + meta["out_offsets"][f]).unsqueeze(1) + cols
        gvalid = inside.unsqueeze(1) & (cols < dim.unsqueeze(1))
        flat = grad_output.reshape(-1)
        g = torch.where(gvalid, flat[gcol.clamp(0, max(flat.numel() - 1, 0))], 0)
        off = offsets.long()
        if PoolingMode(pooling) == PoolingMode.MEAN:
            lens = (off[1:] - off[:-1]).clamp(min=1).to(g.dtype)
            g = g / lens[bag_c].unsqueeze(1)
        if per_sample_weights is not None:
            g = g * per_sample_weights.to(g.dtype).unsqueeze(1)
        total = layout.total_rows
        key = torch.where(inside, meta["row_offsets"][t] + indices.long(), total)
        # Stable: equal keys keep (feature, position) order, the reference's summation order.
        sorted_key, perm = torch.sort(key, stable=True)
        count, head, first = segments(sorted_key, total)
        summed = torch.segment_reduce(g[perm], "sum", lengths=count, unsafe=True)[first]
        return sorted_key, summed, head

    def row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per looked-up table: (t, sorted distinct ids [U], summed gradients [U, D]).

        The sizes are data-dependent: one host read (the per-table counts) per call
        (``row_grads_padded`` has none)."""
        indices, offsets = lookup.indices, lookup.offsets
        nf, n = layout.num_features, indices.numel()
        b = (offsets.numel() - 1) // nf
        tables = sorted(set(layout.feature_table))
        if n == 0 or b == 0:
            ids0 = torch.zeros(0, dtype=torch.int64, device=indices.device)
            return [(t, ids0, grad_output.new_zeros(0, layout.dims[t])) for t in tables]
        bag = bag_of_ids(offsets, n)  # (unchecked, as the reference's)
        key, summed, head = self._summed(layout, lookup, grad_output, bag, b)
        return rows_by_table(layout, key, head, summed, tables)

    def row_grads_padded(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor, bounds: list[int]
    ) -> list[PaddedRows]:
        """``row_grads`` in a block of ``bounds[t]`` rows per table t, the count on the device
        (``padded_rows.pad_heads``): no host read."""
        indices, offsets = lookup.indices, lookup.offsets
        nf, n = layout.num_features, indices.numel()
        b = (offsets.numel() - 1) // nf
        if n == 0 or b == 0:
            return pad_heads(layout, None, None, None, bounds, grad_output.device)
        bag = bag_of_ids(offsets, n)  # (unchecked, as the reference's)
        key, summed, head = self._summed(layout, lookup, grad_output, bag, b)
        return pad_heads(layout, key, head, summed, bounds, grad_output.device)

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
        """Sum each distinct row's gradients in a fixed order, then apply the optimizer."""
        if opt.qat is not None:  # its padded rows would put zeros in a row's [min, max]
            raise ConfigError("QAT (train.qat) is not in the cuda backend; run on the CPU")
        b, bag = self._check(layout, weights, lookup)
        check_grad_shape(grad_output, layout, lookup.offsets)
        for k in state_shapes(opt.kind, layout.total_rows, layout.total_elems):
            if k not in state:
                raise TBEInputError(f"cuda TBE backend: optimizer '{opt.kind}' needs state '{k}'")
        n = lookup.indices.numel()
        if n == 0 or b == 0 or layout.total_elems == 0:
            return
        sorted_key, summed, _ = self._summed(layout, lookup, grad_output, bag, b)
        meta, total = layout.meta(weights.device), layout.total_rows
        cols = torch.arange(summed.shape[1], device=weights.device)
        real = sorted_key < total
        key_c = sorted_key.clamp(0, max(total - 1, 0))
        u_t = torch.bucketize(key_c, meta["row_offsets"][1:], right=True)
        u_dim = meta["dims"][u_t]
        base = meta["elem_offsets"][u_t] + (key_c - meta["row_offsets"][u_t]) * u_dim
        evalid = real.unsqueeze(1) & (cols < u_dim.unsqueeze(1))
        eidx = (base.unsqueeze(1) + cols).clamp(0, layout.total_elems - 1)
        w = torch.where(evalid, weights[eidx], 0)
        st = {k: (s[key_c] if k == "momentum1" else s[eidx]) for k, s in state.items()}
        if opt.kind == "rowwise_adagrad":  # mean(g*g) over the row's own columns
            gw = summed + opt.weight_decay * w if opt.weight_decay else summed
            st["momentum1"] += (gw * gw).sum(1) / u_dim.to(gw.dtype)
            w = w - opt.lr * gw / (st["momentum1"].sqrt() + opt.eps).unsqueeze(1)
        else:  # elementwise: the padded columns are computed and never written
            apply_rows(opt, w, summed.to(w.dtype), st, step)
        put_valid(weights, eidx, w, evalid)
        for k, s in state.items():
            if k == "momentum1":
                put_valid(s, key_c, st[k], real)
            else:
                put_valid(s, eidx, st[k], evalid)
