"""The planner's result and its printed report: ``PlanResult``, ``format_report``.

Split out of ``neorec.sharding.planner`` (public names are re-exported there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neorec.sharding.cost_model import TableSpec, cache_rows
from neorec.sharding.cost_types import PHASES, PlanCost
from neorec.sharding.hit_rate import cache_hit_rates
from neorec.sharding.learned_cost import Scoring, model_summary
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import CACHED_STORAGES, ShardingPlan

__all__ = ["PlanResult", "format_report", "SIMULATION_NOTE"]

SIMULATION_NOTE = (
    "predicted by neorec's cost model (a simulation from Topology constants, not a measurement)"
)


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
    scoring: Scoring | None = None
    """Which cost model ranked the candidate plans (None: analytical, not recorded)."""
    learned_ms: dict[str, float] | None = None
    """The learned model's ms per step of the plan per target (None: analytical scoring)."""
    candidates: list[ShardingPlan] = field(default_factory=list)
    """Every plan the search scored on the way (its starts, the greedy baselines' plans):
    ``neorec.sharding.planner_shortlist`` draws the plans to measure from them."""
    tuning: dict[str, Any] | None = None
    """When the plan was picked by measuring a shortlist here (``neorec plan --tune``): what was
    measured and how (``neorec.measure.plan_tune``); None: picked by the cost model alone."""

    @property
    def predicted_step_s(self) -> float:
        """Predicted embedding step: the learned model's when it scored the plan, else the
        analytical one's (``cost.max_time_s``)."""
        if self.learned_ms is not None:
            return self.learned_ms["step"] / 1000
        return self.cost.max_time_s

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
            "predicted_step_embedding_s": self.predicted_step_s,
            "analytical_step_embedding_s": c.max_time_s,
            "cost_model": (self.scoring.to_dict() if self.scoring else {"kind": "analytical"}),
            **({"learned_ms": self.learned_ms} if self.learned_ms is not None else {}),
            **({"tuning": self.tuning} if self.tuning is not None else {}),
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
            "topology": {
                **self.topology.to_dict(),
                "learned_cost": model_summary(self.topology.learned_cost),
            },
        }


def _tuning_lines(tu: dict[str, Any]) -> list[str]:
    """``neorec plan --tune``: the shortlist as measured here, the pick marked."""
    lines = [
        f"MEASURED (--tune): {len(tu['measured'])} plans run on {tu['world']} gloo ranks here "
        f"({tu['rounds']} rounds of {tu['passes']} passes of {tu['iters']} steps, batch "
        f"{tu['batch']}; median ms per step); picked: {tu['picked']}"
        + ("" if tu["picked"] == "planner" else " (not the cost model's own pick)"),
    ]
    noise = tu["noise_ms"]
    if tu["fastest"] != "planner":
        if noise is None:
            lines.append(
                f"  {tu['fastest']} led the planner's plan by {tu['lead_ms']:.3f} ms; noise not "
                "estimated (fewer than 3 rounds)"
            )
        else:
            verdict = "clear of" if tu["clear"] else "within"
            lines.append(
                f"  {tu['fastest']} led the planner's plan by {tu['lead_ms']:.3f} ms, {verdict} "
                f"the noise ({noise:.3f} ms: {tu.get('noise_sigmas', 2.0):g} standard errors of "
                "the difference)"
            )
    for m in tu["measured"]:
        mark = "*" if m["label"] == tu["picked"] else " "
        lines.append(
            f"  {mark} {m['label']:<20} measured {m['ms_per_step']:>9.3f} ms   predicted "
            f"{m['predicted_ms']:>9.3f} ms"
        )
    return lines


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
    sc = result.scoring
    if sc is not None:
        lines += [f"cost model: {sc.note}", *sc.warnings]
    if result.learned_ms is not None:
        lm = result.learned_ms
        lines.append(
            f"learned prediction per step: {lm['step']:.3f} ms (fwd {lm['fwd']:.3f}, bwd "
            f"{lm['bwd']:.3f}, comm {lm['comm']:.3f} ms); the analytical figures below rank the "
            "shards"
        )
    if result.tuning is not None:
        lines += _tuning_lines(result.tuning)
    which = "analytical" if result.learned_ms is not None else "predicted"
    lines += [
        f"{which} embedding time per step: {c.max_time_s * 1e3:.3f} ms (sum over phases of the "
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
