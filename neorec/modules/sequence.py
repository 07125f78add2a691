"""SequenceEmbeddingCollection: non-pooled lookups of sequence features (and pooled ones of the
others) over shared tables, one fused backward-update for all of them.

A sequence feature's ids are not pooled: each id's row is an output row, so feature ``f`` gives a
jagged [n_f, D_f] tensor (n_f: its ids in the batch). The specification is ``nn.Embedding`` per
table plus the reference row optimizer (``neorec.ops.row_optim``); the lookup is
``neorec.ops.seq_lookup`` (the C kernel on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neorec.config import ConfigError, TableConfig
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.collection_parts import (
    as_device,
    check_memory,
    check_tables,
    checked_batch,
    feature_maps,
    init_rows,
    register_table_buffers,
)
from neorec.ops.seq_lookup import get_seq_backend, seq_lookup, seq_out_offsets
from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, check_finite_weights, get_backend
from neorec.phases import table_init_skipped
from neorec.sparse import SparseFeatures

__all__ = ["SequenceEmbeddingCollection"]


class SequenceEmbeddingCollection(EmbeddingCollection):
    """Tables looked up by sequence features (rows as they are) and pooled features (bags summed
    or averaged, per-id weights applied), trained by one fused row-optimizer update.

    ``forward(batch)`` returns one flat tensor: for each feature in ``feature_names`` order, a
    sequence feature's [n_f, D_f] rows or a pooled feature's [B, D_f] bags; ``split(out, batch)``
    (or ``lookup(batch)``) gives them by name. A table read by a sequence and a pooled feature
    (the item table: history and candidate) is updated once per step from both gradients,
    summed in (feature, position) order as the pooled collection does. Per-id weights weigh
    pooled features' ids only; a sequence feature's rows are returned unweighted (its weights,
    timestamps and actions are the model's to use). float32 tables only.
    """

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
        sequence_features: Sequence[str] | None = None,
    ) -> None:
        """``sequence_features``: the features looked up without pooling (None: all of them)."""
        who = type(self).__name__
        check_tables(tables, who)
        super().__init__(tables, spec)
        precs = sorted({getattr(t, "precision", "") or "fp32" for t in self.tables})
        if precs != ["fp32"]:
            raise ConfigError(f"{who}: float32 tables only, got precisions {precs}")
        seq = list(self.feature_names if sequence_features is None else sequence_features)
        unknown = sorted(set(seq) - set(self.feature_names))
        if unknown:
            raise ConfigError(f"{who}: sequence features {unknown} read no table")
        self.sequence_features = [f for f in self.feature_names if f in set(seq)]
        self.pooled_features = [f for f in self.feature_names if f not in set(seq)]
        table_of = {f: i for i, t in enumerate(self.tables) for f in t.features}
        rows, dims = tuple(t.rows for t in self.tables), tuple(t.dim for t in self.tables)
        self.layout = TBELayout(rows, dims, tuple(table_of[f] for f in self.feature_names))
        self.pooled_layout = TBELayout(rows, dims, tuple(table_of[f] for f in self.pooled_features))
        self._is_seq = [f in set(seq) for f in self.feature_names]
        device = as_device(device)
        seq_name = spec.backend if spec.backend in ("cpu", "reference") else "auto"
        self.seq_backend = get_seq_backend(seq_name, device)
        self.backend = get_backend(spec.backend, device)
        check_memory(self.tables, self.layout, self.optimizer.kind, device)
        register_table_buffers(self, self.layout, self.optimizer.kind, device)
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self.reset_parameters(spec.init_scale, spec.seed)

    def reset_parameters(self, init_scale: float = 0.0, seed: int = 0) -> None:
        """The pooled collection's initial rows (``init_rows``); zero state and step."""
        for t, table in enumerate(self.tables if not table_init_skipped() else []):
            init_rows(
                table, seed, 0, table.rows, init_scale, out=self.layout.table(self.weights, t)
            )
        for k in self.state_names:
            getattr(self, k).zero_()
        self.step.zero_()

    @property
    def output_dim(self) -> int:
        """Columns of the pooled features' [B, ·] part (sequence features' rows are jagged)."""
        return sum(self.layout.dims[t] for t in self.pooled_layout.feature_table)

    def table_weight(self, name: str) -> Tensor:
        """One table's rows [rows, dim] (a view)."""
        for i, t in enumerate(self.tables):
            if t.name == name:
                return self.layout.table(self.weights, i)
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")

    # ---- lookup ----------------------------------------------------------------------------
    def split(self, out: Tensor, batch: SparseFeatures) -> dict[str, Tensor]:
        """``forward``'s flat output by feature name: [n_f, D_f] or [B, D_f] views."""
        batch = batch.reorder(self.feature_names)
        counts = batch.lengths_per_key().tolist()
        b = batch.batch_size
        res, at = {}, 0
        for f, name in enumerate(self.feature_names):
            d = self.layout.dims[self.layout.feature_table[f]]
            n = int(counts[f]) if self._is_seq[f] else b
            res[name] = out[at : at + n * d].view(n, d)
            at += n * d
        return res

    def lookup(self, batch: SparseFeatures) -> dict[str, Tensor]:
        """Each feature's rows (sequence) or bags (pooled), by name."""
        return self.split(self.forward(batch), batch)

    def forward(self, sparse: SparseFeatures) -> Tensor:
        """The flat output (see the class): one kernel call for all sequence features, one
        pooled TBE call for the pooled ones; the backward is one fused update of all."""
        batch = checked_batch(self, sparse)
        dev = self.weights.device
        indices = batch.values.to(dev, torch.int64)
        offsets = batch.offsets().to(dev)
        fpos = [0, *torch.cumsum(batch.lengths_per_key(), 0).tolist()]
        b = batch.batch_size
        psw = batch.weights.to(dev) if batch.weights is not None else None

        def run() -> Tensor:
            return self._forward(indices, offsets, fpos, psw, b)

        def update(grad: Tensor) -> None:
            if b == 0:  # as the pooled collection: a step per batch of samples, ids or not
                return
            check_finite_weights(psw)
            g = self._per_id_grad(grad, offsets, fpos, psw, b)
            step = int(self.step) + 1
            self.seq_backend.backward_update(
                self.layout, self.weights, self.optimizer_state(), (indices, fpos), g,
                self.optimizer, step,
            )  # fmt: skip
            self.step.fill_(step)  # counted once the update went through
            for hook in self._hooks:
                hook(self.layout, indices, offsets)

        return seq_lookup(self._anchor, run, update)

    def _forward(
        self, indices: Tensor, offsets: Tensor, fpos: list[int], psw: Tensor | None, b: int
    ) -> Tensor:
        seq_f = [f for f in range(len(self._is_seq)) if self._is_seq[f]]
        if len(seq_f) == len(self._is_seq):
            return self.seq_backend.forward(self.layout, self.weights, indices, fpos)
        parts: dict[int, Tensor] = {}
        if seq_f:
            lay = TBELayout(self.layout.rows, self.layout.dims, self._tables_of(seq_f))
            ids, fp = _gather(indices, fpos, seq_f)
            flat = self.seq_backend.forward(lay, self.weights, ids, fp)
            oo = seq_out_offsets(lay, fp)
            parts.update({f: flat[oo[i] : oo[i + 1]] for i, f in enumerate(seq_f)})
        pool_f = [f for f in range(len(self._is_seq)) if not self._is_seq[f]]
        ids, fp = _gather(indices, fpos, pool_f)
        w = _gather(psw, fpos, pool_f)[0] if psw is not None else None
        off = torch.cat([offsets[f * b : (f + 1) * b] - offsets[f * b] for f in pool_f])
        off = torch.cat([off + torch.repeat_interleave(  # each feature's bags after the last's
            torch.tensor(fp[:-1], device=off.device), b), off.new_tensor([fp[-1]])])  # fmt: skip
        pooled = self.backend.forward(
            self.pooled_layout, self.weights, Lookup(ids, off, w, self.pooling)
        )
        po = self.pooled_layout.out_offsets
        parts.update({f: pooled[:, po[i] : po[i + 1]].reshape(-1) for i, f in enumerate(pool_f)})
        return torch.cat([parts[f] for f in range(len(self._is_seq))])

    def _tables_of(self, feats: list[int]) -> tuple[int, ...]:
        return tuple(self.layout.feature_table[f] for f in feats)

    def _per_id_grad(
        self, grad: Tensor, offsets: Tensor, fpos: list[int], psw: Tensor | None, b: int
    ) -> Tensor:
        """The flat gradient with one row per id: a pooled feature's bag gradient repeated for
        each of its ids (divided by the bag's length for mean, times its weight), in the
        reference's order of roundings (``ReferenceBackend.counted_row_grads``)."""
        if all(self._is_seq):
            return grad
        parts, at = [], 0
        for f, t in enumerate(self.layout.feature_table):
            d, n = self.layout.dims[t], fpos[f + 1] - fpos[f]
            if self._is_seq[f]:
                parts.append(grad[at : at + n * d])
                at += n * d
                continue
            block = grad[at : at + b * d].view(b, d)
            at += b * d
            lens = offsets[f * b + 1 : (f + 1) * b + 1] - offsets[f * b : (f + 1) * b]
            bag = torch.repeat_interleave(torch.arange(b, device=grad.device), lens)
            g = block[bag]
            if self.pooling == PoolingMode.MEAN:
                g = g / lens.clamp(min=1).to(g.dtype)[bag].unsqueeze(1)
            if psw is not None:
                g = g * psw[fpos[f] : fpos[f + 1]].unsqueeze(1).to(g.dtype)
            parts.append(g.reshape(-1))
        return torch.cat(parts) if parts else grad


def _gather(t: Tensor, fpos: list[int], feats: list[int]) -> tuple[Tensor, list[int]]:
    """The ids (or per-id values) of features ``feats``, and their feature offsets."""
    out, fp = [], [0]
    for f in feats:
        out.append(t[fpos[f] : fpos[f + 1]])
        fp.append(fp[-1] + fpos[f + 1] - fpos[f])
    return (torch.cat(out) if out else t[:0]), fp
