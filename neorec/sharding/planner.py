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
   table to finer splits / the slower tier when it does not fit anywhere.
5. **Improve**: local search on the slowest rank: move a shard, swap two shards, or re-split a
   table (by columns or rows), accepted only when the slowest rank gets faster without any other
   rank getting as slow.

The objective is the slowest rank's predicted time (``CostModel``), subject to every rank's device,
host and SSD memory. Predictions are a simulation, not measurements. Every shard's cost is its own
(a column-wise slice under row-wise Adagrad pays its unfused update and collective itself; the
other shards of its rank stay fused), so a rank's load is the sum of its shards' and the search's
loads equal the evaluated plan's.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from neorec.errors import NeorecError
from neorec.sharding.cost_model import (
    CACHE_MIN_BATCHES,
    PHASES,
    CostModel,
    PlanCost,
    ShardCost,
    TableSpec,
    cache_hit_rates,
    cache_rows,
)
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import (
    CACHED_STORAGES,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    split_evenly,
)

__all__ = [
    "PlanningError",
    "PlanResult",
    "Planner",
    "plan_tables",
    "format_report",
    "DEFAULT_CACHE_FRACTIONS",
]

SIMULATION_NOTE = (
    "predicted by neorec's cost model (a simulation from Topology constants, not a measurement)"
)
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


