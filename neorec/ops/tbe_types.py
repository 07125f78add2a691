"""The TBE's types: the static shape of a table batch (``TBELayout``), a batch's lookup input
(``Lookup``), the pooling of a bag and the interface every backend implements (``TBEBackend``).

All tables of a module live in one flat float32 ``weights`` tensor (table ``t`` occupies
``weights[elem_offsets[t]:elem_offsets[t+1]]`` as a row-major [rows_t, dim_t] block). A batch is
feature-major (see ``neorec.sparse``): feature ``f`` looks up table ``feature_table[f]``; its
pooled output occupies columns ``out_offsets[f]:out_offsets[f+1]`` of the [B, sum(dims)] output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

from neorec.ops.row_optim import RowOptimizer

__all__ = ["PoolingMode", "TBELayout", "Lookup", "TBEBackend"]


class PoolingMode(str, Enum):
    """How the rows of a bag are combined."""

    SUM = "sum"
    MEAN = "mean"


@dataclass(frozen=True)
class TBELayout:
    """Static shape of a table batch: tables (rows, dim) and which table each feature reads."""

    rows: tuple[int, ...]
    dims: tuple[int, ...]
    feature_table: tuple[int, ...]
    elem_offsets: tuple[int, ...] = field(init=False)
    row_offsets: tuple[int, ...] = field(init=False)
    out_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.dims):
            raise ValueError(f"{len(self.rows)} row counts for {len(self.dims)} dims")
        for t, (r, d) in enumerate(zip(self.rows, self.dims)):
            if r < 0 or d <= 0:
                raise ValueError(f"table {t}: rows must be >= 0 and dim > 0, got rows={r} dim={d}")
        for f, t in enumerate(self.feature_table):
            if not 0 <= t < len(self.rows):
                raise ValueError(f"feature {f} maps to table {t}, but there are {len(self.rows)}")
        elem, row, out = [0], [0], [0]
        for r, d in zip(self.rows, self.dims):
            elem.append(elem[-1] + r * d)
            row.append(row[-1] + r)
        for t in self.feature_table:
            out.append(out[-1] + self.dims[t])
        object.__setattr__(self, "elem_offsets", tuple(elem))
        object.__setattr__(self, "row_offsets", tuple(row))
        object.__setattr__(self, "out_offsets", tuple(out))

    @property
    def num_tables(self) -> int:
        """T."""
        return len(self.rows)

    @property
    def num_features(self) -> int:
        """F."""
        return len(self.feature_table)

    @property
    def total_dim(self) -> int:
        """Columns of the pooled output."""
        return self.out_offsets[-1]

    @property
    def total_rows(self) -> int:
        """Rows over all tables."""
        return self.row_offsets[-1]

    @property
    def total_elems(self) -> int:
        """Elements of the flat weights."""
        return self.elem_offsets[-1]

    def table(self, weights: Tensor, t: int) -> Tensor:
        """View of table ``t`` as [rows, dim]."""
        lo, hi = self.elem_offsets[t], self.elem_offsets[t + 1]
        return weights[lo:hi].view(self.rows[t], self.dims[t])

    @functools.lru_cache(maxsize=8)  # noqa: B019 - layouts are few and immutable
    def meta(self, device: torch.device) -> dict[str, Tensor]:
        """The offsets as int64 tensors on ``device`` (for kernels)."""
        mk = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return {
            "rows": mk(self.rows),
            "dims": mk(self.dims),
            "feature_table": mk(self.feature_table),
            "elem_offsets": mk(self.elem_offsets),
            "row_offsets": mk(self.row_offsets),
            "out_offsets": mk(self.out_offsets),
        }


@dataclass(frozen=True, eq=False)
class Lookup:
    """The batch's lookup input: what every backend takes (F features, B samples, N ids)."""

    indices: Tensor
    """int64 [N]: the ids, feature-major (feature f's B bags, then feature f+1's)."""
    offsets: Tensor
    """int64 [F*B+1]: bag ``i`` is ``indices[offsets[i]:offsets[i+1]]``."""
    per_sample_weights: Tensor | None
    """float [N]: each id's weight in its bag (None: all 1)."""
    pooling: PoolingMode
    """How a bag's rows are combined."""


class TBEBackend(Protocol):
    """A kernel implementation of the TBE forward and fused backward-update.

    Every method takes the batch as one ``Lookup``; feature ``f`` reads table
    ``layout.feature_table[f]``, and its pooled output occupies columns
    ``layout.out_offsets[f]:out_offsets[f+1]`` of the [B, layout.total_dim] output.

    Optional (``row_grads`` the module function falls back to the reference's):
    ``row_grads(layout, lookup, grad_output)``, per looked-up table (t, sorted distinct ids [U],
    summed gradients [U, D]), the sums ``backward_update`` applies; the GPU backends'
    ``row_grads_padded(layout, lookup, grad_output, bounds)``, the same in blocks of host-known
    size (``padded_rows``).
    """

    name: str

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, layout.total_dim] of ``lookup`` over the flat ``weights``."""
        ...

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
        """Apply ``opt`` in place to the rows ``lookup`` touched (``weights`` and ``state``),
        from d(loss)/d(output) ``grad_output`` [B, layout.total_dim]: each distinct row's
        gradients summed in (feature, batch position) order, then one update per row."""
        ...
