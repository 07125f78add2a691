"""EmbeddingBagCollection: many pooled embedding tables over one fused TBE call."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from neorec.config import TableConfig
from neorec.ops.memory import table_empty
from neorec.ops.row_optim import RowOptimizer, zeros_state
from neorec.ops.tbe import PoolingMode, TBEBackend, TBELayout, get_backend, tbe_lookup
from neorec.sparse import SparseFeatures

__all__ = ["EmbeddingBagCollection", "UpdateHook", "init_rows", "INIT_CHUNK_ROWS"]

INIT_CHUNK_ROWS = 8192
"""Rows per independently seeded init chunk: any row range can be generated on its own."""


def init_rows(
    spec: TableConfig,
    seed: int,
    row_start: int,
    row_end: int,
    init_scale: float = 0.0,
    out: Tensor | None = None,
) -> Tensor:
    """Initial values of rows ``[row_start, row_end)`` of a table, the same in every layout.

    Each chunk of ``INIT_CHUNK_ROWS`` rows has its own generator seeded from (seed, table name,
    chunk), so a shard, a cache fill or a checkpoint test can build any slice without the rest.
    """
    bound = init_scale or math.sqrt(1.0 / spec.rows)
    if out is None:
        out = torch.empty(row_end - row_start, spec.dim)
    name_key = zlib.crc32(spec.name.encode())
    gen = torch.Generator(device="cpu")
    first = row_start // INIT_CHUNK_ROWS
    last = (row_end - 1) // INIT_CHUNK_ROWS if row_end > row_start else first - 1
    for c in range(first, last + 1):
        lo, hi = c * INIT_CHUNK_ROWS, min(spec.rows, (c + 1) * INIT_CHUNK_ROWS)
        gen.manual_seed((seed * 1_000_003 + name_key * 7_919 + c) % (1 << 63))
        vals = torch.rand(hi - lo, spec.dim, generator=gen).mul_(2 * bound).sub_(bound)
        a, b = max(lo, row_start), min(hi, row_end)
        out[a - row_start : b - row_start].copy_(vals[a - lo : b - lo])
    return out


def register_table_buffers(
    module: nn.Module,
    layout: TBELayout,
    optimizer: str,
    device: torch.device,
    prefix: str = "",
    weights: Tensor | None = None,
) -> None:
    """Register ``{prefix}weights`` (``weights``, else uninitialized), the fused optimizer's zeroed
    state and a ``{prefix}step`` counter as buffers of ``module``, for a flat TBE ``layout``."""
    if weights is None:
        weights = table_empty(layout.total_elems, device=device)
    module.register_buffer(prefix + "weights", weights)
    for k, v in zeros_state(optimizer, layout.total_rows, layout.total_elems, device).items():
        module.register_buffer(prefix + k, v)
    module.register_buffer(prefix + "step", torch.zeros((), dtype=torch.int64))


UpdateHook = Callable[[TBELayout, Tensor, Tensor], None]
"""Called after each fused update with (layout, indices, offsets) of the batch."""


class EmbeddingBagCollection(nn.Module):
    """Pooled lookups of every table in one TBE call; trained by a fused row optimizer.

    Weights and optimizer state are flat float32 buffers (see ``neorec.ops.tbe``), so they are
    in ``state_dict()`` but never handed to a dense ``torch.optim`` optimizer; the embedding
    update happens inside ``loss.backward()``.
    """

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: RowOptimizer | None = None,
        pooling: str = "sum",
        backend: str = "auto",
        device: torch.device | str = "cpu",
        init_scale: float = 0.0,
        seed: int = 0,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.optimizer = optimizer or RowOptimizer()
        self.pooling = PoolingMode(pooling)
        self.validate_ids = validate_ids
        self.feature_names = [f for t in self.tables for f in t.features]
        feature_table = tuple(i for i, t in enumerate(self.tables) for _ in t.features)
        self.layout = TBELayout(
            rows=tuple(t.rows for t in self.tables),
            dims=tuple(t.dim for t in self.tables),
            feature_table=feature_table,
        )
        device = torch.device(device)
        self.backend: TBEBackend = get_backend(backend, device)
        register_table_buffers(self, self.layout, self.optimizer.kind, device)
        # Zero-element tensor that puts the TBE op in the autograd graph (see tbe_lookup).
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature = {f: t.rows for t in self.tables for f in t.features}
        self._table_by_feature = {f: t.name for t in self.tables for f in t.features}
        self._hooks: list[UpdateHook] = []
        self.reset_parameters(init_scale, seed)

    # ---- parameters ----------------------------------------------------------------------
    def reset_parameters(self, init_scale: float = 0.0, seed: int = 0) -> None:
        """Uniform init per table: +-init_scale, or +-sqrt(1/rows) as in the reference DLRM."""
        for t, spec in enumerate(self.tables):
            block = self.layout.table(self.weights, t)
            init_rows(spec, seed, 0, spec.rows, init_scale, out=block)
        for k in self.state_names:
            getattr(self, k).zero_()
        self.step.zero_()

    @property
    def state_names(self) -> list[str]:
        """Names of the optimizer state buffers."""
        return [k for k in ("momentum1", "exp_avg", "exp_avg_sq") if hasattr(self, k)]

    def optimizer_state(self) -> dict[str, Tensor]:
        """The fused optimizer's state tensors (flat)."""
        return {k: getattr(self, k) for k in self.state_names}

    def table_weight(self, name: str) -> Tensor:
        """View [rows, dim] of one table's weights."""
        return self.layout.table(self.weights, self._table_index(name))

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after every fused update (row tracking)."""
        self._hooks.append(hook)

    @property
    def output_dim(self) -> int:
        """Columns of the pooled output."""
        return self.layout.total_dim

    # ---- forward -------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order."""
        sparse = sparse.reorder(self.feature_names)
        if self.validate_ids:
            sparse.validate(self._rows_by_feature, self._table_by_feature)
        dev = self.weights.device
        indices = sparse.values.to(dev, torch.int64)
        offsets = sparse.offsets().to(dev)
        psw = sparse.weights.to(dev) if sparse.weights is not None else None

        def update(grad_output: Tensor) -> None:
            self.step += 1
            self.backend.backward_update(
                self.layout,
                self.weights,
                self.optimizer_state(),
                indices,
                offsets,
                psw,
                self.pooling,
                grad_output,
                self.optimizer,
                int(self.step),
            )
            for hook in self._hooks:
                hook(self.layout, indices, offsets)

        return tbe_lookup(
            self._anchor,
            self.backend,
            self.layout,
            self.weights,
            indices,
            offsets,
            psw,
            self.pooling,
            update,
        )
