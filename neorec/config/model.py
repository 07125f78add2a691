"""Config sections of the model: embedding tables, their fused optimizer, the DLRM's shape."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from neorec.config.checks import (
    MAX_DIM,
    MAX_ROWS,
    MAX_TABLES,
    MAX_TOTAL_ELEMS,
    MAX_WIDTH,
    check_fields,
    item_rule,
    rule,
    show,
    suggest,
)
from neorec.errors import ConfigError

__all__ = [
    "TableConfig",
    "ModelConfig",
    "EmbeddingConfig",
    "EMBEDDING_OPTIMIZERS",
    "PRECISIONS",
    "DYNAMIC_DEFAULTS",
]

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
TABLE_KINDS = ("fixed", "dynamic")
"""``TableConfig.kind``: ids are rows (``fixed``) or raw ids mapped to slots (``dynamic``)."""
ADMISSIONS = ("always", "threshold", "probability")
"""Admission policies of dynamic tables."""
EVICTIONS = ("lru", "lfu", "ttl")
"""Eviction policies of dynamic tables."""
"""Stored precisions of embedding rows (``neorec.ops.lowp_rows.PRECISIONS``)."""

EMBEDDING_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
"""The fused optimizers (``neorec.ops.row_optim.OPTIMIZERS``)."""
_F32_MAX = 3.4028234663852886e38
"""Largest float32: the fused optimizer computes in float32."""
_MAX_POOLING = 100_000.0
"""Largest mean pooling factor (ids per bag); the paper-scale tables reach ~140."""


def _table_where(name: Any) -> str:
    return f"embedding.tables[{name!r}]" if isinstance(name, str) else "embedding.tables[?]"


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table."""

    name: str = field(metadata=rule(nonempty=True))
    """Table name (unique)."""
    rows: int = field(metadata=rule(1, MAX_ROWS))
    """Number of rows (distinct ids)."""
    dim: int = field(metadata=rule(1, MAX_DIM))
    """Embedding dimension."""
    pooling_factor: float = field(default=1.0, metadata=rule(0, _MAX_POOLING))
    """Mean ids per sample of each feature reading this table (synthetic data, planner)."""
    features: list[str] = field(default_factory=list)
    """Features that read this table; default: one feature named like the table."""
    storage: str = field(default="memory", metadata=rule(choices=("memory", "dram", "ssd")))
    """Where rows live: ``memory`` (all in the fast tier), or ``dram`` / ``ssd`` behind a row cache."""
    cache_rows: int = field(default=0, metadata=rule(0, MAX_ROWS))
    """Rows of the row cache (dram/ssd storage); 0 = use cache_fraction."""
    cache_fraction: float = field(default=0.0, metadata=rule(0, 1))
    """Cache size as a share of rows (dram/ssd storage); 0 with cache_rows 0 = 10%."""
    cache_policy: str = field(default="lru", metadata=rule(choices=("lru", "lfu")))
    """Row cache eviction policy: ``lru`` or ``lfu``."""
    precision: str = field(default="", metadata=rule(choices=("",) + PRECISIONS))
    """Stored precision of the rows: fp32, fp16, bf16, fp8 (e4m3 + a per-row scale); empty =
    ``embedding.precision``. The optimizer state stays fp32."""
    kind: str = field(default="fixed", metadata=rule(choices=TABLE_KINDS))
    """``fixed`` (ids are rows in ``[0, rows)``) or ``dynamic`` (any 64-bit raw id, mapped to one
    of ``capacity`` slots by an id map with admission and eviction; ``neorec.storage.dynamic``)."""
    capacity: int = field(default=0, metadata=rule(0, MAX_ROWS))
    """Slots of a dynamic table; 0 = ``rows``. On dram / ssd the slot rows live in the store and
    ``cache_rows`` / ``cache_fraction`` are of the slots (+ the default row)."""
    admission: str = field(default="always", metadata=rule(choices=ADMISSIONS))
    """Dynamic tables: when an unseen id gets a slot: ``always``, ``threshold`` (on its
    ``admit_threshold``-th sighting, counted in a count-min sketch) or ``probability``."""
    admit_threshold: int = field(default=1, metadata=rule(1, 1_000_000))
    """Sightings (lookups) before an id is admitted (admission ``threshold``)."""
    admit_probability: float = field(default=1.0, metadata=rule(0, 1))
    """Share of ids admitted, decided per id by a seeded hash (admission ``probability``)."""
    eviction: str = field(default="lru", metadata=rule(choices=EVICTIONS))
    """Dynamic tables, when full: ``lru``, ``lfu``, or ``ttl`` (ids unused for more than
    ``ttl_steps`` steps are forgotten; LRU when still full)."""
    ttl_steps: int = field(default=0, metadata=rule(0, 2**62))
    """Steps an unused id keeps its slot (eviction ``ttl``)."""
    unadmitted: str = field(default="zeros", metadata=rule(choices=("zeros", "default_row")))
    """What an unadmitted id reads: ``zeros`` (dropped from its bag: no contribution, no update)
    or ``default_row`` (one shared trained row per table)."""

    def __post_init__(self) -> None:
        where = _table_where(self.name)
        check_fields(self, where)
        _check_kind(self, where)
        if self.cache_rows and self.cache_fraction:
            raise ConfigError(f"{where}: set cache_rows or cache_fraction, not both")
        for i, f in enumerate(self.features):
            if not f:
                raise ConfigError(f"{where}.features[{i}] must be a non-empty name")
        if len(set(self.features)) != len(self.features):
            raise ConfigError(f"{where}.features {self.features} repeat a name")
        if not self.features:
            self.features = [self.name]


