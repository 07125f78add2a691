"""EmbeddingBagCollection: many pooled embedding tables over one fused TBE call."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from neorec.config import ConfigError, TableConfig
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.collection_parts import (
    INIT_CHUNK_ROWS,
    as_device,
    check_memory,
    check_tables,
    checked_batch,
    feature_maps,
    init_rows,
    register_table_buffers,
)
from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat, table_key
from neorec.ops.tbe import (
    Lookup,
    TBEBackend,
    TBELayout,
    check_finite_weights,
    check_grad_output,
    get_backend,
    tbe_lookup,
)
from neorec.phases import table_init_skipped
from neorec.sparse import SparseFeatures

__all__ = ["EmbeddingBagCollection", "table_precision"]


class EmbeddingBagCollection(EmbeddingCollection):
    """Pooled lookups of every table in one TBE call; trained by a fused row optimizer.

    Weights and optimizer state are flat buffers (see ``neorec.ops.tbe``), so they are in
    ``state_dict()`` but never handed to a dense ``torch.optim`` optimizer; the embedding update
    happens inside ``loss.backward()``. The weights are float32, or packed fp16 / bf16 / fp8 rows
    when the tables' ``precision`` says so (one precision per collection; the optimizer state
    stays float32; see ``neorec.ops.lowp_rows``); ``spec.rounding`` is how updated rows are stored.
    """

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
    ) -> None:
        check_tables(tables, type(self).__name__)
        super().__init__(tables, spec)
        self.row_format = RowFormat(table_precision(tables))
        feature_table = tuple(i for i, t in enumerate(self.tables) for _ in t.features)
        self.layout = TBELayout(
            rows=tuple(t.rows for t in self.tables),
            dims=tuple(t.dim for t in self.tables),
            feature_table=feature_table,
        )
        device = as_device(device)
        self.backend: TBEBackend = get_backend(spec.backend, device)
        packed = None
        if self.row_format.precision != "fp32":
            keys = [(table_key(t.name), 0, 0, t.dim) for t in self.tables]
            self.backend = LowpRowsBackend(
                self.backend, self.row_format, spec.rounding, spec.seed, keys
            )
            packed = self.row_format.empty(self.layout, device)
        self.rounding = getattr(self.backend, "rounding", "nearest")
        check_memory(self.tables, self.layout, self.optimizer.kind, device)
        register_table_buffers(self, self.layout, self.optimizer.kind, device, weights=packed)
        # Zero-element tensor that puts the TBE op in the autograd graph (see tbe_lookup).
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self._host_step: tuple[Tensor, int, int] | None = None  # (step, its _version, value)
        self.reset_parameters(spec.init_scale, spec.seed)

    # ---- parameters ----------------------------------------------------------------------
    def reset_parameters(self, init_scale: float = 0.0, seed: int = 0) -> None:
        """Uniform init per table: +-init_scale, or +-sqrt(1/rows) as in the reference DLRM."""
        fmt = self.row_format
        for t, spec in enumerate(self.tables if not table_init_skipped() else []):
            if fmt.precision == "fp32":
                init_rows(
                    spec, seed, 0, spec.rows, init_scale, out=self.layout.table(self.weights, t)
                )
                continue
            for lo in range(0, spec.rows, INIT_CHUNK_ROWS):  # rounded to nearest, chunk by chunk
                hi = min(spec.rows, lo + INIT_CHUNK_ROWS)
                rows = init_rows(spec, seed, lo, hi, init_scale)
                fmt.encode(self.weights, self.layout, t, torch.arange(lo, hi), rows)
        for k in self.state_names:
            getattr(self, k).zero_()
        self.step.zero_()

    def table_weight(self, name: str) -> Tensor:
        """One table's weights [rows, dim]: a view of the fp32 buffer, or for low-precision
        tables their fp32 values (a copy; write with ``set_table_weight``)."""
        t = self._table_index(name)
        if self.row_format.precision == "fp32":
            return self.layout.table(self.weights, t)
        return self.row_format.decode(self.weights, self.layout, t)

    def set_table_weight(self, name: str, rows: Tensor) -> None:
        """Overwrite one table's weights with fp32 ``rows`` [rows, dim] (rounded to nearest)."""
        t = self._table_index(name)
        want = (self.layout.rows[t], self.layout.dims[t])
        if tuple(rows.shape) != want:
            raise ConfigError(f"table '{name}': rows must be {list(want)}, got {list(rows.shape)}")
        self.row_format.encode(self.weights, self.layout, t, None, rows.to(self.weights.device))

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")

    def _next_step(self) -> int:
        """``self.step + 1`` from a host copy of the (device) counter: read once, and again only
        after something else wrote or replaced it (a restore, a reset, a move: the buffer or its
        version changed)."""
        seen, buf = self._host_step, self.step
        if seen is None or seen[0] is not buf or seen[1] != buf._version:
            seen = (buf, buf._version, int(buf))  # a host read: first step, or after a write
            self._host_step = seen
        return seen[2] + 1

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Check ``host``, the host copy of a later batch whose device copy is ``sparse``, and
        mark the device copy checked: its forward then reads nothing back from the device."""
        if host is not None and host.keys == self.feature_names:
            checked_batch(self, host)  # raises SparseFeatureError naming the culprit
            sparse.checked_for = self  # type: ignore[attr-defined]

    # ---- forward -------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order.

        The batch is checked first (see ``checked_batch``); a zero-sample batch gives a [0, D]
        output whose backward changes nothing (no rows, no step).
        """
        sparse = checked_batch(self, sparse)
        dev = self.weights.device
        indices = sparse.values.to(dev, torch.int64)
        offsets = sparse.offsets().to(dev)
        psw = sparse.weights.to(dev) if sparse.weights is not None else None
        samples = sparse.batch_size
        lookup = Lookup(indices, offsets, psw, self.pooling)

        def update(grad_output: Tensor) -> None:
            if samples == 0:
                return
            check_grad_output(grad_output, self.layout)
            check_finite_weights(psw)
            step = self._next_step()
            self.backend.backward_update(
                self.layout,
                self.weights,
                self.optimizer_state(),
                lookup,
                grad_output,
                self.optimizer,
                step,
            )
            # Counted once the update went through: a refused batch leaves Adam's count alone.
            self.step.fill_(step)
            self._host_step = (self.step, self.step._version, step)
            for hook in self._hooks:
                hook(self.layout, indices, offsets)

        return tbe_lookup(self._anchor, self.backend, self.layout, self.weights, lookup, update)


def table_precision(tables: Sequence[TableConfig]) -> str:
    """The one precision of ``tables`` (``ConfigError`` when they differ: build one collection
    per precision, e.g. with ``GroupedEmbeddingBagCollection``)."""
    precs = sorted({getattr(t, "precision", "") or "fp32" for t in tables})
    if len(precs) > 1:
        raise ConfigError(
            f"one EmbeddingBagCollection holds one precision, got {precs}; group the tables by "
            "precision (neorec.modules.GroupedEmbeddingBagCollection)"
        )
    return precs[0]
