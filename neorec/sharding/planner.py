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
6. **Baselines**: the greedy baselines' plans (``planner_baselines``; whole tables onto the
   least-loaded rank by a key) are candidates too: the plan returned is never worse than theirs
   by the model that scores it.

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

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from neorec.sharding.cost_model import CACHE_MIN_BATCHES, CostModel, TableSpec, cache_rows
from neorec.sharding.learned_cost import resolve
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.planner_baselines import baseline_candidates
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
from neorec.sharding.types import CACHED_STORAGES, ShardingPlan, ShardingType

_TW, _DP = ShardingType.TABLE_WISE, ShardingType.DATA_PARALLEL
_LEARNED_TYPE_SETS = (
    (_TW,),
    (_TW, _DP),
    (_TW, ShardingType.ROW_WISE),
    (_TW, ShardingType.COLUMN_WISE),
)
"""Restricted starts ranked by a learned model next to the unrestricted ones."""
_LEARNED_EVALS = 400
"""Plan evaluations of the learned model's final moves (``Planner._learned_moves``)."""

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
        cost_model: str = "auto",
    ) -> None:
        """``allow_host``: the host tier (and the ``dram`` cached tier) may hold rows, where the
        topology has host memory. ``allow_cached_tiers``: offer the cached tiers (``dram`` with
        host memory and ``allow_host``, ``ssd`` with ``ssd_capacity_gb``) with a row cache of
        each of ``cache_fractions``. Off by default: the distributed runtime does not run cached
        tables (``neorec plan`` turns it on; ``planner.allow_cached_tiers``).
        ``cost_model``: which model ranks the candidate plans (``learned_cost.COST_MODEL_MODES``;
        ``auto`` = the topology's learned model when fitted on this machine and world size)."""
        self.topo = topology
        self.scoring = resolve(topology, cost_model)
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
        self._type_filter: set[ShardingType] = set()
        """Sharding types the options keep (where a table allows any of them); empty = all."""

    # ---- public -------------------------------------------------------------------------------
    def plan(self, tables: Sequence[TableSpec]) -> PlanResult:
        """Plan ``tables``; raises ``PlanningError`` when no placement fits in memory."""
        t0 = time.perf_counter()
        if not tables:
            raise PlanningError("no tables to plan", [])
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique: {names}")
        best: tuple[float, int, ShardingPlan] | None = None
        iters = 0
        memo = _Memo()
        learned = self.scoring.model
        cands: list[ShardingPlan] = []
        starts: list[tuple[_Start, set[ShardingType]]] = [
            (share, set()) for share in self._split_shares(tables)
        ]
        if learned is not None:
            # The search minimizes the additive analytical loads; the learned model may prefer
            # plans with fewer kinds of collectives, so it also ranks searches whose options are
            # restricted to a few sharding types (tables that allow none of them keep theirs).
            starts += [(None, set(f)) for f in _LEARNED_TYPE_SETS]
        failure: PlanningError | None = None
        for share, types in starts:
            self._type_filter = types
            s = _Search(self, list(tables), memo)  # per-option results: filter-independent
            try:
                s.initial(share)
            except PlanningError as e:
                # A start that does not fit: the others (and the baselines) still count; the
                # first unrestricted start's diagnosis is raised when nothing fits at all.
                if failure is None and not types:
                    failure = e
                continue
            finally:
                self._type_filter = set()
            # With a learned model the search (additive analytical loads) proposes plans and the
            # learned model ranks them: the start's plan before and after the local search.
            if learned is not None:
                cands.append(s.to_plan())
            iters += s.improve()
            cands.append(s.to_plan())
            if learned is None:
                obj = s.objective()[0]
                if best is None or obj < best[0] * (1 - 1e-9):
                    best = (obj, iters, cands[-1])
        # The greedy baselines' plans are candidates too, scored by the same model: the plan
        # returned is never worse than theirs by that model.
        baselines = [b for _, b in baseline_candidates(self, tables)]
        if not cands and best is None and not baselines:
            assert failure is not None
            raise failure
        searched = list(cands)
        if learned is not None:
            best, n = self._learned_pick(cands, tables, baselines)
            iters += n
        elif baselines:
            top = self.cm.evaluate(best[2], tables).max_time_s if best else math.inf
            for b in baselines:
                obj = self.cm.evaluate(b, tables).max_time_s
                if obj < top * (1 - 1e-9):
                    best, top = (obj, iters, b), obj
        assert best is not None
        plan = best[2]
        validate_plan(plan)
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
            "cost_model": self.scoring.to_dict(),
        }
        scored = None
        if learned is not None:
            scored = learned.predict_ms(self.cm, plan, tables)
            plan.meta["predicted_step_embedding_s"] = scored["step"] / 1000
            plan.meta["analytical_step_embedding_s"] = cost.max_time_s
        if plan.cached_tables():
            plan.meta["cached_tiers"] = (
                "tables with storage dram/ssd run behind a row cache (neorec.storage.cached); "
                "the distributed runtime does not run them"
            )
        return PlanResult(
            plan,
            cost,
            list(tables),
            self.topo,
            self.batch,
            dt,
            iters,
            self.scoring,
            scored,
            candidates=[*searched, *baselines],
        )

    def _learned_pick(
        self,
        cands: list[ShardingPlan],
        tables: Sequence[TableSpec],
        baselines: Sequence[ShardingPlan] = (),
    ) -> tuple[tuple[float, int, ShardingPlan], int]:
        """The candidate with the lowest learned step time, then improved by ``_learned_moves``,
        within a trust region: a searched plan is eligible only while its analytical step is
        within (1 + the learned model's held-out mean |error|) of the best analytical candidate's
        (the learned model is not trusted further from the plans the analytical model vouches
        for); the greedy ``baselines`` always are. Returns ((learned seconds, 0, plan), moves)."""
        learned = self.scoring.model
        assert learned is not None
        n_search = len(cands)
        cands = [*cands, *baselines]
        costs = [self.cm.evaluate(c, tables) for c in cands]
        tau = float(learned.validation["step"]["mean_abs_error"])
        limit = min(c.max_time_s for c in costs) * (1 + tau)
        best: tuple[float, int, ShardingPlan] | None = None
        for i, (cand, cost) in enumerate(zip(cands, costs)):
            if i < n_search and cost.max_time_s > limit * (1 + 1e-9):
                continue
            obj = learned.step_s(self.cm, cand, tables, cost)
            if best is None or obj < best[0] * (1 - 1e-9):
                best = (obj, 0, cand)
        assert best is not None
        limit = max(limit, self.cm.evaluate(best[2], tables).max_time_s)
        plan, score, moves = self._learned_moves(best[2], tables, best[0], limit)
        return (score, 0, plan), moves

    def table_moves(
        self, plan: ShardingPlan, tables: Sequence[TableSpec]
    ) -> Iterator[tuple[str, ShardingPlan]]:
        """(``move {table} -> {rank}``, the plan) for each table-wise table of ``plan`` moved onto
        another rank it may use, in table then rank order (``neorec plan --tune``'s shortlist)."""
        specs = {t.name: t for t in tables}
        for i, tp in enumerate(plan.tables):
            if tp.sharding_type is not ShardingType.TABLE_WISE:
                continue
            for r in self.candidate_ranks(specs[tp.name]):
                if r != tp.shards[0].rank:
                    yield f"move {tp.name} -> {r}", _moved(plan, i, r)

    def _learned_moves(
        self, plan: ShardingPlan, tables: Sequence[TableSpec], score: float, limit: float
    ) -> tuple[ShardingPlan, float, int]:
        """Hill-climb the learned model's step time by moving whole table-wise tables to other
        ranks (first improvement, in table then rank order; every candidate must fit memory, the
        table's pinned ranks and the analytical ``limit``), at most ``_LEARNED_EVALS``
        evaluations: (plan, its learned seconds, moves made)."""
        learned = self.scoring.model
        assert learned is not None
        specs = {t.name: t for t in tables}
        evals = moves = 0
        improved = True
        while improved and evals < _LEARNED_EVALS:
            improved = False
            for i, tp in enumerate(plan.tables):
                if tp.sharding_type is not ShardingType.TABLE_WISE:
                    continue
                cur = tp.shards[0].rank
                for r in self.candidate_ranks(specs[tp.name]):
                    if r == cur or evals >= _LEARNED_EVALS:
                        continue
                    cand = _moved(plan, i, r)
                    cost = self.cm.evaluate(cand, tables)
                    evals += 1
                    if not cost.fits or cost.max_time_s > limit * (1 + 1e-9):
                        continue
                    s = learned.step_s(self.cm, cand, tables, cost)
                    if s < score * (1 - 1e-9):
                        plan, score, improved = cand, s, True
                        moves += 1
                        break
        return plan, score, moves

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
        if self._type_filter and allowed & self._type_filter:
            allowed &= self._type_filter  # a learned model's extra start (see ``plan``)
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


def _moved(plan: ShardingPlan, i: int, rank: int) -> ShardingPlan:
    """``plan`` with its table-wise table ``i`` on ``rank`` instead (the other tables shared)."""
    tp = plan.tables[i]
    moved = dataclasses.replace(tp, shards=[dataclasses.replace(tp.shards[0], rank=rank)])
    return dataclasses.replace(plan, tables=[*plan.tables[:i], moved, *plan.tables[i + 1 :]])


def plan_tables(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    optimizer: str = "rowwise_adagrad",
    **kw: Any,
) -> PlanResult:
    """Plan ``tables`` on ``topology`` (see ``Planner``); raises ``PlanningError`` when infeasible."""
    return Planner(topology, batch_size, optimizer, **kw).plan(tables)