DYNAMIC_DEFAULTS: dict[str, Any] = {
    "capacity": 0,
    "admission": "always",
    "admit_threshold": 1,
    "admit_probability": 1.0,
    "eviction": "lru",
    "ttl_steps": 0,
    "unadmitted": "zeros",
}
"""The dynamic-table fields and their defaults (a fixed table must leave them so)."""


def _check_kind(t: TableConfig, where: str) -> None:
    """Refuse dynamic-table fields on a fixed table, and settings that contradict each other."""
    if t.kind == "fixed":
        for k, v in DYNAMIC_DEFAULTS.items():
            if getattr(t, k) != v:
                raise ConfigError(
                    f"{where}.{k} = {show(getattr(t, k))} is for kind = 'dynamic' tables; "
                    f"set kind = 'dynamic' or remove {k}"
                )
        return
    if t.precision not in ("", "fp32"):
        raise ConfigError(
            f"{where}: kind 'dynamic' stores fp32 rows, got precision {t.precision!r}; "
            "remove precision or set it to 'fp32'"
        )
    if t.admit_threshold != 1 and t.admission != "threshold":
        raise ConfigError(
            f"{where}.admit_threshold = {t.admit_threshold} needs admission = 'threshold' "
            f"(got {t.admission!r})"
        )
    if t.admit_probability != 1.0 and t.admission != "probability":
        raise ConfigError(
            f"{where}.admit_probability = {t.admit_probability} needs admission = "
            f"'probability' (got {t.admission!r})"
        )
    if t.eviction == "ttl" and t.ttl_steps < 1:
        raise ConfigError(f"{where}: eviction 'ttl' needs ttl_steps >= 1, got {t.ttl_steps}")
    if t.ttl_steps and t.eviction != "ttl":
        raise ConfigError(
            f"{where}.ttl_steps = {t.ttl_steps} needs eviction = 'ttl' (got {t.eviction!r})"
        )


_WIDTHS = rule(nonempty=True, item=item_rule(1, MAX_WIDTH))


