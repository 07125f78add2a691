"""GroupedEmbeddingBagCollection: tables of different stored precisions, one collection each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from neorec.config import TableConfig
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec, EmbeddingCollection, UpdateHook
from neorec.modules.collection_parts import check_tables, checked_batch, feature_maps
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.sparse import SparseFeatures

__all__ = ["GroupedEmbeddingBagCollection"]


def parts_permutation(ebc: Any, parts: Sequence[Any]) -> Tensor:
    """The columns of ``parts``' concatenated pooled outputs, in ``ebc.feature_names`` order (a
    collection made of collections); ``ConfigError`` when the parts' features are not its own."""
    dims = {f: t.dim for t in ebc.tables for f in t.features}
    start, cols = 0, {}
    for g in parts:
        for f in g.feature_names:
            cols[f] = torch.arange(start, start + dims[f])
            start += dims[f]
    if sorted(cols) != sorted(ebc.feature_names):
        raise ConfigError(
            f"{type(ebc).__name__}: the parts' features {sorted(cols)} are not the tables' "
            f"{sorted(ebc.feature_names)}"
        )
    return torch.cat([cols[f] for f in ebc.feature_names])


class GroupedEmbeddingBagCollection(EmbeddingCollection):
    """One ``EmbeddingBagCollection`` per table precision (fp32, fp16, bf16, fp8), with the
    interface of one collection: pooled outputs in the tables' feature order.

    Each table is initialized from its name and the seed, as in a single collection, and each
    group's TBE pools and updates its tables exactly as a single collection would: the result
    equals one collection whose tables are stored in their own precisions.
    """

    _perm: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        spec: CollectionSpec,
        device: torch.device | str = "cpu",
    ) -> None:
        check_tables(tables, type(self).__name__)
        super().__init__(tables, spec)
        order: list[str] = []
        for t in self.tables:
            p = t.precision or "fp32"
            if p not in order:
                order.append(p)
        self.groups = nn.ModuleDict(
            {
                p: EmbeddingBagCollection(
                    [t for t in self.tables if (t.precision or "fp32") == p], spec, device
                )
                for p in order
            }
        )
        self._parts: list[EmbeddingBagCollection] = [self.groups[p] for p in order]  # type: ignore[misc]
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self.register_buffer("_perm", parts_permutation(self, self._parts), persistent=False)
        self.weights = torch.empty(0)  # dtype of pooled outputs for batch checks: float32

    @property
    def step(self) -> Tensor:
        """The fused updates applied so far (every group counts each batch)."""
        return self._parts[0].step

    def optimizer_state(self) -> dict[str, Tensor]:
        """Each group's state tensors, ``<precision>.<name>``."""
        names = list(self.groups.keys())  # the parts' order
        return {
            f"{p}.{k}": v
            for p, g in zip(names, self._parts)
            for k, v in g.optimizer_state().items()
        }

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after every group's fused update."""
        for g in self._parts:
            g.add_update_hook(hook)

    def _group_of(self, name: str) -> EmbeddingBagCollection:
        for g in self._parts:
            if any(t.name == name for t in g.tables):
                return g
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")

    def table_weight(self, name: str) -> Tensor:
        """One table's weights [rows, dim] as fp32 (see ``EmbeddingBagCollection``)."""
        return self._group_of(name).table_weight(name)

    def set_table_weight(self, name: str, rows: Tensor) -> None:
        """Overwrite one table's weights (rounded to its precision)."""
        self._group_of(name).set_table_weight(name, rows)

    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order."""
        sparse = checked_batch(self, sparse)
        outs = [g(sparse.select(g.feature_names)) for g in self._parts]
        return torch.cat(outs, dim=1).index_select(1, self._perm)