@dataclass
class PlanResult:
    """A plan, its predicted cost and how it was found."""

    plan: ShardingPlan
    cost: PlanCost
    tables: list[TableSpec]
    topology: Topology
    batch_size: int
    planning_s: float
    iterations: int

    def critical_ranks(self) -> list[tuple[str, int, float]]:
        """(phase, slowest rank, seconds) for each phase of the step."""
        out = []
        for p, name in enumerate(PHASES):
            r = max(self.cost.ranks, key=lambda r: (r.phases[p], -r.rank))
            out.append((name, r.rank, r.phases[p]))
        return out

    def critical_path(self, top: int = 5) -> list[tuple[str, str, float]]:
        """(table, shard, seconds) of the largest shards on the ranks that set a phase's time."""
        ranks = list(dict.fromkeys(r for _, r, _ in self.critical_ranks()))
        items = [x for r in ranks for x in self.cost.ranks[r].shards]
        items.sort(key=lambda x: (-x[2], x[0]))
        return [(name, str(shard), t) for name, shard, t in items[:top]]

    def tiers(self) -> dict[str, dict[str, float]]:
        """Memory per tier: GB used over all ranks, their capacity, and the fullest rank's GB."""
        c = self.cost
        w = len(c.ranks)
        out = {}
        for tier, cap, used in (
            ("device", c.device_capacity_bytes, [r.device_bytes for r in c.ranks]),
            ("host", c.host_capacity_bytes, [r.host_bytes for r in c.ranks]),
            ("ssd", c.ssd_capacity_bytes, [r.ssd_bytes for r in c.ranks]),
        ):
            out[tier] = {
                "used_gb": sum(used) / GB,
                "capacity_gb": cap * w / GB,
                "max_rank_gb": max(used) / GB,
                "rank_capacity_gb": cap / GB,
            }
        return out

    def cached_tables(self) -> list[dict[str, Any]]:
        """Tables in a cached tier: storage, cache fraction and expected hit rate (simulation)."""
        specs = {t.name: t for t in self.tables}
        out = []
        for tp in self.plan.cached_tables():
            spec = specs[tp.name]
            out.append(
                {
                    "table": tp.name,
                    "type": tp.sharding_type.value,
                    "storage": tp.storage,
                    "cache_fraction": tp.cache_fraction,
                    "cache_rows": sum(cache_rows(s.rows, tp.cache_fraction) for s in tp.shards),
                    "expected_hit_rate": cache_hit_rates(spec, [tp.cache_fraction])[0],
                    "skew": _skew_label(spec),
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (per-rank time, memory, tables; imbalance; critical path; plan)."""
        c = self.cost
        types: dict[str, int] = {}
        for t in self.plan.tables:
            key = f"{t.sharding_type.value}/{t.storage}"
            types[key] = types.get(key, 0) + 1
        return {
            "note": f"simulation: times and memory are {SIMULATION_NOTE}",
            "world_size": self.plan.world_size,
            "ranks_per_host": self.plan.ranks_per_host,
            "batch_size": self.batch_size,
            "num_tables": len(self.tables),
            "params": sum(t.params for t in self.tables),
            "predicted_step_embedding_s": c.max_time_s,
            "mean_rank_s": c.mean_time_s,
            "max_rank_s": c.max_rank_s,
            "imbalance": c.imbalance,
            "sample_side_s": c.sample_side_s,
            "phases": [{"phase": n, "rank": r, "seconds": t} for n, r, t in self.critical_ranks()],
            "device_capacity_gb": c.device_capacity_bytes / GB,
            "host_capacity_gb": c.host_capacity_bytes / GB,
            "ssd_capacity_gb": c.ssd_capacity_bytes / GB,
            "tiers": self.tiers(),
            "cached_tables": self.cached_tables(),
            "types": types,
            "planning_s": self.planning_s,
            "iterations": self.iterations,
            "critical_path": [
                {"table": n, "shard": s, "seconds": t} for n, s, t in self.critical_path()
            ],
            "ranks": [
                {
                    "rank": r.rank,
                    "time_s": c.rank_time(r.rank),
                    "compute_s": r.compute_s,
                    "comm_s": r.comm_s,
                    "device_gb": r.device_bytes / GB,
                    "host_gb": r.host_bytes / GB,
                    "ssd_gb": r.ssd_bytes / GB,
                    "tables": sorted({name for name, _, _ in r.shards}),
                }
                for r in c.ranks
            ],
            "topology": self.topology.to_dict(),
        }


def _skew_label(t: TableSpec) -> str:
    a = t.hit_alpha
    if a is None:
        return "locality" if t.id_distribution else "locality-calibrated as skew is unknown"
    return "uniform" if a == 0 else f"zipf {a:g}"


def format_report(result: PlanResult, max_ranks: int = 32) -> str:
    """Readable report: per-rank time, memory per tier and tables, imbalance and critical path."""
    c, p = result.cost, result.plan
    params = sum(t.params for t in result.tables)
    tiers = result.tiers()
    dev, host, ssd = (tiers[k]["used_gb"] for k in ("device", "host", "ssd"))
    ssd_on = c.ssd_capacity_bytes > 0 or ssd > 0
    ssd_cap = f", ssd {c.ssd_capacity_bytes / GB:.1f} GB/rank" if ssd_on else ""
    lines = [
        f"SIMULATION: all times and memory below are {SIMULATION_NOTE}.",
        f"topology: {result.topology.name or 'custom'}; {p.world_size} ranks, "
        f"{p.ranks_per_host} per host; device {c.device_capacity_bytes / GB:.1f} GB/rank for "
        f"tables, host {c.host_capacity_bytes / GB:.1f} GB/rank{ssd_cap}",
        f"tables: {len(result.tables)}, params: {params:,} ({params / 1e12:.3f} T), "
        f"batch {result.batch_size}; memory used: device {dev:,.1f} GB, host {host:,.1f} GB"
        + (f", ssd {ssd:,.1f} GB" if ssd_on else ""),
        "memory per tier (used / capacity over all ranks; fullest rank / its capacity): "
        + "; ".join(
            f"{name} {tiers[k]['used_gb']:,.1f} / {tiers[k]['capacity_gb']:,.1f} GB "
            f"({tiers[k]['max_rank_gb']:.2f} / {tiers[k]['rank_capacity_gb']:.2f} GB)"
            for k, name in (("device", "device"), ("host", "host DRAM"), ("ssd", "SSD"))
            if k != "ssd" or ssd_on
        ),
    ]
    cached = result.cached_tables()
    if cached:
        by = {k: [x for x in cached if x["storage"] == k] for k in CACHED_STORAGES}
        hits = [x["expected_hit_rate"] for x in cached]
        fr = sorted({x["cache_fraction"] for x in cached})
        skews: dict[str, int] = {}
        for x in cached:
            skews[x["skew"]] = skews.get(x["skew"], 0) + 1
        lines.append(
            f"cached tiers: {len(cached)} table(s) behind a row cache in device memory ("
            + ", ".join(f"{len(v)} in {k}" for k, v in by.items() if v)
            + f"); cache fractions {', '.join(f'{f * 100:g}%' for f in fr)}; expected hit rates "
            f"{min(hits):.3f}..{max(hits):.3f} from the tables' skew ("
            + ", ".join(f"{n} {k}" for k, n in sorted(skews.items()))
            + "; simulation, not measured)"
        )
    lines += [
        f"predicted embedding time per step: {c.max_time_s * 1e3:.3f} ms (sum over phases of the "
        f"slowest rank), mean rank {c.mean_time_s * 1e3:.3f} ms, imbalance (step/mean) "
        f"{c.imbalance:.3f}, sample-side {c.sample_side_s * 1e3:.3f} ms",
        "phases: "
        + ", ".join(f"{n} {t * 1e3:.3f} ms (rank {r})" for n, r, t in result.critical_ranks()),
        f"planned in {result.planning_s:.2f} s ({result.iterations} local-search steps)",
        "",
        f"{'rank':>5} {'time ms':>9} {'compute':>9} {'comm':>9} {'dev GB':>8} {'host GB':>8} "
        + (f"{'ssd GB':>8} " if ssd_on else "")
        + f"{'shards':>6}  tables",
    ]
    order = sorted(c.ranks, key=lambda r: (-c.rank_time(r.rank), r.rank))
    shown = order if len(order) <= max_ranks else order[: max_ranks // 2] + order[-max_ranks // 2 :]
    for i, r in enumerate(shown):
        if len(order) > max_ranks and i == max_ranks // 2:
            lines.append(f"{'...':>5} ({len(order) - max_ranks} ranks not shown)")
        names = sorted({n for n, _, _ in r.shards})
        tabs = ", ".join(names[:6]) + (f", ... (+{len(names) - 6})" if len(names) > 6 else "")
        lines.append(
            f"{r.rank:>5} {c.rank_time(r.rank) * 1e3:>9.3f} {r.compute_s * 1e3:>9.3f} "
            f"{r.comm_s * 1e3:>9.3f} {r.device_bytes / GB:>8.2f} {r.host_bytes / GB:>8.2f} "
            + (f"{r.ssd_bytes / GB:>8.2f} " if ssd_on else "")
            + f"{len(r.shards):>6}  {tabs}"
        )
    lines.append("")
    lines.append("critical path (largest shards on the ranks that set a phase's time):")
    for name, shard, t in result.critical_path():
        tp = p.table(name)
        lines.append(
            f"  {name:<24} {tp.sharding_type.short:<5} {tp.storage_label:<7} {shard:<32} "
            f"{t * 1e3:.3f} ms"
        )
    return "\n".join(lines)


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


_MOVABLE = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)
"""Types whose shards local search moves between ranks (never onto a rank that holds another shard
of the same table); table-row-wise shards stay put on their host, data-parallel ones everywhere."""
_NPH = 4  # phases: fwd comm, fwd compute, bwd comm, bwd compute (cost_model.PHASES)
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


class _Search:
    """Mutable search state: per-table option and pieces, per-rank phase loads and memory."""

    def __init__(self, p: Planner, tables: list[TableSpec], memo: _Memo | None = None) -> None:
        self.p = p
        self.cm = p.cm
        self.tables = tables
        self.w = p.topo.world_size
        self.k = p.topo.ranks_per_host
        self.dev_cap = p.topo.device_capacity_bytes
        self.host_cap = p.topo.host_capacity_bytes if p.allow_host else 0.0
        self.ssd_cap = p.topo.ssd_capacity_bytes if "ssd" in p.cached_tiers else 0.0
        self.ph = [[0.0] * _NPH for _ in range(self.w)]
        """Per rank and phase: the sum of its pieces' loads."""
        self.dev = [0.0] * self.w
        self.host = [0.0] * self.w
        self.ssd = [0.0] * self.w
        self.rank_pieces: list[list[_Piece]] = [[] for _ in range(self.w)]
        self.cands = [p.candidate_ranks(t) for t in tables]
        self.opts = [p.options(t) for t in tables]
        self.choice: list[_Option | None] = [None] * len(tables)
        self.pieces: list[list[_Piece]] = [[] for _ in tables]
        self.uniform = 0.0
        self._sample = [0.0] * len(tables)
        self._memo = memo if memo is not None else _Memo()
        self._cache = self._memo.geo

    # ---- pieces of an option ------------------------------------------------------------------
    def geometry(self, i: int, o: _Option) -> _Geo:
        """(row range, col range, cost) of each shard of option ``o`` for table ``i``."""
        hit = self._cache.get((i, o))
        if hit is not None:
            return hit
        t = self.tables[i]
        full = ((0, t.rows), (0, t.dim))
        if o.stype is ShardingType.DATA_PARALLEL:
            geo = [full] * self.w
        elif o.stype is ShardingType.TABLE_WISE:
            geo = [full]
        elif o.stype is ShardingType.COLUMN_WISE:
            geo = [((0, t.rows), c) for c in split_evenly(t.dim, o.n)]
        else:
            geo = [(r, (0, t.dim)) for r in split_evenly(t.rows, o.n)]
        costs: dict[tuple[int, int], ShardCost] = {}
        out = []
        for rows, cols in geo:
            shape = (rows[1] - rows[0], cols[1] - cols[0])
            if shape not in costs:
                costs[shape] = self.cm.shard_cost(
                    t, o.stype, shape[0], shape[1], o.storage, None, o.frac
                )
            out.append((rows, cols, costs[shape]))
        self._cache[(i, o)] = out
        return out

    def make_pieces(self, i: int, o: _Option) -> list[_Piece]:
        """Unplaced pieces of option ``o`` of table ``i``."""
        return [_Piece(i, rows, cols, c) for rows, cols, c in self.geometry(i, o)]

    def total_time(self, i: int, o: _Option) -> float:
        """Sum of an option's shard times plus its sample-side time on every rank."""
        hit = self._memo.total.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            side = self.cm.sample_side_s(self.tables[i], o.stype, len(geo))
            hit = self._memo.total[(i, o)] = sum(c.time_s for _, _, c in geo) + self.w * side
        return hit

    def _time_key(self, i: int, o: _Option) -> tuple[float, int]:
        return (self.total_time(i, o), o.n)

    def _rest_key(self, i: int, storage: str, o: _Option) -> tuple[bool, float, int, float]:
        return (o.storage != storage, self.total_time(i, o), o.n, o.frac)

    def _excess_key(
        self, excess: Callable[[int, _Option], float], i: int, o: _Option
    ) -> tuple[float, float]:
        return (excess(i, o), self.total_time(i, o))

    def _max_shard_s(self, i: int, o: _Option) -> float:
        return max(c.time_s for *_, c in self.geometry(i, o))

    def _peak_key(self, i: int, o: _Option) -> tuple[float, float, int]:
        return (self._max_shard_s(i, o), self.total_time(i, o), o.n)

    def _split_key(self, i: int, o: _Option) -> tuple[float, int, str, str, float]:
        return (self.total_time(i, o), o.n, o.stype.value, o.storage, o.frac)

    def _mem_need(self, i: int, o: _Option) -> tuple[float, float]:
        return (
            max(c.device_bytes + c.host_bytes + c.ssd_bytes for *_, c in self.geometry(i, o)),
            o.frac,
        )

    def fits_empty(self, i: int, o: _Option) -> bool:
        """Whether each shard of the option fits on an empty rank."""
        hit = self._memo.fits.get((i, o))
        if hit is None:
            hit = self._memo.fits[(i, o)] = all(
                c.device_bytes <= self.dev_cap
                and c.host_bytes <= self.host_cap
                and c.ssd_bytes <= self.ssd_cap
                for c in {id(c): c for *_, c in self.geometry(i, o)}.values()
            )
        return hit

    # ---- objective ----------------------------------------------------------------------------
    def phase_max(self) -> list[float]:
        """Slowest rank's load in each phase."""
        return [max(row[p] for row in self.ph) for p in range(_NPH)]

    def objective(self) -> tuple[float, float]:
        """(critical path = sum of phase maxima + sample side, sum of squared loads)."""
        sq = sum(v * v for row in self.ph for v in row)
        return sum(self.phase_max()) + self.uniform, sq

    def _top3(self) -> list[list[tuple[float, int]]]:
        out = []
        for p in range(_NPH):
            best: list[tuple[float, int]] = []
            for r in range(self.w):
                v = self.ph[r][p]
                if len(best) < 3 or v > best[-1][0]:
                    best.append((v, r))
                    best.sort(key=lambda x: (-x[0], x[1]))
                    del best[3:]
            out.append(best)
        return out

    # ---- assignment ---------------------------------------------------------------------------
    def _fits(self, r: int, dev: float, host: float, ssd: float = 0.0) -> bool:
        return (
            self.dev[r] + dev <= self.dev_cap
            and self.host[r] + host <= self.host_cap
            and self.ssd[r] + ssd <= self.ssd_cap
        )

    def _add(self, pc: _Piece, r: int) -> None:
        pc.rank = r
        row = self.ph[r]
        for p in range(_NPH):
            row[p] += pc.ph[p]
        self.dev[r] += pc.dev
        self.host[r] += pc.host
        self.ssd[r] += pc.ssd
        self.rank_pieces[r].append(pc)

    def _remove(self, pc: _Piece) -> None:
        r = pc.rank
        row = self.ph[r]
        for p in range(_NPH):
            row[p] -= pc.ph[p]
        self.dev[r] -= pc.dev
        self.host[r] -= pc.host
        self.ssd[r] -= pc.ssd
        self.rank_pieces[r].remove(pc)
        pc.rank = -1

    def unassign(self, i: int) -> None:
        """Take table ``i`` off the ranks."""
        for pc in self.pieces[i]:
            self._remove(pc)
        self.pieces[i] = []
        self.uniform -= self._sample[i]
        self._sample[i] = 0.0
        self.choice[i] = None

    def assign(self, i: int, o: _Option) -> bool:
        """Place table ``i`` with option ``o`` greedily; False (state unchanged) if it does not fit."""
        pieces = self.make_pieces(i, o)
        ranks = self._choose_ranks(i, o, pieces)
        if ranks is None:
            return False
        for pc, r in zip(pieces, ranks):
            self._add(pc, r)
        self.pieces[i] = pieces
        self.choice[i] = o
        self._sample[i] = self.cm.sample_side_s(self.tables[i], o.stype, len(pieces))
        self.uniform += self._sample[i]
        return True

    def _choose_ranks(self, i: int, o: _Option, pieces: list[_Piece]) -> list[int] | None:
        cands = self.cands[i]
        if o.stype is ShardingType.DATA_PARALLEL:
            ok = all(self._fits(r, pieces[0].dev, pieces[0].host, pieces[0].ssd) for r in cands)
            return list(cands) if ok else None
        if o.stype is not ShardingType.TABLE_ROW_WISE:
            return self._greedy_distinct(pieces, cands)
        best: tuple[float, list[int]] | None = None
        cset = set(cands)
        m = self.phase_max()
        for h in range(self.p.topo.num_hosts):
            group = list(range(h * self.k, (h + 1) * self.k))
            if not cset.issuperset(group):
                continue
            ranks = self._greedy_distinct(pieces, group)
            if ranks is None:
                continue
            new = list(m)
            for pc, r in zip(pieces, ranks):
                for p in range(_NPH):
                    new[p] = max(new[p], self.ph[r][p] + pc.ph[p])
            score = sum(new)
            if best is None or score < best[0] - _EPS:
                best = (score, ranks)
        return None if best is None else best[1]

    def _greedy_distinct(self, pieces: list[_Piece], cands: list[int]) -> list[int] | None:
        """Largest piece first onto the fitting rank that lengthens the critical path least."""
        m = self.phase_max()
        used: set[int] = set()
        out = [-1] * len(pieces)
        for j in sorted(range(len(pieces)), key=lambda j: -pieces[j].tot):
            pc = pieces[j]
            best: tuple[float, float, int] | None = None
            for r in cands:
                if r in used or not self._fits(r, pc.dev, pc.host, pc.ssd):
                    continue
                row = self.ph[r]
                crit = 0.0
                tot = 0.0
                for p in range(_NPH):
                    v = row[p] + pc.ph[p]
                    crit += v if v > m[p] else m[p]
                    tot += v
                key = (crit, tot, r)
                if best is None or key < best:
                    best = key
            if best is None:
                return None
            r = best[2]
            out[j] = r
            used.add(r)
            for p in range(_NPH):  # later siblings see this piece in the maxima
                m[p] = max(m[p], self.ph[r][p] + pc.ph[p])
        return out

    # ---- initial solution ---------------------------------------------------------------------
    def initial(self, split_share: _Start = None) -> None:
        """Cheapest option per table, host tier for the coldest bytes if needed, then LPT.

        With a float ``split_share``, tables whose largest shard would exceed that share of a
        rank's mean load in any phase start split finely enough, so LPT can balance; with
        ``"bound"``, tables start split as ``_bound_split`` chooses.
        """
        n = len(self.tables)
        start: list[_Option] = []
        for i in range(n):
            # Cached options (never faster than the same split in device memory) are looked at
            # only when nothing else fits: their hit rates are computed on demand.
            plain = [o for o in self.opts[i] if not o.cached] or self.opts[i]
            fitting = (
                [o for o in plain if self.fits_empty(i, o)]
                or [o for o in self.opts[i] if o.cached and self.fits_empty(i, o)]
                or self.opts[i]
            )
            device = [o for o in fitting if o.storage == "device"] or fitting
            start.append(min(device, key=partial(self._time_key, i)))
        self._tier(start)
        if split_share == "bound":
            self._bound_split(start)
        elif isinstance(split_share, float):
            self._presplit(start, split_share)
        total_t = sum(self.total_time(i, start[i]) for i in range(n)) / self.w or 1.0
        total_m = sum(sum(c.device_bytes for *_, c in self.geometry(i, start[i])) for i in range(n))
        mem_share = total_m / self.w or 1.0

        def key(i: int) -> tuple[float, str]:
            geo = self.geometry(i, start[i])
            tmax = max(c.time_s for *_, c in geo) / total_t
            mmax = max(c.device_bytes for *_, c in geo) / mem_share
            return (-max(tmax, mmax), self.tables[i].name)

        failed = []
        for i in sorted(range(n), key=key):
            if self.assign(i, start[i]):
                continue
            rest = sorted(
                (o for o in self.opts[i] if o != start[i]),
                key=partial(self._rest_key, i, start[i].storage),
            )
            if not any(self.assign(i, o) for o in rest):
                failed.append(i)
        if failed:
            raise PlanningError(self._diagnose(failed), [self.tables[i].name for i in failed])

    def _presplit(self, start: list[_Option], share: float) -> None:
        """Re-split tables whose shards are too coarse for balancing (see ``initial``)."""
        mean = [0.0] * _NPH
        for i, o in enumerate(start):
            for *_, c in self.geometry(i, o):
                for p, v in enumerate(c.phases):
                    mean[p] += v / self.w
        limit = [share * m for m in mean]

        def excess(i: int, o: _Option) -> float:
            return max(
                max(v - lim for v, lim in zip(c.phases, limit)) for *_, c in self.geometry(i, o)
            )

        for i, o in enumerate(start):
            if excess(i, o) <= 0:
                continue
            alts = [
                a
                for a in self.opts[i]
                if a.storage == o.storage
                and a.frac == o.frac
                and a.stype is not ShardingType.DATA_PARALLEL
                and self.fits_empty(i, a)
            ]
            ok = [a for a in alts if excess(i, a) <= 0]
            if ok:
                start[i] = min(ok, key=partial(self._time_key, i))
            elif alts:
                start[i] = min(alts, key=partial(self._excess_key, excess, i))

    def _peaks(self, i: int, o: _Option) -> tuple[float, ...]:
        """Per phase: the largest shard load of option ``o`` of table ``i``."""
        hit = self._memo.peaks.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            hit = tuple(max(c.phases[p] for *_, c in geo) for p in range(_NPH))
            self._memo.peaks[(i, o)] = hit
        return hit

    def _loads(self, i: int, o: _Option) -> tuple[float, ...]:
        """Per phase: the load of option ``o`` of table ``i`` summed over its shards; then its
        sample-side time (the same on every rank)."""
        hit = self._memo.loads.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            side = self.cm.sample_side_s(self.tables[i], o.stype, len(geo))
            hit = (*(sum(c.phases[p] for *_, c in geo) for p in range(_NPH)), side)
            self._memo.loads[(i, o)] = hit
        return hit

    def _bound_split(self, start: list[_Option]) -> None:
        """Re-split tables while that lowers a lower bound of the objective (``_Bound``).

        Greedy: of the tables whose shard sets a phase's bound, the one whose best other option
        (same tier, any type) lowers the bound most takes it; when no single split lowers it
        (two tables with equally large shards), the best two splits in a row. Every split costs
        time, which raises the means, so it stops once splitting the largest shards costs more
        than it balances. Catches splits that only pay together, which local search, one table
        at a time, does not.
        """
        bnd = _Bound(
            self.w,
            [self._peaks(i, o) for i, o in enumerate(start)],
            [self._loads(i, o) for i, o in enumerate(start)],
        )
        for _ in range(4 * len(start)):
            cur = bnd.value()
            steps = self._bound_steps(bnd, start)
            if not steps:
                return
            b, _, i, a = steps[0]
            if b < cur * (1 - 1e-9):
                start[i] = a
                bnd = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))
                continue
            # Two steps: the first need not lower the bound (the other large shard still sets it).
            best: tuple[float, float, int, _Option, int, _Option] | None = None
            for _, _, i, a in steps[:8]:
                nxt = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))
                more = self._bound_steps(nxt, [*start[:i], a, *start[i + 1 :]])
                if more and (best is None or more[0][:2] < best[:2]):
                    best = (more[0][0], more[0][1], i, a, more[0][2], more[0][3])
            if best is None or best[0] >= cur * (1 - 1e-9):
                return
            for i, a in ((best[2], best[3]), (best[4], best[5])):
                start[i] = a
                bnd = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))

    def _bound_steps(
        self, bnd: _Bound, start: list[_Option]
    ) -> list[tuple[float, float, int, _Option]]:
        """(bound, total time, table, option) of re-splitting each table that sets a phase's
        bound to each of its other options (same tier), best first."""
        out = []
        for i in bnd.setters():
            o = start[i]
            for a in self.opts[i]:
                if a == o or a.storage != o.storage or a.frac != o.frac:
                    continue
                if not self.fits_empty(i, a):
                    continue
                b = bnd.value(i, self._peaks(i, a), self._loads(i, a))
                out.append((b, self.total_time(i, a), i, a))
        out.sort(key=lambda x: (x[0], x[1], x[2]))
        return out

    def _bytes(self, i: int, o: _Option) -> tuple[float, float, float]:
        """(device, host, ssd) bytes of option ``o`` of table ``i`` over all its shards."""
        geo = self.geometry(i, o)
        return (
            sum(c.device_bytes for *_, c in geo),
            sum(c.host_bytes for *_, c in geo),
            sum(c.ssd_bytes for *_, c in geo),
        )

    def _tier(self, start: list[_Option]) -> None:
        """Move tables to a slower tier until they fit in device memory: host (UVM-like), or a
        cached tier (dram / ssd behind a row cache), whichever loses least time per device byte
        freed, greedily over all tables, within the host DRAM and SSD left."""
        slower = (["host"] if self.p.allow_host else []) + self.p.cached_tiers
        if not slower:
            return
        cap = 0.92 * self.dev_cap * self.w
        mem = [self._bytes(i, o) for i, o in enumerate(start)]
        used = [m[0] for m in mem]
        need = sum(used) - cap
        if need <= 0:
            return
        room = {
            "host": 0.95 * self.host_cap * self.w - sum(m[1] for m in mem),
            "ssd": 0.95 * self.ssd_cap * self.w - sum(m[2] for m in mem),
        }
        # A cached tier moves misses at one rank's share of its host's bandwidth: its split is
        # the fastest whose largest shard stays within half a rank's mean load (else the finest): a
        # hot table is spread over ranks (their SSDs and links) rather than left to local search.
        limit = 0.5 * sum(self.total_time(i, o) for i, o in enumerate(start)) / self.w
        moves = []
        for i, o in enumerate(start):
            if o.storage != "device" or self.tables[i].storage:
                continue
            by: dict[tuple[str, float], list[_Option]] = {}  # options per tier and fraction
            for h in self.opts[i]:
                if h.storage in slower and self.fits_empty(i, h):
                    by.setdefault((h.storage, h.frac), []).append(h)
            best: dict[tuple[str, float], _Option] = {}
            for key, hs in by.items():
                if key[0] in CACHED_STORAGES:
                    ok = [h for h in hs if self._max_shard_s(i, h) <= limit]
                    best[key] = (
                        min(ok, key=partial(self._time_key, i))
                        if ok
                        else min(hs, key=partial(self._peak_key, i))
                    )
                else:
                    best[key] = min(hs, key=partial(self._time_key, i))
            for (sto, frac), h in best.items():
                dev, host, ssd = self._bytes(i, h)
                freed = used[i] - dev
                if freed > 0:
                    extra = self.total_time(i, h) - self.total_time(i, o)
                    moves.append(
                        (extra / freed, self.tables[i].name, slower.index(sto), frac, i, h)
                    )
        moved: set[int] = set()
        for *_, i, h in sorted(moves, key=lambda m: m[:4]):
            if need <= 0:
                break
            if i in moved:
                continue
            dev, host, ssd = self._bytes(i, h)
            if self.p.cached_tiers and (host > room["host"] or ssd > room["ssd"]):
                continue  # the next-best tier of this table may still fit
            start[i] = h
            moved.add(i)
            need -= used[i] - dev
            room["host"] -= host
            room["ssd"] -= ssd

    # ---- local search -------------------------------------------------------------------------
    def improve(self) -> int:
        """Local search on the critical path; returns the number of accepted steps."""
        n_pieces = sum(len(p) for p in self.pieces)
        cap = self.p.max_iters if self.p.max_iters is not None else 20 * n_pieces + 100
        it = 0
        while it < cap:
            top = self._top3()
            obj = self.objective()
            sources = list(dict.fromkeys(top[p][0][1] for p in range(_NPH)))
            if not (self._move_or_swap(sources, top, obj) or self._resplit(sources, obj)):
                break
            it += 1
        return it

    def _movable(self, pc: _Piece) -> bool:
        o = self.choice[pc.table]
        # A table with a shard on every rank it may use has nowhere to move one to.
        return o is not None and o.stype in _MOVABLE and o.n < len(self.cands[pc.table])

    def _may_hold(self, pc: _Piece, r: int, other: _Piece | None = None) -> bool:
        cset = self.cands[pc.table]
        if len(cset) != self.w and r not in cset:
            return False
        return not any(q.rank == r for q in self.pieces[pc.table] if q is not pc and q is not other)

    def _delta(
        self, top: list[list[tuple[float, int]]], c: int, t: int, x: tuple[float, ...]
    ) -> tuple[float, float]:
        """(new sum of phase maxima, change of squared loads) if ``x`` moves from ``c`` to ``t``."""
        rc, rt = self.ph[c], self.ph[t]
        crit = 0.0
        dsq = 0.0
        for p in range(_NPH):
            vc, vt = rc[p] - x[p], rt[p] + x[p]
            m = vc if vc > vt else vt
            for v, r in top[p]:
                if r != c and r != t:
                    m = v if v > m else m
                    break
            crit += m
            dsq += vc * vc - rc[p] * rc[p] + vt * vt - rt[p] * rt[p]
        return crit, dsq

    def _better(self, crit: float, dsq: float, obj: tuple[float, float]) -> bool:
        cur = obj[0] - self.uniform
        tol = 1e-9 * max(cur, 1e-12)
        return crit < cur - tol or (crit <= cur + tol and dsq < -1e-9 * max(obj[1], 1e-24))

    def _move_or_swap(
        self, sources: list[int], top: list[list[tuple[float, int]]], obj: tuple[float, float]
    ) -> bool:
        targets = sorted(range(self.w), key=lambda r: (sum(self.ph[r]), r))[:16]
        best: tuple[float, float, _Piece, _Piece | None, int] | None = None
        for c in sources:
            mine = [pc for pc in self.rank_pieces[c] if self._movable(pc)]
            for t in targets:
                if t == c:
                    continue
                for pc in mine:
                    if not self._fits(t, pc.dev, pc.host, pc.ssd) or not self._may_hold(pc, t):
                        continue
                    crit, dsq = self._delta(top, c, t, pc.ph)
                    if self._better(crit, dsq, obj) and (best is None or (crit, dsq) < best[:2]):
                        best = (crit, dsq, pc, None, t)
                for q in self.rank_pieces[t]:
                    if not self._movable(q):
                        continue
                    for pc in mine:
                        if pc.tot <= q.tot or pc.table == q.table:
                            continue
                        x = tuple(a - b for a, b in zip(pc.ph, q.ph))
                        crit, dsq = self._delta(top, c, t, x)
                        if not self._better(crit, dsq, obj):
                            continue
                        if best is not None and (crit, dsq) >= best[:2]:
                            continue
                        if self._swap_ok(pc, q, c, t):
                            best = (crit, dsq, pc, q, t)
        if best is None:
            return False
        _, _, mv, sw, t = best
        c = mv.rank
        self._remove(mv)
        if sw is not None:
            self._remove(sw)
            self._add(sw, c)
        self._add(mv, t)
        return True

    def _swap_ok(self, pc: _Piece, q: _Piece, c: int, r: int) -> bool:
        if not (self._may_hold(pc, r, q) and self._may_hold(q, c, pc)):
            return False
        dd, dh, ds = pc.dev - q.dev, pc.host - q.host, pc.ssd - q.ssd
        return self._fits(r, dd, dh, ds) and self._fits(c, -dd, -dh, -ds)

    def _resplit(self, sources: list[int], obj: tuple[float, float], tables: int = 3) -> bool:
        seen: list[int] = []
        cand = [pc for c in sources for pc in self.rank_pieces[c]]
        for pc in sorted(cand, key=lambda p: (-p.tot, p.table)):
            if pc.table not in seen:
                seen.append(pc.table)
        for i in seen[:tables]:
            cur = self.choice[i]
            assert cur is not None
            biggest = max(p.tot for p in self.pieces[i])
            # A table in device memory is not moved to a cached tier here (never faster at the
            # same split; ``_tier`` moves tables for memory).
            alts = [
                o
                for o in self.opts[i]
                if o != cur
                and not (o.cached and cur.storage == "device")
                and max(g[2].time_s for g in self.geometry(i, o)) < biggest - _EPS
            ]
            alts.sort(key=partial(self._split_key, i))
            for o in alts[:4]:
                if self._try_option(i, o, cur, obj):
                    return True
        return False

    def _try_option(self, i: int, o: _Option, cur: _Option, obj: tuple[float, float]) -> bool:
        """Switch table ``i`` to option ``o`` if that improves the objective; else restore."""
        old = [(pc, pc.rank) for pc in self.pieces[i]]
        self.unassign(i)
        if self.assign(i, o):
            new = self.objective()
            tol = 1e-9 * obj[0]
            if new[0] < obj[0] - tol or (new[0] <= obj[0] + tol and new[1] < obj[1] * (1 - 1e-9)):
                return True
            self.unassign(i)
        for pc, r in old:
            self._add(pc, r)
        self.pieces[i] = [pc for pc, _ in old]
        self.choice[i] = cur
        self._sample[i] = self.cm.sample_side_s(self.tables[i], cur.stype, len(old))
        self.uniform += self._sample[i]
        return False

    # ---- output -------------------------------------------------------------------------------
    def to_plan(self) -> ShardingPlan:
        """The current state as a ``ShardingPlan`` (tables in input order)."""
        out = []
        for i, t in enumerate(self.tables):
            o = self.choice[i]
            assert o is not None
            shards = [
                Shard(pc.rank, pc.rows[0], pc.rows[1], pc.cols[0], pc.cols[1])
                for pc in sorted(self.pieces[i], key=lambda p: (p.rows, p.cols, p.rank))
            ]
            out.append(TablePlan(t.name, t.rows, t.dim, o.stype, shards, o.storage, o.frac))
        return ShardingPlan(self.w, self.k, out)

    def _diagnose(self, failed: list[int]) -> str:
        """Which tables do not fit where, and what would make them fit."""
        topo = self.p.topo
        ssd_tier = "ssd" in self.p.cached_tiers
        ssd_txt = f", {self.ssd_cap / GB:.2f} GB SSD" if ssd_tier else ""
        lines = [
            f"no feasible sharding plan: {len(failed)} table(s) do not fit in memory on "
            f"{self.w} ranks ({self.k} per host; {self.dev_cap / GB:.2f} GB device for tables "
            f"and {self.host_cap / GB:.2f} GB host{ssd_txt} per rank):"
        ]
        free_dev = max(self.dev_cap - d for d in self.dev)
        free_host = max(self.host_cap - h for h in self.host)
        free_ssd = max(self.ssd_cap - x for x in self.ssd)
        free_ssd_txt = f", ssd {free_ssd / GB:.2f} GB" if ssd_tier else ""
        total_need = 0.0
        for i in failed[:20]:
            t = self.tables[i]
            best = min(self.opts[i], key=partial(self._mem_need, i))
            geo = self.geometry(i, best)
            per = self._mem_need(i, best)[0]
            whole = sum(c.device_bytes + c.host_bytes + c.ssd_bytes for *_, c in geo)
            total_need += whole
            lines.append(
                f"  - table '{t.name}' ({t.rows:,} x {t.dim}, {whole / GB:.2f} GB with optimizer "
                f"state and buffers): its smallest option {best.label()} needs {per / GB:.2f} GB "
                f"on each of {len(geo)} rank(s); most free: device {free_dev / GB:.2f} GB, host "
                f"{free_host / GB:.2f} GB{free_ssd_txt}"
            )
        if len(failed) > 20:
            lines.append(f"  ... and {len(failed) - 20} more")
        all_need = sum(
            min(sum(self._bytes(i, o)) for o in self.opts[i]) for i in range(len(self.tables))
        )
        per_rank = self.dev_cap + self.host_cap + self.ssd_cap
        cap_all = per_rank * self.w
        tiers = "device + host" + (" + ssd" if ssd_tier else "")
        lines.append(
            f"all tables need at least {all_need / GB:,.1f} GB; the ranks offer "
            f"{cap_all / GB:,.1f} GB ({tiers})."
        )
        more = math.ceil(all_need / (0.9 * per_rank)) if per_rank > 0 else 0
        pinned = [
            self.tables[i].name
            for i in failed
            if self.tables[i].allowed_types
            and ShardingType.ROW_WISE not in self.tables[i].allowed_types
        ]
        t0 = self.tables[failed[0]]
        scale = min(1.0, 0.9 * free_dev / max(1.0, total_need)) if total_need else 1.0
        lines.append("fixes:")
        lines.append(
            f"  - more ranks: about {max(more, self.w + 1)} ranks of this size would hold them"
        )
        if topo.host_memory_gb <= 0 or not self.p.allow_host:
            lines.append(
                "  - a slower tier: give the topology host memory (host_memory_gb) so rows can "
                "live in host DRAM (UVM-like, or behind a row cache), or allow storage = host"
            )
        else:
            lines.append("  - a slower tier: more host memory per host (host_memory_gb)")
        if ssd_tier:
            lines.append(
                "  - the SSD tier: more SSD per host (ssd_capacity_gb), or smaller row caches "
                f"(cache_fractions, now {', '.join(f'{f:g}' for f in self.p.cache_fractions)})"
            )
        else:
            allow = (
                "allow cached tiers ([planner] allow_cached_tiers = true; `neorec plan` does "
                "unless --no-cached-tiers)"
            )
            if topo.ssd_capacity_gb > 0:
                how = (
                    f"the topology's SSD ({topo.ssd_capacity_gb:,.0f} GB per host) is unused: "
                    f"{allow}"
                )
            else:
                how = "" if self.p.allow_cached else f"{allow} and "
                how += "give the topology SSD per host (ssd_capacity_gb, ssd_bw_gbs)"
            lines.append(
                f"  - an SSD tier: {how}; rows then live on SSD behind a row cache of "
                f"{self.p.cache_fractions[0] * 100:g}-{self.p.cache_fractions[-1] * 100:g}% of "
                "their rows in device memory (MTrainS; simulated: the distributed runtime does "
                "not run cached tiers)"
            )
        if pinned:
            lines.append(
                f"  - row-wise splits: allow row_wise / table_row_wise for {pinned[:5]} "
                "(their allowed types forbid splitting rows)"
            )
        else:
            lines.append("  - row-wise splits: already tried over every allowed rank")
        lines.append(
            f"  - smaller dims: e.g. table '{t0.name}' at dim <= {max(1, int(t0.dim * scale))}, "
            "or fewer rows (hashing) / a smaller optimizer (sgd, rowwise_adagrad instead of adam)"
        )
        return "\n".join(lines)


def plan_tables(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    optimizer: str = "rowwise_adagrad",
    **kw: Any,
) -> PlanResult:
    """Plan ``tables`` on ``topology`` (see ``Planner``); raises ``PlanningError`` when infeasible."""
    return Planner(topology, batch_size, optimizer, **kw).plan(tables)
