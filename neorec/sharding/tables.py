"""Tables as the planner sees them: ``TableSpec``, from a config or a CSV / JSON table file."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neorec.config import TableConfig
from neorec.errors import ConfigError
from neorec.ops.id_map_size import map_bytes_per_slot
from neorec.sharding.types import CACHED_STORAGES, STORAGES, ShardingType, parse_sharding_type

__all__ = [
    "OPTIMIZERS",
    "ID_DISTRIBUTIONS",
    "CACHE_POLICIES",
    "ROW_BYTES",
    "TableSpec",
    "pool_table",
    "load_tables",
    "tables_from_config",
]

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
ID_DISTRIBUTIONS = ("", "uniform", "zipf", "locality")
"""How a table's ids are drawn, for cache hit rates: empty = unknown (locality-calibrated, the
production-like default), or as ``data.id_distribution``."""
CACHE_POLICIES = ("lru", "lfu")
_LOWP_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
"""Sharding types of fp16 / bf16 / fp8 tables (``ShardedEmbeddingBagCollection._precision``)."""
ROW_BYTES = {"fp32": (4, 0), "fp16": (2, 0), "bf16": (2, 0), "fp8": (1, 4)}
"""Stored precisions: (bytes per value, bytes per row) -- fp8 rows carry a 4-byte scale
(``neorec.ops.lowp_rows``)."""


@dataclass(kw_only=True)
class TableSpec:
    """One table as the planner sees it: shape, load, and per-table constraints."""

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    """Mean ids per sample looked up in this table (summed over the features reading it)."""
    optimizer: str = ""
    """Fused optimizer of this table; empty = the planner's default."""
    allowed_types: tuple[ShardingType, ...] = ()
    """Sharding types the planner may use; empty = any."""
    ranks: tuple[int, ...] = ()
    """Pin: the table's shards may only go on these ranks; empty = any."""
    storage: str = ""
    """Force a storage tier (``device``, ``host``, or the cached ``dram`` / ``ssd``); empty = the
    planner chooses."""
    zipf_alpha: float = 0.0
    """Access skew: ids drawn with P(k-th most popular row) ~ k^-zipf_alpha; 0 = uniform. Skew
    lowers the distinct rows a batch touches (rows gathered and updated), not the id count."""
    cache_fraction: float = 0.0
    """Cache size of a forced ``dram`` / ``ssd`` storage as a share of rows; 0 = the planner
    chooses among its candidate fractions."""
    cache_policy: str = "lru"
    """Row cache eviction policy (``lru`` or ``lfu``) assumed for the cached tiers' hit rates."""
    id_distribution: str = ""
    """Id distribution for cache hit rates when ``zipf_alpha`` is 0: ``uniform``, ``locality``, or
    empty = unknown (taken as the locality-calibrated, production-like distribution)."""
    precision: str = ""
    """Stored precision of the rows (``fp32``, ``fp16``, ``bf16``, ``fp8`` with a 4-byte scale per
    row); empty = the cost model's ``weight_bytes`` per value."""
    map_bytes_per_row: float = 0.0
    """Memory per row besides the row and its optimizer state: a dynamic table's id map
    (``neorec.ops.id_map_size.map_bytes_per_slot``; its ``rows`` are its slots)."""

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0 or self.pooling_factor < 0 or self.zipf_alpha < 0:
            raise ValueError(
                f"table '{self.name}': rows, dim must be > 0 and pooling_factor, zipf_alpha >= 0, "
                f"got rows={self.rows}, dim={self.dim}, pooling_factor={self.pooling_factor}, "
                f"zipf_alpha={self.zipf_alpha}"
            )
        if self.optimizer and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table '{self.name}': optimizer must be one of {OPTIMIZERS}")
        if self.precision and self.precision not in ROW_BYTES:
            raise ValueError(f"table '{self.name}': precision must be one of {sorted(ROW_BYTES)}")
        if self.storage and self.storage not in STORAGES:
            raise ValueError(f"table '{self.name}': storage must be one of {STORAGES}")
        if not 0.0 <= self.cache_fraction <= 1.0 or (
            self.cache_fraction and self.storage not in CACHED_STORAGES
        ):
            raise ValueError(
                f"table '{self.name}': cache_fraction must be in [0, 1] and is only for storage "
                f"dram or ssd, got {self.cache_fraction} with storage '{self.storage}'"
            )
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"table '{self.name}': cache_policy must be one of {CACHE_POLICIES}")
        if self.id_distribution not in ID_DISTRIBUTIONS:
            raise ValueError(
                f"table '{self.name}': id_distribution must be one of {ID_DISTRIBUTIONS[1:]} "
                f"or empty, got '{self.id_distribution}'"
            )
        self.allowed_types = tuple(
            t if isinstance(t, ShardingType) else parse_sharding_type(str(t))
            for t in self.allowed_types
        )
        self.ranks = tuple(int(r) for r in self.ranks)

    @property
    def params(self) -> int:
        """Number of parameters (rows x dim)."""
        return self.rows * self.dim

    @property
    def hit_alpha(self) -> float | None:
        """Zipf exponent for cache hit rates: ``zipf_alpha`` when set, 0 for uniform ids, None for
        the locality-calibrated distribution (``locality`` or unknown)."""
        if self.zipf_alpha > 0:
            return self.zipf_alpha
        return 0.0 if self.id_distribution in ("uniform", "zipf") else None

    @classmethod
    def from_config(cls, t: TableConfig, **kw: Any) -> TableSpec:
        """From a ``neorec.config.TableConfig`` (pooling summed over the features reading it)."""
        pooling = t.pooling_factor * max(1, len(t.features))
        prec = getattr(t, "precision", "")
        if prec and prec != "fp32" and "precision" not in kw:
            kw["precision"] = prec  # fp32 tables keep the cost model's weight_bytes
        rows = t.rows
        if getattr(t, "kind", "fixed") == "dynamic":  # capacity slots (+ a default row) + map
            cap = int(t.capacity or t.rows)
            rows = cap + int(t.unadmitted == "default_row")
            per = map_bytes_per_slot(cap, t.admission, t.eviction)
            kw.setdefault("map_bytes_per_row", per * cap / rows)
        return cls(name=t.name, rows=rows, dim=t.dim, pooling_factor=pooling, **kw)


