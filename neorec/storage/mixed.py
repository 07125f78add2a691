"""MixedEmbeddingBagCollection: fixed tables in one collection and dynamic tables in another,
with the interface of one collection (split from ``dynamic.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.modules.collection import EmbeddingCollection, UpdateHook
from neorec.modules.collection_parts import checked_batch, feature_maps
from neorec.modules.embedding_groups import parts_permutation
from neorec.sparse import SparseFeatures

__all__ = ["MixedEmbeddingBagCollection"]


class MixedEmbeddingBagCollection(EmbeddingCollection):
    """Fixed tables in one collection (any kind: in memory, low precision, row cache) and dynamic
    tables in a ``DynamicEmbeddingBagCollection`` (in memory or behind a row cache), with the
    interface of one collection: pooled outputs in ``tables``' feature order."""

    _perm: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        fixed: EmbeddingCollection,
        dynamic: Any,
    ) -> None:
        super().__init__(tables)
        self.fixed, self.dynamic = fixed, dynamic
        self.optimizer = dynamic.optimizer
        self.pooling = dynamic.pooling
        self.validate_ids = False
        self._parts: list[Any] = [fixed, dynamic]
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self.register_buffer("_perm", parts_permutation(self, self._parts), persistent=False)
        self.weights = torch.empty(0)  # dtype of pooled outputs for batch checks: float32

    @property
    def step(self) -> Tensor:
        """The fused updates applied so far (both parts count each batch)."""
        return self.dynamic.step

    def optimizer_state(self) -> dict[str, Tensor]:
        """Each part's state tensors, ``fixed.<name>`` and ``dynamic.<name>``."""
        return {
            f"{n}.{k}": v
            for n, g in (("fixed", self.fixed), ("dynamic", self.dynamic))
            for k, v in g.optimizer_state().items()
        }

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after each part's fused update (each with its
        own layout)."""
        for g in self._parts:
            g.add_update_hook(hook)

    def table_weight(self, name: str) -> Tensor:
        """One table's rows (a dynamic table's slot rows)."""
        part: Any = self.dynamic if name in {t.name for t in self.dynamic.tables} else self.fixed
        out: Tensor = part.table_weight(name)
        return out

    def stats(self) -> dict[str, Any]:
        """The dynamic tables' ``stats()``."""
        out: dict[str, Any] = self.dynamic.stats()
        return out

    def prefetch(self, sparse: SparseFeatures, defer: bool = False) -> None:
        """Each part's row cache ``prefetch`` (parts without one: nothing), on its features."""
        for g in self._parts:
            g.prefetch(sparse.select(g.feature_names), defer=defer)

    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order."""
        sparse = checked_batch(self, sparse)
        outs = [g(sparse.select(g.feature_names)) for g in self._parts]
        return torch.cat(outs, dim=1).index_select(1, self._perm)

    def flush(self) -> None:
        """Both parts' slower stores complete (a row cache writes back its dirty rows)."""
        for g in self._parts:
            g.flush()

    def close(self) -> None:
        """Both parts release their files and threads (after ``flush``)."""
        for g in self._parts:
            g.close()
