"""The planner's small parts: options, pieces, the search's lower bound and memo, its error.

Split out of ``neorec.sharding.planner`` (public names are re-exported there).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from neorec.errors import NeorecError
from neorec.sharding.cost_types import ShardCost
from neorec.sharding.types import CACHED_STORAGES, ShardingType

__all__ = ["PlanningError", "DEFAULT_CACHE_FRACTIONS"]

_EPS = 1e-12
DEFAULT_CACHE_FRACTIONS = (0.01, 0.05, 0.10, 0.25)
"""Row cache sizes (share of a shard's rows) the planner tries for the cached tiers."""
_Start = float | Literal["bound"] | None
"""How ``_Search.initial`` pre-splits: not at all, by a share of the mean load, or by a bound."""
_CACHED_TYPES = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
"""Sharding types offered with a cached tier (whole rows per shard, one cache per shard)."""


class PlanningError(NeorecError, ValueError):
    """No plan fits in memory; the message lists which tables do not fit where and the fixes."""

    def __init__(self, message: str, tables: list[str]) -> None:
        super().__init__(message)
        self.tables = tables


@dataclass(frozen=True)
class _Option:
    """One way to shard a table: type, storage tier, number of shards and (cached tiers) the
    row cache fraction."""

    stype: ShardingType
    storage: str
    n: int
    frac: float = 0.0

    @property
    def cached(self) -> bool:
        return self.storage in CACHED_STORAGES

    def label(self) -> str:
        extra = f"x{self.n}" if self.stype not in (ShardingType.TABLE_WISE,) else ""
        sto = f"{self.storage}@{self.frac * 100:g}%" if self.cached else self.storage
        return f"{self.stype.short}{extra}/{sto}"


class _Piece:
    """One shard being placed: geometry, predicted cost and current rank (-1 = unplaced)."""

    __slots__ = ("table", "rows", "cols", "ph", "tot", "dev", "host", "ssd", "rank")

    def __init__(self, table: int, rows: tuple[int, int], cols: tuple[int, int], c: ShardCost):
        self.table = table
        self.rows = rows
        self.cols = cols
        self.ph = c.phases
        self.tot = c.time_s
        self.dev = c.device_bytes
        self.host = c.host_bytes
        self.ssd = c.ssd_bytes
        self.rank = -1


_MOVABLE = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)
"""Types whose shards local search moves between ranks (never onto a rank that holds another shard
of the same table); table-row-wise shards stay put on their host, data-parallel ones everywhere."""
_NPH = 4  # phases: fwd comm, fwd compute, bwd comm, bwd compute (cost_types.PHASES)
_Geo = list[tuple[tuple[int, int], tuple[int, int], ShardCost]]


class _Bound:
    """A lower bound of the objective for per-table options: per phase, the largest of the mean
    rank load and the largest shard (no placement does better than either), plus the sample side.
    Holds, per table at its current option, the phase peaks (largest shard) and loads (summed
    over shards, then the sample side); ``_Search._bound_split`` splits tables while that lowers
    it."""

    def __init__(self, w: int, peaks: list[tuple[float, ...]], loads: list[tuple[float, ...]]):
        self.w = w
        self.peaks = peaks
        self.loads = loads
        self.total = [sum(ld[p] for ld in loads) for p in range(_NPH + 1)]
        self.top: list[list[tuple[float, int]]] = []
        """Per phase: the two largest peaks of different tables, as (peak, table)."""
        self._rank()

    def _rank(self) -> None:
        n = len(self.peaks)
        self.top = []
        for p in range(_NPH):
            two = heapq.nlargest(2, ((self.peaks[j][p], -j) for j in range(n)))
            self.top.append([(v, -j) for v, j in two] + [(0.0, -1)])

    def setters(self) -> list[int]:
        """Tables whose shard is the largest of some phase."""
        return sorted({self.top[p][0][1] for p in range(_NPH)})

    def value(self, i: int = -1, peak: Sequence[float] = (), load: Sequence[float] = ()) -> float:
        """The bound, with table ``i`` at ``peak`` and ``load`` when given."""
        own = i >= 0
        out = self.total[_NPH] + (load[_NPH] - self.loads[i][_NPH] if own else 0.0)
        for p in range(_NPH):
            top = self.top[p]
            if not own:
                out += max(self.total[p] / self.w, top[0][0])
                continue
            other = top[0][0] if top[0][1] != i else top[1][0]
            out += max((self.total[p] - self.loads[i][p] + load[p]) / self.w, other, peak[p])
        return out

    def with_table(self, i: int, peak: tuple[float, ...], load: tuple[float, ...]) -> _Bound:
        """A copy with table ``i`` at ``peak`` and ``load``."""
        peaks, loads = list(self.peaks), list(self.loads)
        peaks[i], loads[i] = peak, load
        return _Bound(self.w, peaks, loads)


@dataclass
class _Memo:
    """Per-option results (by table index and option) shared by the starts of one plan."""

    geo: dict[tuple[int, _Option], _Geo] = field(default_factory=dict)
    total: dict[tuple[int, _Option], float] = field(default_factory=dict)
    fits: dict[tuple[int, _Option], bool] = field(default_factory=dict)
    peaks: dict[tuple[int, _Option], tuple[float, ...]] = field(default_factory=dict)
    loads: dict[tuple[int, _Option], tuple[float, ...]] = field(default_factory=dict)