def tables_from_config(
    tables: Iterable[TableConfig],
    types: dict[str, str] | None = None,
    default_type: str = "",
    zipf_alpha: float = 0.0,
    id_distribution: str = "",
) -> list[TableSpec]:
    """Planner tables from config tables; ``sharding.types`` / ``default_type`` become constraints,
    ``zipf_alpha`` the access skew of every table (0 = uniform ids), ``id_distribution`` what
    cache hit rates assume (empty = unknown). A table's own ``storage`` (memory / dram / ssd of
    single-process training) is not a planner constraint here (see ``neorec plan``)."""
    out = []
    for t in tables:
        if getattr(t, "kind", "fixed") == "dynamic":
            # always row-wise by the hash of the raw id over every rank (the runtime's only way)
            named = (types or {}).get(t.name, "")
            if named and parse_sharding_type(named) != ShardingType.ROW_WISE:
                raise ConfigError(
                    f"sharding.types.{t.name} = {named!r}: table {t.name!r} is dynamic; dynamic "
                    "tables are sharded row-wise by the hash of the raw id over every rank (set "
                    "row_wise or drop the entry)"
                )
            out.append(
                TableSpec.from_config(
                    t,
                    allowed_types=(ShardingType.ROW_WISE,),
                    zipf_alpha=zipf_alpha,
                    id_distribution=id_distribution,
                )
            )
            continue
        st = (types or {}).get(t.name, default_type)
        allowed: tuple[ShardingType, ...] = (parse_sharding_type(st),) if st else ()
        if not allowed and getattr(t, "precision", "fp32") not in ("", "fp32"):
            allowed = _LOWP_TYPES  # low-precision rows: shards the fused kernel updates
        out.append(
            TableSpec.from_config(
                t, allowed_types=allowed, zipf_alpha=zipf_alpha, id_distribution=id_distribution
            )
        )
    return out


def _split_list(text: str) -> list[str]:
    return [x for x in text.replace(";", " ").replace("|", " ").split() if x]


def _spec_from_record(d: dict[str, Any], where: str) -> TableSpec:
    try:
        allowed: Any = d.get("allowed_types") or ()
        ranks: Any = d.get("ranks") or ()
        return TableSpec(
            name=str(d["name"]),
            rows=int(float(d["rows"])),
            dim=int(d["dim"]),
            pooling_factor=float(d.get("pooling_factor") or 1.0),
            optimizer=str(d.get("optimizer") or ""),
            allowed_types=tuple(
                parse_sharding_type(str(a))
                for a in (_split_list(allowed) if isinstance(allowed, str) else allowed)
            ),
            ranks=tuple(int(r) for r in (_split_list(ranks) if isinstance(ranks, str) else ranks)),
            storage=str(d.get("storage") or ""),
            zipf_alpha=float(d.get("zipf_alpha") or 0.0),
            cache_fraction=float(d.get("cache_fraction") or 0.0),
            cache_policy=str(d.get("cache_policy") or "lru"),
            id_distribution=str(d.get("id_distribution") or ""),
            precision=str(d.get("precision") or ""),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: bad table record {d}: {e}") from None


def load_tables(path: str | Path) -> list[TableSpec]:
    """Tables from CSV (header ``name,rows,dim,pooling_factor`` and optionally ``optimizer``,
    ``allowed_types``, ``ranks``, ``storage``, ``zipf_alpha``, ``cache_fraction``,
    ``cache_policy``, ``id_distribution``; lists separated by ``;``) or JSON (a list of objects,
    or ``{"tables": [...]}``)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"table file not found: {p}")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"table file {p}: not valid JSON: {e}") from None
        records = data.get("tables") if isinstance(data, dict) else data
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(
                f'table file {p}: expected a list of table objects or {{"tables": [...]}}, got '
                f"{type(data).__name__}"
                + (f" with keys {sorted(data)[:8]}" if isinstance(data, dict) else "")
            )
        return [_spec_from_record(r, f"{p}[{i}]") for i, r in enumerate(records)]
    with p.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("name") and not r["name"].startswith("#")]
    return [_spec_from_record(r, f"{p}:{i + 2}") for i, r in enumerate(rows)]


POOL_DIMS = (4, 8, 16, 32, 64, 128, 256)
POOL_DIM_WEIGHTS = (0.05, 0.10, 0.20, 0.25, 0.20, 0.12, 0.08)


def pool_table(rng: Any, name: str) -> TableSpec:
    """One table with production-like spread (``bench planner``'s pool, calibration's ``pool``
    blocks), from ``rng`` (``random.Random``): rows 1e3..1e8 log-uniform, a dim from
    ``POOL_DIMS``, and a heavy-tailed pooling factor (most features look up a few ids, a few
    hundreds: log-normal around 3, at most 400)."""
    rows = int(10 ** rng.uniform(3, 8))
    dim = rng.choices(POOL_DIMS, POOL_DIM_WEIGHTS)[0]
    pooling = min(400.0, max(1.0, math.exp(rng.gauss(math.log(3.0), 1.4))))
    return TableSpec(name=name, rows=rows, dim=dim, pooling_factor=round(pooling, 2))
