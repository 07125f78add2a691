"""Sharding planner: choose each table's sharding type, storage tier and shard ranks.

Steps (all deterministic, pure Python):

1. **Enumerate** per table the options its constraints allow: data-parallel, table-wise,
   column-wise in 2, 4, 8, ... slices, table-row-wise over one host, row-wise over 2, 4, 8, ...
   or all ranks (a row shard sends partial sums for every sample: fewer cost less); each
   with ``device`` or (when the topology has host memory) ``host`` storage; with
   ``allow_cached_tiers``, table-wise and row-split options also in the cached tiers: rows in host
   DRAM (``dram``) or on SSD (``ssd``, when the topology has ``ssd_capacity_gb``) behind a row
   cache of each candidate fraction (``cache_fractions``) in device memory.
2. **Estimate** every option's shard times and memory with ``CostModel`` (a cached tier's miss
   traffic from the table's expected hit rate; computed only for options the search considers).
3. **Propose**: each table starts at its cheapest option in total time (never a cached one: they
   are never faster than the same split in device memory); when the tables do not fit in device
   memory, the tables that lose least time per device byte freed move to a slower tier (host,
   dram or ssd, whichever loses least per byte, within the host DRAM and SSD left). So the cached
   tiers are used only when the tables do not fit otherwise, or where they beat the host tier.
   Steps 3-5 run from several starts, keeping the best plan: as proposed; with the tables whose
   largest shard exceeds a share of a rank's mean load split finer; and with tables split one at
   a time while that lowers a lower bound of the objective (per phase, the larger of the mean
   rank load and the largest shard).
4. **Partition**: LPT greedy (largest first, onto the least-loaded rank that fits), escalating a
   table to finer splits / the slower tier when it does not fit anywhere. When a table still fits
   nowhere and tables live in host DRAM or on SSD, LPT runs once more ordered by each table's
   share of every tier, counting all of its bytes in DRAM / on SSD (a row split over a whole
   host needs room on each of its ranks; placed after large table-wise tables it can find that
   tier fragmented). Plans that fit at the first try are unchanged by this.
5. **Improve**: local search on the slowest rank: move a shard, swap two shards, or re-split a
   table (by columns or rows), accepted only when the slowest rank gets faster without any other
   rank getting as slow.

The objective is the slowest rank's predicted time (``CostModel``), subject to every rank's device,
host and SSD memory. Predictions are a simulation, not measurements. Every shard's cost is its own
(a column-wise slice under row-wise Adagrad pays its unfused update and collective itself; the
other shards of its rank stay fused), so a rank's load is the sum of its shards' and the search's
loads equal the evaluated plan's.

Modules: this one holds ``Planner`` (options per table, the starts) and ``plan_tables``;
``planner_parts`` the options, pieces, bound and ``PlanningError``; ``planner_search`` the search
state and initial solution; ``planner_local`` the local search; ``planner_diagnose`` the
infeasibility message; ``planner_report`` ``PlanResult`` and ``format_report`` (all public names
are importable from here). DMT tower plans: ``neorec.sharding.towers_cost``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from neorec.sharding.cost_model import CACHE_MIN_BATCHES, CostModel, TableSpec, cache_rows
from neorec.sharding.planner_local import _Search
from neorec.sharding.planner_parts import (
    _CACHED_TYPES,
    DEFAULT_CACHE_FRACTIONS,
    PlanningError,
    _Memo,
    _Option,
    _Start,
)
from neorec.sharding.planner_report import SIMULATION_NOTE, PlanResult, format_report
from neorec.sharding.topology import Topology
from neorec.sharding.types import CACHED_STORAGES, ShardingType

__all__ = [
    "PlanningError",
    "PlanResult",
    "Planner",
    "plan_tables",
    "format_report",
    "DEFAULT_CACHE_FRACTIONS",
]


class Planner:
    """Cost-model search for a ``ShardingPlan`` (see the module docstring for the steps)."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        optimizer: str = "rowwise_adagrad",
        *,
        weight_bytes: int = 4,
        allow_host: bool = True,
        allow_cached_tiers: bool = False,
        cache_fractions: Sequence[float] = DEFAULT_CACHE_FRACTIONS,
        max_cw_slices: int = 64,
        max_iters: int | None = None,
    ) -> None:
        """``allow_host``: the host tier (and the ``dram`` cached tier) may hold rows, where the
        topology has host memory. ``allow_cached_tiers``: offer the cached tiers (``dram`` with
        host memory and ``allow_host``, ``ssd`` with ``ssd_capacity_gb``) with a row cache of
        each of ``cache_fractions``. Off by default: the distributed runtime does not run cached
        tables (``neorec plan`` turns it on; ``planner.allow_cached_tiers``)."""
        self.topo = topology
        self.cm = CostModel(topology, batch_size, optimizer, weight_bytes=weight_bytes)
        self.batch = batch_size
        self.allow_host = allow_host and topology.host_capacity_bytes > 0
        self.allow_cached = allow_cached_tiers
        fr = sorted({float(f) for f in cache_fractions})
        if any(not 0.0 < f < 1.0 for f in fr) or (allow_cached_tiers and not fr):
            raise ValueError(f"cache_fractions must be in (0, 1), got {list(cache_fractions)}")
        self.cache_fractions = tuple(fr)
        self.cm.cache_fractions = self.cache_fractions
        self.cached_tiers: list[str] = []
        """Cached tiers this topology offers (``dram``, ``ssd``) when they are allowed."""
        if allow_cached_tiers:
            if self.allow_host:
                self.cached_tiers.append("dram")
            if topology.ssd_capacity_bytes > 0:
                self.cached_tiers.append("ssd")
        self.max_cw = max_cw_slices
        self.max_iters = max_iters

    # ---- public -------------------------------------------------------------------------------
    def plan(self, tables: Sequence[TableSpec]) -> PlanResult:
        """Plan ``tables``; raises ``PlanningError`` when no placement fits in memory."""
        t0 = time.perf_counter()
        if not tables:
            raise PlanningError("no tables to plan", [])
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique: {names}")
        best: tuple[float, int, _Search] | None = None
        iters = 0
        memo = _Memo()
        for share in self._split_shares(tables):
            s = _Search(self, list(tables), memo)
            s.initial(share)
            iters += s.improve()
            obj = s.objective()[0]
            if best is None or obj < best[0] * (1 - 1e-9):
                best = (obj, iters, s)
        assert best is not None
        plan = best[2].to_plan()
        plan.validate()
        cost = self.cm.evaluate(plan, tables)
        if not cost.fits:  # the search only accepts fitting placements; guard the invariant
            raise AssertionError(f"planner produced an overflowing plan: {cost.overflows()}")
        dt = time.perf_counter() - t0
        plan.meta = {
            "source": "neorec.sharding.planner",
            "note": f"simulation: {SIMULATION_NOTE}",
            "predicted_step_embedding_s": cost.max_time_s,
            "imbalance": cost.imbalance,
            "batch_size": self.batch,
        }
        if plan.cached_tables():
            plan.meta["cached_tiers"] = (
                "tables with storage dram/ssd run behind a row cache (neorec.storage.cached); "
                "the distributed runtime does not run them"
            )
        return PlanResult(plan, cost, list(tables), self.topo, self.batch, dt, iters)

    def _split_shares(self, tables: Sequence[TableSpec]) -> list[_Start]:
        """Starts to try (see ``_Search.initial``): no pre-split, then pre-splits while the
        problem is small enough."""
        size = len(tables) * self.topo.world_size
        if size > 100_000:
            return [None]
        return [None, "bound", 0.5] if size > 20_000 else [None, "bound", 0.5, 0.25]

    # ---- options ------------------------------------------------------------------------------
    def candidate_ranks(self, t: TableSpec) -> list[int]:
        """Ranks a table may use (its pin, or all)."""
        if t.ranks:
            bad = [r for r in t.ranks if not 0 <= r < self.topo.world_size]
            if bad:
                raise ValueError(
                    f"table '{t.name}': pinned ranks {bad} do not exist "
                    f"(world_size {self.topo.world_size})"
                )
            return sorted(set(t.ranks))
        return list(range(self.topo.world_size))

    def cache_choices(self, t: TableSpec) -> list[float]:
        """Cache fractions offered for ``t`` in a cached tier: its own (a forced dram / ssd
        storage with a cache fraction), else the candidates large enough to hold
        ``CACHE_MIN_BATCHES`` batches' distinct rows and smaller than the table."""
        if t.cache_fraction:
            return [t.cache_fraction]
        lo = self.cm.min_cache_fraction(t)
        return [f for f in self.cache_fractions if f >= lo and cache_rows(t.rows, f) < t.rows]

    def _storages(self, t: TableSpec) -> list[tuple[str, float]]:
        """(storage, cache fraction) pairs the table may use, fastest tier first."""
        if t.storage in CACHED_STORAGES:
            if not self.allow_cached:
                raise ValueError(
                    f"table '{t.name}': storage '{t.storage}' is a cached tier, but cached tiers "
                    "are not allowed here (allow_cached_tiers; the distributed runtime does not "
                    "run them)"
                )
            fr = self.cache_choices(t)
            if not fr:
                raise ValueError(
                    f"table '{t.name}': storage '{t.storage}' needs a row cache of at least "
                    f"{self.cm.min_cache_fraction(t):.3g} of its rows (the distinct rows of "
                    f"{CACHE_MIN_BATCHES:g} batches of {self.batch}); candidates: "
                    f"{list(self.cache_fractions)}"
                )
            return [(t.storage, f) for f in fr]
        if t.storage:
            return [(t.storage, 0.0)]
        out = [("device", 0.0)] + ([("host", 0.0)] if self.allow_host else [])
        if self.cached_tiers:
            fr = self.cache_choices(t)
            out += [(tier, f) for tier in self.cached_tiers for f in fr]
        return out

    def options(self, t: TableSpec) -> list[_Option]:
        """Every option the table's constraints allow."""
        w, k = self.topo.world_size, self.topo.ranks_per_host
        cands = self.candidate_ranks(t)
        allowed = set(t.allowed_types) if t.allowed_types else set(ShardingType)
        storages = self._storages(t)
        out: list[_Option] = []
        if (
            ShardingType.DATA_PARALLEL in allowed
            and len(cands) == w
            and ("device", 0.0) in storages
        ):
            out.append(_Option(ShardingType.DATA_PARALLEL, "device", w))
        full_hosts = [
            h
            for h in range(self.topo.num_hosts)
            if all(r in cands for r in range(h * k, (h + 1) * k))
        ]
        for sto, fr in storages:
            cached = sto in CACHED_STORAGES
            if ShardingType.TABLE_WISE in allowed:
                out.append(_Option(ShardingType.TABLE_WISE, sto, 1, fr))
            if ShardingType.COLUMN_WISE in allowed and not cached:
                n = 2
                while n <= min(len(cands), self.max_cw, t.dim) and t.dim // n >= min(4, t.dim):
                    out.append(_Option(ShardingType.COLUMN_WISE, sto, n))
                    n *= 2
            if ShardingType.TABLE_ROW_WISE in allowed and k > 1 and full_hosts:
                out.append(_Option(ShardingType.TABLE_ROW_WISE, sto, min(k, t.rows), fr))
            if ShardingType.ROW_WISE in allowed and len(cands) > 1:
                # Over all candidate ranks, or fewer: each row shard sends partial sums for
                # every sample, so fewer shards cost less and can stay off the busiest ranks.
                n = 2
                while n < min(len(cands), t.rows):
                    out.append(_Option(ShardingType.ROW_WISE, sto, n, fr))
                    n *= 2
                out.append(_Option(ShardingType.ROW_WISE, sto, min(len(cands), t.rows), fr))
        if not out:
            raise ValueError(
                f"table '{t.name}': no sharding option satisfies its constraints "
                f"(allowed types {[a.value for a in allowed]}, ranks {t.ranks or 'any'}, "
                f"storage {t.storage or 'any'}; cached storage is for "
                f"{', '.join(x.short for x in _CACHED_TYPES)} only)"
            )
        return out


def plan_tables(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    optimizer: str = "rowwise_adagrad",
    **kw: Any,
) -> PlanResult:
    """Plan ``tables`` on ``topology`` (see ``Planner``); raises ``PlanningError`` when infeasible."""
    return Planner(topology, batch_size, optimizer, **kw).plan(tables)
