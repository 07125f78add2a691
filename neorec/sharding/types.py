"""The sharding plan as data: which rank holds which rows and columns of each table.

A ``ShardingPlan`` is produced by the planner, consumed by the distributed runtime and can be
written by hand. It round-trips through JSON and prints as a table.

Conventions (the runtime relies on them):
- Shard ranges are half-open ``[start, end)`` in global row and column coordinates.
- No shard is empty. Row-wise and table-row-wise splits are balanced: shard sizes differ by at
  most one row, larger shards first. A table with fewer rows than ranks gets fewer shards (one row
  each, on the first ``rows`` ranks of the group) rather than empty ones.
- Column-wise slices are balanced the same way over columns and assigned round-robin to the given
  ranks; every slice holds all rows.
- Data-parallel: one full replica on every rank ``0..world_size-1``.
- ``storage`` says where a table's rows live: ``device`` (HBM / the rank's memory), ``host``
  (host DRAM read by the device, UVM-like; slower), or a cached tier: ``dram`` (host DRAM) or
  ``ssd`` behind a row cache of ``cache_fraction`` of each shard's rows in the rank's device
  memory (MTrainS; ``neorec.storage.cached``). ``cache_fraction`` is in (0, 1] for the cached
  tiers and 0 otherwise; plans without cached tables read and write exactly as before. The
  distributed runtime executes ``device`` and ``host`` only (``RUNTIME_STORAGES``); see
  ``plan_checks.check_storage``.

The plan is data: reading JSON strictly is ``plan_json``'s (``parse_plan_dict``, ``load_plan``),
validation ``plan_checks``' (``validate_plan``: the shards tile each table as its type requires;
``check_model``, ``check_storage``), both built on this module; ``fixed_plan.plan_by_type`` builds
a whole validated plan with a fixed type per table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from neorec.errors import NeorecError

__all__ = [
    "ShardingType",
    "Shard",
    "TablePlan",
    "ShardingPlan",
    "PlanValidationError",
    "TableLike",
    "STORAGES",
    "CACHED_STORAGES",
    "RUNTIME_STORAGES",
    "PLAN_FORMAT_VERSION",
    "split_evenly",
    "data_parallel",
    "DENSE_DP_MAX_ELEMS",
    "dense_dp",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "parse_sharding_type",
]

PLAN_FORMAT_VERSION = 1
STORAGES = ("device", "host", "dram", "ssd")
CACHED_STORAGES = ("dram", "ssd")
"""Tiers whose rows live in a slower store behind a row cache in device memory."""
RUNTIME_STORAGES = ("device", "host")
"""Tiers the distributed runtime (``neorec.distributed``) executes."""


class ShardingType(str, Enum):
    """How one table is split across ranks."""

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"

    @property
    def short(self) -> str:
        """Abbreviation used in printed tables (DP, TW, RW, CW, TWRW)."""
        return _SHORT[self]


_SHORT = {
    ShardingType.DATA_PARALLEL: "DP",
    ShardingType.TABLE_WISE: "TW",
    ShardingType.ROW_WISE: "RW",
    ShardingType.COLUMN_WISE: "CW",
    ShardingType.TABLE_ROW_WISE: "TWRW",
}


class PlanValidationError(NeorecError, ValueError):
    """A plan is malformed or inconsistent; ``problems`` lists each issue naming the table, shard
    and field, ``source`` the file. The message is one line (the first few problems)."""

    SHOWN = 4
    """Problems spelled out in the message (all are in ``problems``)."""

    def __init__(self, problems: list[str], source: str | Path = "") -> None:
        self.problems = list(problems)
        self.source = str(source)
        where = f" {self.source}" if self.source else ""
        shown = "; ".join(" ".join(p.split()) for p in self.problems[: self.SHOWN])
        more = len(self.problems) - self.SHOWN
        tail = f"; ... and {more} more problem(s)" if more > 0 else ""
        super().__init__(f"invalid sharding plan{where}: {shown}{tail}")


class TableLike(Protocol):
    """Anything with a table's name, rows and dim (e.g. ``neorec.config.TableConfig``)."""

    @property
    def name(self) -> str: ...
    @property
    def rows(self) -> int: ...
    @property
    def dim(self) -> int: ...