@dataclass(kw_only=True)
class ModelConfig:
    """DLRM shape."""

    num_dense: int = field(default=13, metadata=rule(1, MAX_WIDTH))
    """Dense (continuous) input features."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32, 16], metadata=_WIDTHS)
    """Bottom MLP widths; the last must equal the embedding dim for the dot interaction."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32, 1], metadata=_WIDTHS)
    """Top MLP widths; the last must be 1 (the logit)."""
    interaction: str = field(default="dot", metadata=rule(choices=("dot", "dcn")))
    """``dot`` (DLRM pairwise dot products) or ``dcn`` (DCNv2 cross network)."""
    dcn_layers: int = field(default=3, metadata=rule(0, 1000))
    """Cross layers for ``dcn``."""
    dcn_low_rank: int = field(default=0, metadata=rule(0, MAX_WIDTH))
    """Low-rank factor of each cross layer (0 = full rank), as in MLPerf DLRMv2 (512)."""
    dot_self: bool = False
    """Include each feature's dot product with itself (dot interaction)."""

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp must end with 1 (the logit), got {self.top_mlp}")


@dataclass(kw_only=True)
class EmbeddingConfig:
    """Embedding tables and their fused optimizer."""

    tables: list[TableConfig] = field(default_factory=list)
    """Explicit tables; when empty, ``num_tables`` tables ``t0..`` of ``rows`` x ``dim``."""
    num_tables: int = field(default=8, metadata=rule(1, MAX_TABLES))
    """Generated table count (when ``tables`` is empty)."""
    rows: int = field(default=10_000, metadata=rule(1, MAX_ROWS))
    """Rows of each generated table."""
    dim: int = field(default=16, metadata=rule(1, MAX_DIM))
    """Dim of each generated table."""
    pooling_factor: float = field(default=4.0, metadata=rule(0, _MAX_POOLING))
    """Pooling factor of each generated table."""
    pooling: str = field(default="sum", metadata=rule(choices=("sum", "mean")))
    """``sum`` or ``mean``."""
    optimizer: str = field(default="rowwise_adagrad", metadata=rule(choices=EMBEDDING_OPTIMIZERS))
    """Fused optimizer: sgd, rowwise_adagrad, adam."""
    lr: float = field(default=0.05, metadata=rule(gt=0, hi=_F32_MAX))
    """Fused optimizer learning rate."""
    eps: float = field(default=1e-8, metadata=rule(gt=0, hi=_F32_MAX))
    """Fused optimizer epsilon."""
    weight_decay: float = field(default=0.0, metadata=rule(0, _F32_MAX))
    """Fused optimizer L2 penalty (``train.lr_scaling = "cowclip"`` scales it linearly with the
    batch)."""
    cowclip_ratio: float = field(default=0.0, metadata=rule(0, _F32_MAX))
    """CowClip's r (adaptive column-wise clipping, Zheng et al. 2023): each touched row's gradient
    is clipped to the norm ``count * max(r * ||row||, cowclip_bound)``; 0 = off."""
    cowclip_bound: float = field(default=0.0, metadata=rule(0, _F32_MAX))
    """CowClip's zeta: the clip threshold's floor per occurrence (needs cowclip_ratio > 0)."""
    backend: str = field(
        default="auto", metadata=rule(choices=("auto", "reference", "cpu", "cuda", "triton"))
    )
    """TBE backend: auto, reference, cpu, cuda, triton."""
    init_scale: float = field(default=0.0, metadata=rule(0, _F32_MAX))
    """Uniform init range +-init_scale; 0 = +-sqrt(1/rows) as in the reference DLRM."""
    precision: str = field(default="fp32", metadata=rule(choices=PRECISIONS))
    """Stored precision of every table whose own ``precision`` is unset."""
    rounding: str = field(default="auto", metadata=rule(choices=("auto", "nearest", "stochastic")))
    """How updated low-precision rows are rounded; ``auto`` = the measured choice per format
    (``neorec.ops.lowp_rows.DEFAULT_ROUNDING``)."""

    def __post_init__(self) -> None:
        check_fields(self, "embedding")
        if self.cowclip_bound and not self.cowclip_ratio:
            raise ConfigError(
                f"embedding.cowclip_bound {self.cowclip_bound} is set but embedding.cowclip_ratio "
                "is 0 (CowClip is off: the bound would be ignored); set cowclip_ratio > 0"
            )
        if self.eps < 1.4e-45:  # rounds to 0 in float32
            raise ConfigError(
                f"embedding.eps must not round to 0 in float32 (>= 1.4e-45), got {self.eps}"
            )
        tables = []
        for i, t in enumerate(self.tables):
            if isinstance(t, dict):
                t = TableConfig(**_table_kwargs(t, i))
            elif not isinstance(t, TableConfig):
                raise ConfigError(f"embedding.tables[{i}] must be a table, got {show(t)}")
            tables.append(t)
        self.tables = tables
        if len(self.tables) > MAX_TABLES:
            raise ConfigError(
                f"embedding.tables has {len(self.tables):,} tables, at most {MAX_TABLES:,} allowed"
            )
        if not self.tables:
            self.tables = [
                TableConfig(
                    name=f"t{i}", rows=self.rows, dim=self.dim, pooling_factor=self.pooling_factor
                )
                for i in range(self.num_tables)
            ]
        for t in self.tables:
            if t.kind == "dynamic":  # slot rows are fp32 for now
                if t.precision not in ("", "fp32"):
                    raise ConfigError(
                        f"{_table_where(t.name)}: a dynamic table's rows are fp32 for now, got "
                        f"precision {t.precision}"
                    )
                t.precision = "fp32"
            t.precision = t.precision or self.precision
            if t.precision != "fp32" and t.storage != "memory":
                raise ConfigError(
                    f"{_table_where(t.name)}: precision {t.precision} needs storage 'memory' "
                    f"(the {t.storage} row cache holds fp32 rows)"
                )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            dup = sorted(n for n, c in Counter(names).items() if c > 1)
            raise ConfigError(f"embedding table names must be unique, repeated: {dup}")
        feats = [f for t in self.tables for f in t.features]
        if len(set(feats)) != len(feats):
            dup = sorted(f for f, c in Counter(feats).items() if c > 1)
            raise ConfigError(f"a feature may read only one table; read by several: {dup}")
        total = sum(t.rows * t.dim for t in self.tables)
        if total > MAX_TOTAL_ELEMS:
            raise ConfigError(
                f"embedding: the tables hold {total:,} weights in all, at most "
                f"{MAX_TOTAL_ELEMS:,} allowed; lower embedding rows or dim"
            )
        if self.cowclip_ratio:
            self._check_cowclip()

    def _check_cowclip(self) -> None:
        """CowClip needs each row's count in the batch: only the fused update of fp32 fixed
        tables in memory on the reference and cpu backends has it."""
        if self.backend not in ("auto", "reference", "cpu"):
            raise ConfigError(
                f"embedding.cowclip_ratio needs embedding.backend 'auto', 'reference' or 'cpu', "
                f"got {self.backend!r}"
            )
        for t in self.tables:
            if t.precision != "fp32" or t.kind != "fixed" or t.storage != "memory":
                raise ConfigError(
                    f"{_table_where(t.name)}: embedding.cowclip_ratio needs fp32 fixed tables in "
                    f"memory, got precision {t.precision}, kind {t.kind}, storage {t.storage}"
                )

    @property
    def feature_names(self) -> list[str]:
        """All features in table order."""
        return [f for t in self.tables for f in t.features]


def _table_kwargs(d: dict[str, Any], i: int) -> dict[str, Any]:
    """Keyword arguments of a TableConfig from a TOML table, unknown/missing keys named."""
    known = list(TableConfig.__dataclass_fields__)
    where = f"embedding.tables[{i}]"
    for k in d:
        if k not in known:
            raise ConfigError(
                f"unknown key '{k}' in {where}{suggest(str(k), known)}; known: {known}"
            )
    for k in ("name", "rows", "dim"):
        if k not in d:
            raise ConfigError(f"{where} needs '{k}'")
    return d
