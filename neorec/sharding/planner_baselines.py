"""The greedy baselines (DreamShard-style: whole tables, sorted by a key, onto the least-loaded
rank that fits) and the planner's candidates made from them (``baseline_candidates``): a plan
the planner returns is never worse than theirs by the model that scores it.
``neorec bench planner`` compares the planner with the same baselines."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.types import ShardingPlan, ShardingType, TablePlan, table_wise

if TYPE_CHECKING:
    from neorec.sharding.planner import Planner

__all__ = ["BASELINES", "greedy_baseline", "baseline_candidates", "plan_key"]


def _tw_bytes(cm: CostModel, t: TableSpec) -> float:
    return cm.shard_cost(t, ShardingType.TABLE_WISE, t.rows, t.dim).device_bytes


BASELINES: dict[str, Callable[[TableSpec], float] | None] = {
    "random": None,
    "size_greedy": lambda t: float(t.rows * t.dim),
    "dim_greedy": lambda t: float(t.dim),
    "lookup_greedy": lambda t: t.dim * t.pooling_factor,
    "size_lookup_greedy": lambda t: t.dim * t.pooling_factor * math.log10(t.rows),
}
"""DreamShard-style greedy baselines: whole tables sorted by the key (``random``: shuffled),
each onto the rank with the smallest sum of that key among those it fits on."""


def greedy_baseline(
    name: str, tables: Sequence[TableSpec], cm: CostModel, seed: int = 0
) -> ShardingPlan | None:
    """Whole tables sorted by the baseline's key onto the least-key-loaded rank that fits
    (device memory, table-wise); None when a table fits on no rank."""
    topo = cm.topo
    w, cap = topo.world_size, topo.device_capacity_bytes
    key = BASELINES[name]
    rng = random.Random(seed)
    order = list(tables)
    if key is None:
        rng.shuffle(order)
    else:
        order.sort(key=lambda t: (-key(t), t.name))
    load, mem = [0.0] * w, [0.0] * w
    plans = []
    for t in order:
        need = _tw_bytes(cm, t)
        fits = [r for r in range(w) if mem[r] + need <= cap]
        if not fits:
            return None
        r = rng.choice(fits) if key is None else min(fits, key=lambda r: (load[r], r))
        load[r] += key(t) if key is not None else 0.0
        mem[r] += need
        plans.append(table_wise(t, r))
    by_name = {p.name: p for p in plans}
    return ShardingPlan(w, topo.ranks_per_host, [by_name[t.name] for t in tables])


def baseline_candidates(
    p: Planner, tables: Sequence[TableSpec], seed: int = 0
) -> list[tuple[str, ShardingPlan]]:
    """The greedy baselines' plans of ``tables`` that the planner may return (every table
    unpinned, table-wise allowed, no forced storage; the plan fits), in ``BASELINES`` order,
    duplicates dropped: the planner's candidates next to its own searches, so a plan it returns
    is never worse than theirs by the model that scores it."""
    if any(
        t.ranks
        or t.storage not in ("", "device")
        or (t.allowed_types and ShardingType.TABLE_WISE not in t.allowed_types)
        for t in tables
    ):
        return []
    out: list[tuple[str, ShardingPlan]] = []
    seen: list[list[TablePlan]] = []
    for name in BASELINES:
        plan = greedy_baseline(name, tables, p.cm, seed)
        if plan is None or plan.tables in seen or not p.cm.evaluate(plan, tables).fits:
            continue
        seen.append(plan.tables)
        out.append((name, plan))
    return out


def plan_key(plan: dict) -> str:
    """A key of a plan dict (``ShardingPlan.to_dict``) that is equal for plans differing only by
    which rank is which, when every rank is on one host (ranks relabeled in order of first use,
    tables and shards in plan order): such plans run the same work, and the models score them
    alike. Plans on several hosts keep their ranks. (On a 2-core VM a plan and its mirror
    differed by 2-8% per step until stop 34: the output assembly's per-column ``index_add``,
    whose cost followed the owner order; with ``place_columns`` they measure alike.)"""
    import json

    tables = plan["tables"]
    if int(plan.get("ranks_per_host") or plan["world_size"]) == int(plan["world_size"]):
        new: dict[int, int] = {}
        for t in tables:
            for s in t["shards"]:
                new.setdefault(int(s["rank"]), len(new))
        tables = [
            {**t, "shards": [{**s, "rank": new[int(s["rank"])]} for s in t["shards"]]}
            for t in tables
        ]
    return json.dumps(tables, sort_keys=True)