@dataclass(frozen=True)
class Shard:
    """A block of one table on one rank: rows ``[row_start, row_end)``, cols ``[col_start, col_end)``."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        """Number of rows in the shard."""
        return self.row_end - self.row_start

    @property
    def cols(self) -> int:
        """Number of columns in the shard."""
        return self.col_end - self.col_start

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"rank": r, "rows": [start, end], "cols": [start, end]}``."""
        return {
            "rank": self.rank,
            "rows": [self.row_start, self.row_end],
            "cols": [self.col_start, self.col_end],
        }

    def __str__(self) -> str:
        return f"r{self.rank}[{self.row_start}:{self.row_end},{self.col_start}:{self.col_end}]"


@dataclass
class TablePlan:
    """How one table is sharded: its type, its shards and where its rows are stored."""

    name: str
    rows: int
    dim: int
    sharding_type: ShardingType
    shards: list[Shard]
    storage: str = "device"
    cache_fraction: float = 0.0
    """Row cache size as a share of each shard's rows (``dram`` / ``ssd`` storage only)."""

    @property
    def cached(self) -> bool:
        """Whether the rows live in a cached tier (``dram`` or ``ssd`` behind a row cache)."""
        return self.storage in CACHED_STORAGES

    @property
    def storage_label(self) -> str:
        """Storage for printing: ``device``, ``host``, or e.g. ``ssd@5%`` with the cache fraction."""
        if not self.cached:
            return self.storage
        return f"{self.storage}@{self.cache_fraction * 100:g}%"

    def ranks(self) -> list[int]:
        """Ranks holding a shard of this table, in shard order (no duplicates)."""
        return list(dict.fromkeys(s.rank for s in self.shards))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``cache_fraction`` only where it is set: plans without it stay as before)."""
        out: dict[str, Any] = {
            "name": self.name,
            "rows": self.rows,
            "dim": self.dim,
            "type": self.sharding_type.value,
            "storage": self.storage,
        }
        if self.cached or self.cache_fraction:
            out["cache_fraction"] = self.cache_fraction
        out["shards"] = [s.to_dict() for s in self.shards]
        return out


def parse_sharding_type(text: str) -> ShardingType:
    """``ShardingType`` from its value (``row_wise``) or abbreviation (``RW``), case-insensitive."""
    t = text.strip().lower()
    for st in ShardingType:
        if t in (st.value, st.short.lower()):
            return st
    known = ", ".join(f"{s.value} ({s.short})" for s in ShardingType)
    raise ValueError(f"unknown sharding type '{text}'; known: {known}")


@dataclass
class ShardingPlan:
    """Placement of every table on ``world_size`` ranks, ``ranks_per_host`` per host."""

    world_size: int
    ranks_per_host: int
    tables: list[TablePlan] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (planner version, predicted cost); not used by the runtime."""
    source: str = field(default="", compare=False, repr=False)
    """The file the plan was read from (named in its errors); not part of the plan."""

    # ---- access -------------------------------------------------------------------------------
    def table(self, name: str) -> TablePlan:
        """The plan of table ``name`` (KeyError naming the known tables otherwise)."""
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table '{name}' not in plan; tables: {[t.name for t in self.tables]}")

    def shards_on_rank(self, rank: int) -> list[tuple[TablePlan, Shard]]:
        """All (table plan, shard) pairs held by ``rank``, in table order then shard order."""
        return [(t, s) for t in self.tables for s in t.shards if s.rank == rank]

    def host_of(self, rank: int) -> int:
        """Host index of ``rank``."""
        return rank // self.ranks_per_host

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict with a format version."""
        return {
            "format_version": PLAN_FORMAT_VERSION,
            "world_size": self.world_size,
            "ranks_per_host": self.ranks_per_host,
            "tables": [t.to_dict() for t in self.tables],
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text (stable key order)."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        Path(path).write_text(self.to_json() + "\n")

    # ---- printing -----------------------------------------------------------------------------
    def format_table(self, max_shards: int = 8) -> str:
        """Readable table: one line per table with its type, storage and shards."""
        hdr = f"{'table':<24} {'type':<5} {'rows':>13} {'dim':>5} {'storage':<7} shards"
        wide = max((len(t.storage_label) for t in self.tables), default=0) > 7
        if wide:
            hdr = f"{'table':<24} {'type':<5} {'rows':>13} {'dim':>5} {'storage':<10} shards"
        lines = [
            f"ShardingPlan: world_size={self.world_size}, ranks_per_host={self.ranks_per_host}, "
            f"{len(self.tables)} tables",
            hdr,
            "-" * len(hdr),
        ]
        for t in self.tables:
            shards = [str(s) for s in t.shards[:max_shards]]
            if len(t.shards) > max_shards:
                shards.append(f"... (+{len(t.shards) - max_shards} more)")
            sto = f"{t.storage_label:<10}" if wide else f"{t.storage_label:<7}"
            lines.append(
                f"{t.name:<24} {t.sharding_type.short:<5} {t.rows:>13,} {t.dim:>5} "
                f"{sto} {' '.join(shards)}"
            )
        return "\n".join(lines)

    # ---- tiers --------------------------------------------------------------------------------
    def cached_tables(self) -> list[TablePlan]:
        """Tables placed in a cached tier (``dram`` / ``ssd`` behind a row cache)."""
        return [t for t in self.tables if t.cached]


# ---- constructors ---------------------------------------------------------------------------
def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``min(parts, total)`` non-empty ranges tiling ``[0, total)``; sizes differ by <= 1."""
    if total <= 0 or parts <= 0:
        raise ValueError(f"split_evenly needs total > 0 and parts > 0, got {total}, {parts}")
    n = min(parts, total)
    base, extra = divmod(total, n)
    out, pos = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((pos, pos + size))
        pos += size
    return out


