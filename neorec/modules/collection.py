"""EmbeddingCollection: the interface every embedding collection implements.

A collection pools the bags of a ``SparseFeatures`` batch over its tables and trains them with a
fused row optimizer inside ``backward``: no dense optimizer ever sees its weights. The unsharded
``EmbeddingBagCollection`` is the specification; the grouped, cached, dynamic, mixed and sharded
collections compute the same function over other memory or other ranks. The trainer, pipelines,
summary and checkpoints talk to any of them through this interface only.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from neorec.config import TableConfig
from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe import PoolingMode, TBELayout
from neorec.sparse import SparseFeatures

__all__ = ["EmbeddingCollection", "UpdateHook", "STATE_NAMES", "optimizer_state_of"]

UpdateHook = Callable[[TBELayout, Tensor, Tensor], None]
"""Called after each fused update with (layout, indices, offsets) of the batch."""

STATE_NAMES = ("momentum1", "exp_avg", "exp_avg_sq")
"""The fused optimizers' state buffers (row-wise Adagrad: momentum1; Adam: exp_avg, exp_avg_sq)."""


class EmbeddingCollection(nn.Module, metaclass=ABCMeta):
    """Pooled lookups of ``tables``, trained by a fused row optimizer inside ``backward``.

    ``forward(sparse)`` -> [B, ``output_dim``]: each feature's pooled bag, features in
    ``feature_names`` order (the tables' order, each table's features in order).
    """

    tables: list[TableConfig]
    """The tables, in the order of the pooled output."""
    feature_names: list[str]
    """The features, in the order of the pooled output."""
    optimizer: RowOptimizer
    """The fused row optimizer (every part has the same)."""
    pooling: PoolingMode
    """How a bag's rows are pooled (sum or mean)."""
    comm_stats: Any = None
    """A distributed collection's ``CommStats`` (bytes and waits per collective); else None."""
    host_resident: bool = False
    """Its rows live in host stores behind a cache (row trackers keep their masks on the host)."""
    row_format: Any = None
    """The stored format of its rows (``neorec.ops.lowp_rows.RowFormat``), where one format
    holds all of them; None: float32 rows, or parts of their own."""

    @abstractmethod
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, ``output_dim``], features in ``feature_names`` order."""

    @property
    @abstractmethod
    def output_dim(self) -> int:
        """Columns of the pooled output."""

    if TYPE_CHECKING:

        @property
        def step(self) -> Tensor:
            """Fused updates applied so far (a 0-d int64 tensor: a buffer, or a part's)."""
            ...

    @property
    @abstractmethod
    def state_names(self) -> list[str]:
        """Names of the fused optimizer's state (a subset of ``STATE_NAMES``)."""

    @abstractmethod
    def optimizer_state(self) -> dict[str, Tensor]:
        """Every fused-optimizer state tensor this collection holds, by name (a collection made
        of collections prefixes each part's names with the part's)."""

    @abstractmethod
    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after every fused update (row tracking)."""

    @abstractmethod
    def table_weight(self, name: str) -> Tensor:
        """One table's rows [rows, dim] as float32 (those this rank holds when sharded)."""

    def set_lr(self, lr: float) -> None:
        """Set the fused row optimizer's lr, in place, for the next updates: this collection's
        and every collection inside it (parts, groups, caches). The tables, their state and the
        TBE layout stay as they are; on a sharded collection every rank must set the same lr."""
        for m in self.modules():
            if isinstance(m, EmbeddingCollection):
                m.optimizer = replace(m.optimizer, lr=float(lr))

    def fused_steps(self) -> int:
        """Fused updates applied so far (a host read): the most any of its counters has."""
        return int(self.step)

    def stats(self) -> dict[str, Any]:
        """Counters worth reporting (row cache hits and misses, dynamic tables' admissions,
        evictions and occupancy); empty when there are none."""
        return {}

    def prefetch(self, sparse: SparseFeatures, defer: bool = False) -> None:
        """Pipeline stage for the next batch (``defer``: once this step's forward has made its
        own rows resident): a row cache reads the batch's missing rows. Nothing by default."""

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Prepare a later batch's input distribution from ``host``, its copy before the
        host-to-device copy (pipelines call this before the step). Nothing by default: a
        collection without staging distributes its input in ``forward``."""

    def flush(self) -> None:
        """Make slower stores complete (a row cache writes back its dirty rows). Nothing by
        default."""

    def close(self) -> None:
        """Release files and threads (after ``flush``). Nothing by default."""


def optimizer_state_of(module: nn.Module, prefix: str = "") -> dict[str, Tensor]:
    """The ``STATE_NAMES`` buffers ``module`` registered (with ``prefix``), by name."""
    return {k: getattr(module, prefix + k) for k in STATE_NAMES if hasattr(module, prefix + k)}
