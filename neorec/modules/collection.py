"""EmbeddingCollection: the interface every embedding collection implements.

A collection pools the bags of a ``SparseFeatures`` batch over its tables and trains them with a
fused row optimizer inside ``backward``: no dense optimizer ever sees its weights. The unsharded
``EmbeddingBagCollection`` is the specification; the grouped, cached, dynamic, mixed and sharded
collections compute the same function over other memory or other ranks. The trainer, pipelines,
summary and checkpoints talk to any of them through this interface only.

``CollectionSpec`` is what every collection of a run shares (the fused optimizer, pooling, kernel
backend, initialization, rounding of low-precision rows, id checks): the builder makes one from the
config and every collection constructor takes it, after its tables.
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from neorec.config import ConfigError, TableConfig
from neorec.ops.qat import Periodic
from neorec.ops.row_optim import RowOptimizer, state_shapes
from neorec.ops.tbe import PoolingMode, TBELayout
from neorec.sparse import SparseFeatures

__all__ = [
    "EmbeddingCollection",
    "CollectionSpec",
    "UpdateHook",
    "STATE_NAMES",
    "optimizer_state_of",
]

UpdateHook = Callable[[TBELayout, Tensor, Tensor], None]
"""Called after each fused update with (layout, indices, offsets) of the batch."""

STATE_NAMES = ("momentum1", "exp_avg", "exp_avg_sq")
"""The fused optimizers' state buffers (row-wise Adagrad: momentum1; Adam: exp_avg, exp_avg_sq)."""


@dataclass(frozen=True)
class CollectionSpec:
    """What every embedding collection of a run shares, checked once when made (a
    ``ConfigError`` naming the first bad field). The tables are each collection's own."""

    optimizer: RowOptimizer = field(default_factory=RowOptimizer)
    """The fused row optimizer."""
    pooling: str = "sum"
    """How a bag's rows are pooled: ``sum`` or ``mean``."""
    backend: str = "auto"
    """The TBE backend (``neorec.ops.tbe.get_backend``: checked against the device)."""
    init_scale: float = 0.0
    """Initial rows uniform in +-init_scale; 0: +-sqrt(1/rows)."""
    seed: int = 0
    """Seed of the initial rows (and of stochastic rounding, id maps' admission)."""
    rounding: str = "auto"
    """How updated low-precision rows are stored (``neorec.ops.lowp_rows``)."""
    validate_ids: bool = True
    """Refuse ids outside their tables (dynamic tables take any raw id whatever this says)."""

    def __post_init__(self) -> None:
        who = type(self).__name__
        if not isinstance(self.optimizer, RowOptimizer):
            raise ConfigError(
                f"{who}: optimizer must be a RowOptimizer (e.g. RowOptimizer(kind='adam')), "
                f"got {type(self.optimizer).__name__} {self.optimizer!r}"[:300]
            )
        if self.pooling not in [m.value for m in PoolingMode]:
            raise ConfigError(f"{who}: pooling must be 'sum' or 'mean', got {self.pooling!r}")
        object.__setattr__(self, "pooling", PoolingMode(self.pooling).value)
        scale = float(self.init_scale) if isinstance(self.init_scale, Real) else math.nan
        if isinstance(self.init_scale, bool) or not (math.isfinite(scale) and scale >= 0):
            raise ConfigError(
                f"{who}: init_scale must be a finite number >= 0 (0 = sqrt(1/rows)), "
                f"got {self.init_scale!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, Integral):
            raise ConfigError(f"{who}: seed must be an integer, got {self.seed!r}")
        if not isinstance(self.validate_ids, bool):
            raise ConfigError(
                f"{who}: validate_ids must be True or False, got {self.validate_ids!r}"
            )


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
    validate_ids: bool = True
    """Batches' ids are checked against their tables' rows (``collection_parts.checked_batch``)."""
    comm_stats: Any = None
    """A distributed collection's ``CommStats`` (bytes and waits per collective); else None."""
    host_resident: bool = False
    """Its rows live in host stores behind a cache (row trackers keep their masks on the host)."""
    row_format: Any = None
    """The stored format of its rows (``neorec.ops.lowp_rows.RowFormat``), where one format
    holds all of them; None: float32 rows, or parts of their own."""

    def __init__(
        self, tables: Sequence[TableConfig] = (), spec: CollectionSpec | None = None
    ) -> None:
        """``tables`` and their ``feature_names``; with ``spec`` its optimizer, pooling and id
        checks; no update hooks yet."""
        super().__init__()
        self.tables = list(tables)
        self.feature_names = [f for t in self.tables for f in t.features]
        if spec is not None:
            self.optimizer = spec.optimizer
            self.pooling = PoolingMode(spec.pooling)
            self.validate_ids = spec.validate_ids
        self._hooks: list[UpdateHook] = []

    @abstractmethod
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, ``output_dim``], features in ``feature_names`` order."""

    @property
    def output_dim(self) -> int:
        """Columns of the pooled output: each feature's table dim."""
        return sum(t.dim * len(t.features) for t in self.tables)

    if TYPE_CHECKING:

        @property
        def step(self) -> Tensor:
            """Fused updates applied so far (a 0-d int64 tensor: a buffer, or a part's)."""
            ...

    @property
    def state_names(self) -> list[str]:
        """Names of the fused optimizer's state (a subset of ``STATE_NAMES``, in its order)."""
        return list(state_shapes(self.optimizer.kind, 0, 0))

    def optimizer_state(self) -> dict[str, Tensor]:
        """Every fused-optimizer state tensor this collection holds, by name (a collection made
        of collections prefixes each part's names with the part's): by default the
        ``STATE_NAMES`` buffers it registered."""
        return optimizer_state_of(self)

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after every fused update (row tracking): by
        default kept in the list its updates call."""
        self._hooks.append(hook)

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

    def set_qat(self, qat: Periodic | None) -> None:
        """Set the fused row optimizer's QAT regularizer (None: off), in place, for the next
        updates, as ``set_lr`` sets the lr (every rank must set the same)."""
        for m in self.modules():
            if isinstance(m, EmbeddingCollection):
                m.optimizer = replace(m.optimizer, qat=qat)

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