DENSE_DP_MAX_ELEMS = 1 << 18
"""A data-parallel table of at most this many elements (rows x dim, 1 MiB of float32) has its
gradient summed over ranks as a dense block (``neorec.distributed.replicas``: one all-gather for
every such table of a step, no row counts exchanged first); larger ones exchange their touched
rows. The cost model prices the two the same way the runtime picks them."""


def dense_dp(rows: int, dim: int, max_elems: int = DENSE_DP_MAX_ELEMS) -> bool:
    """Whether a data-parallel table of ``rows`` x ``dim`` is summed over ranks as a dense block
    rather than as (id, row) pairs: the one rule the runtime and the cost model both follow."""
    return rows * dim <= max_elems


def data_parallel(table: TableLike, world_size: int, storage: str = "device") -> TablePlan:
    """A full replica of ``table`` on every rank."""
    shards = [Shard(r, 0, table.rows, 0, table.dim) for r in range(world_size)]
    return TablePlan(table.name, table.rows, table.dim, ShardingType.DATA_PARALLEL, shards, storage)


def table_wise(table: TableLike, rank: int, storage: str = "device") -> TablePlan:
    """The whole ``table`` on ``rank``."""
    shard = Shard(rank, 0, table.rows, 0, table.dim)
    return TablePlan(table.name, table.rows, table.dim, ShardingType.TABLE_WISE, [shard], storage)


def _row_shards(table: TableLike, ranks: Sequence[int]) -> list[Shard]:
    if not ranks:
        raise ValueError(f"table '{table.name}': row split needs at least one rank")
    ranges = split_evenly(table.rows, len(ranks))
    return [Shard(r, a, b, 0, table.dim) for r, (a, b) in zip(ranks, ranges)]


def row_wise(table: TableLike, ranks: Sequence[int], storage: str = "device") -> TablePlan:
    """Balanced row ranges of ``table`` on ``ranks`` (fewer shards if rows < len(ranks))."""
    shards = _row_shards(table, ranks)
    return TablePlan(table.name, table.rows, table.dim, ShardingType.ROW_WISE, shards, storage)


def column_wise(
    table: TableLike, ranks: Sequence[int], n_slices: int | None = None, storage: str = "device"
) -> TablePlan:
    """``n_slices`` balanced column slices (default: one per rank) assigned round-robin to ranks."""
    if not ranks:
        raise ValueError(f"table '{table.name}': column split needs at least one rank")
    n = len(ranks) if n_slices is None else n_slices
    if not 1 <= n <= table.dim:
        raise ValueError(f"table '{table.name}': n_slices must be in 1..dim={table.dim}, got {n}")
    cols = split_evenly(table.dim, n)
    shards = [Shard(ranks[i % len(ranks)], 0, table.rows, a, b) for i, (a, b) in enumerate(cols)]
    return TablePlan(table.name, table.rows, table.dim, ShardingType.COLUMN_WISE, shards, storage)


def table_row_wise(
    table: TableLike, host: int, ranks_per_host: int, storage: str = "device"
) -> TablePlan:
    """Balanced row ranges of ``table`` over the ranks of ``host``."""
    ranks = list(range(host * ranks_per_host, (host + 1) * ranks_per_host))
    shards = _row_shards(table, ranks)
    return TablePlan(
        table.name, table.rows, table.dim, ShardingType.TABLE_ROW_WISE, shards, storage
    )
