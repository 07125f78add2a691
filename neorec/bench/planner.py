"""``neorec bench planner``: the planner against DreamShard-style greedy baselines (simulation).

Tasks in the style of AutoShard / DreamShard: 50-100 tables drawn from a pool with
production-like spread (rows log-uniform 1e3..1e8, dims 4..256, heavy-tailed pooling factors),
sharded on 4 or 8 ranks of one host under a per-rank memory limit. The baselines place whole
tables (table-wise), sorted by their key, each onto the rank with the smallest sum of that key
among those it fits on: random, size, dim, lookup (dim x pooling), size-lookup
(dim x pooling x log10 rows). Every method is scored by the same ``CostModel``; the figure is the
slowest rank's predicted time. A benchmark, not a test: it prints a table and a JSON line.

``--measure`` instead measures (not predicts): a few small random table mixes on 2 gloo ranks
here, the planner's plan (scored by the ``--topology`` file's learned cost model when it was
fitted on this machine) and every greedy baseline's plan, each run for real with the sharded
runtime (``bench dist --embedding-only``'s step, medians over ``--repeats`` rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.planner import Planner, PlanningError
from neorec.sharding.planner_baselines import BASELINES, _tw_bytes, greedy_baseline, plan_key
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import (
    ShardingPlan,
    TablePlan,
    column_wise,
    data_parallel,
    row_wise,
    table_wise,
)

__all__ = [
    "paper_scale_tables",
    "write_tables_csv",
    "make_pool",
    "make_tasks",
    "BASELINES",
    "greedy_baseline",
    "plan_lower_bound_s",
    "run_task_set",
    "main",
]

PASSES = 5
"""Interleaved passes per round of ``--measure`` (10 steps each)."""
DIMS = (4, 8, 16, 32, 64, 128, 256)
DIM_WEIGHTS = (0.05, 0.10, 0.20, 0.25, 0.20, 0.12, 0.08)


def make_pool(n: int = 856, seed: int = 0) -> list[TableSpec]:
    """A pool of tables with production-like spread (seeded)."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        rows = int(10 ** rng.uniform(3, 8))
        dim = rng.choices(DIMS, DIM_WEIGHTS)[0]
        # Heavy tail: most features look up a few ids, a few look up hundreds.
        pooling = min(400.0, max(1.0, math.exp(rng.gauss(math.log(3.0), 1.4))))
        pool.append(
            TableSpec(name=f"pool{i}", rows=rows, dim=dim, pooling_factor=round(pooling, 2))
        )
    return pool


def paper_scale_tables(n: int = 480, seed: int = 2022) -> list[TableSpec]:
    """The table list of ``configs/paper_scale.toml`` (~4 T parameters; seeded, deterministic)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rows = int(10 ** rng.uniform(4, 9))
        dim = rng.choices((32, 64, 128, 256), (0.15, 0.35, 0.35, 0.15))[0]
        pooling = min(200.0, max(1.0, math.exp(rng.gauss(math.log(4.0), 1.2))))
        out.append(
            TableSpec(name=f"f{i:03d}", rows=rows, dim=dim, pooling_factor=round(pooling, 2))
        )
    return out


def write_tables_csv(tables: Sequence[TableSpec], path: str) -> None:
    """Write ``name,rows,dim,pooling_factor`` CSV (the planner's table-file format)."""
    with open(path, "w") as f:
        f.write("name,rows,dim,pooling_factor\n")
        for t in tables:
            f.write(f"{t.name},{t.rows},{t.dim},{t.pooling_factor}\n")


@dataclass
class Task:
    """One sharding task: tables, ranks and the per-rank memory limit (GB)."""

    tables: list[TableSpec]
    ranks: int
    mem_limit_gb: float


def mem_limit_gb(cm: CostModel, tables: Sequence[TableSpec], ranks: int) -> float:
    """A task's per-rank memory limit for tables: 1.3x the mean table-wise bytes per rank, at
    least 1.1x the largest table's (GB)."""
    mem = [_tw_bytes(cm, t) for t in tables]
    return max(1.1 * max(mem), 1.3 * sum(mem) / ranks) / GB


def make_tasks(
    pool: list[TableSpec], ranks: int, n_tasks: int, batch: int, seed: int
) -> list[Task]:
    """Tasks of 50-100 pool tables; memory limit: 1.3x the mean per rank, >= 1.1x the largest."""
    rng = random.Random(seed * 1000 + ranks)
    probe = CostModel(_topology(ranks, 1e6), batch)
    tasks = []
    for _ in range(n_tasks):
        k = rng.randint(50, 100)
        tables = rng.sample(pool, k)
        tasks.append(Task(tables, ranks, mem_limit_gb(probe, tables, ranks)))
    return tasks


def _topology(ranks: int, mem_limit_gb: float) -> Topology:
    """One host of ``ranks`` GPUs whose table memory is ``mem_limit_gb`` (reserve on top)."""
    return Topology(
        world_size=ranks,
        ranks_per_host=ranks,
        device_memory_gb=mem_limit_gb + 1.0,
        device_reserve_gb=1.0,
        host_memory_gb=0.0,
        name=f"bench {ranks} GPUs, one host (preset)",
    )


def _options(t: TableSpec, world: int) -> list[TablePlan]:
    """Every way the planner may shard ``t`` on one host of ``world`` ranks (placement aside)."""
    ranks = list(range(world))
    out = [table_wise(t, 0), data_parallel(t, world)]
    out += [row_wise(t, ranks[:k]) for k in range(2, world + 1) if k <= t.rows]
    out += [column_wise(t, ranks[:k]) for k in range(2, world + 1) if k <= t.dim]
    return out


def plan_lower_bound_s(tables: Sequence[TableSpec], cm: CostModel) -> float:
    """No plan of ``tables`` has a smaller ``max_time_s`` (memory ignored; one host).

    The plan's time is, per phase, its slowest rank, plus the sample-side term (the same on
    every rank) and the collectives' fixed latency. A phase's slowest rank is at least the mean
    over ranks, so the time is at least (all shards' time) / ranks + sample side + fixed; each
    table adds at least its cheapest option's share of that, whatever the others do.
    """
    world = cm.topo.world_size
    total = 0.0
    for t in tables:
        total += min(
            sum(cm.shard_cost(t, o.sharding_type, s.rows, s.cols).time_s for s in o.shards) / world
            + cm.sample_side_s(t, o.sharding_type, len(o.shards))
            for o in _options(t, world)
        )
    fixed = min(cm.fixed_s(sharded, dp) for sharded, dp in ((True, False), (False, True)))
    return total + fixed


def run_task_set(tasks: list[Task], batch: int) -> dict:
    """Score planner and baselines on every task; return per-task costs and summary figures."""
    rows = []
    plan_s = []
    for ti, task in enumerate(tasks):
        topo = _topology(task.ranks, task.mem_limit_gb)
        cm = CostModel(topo, batch)
        costs: dict[str, float | None] = {}
        for name in BASELINES:
            plan = greedy_baseline(name, task.tables, cm, seed=ti)
            costs[name] = None if plan is None else cm.evaluate(plan, task.tables).max_time_s
        t0 = time.perf_counter()
        try:
            res = Planner(topo, batch, allow_host=False).plan(task.tables)
            costs["planner"] = res.cost.max_time_s
        except PlanningError:
            costs["planner"] = None
        costs["bound"] = plan_lower_bound_s(task.tables, cm)
        plan_s.append(time.perf_counter() - t0)
        rows.append(costs)
    return {"rows": rows, "plan_s": plan_s}


def _summary(label: str, out: dict) -> dict:
    rows = out["rows"]
    gains, ceilings = [], []
    for c in rows:
        base = [v for k, v in c.items() if k in BASELINES and v is not None]
        if c["planner"] is not None and base:
            gains.append(1.0 - c["planner"] / min(base))
            ceilings.append(1.0 - c["bound"] / min(base))
    means = {}
    for k in [*BASELINES, "planner", "bound"]:
        vals = [c[k] for c in rows if c[k] is not None]
        means[k] = statistics.fmean(vals) * 1e3 if vals else float("nan")
    fails = {k: sum(1 for c in rows if c[k] is None) for k in [*BASELINES, "planner"]}
    return {
        "set": label,
        "tasks": len(rows),
        "mean_max_rank_ms": means,
        "infeasible": fails,
        "gain_vs_best_baseline_mean": statistics.fmean(gains) if gains else float("nan"),
        "gain_vs_best_baseline_worst": min(gains) if gains else float("nan"),
        # What any plan could gain at most (1 - lower bound / best baseline), mean over tasks.
        "gain_ceiling_mean": statistics.fmean(ceilings) if ceilings else float("nan"),
        "planning_s_mean": statistics.fmean(out["plan_s"]),
        "planning_s_max": max(out["plan_s"]),
    }


def _checked_batch(n: int) -> int:
    """``--measure-batch``'s value, checked: a positive even number (2 ranks split the batch)."""
    if n < 2 or n % 2:
        raise ValueError(f"--measure-batch must be a positive even number of samples, not {n}")
    return n


def _even_batch(text: str) -> int:
    """``--measure-batch`` on the command line (``_checked_batch``, as an argparse error)."""
    try:
        return _checked_batch(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive even number of samples, not {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and one JSON line."""
    ap = argparse.ArgumentParser(prog="neorec bench planner", description=__doc__)
    ap.add_argument("--tasks", type=int, default=20, help="tasks per task set")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch-size", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--write-paper-scale", metavar="CSV", help="write the paper-scale table list and exit"
    )
    ap.add_argument(
        "--measure",
        action="store_true",
        help="instead: MEASURE the planner's plan and every greedy baseline's plan of a few small "
        "tasks on 2 gloo ranks here (bench dist --embedding-only), ms/step",
    )
    ap.add_argument("--measure-tasks", type=int, default=4, help="tasks with --measure")
    ap.add_argument(
        "--measure-kind",
        choices=MEASURE_KINDS,
        default="pool",
        help="--measure: pool = bench planner's tasks made small (6-12 pool tables of <= 3e5 "
        "rows, its per-rank memory limit); mix = random mixes of 4-8 tables, no memory limit",
    )
    ap.add_argument(
        "--measure-batch",
        type=_even_batch,
        default=None,
        help="--measure-kind pool: the global batch of every task (default 1024; even: 2 ranks; "
        "4096 measures with about half the round-to-round noise of 1024 here)",
    )
    ap.add_argument(
        "--topology", default="", help="--measure: topology JSON (calibrated; its learned model)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="--measure: rounds (median)")
    ap.add_argument(
        "--cost-model",
        choices=("auto", "learned", "analytical"),
        default="auto",
        help="--measure: the model the planner scores plans with (auto: the topology's learned "
        "one when fitted here)",
    )
    args = ap.parse_args(argv)
    if args.write_paper_scale:
        write_tables_csv(paper_scale_tables(), args.write_paper_scale)
        return 0
    if args.measure_batch is not None and not (args.measure and args.measure_kind == "pool"):
        ap.error("--measure-batch applies to --measure with --measure-kind pool")
    if args.measure:
        return measure_tasks(
            args.measure_tasks,
            args.topology,
            args.repeats,
            args.seed,
            args.cost_model,
            args.measure_kind,
            args.measure_batch,
        )
    pool = make_pool(seed=args.seed)
    summaries = []
    for ranks in args.ranks:
        tasks = make_tasks(pool, ranks, args.tasks, args.batch_size, args.seed)
        summaries.append(_summary(f"{ranks} ranks", run_task_set(tasks, args.batch_size)))
    print(
        "SIMULATION: every method is scored by the same neorec cost model (predicted, not measured)"
    )
    names = [*BASELINES, "planner"]
    hdr = f"{'task set':<10} " + " ".join(f"{n:>18}" for n in names)
    hdr += f" {'gain mean':>10} {'gain worst':>10} {'ceiling':>8} {'plan s':>7}"
    print(
        "mean max-rank predicted time (ms) per step; gain = 1 - planner / best baseline per task;"
    )
    print("ceiling = 1 - lower bound of any plan (plan_lower_bound_s) / best baseline, mean")
    print(hdr)
    print("-" * len(hdr))
    for s in summaries:
        cells = " ".join(f"{s['mean_max_rank_ms'][n]:>18.3f}" for n in names)
        print(
            f"{s['set']:<10} {cells} {s['gain_vs_best_baseline_mean']:>10.1%} "
            f"{s['gain_vs_best_baseline_worst']:>10.1%} {s['gain_ceiling_mean']:>8.1%} "
            f"{s['planning_s_max']:>7.2f}"
        )
        bad = {k: v for k, v in s["infeasible"].items() if v}
        if bad:
            print(f"{'':<10} infeasible (did not fit memory; excluded from best): {bad}")
    ok = all(s["gain_vs_best_baseline_mean"] >= 0.15 for s in summaries)
    print(f"target (mean gain >= 15% on each task set): {'met' if ok else 'NOT met'}")
    print(json.dumps({"bench": "planner", "batch_size": args.batch_size, "sets": summaries}))
    return 0


MEASURE_KINDS = ("pool", "mix")
"""``--measure-kind``: ``pool``, bench planner's tasks made small (``pool_task``); ``mix``, random
table mixes of 4-8 tables without a memory limit (``learned_placements.random_mix``)."""
POOL_MAX_ROWS = 300_000
POOL_MAX_DIM = 128


def _pool_task(
    rng: random.Random, pool: Sequence[TableSpec], topo: Topology, batch: int, opt: str
) -> tuple[list[TableSpec], Topology]:
    """A ``bench planner``-style task small enough for 2 gloo ranks here: 6-12 tables drawn from
    ``pool``'s tables of at most ``POOL_MAX_ROWS`` rows and ``POOL_MAX_DIM`` columns (Zipf 1.05),
    and ``topo`` with ``make_tasks``' per-rank device memory for tables (``mem_limit_gb``; the
    reserve kept on top). The runtime here
    does not enforce the limit; the planner and the baselines plan within it, as in ``bench
    planner``'s simulated tasks."""
    small = [t for t in pool if t.rows <= POOL_MAX_ROWS and t.dim <= POOL_MAX_DIM]
    tables = [
        dataclasses.replace(t, zipf_alpha=1.05) for t in rng.sample(small, rng.randint(6, 12))
    ]
    limit = mem_limit_gb(CostModel(topo, batch, opt), tables, topo.world_size)
    return tables, dataclasses.replace(topo, device_memory_gb=limit + topo.device_reserve_gb)


def measure_tasks(
    n_tasks: int,
    topology: str = "",
    repeats: int = 3,
    seed: int = 0,
    cost_model: str = "auto",
    kind: str = "pool",
    pool_batch: int | None = None,
) -> int:
    """``--measure``: ``n_tasks`` small tasks on 2 gloo ranks here (``kind``: see
    ``MEASURE_KINDS``; ``pool_batch``: the pool tasks' global batch, default 1024; a mix draws its
    own); the planner's plan (scored by the topology's learned model when it has one
    fitted here; its candidates include the baselines' plans) and every greedy baseline's plan,
    each distinct plan measured for real (``bench dist --embedding-only``'s sharded step, medians
    over ``repeats`` rounds; plans that differ only by which rank is which are one plan); prints
    ms/step and one JSON line. A planner plan identical to the best baseline's is a tie (the same
    measurement), not a win."""
    from neorec.bench.dist import run_passes
    from neorec.sharding.learned_cost import specs_dicts
    from neorec.sharding.learned_placements import random_mix

    if kind not in MEASURE_KINDS:
        raise ValueError(f"--measure-kind must be one of {', '.join(MEASURE_KINDS)}, not {kind!r}")
    if pool_batch is not None and kind != "pool":
        raise ValueError(f"--measure-batch applies to --measure-kind pool ({kind} draws its own)")
    pool_batch = 1024 if pool_batch is None else _checked_batch(pool_batch)
    world = 2
    base_topo = Topology.load(topology).with_world(world) if topology else Topology.local_cpu(world)
    rng = random.Random(5000 + seed)
    pool = make_pool(seed=seed)
    tasks: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    for ti in range(n_tasks):
        opt = "rowwise_adagrad"
        if kind == "pool":
            batch = pool_batch
            tables, topo = _pool_task(rng, pool, base_topo, batch, opt)
        else:
            topo = base_topo
            tables, batch, _ = random_mix(rng, f"task{ti}")
            while len(tables) < 4:
                tables, batch, _ = random_mix(rng, f"task{ti}")
        cm = CostModel(topo, batch, opt)
        res = Planner(topo, batch, opt, allow_host=False, cost_model=cost_model).plan(tables)
        model = res.scoring.model if res.scoring else None
        plans: dict[str, ShardingPlan] = {"planner": res.plan}
        for name in BASELINES:
            # seed 0: the random baseline's plan is the one among the planner's candidates
            plan = greedy_baseline(name, tables, cm, seed=0)
            if plan is not None:
                plans[name] = plan
        job_of: dict[str, int] = {}
        keys: dict[str, int] = {}  # plans equal up to which rank is which: measured once
        for label, plan in plans.items():
            key = plan_key(plan.to_dict())
            if key in keys:
                job_of[label] = keys[key]
                continue
            job_of[label] = keys[key] = len(jobs)
            jobs.append(
                {
                    "task": ti,
                    "tables": specs_dicts(tables),
                    "batch": batch,
                    "optimizer": opt,
                    "alpha": tables[0].zipf_alpha,
                    "plan": plan.to_dict(),
                }
            )
        pred = {
            k: model.predict_ms(cm, v, tables)["step"]
            if model
            else 1000 * cm.evaluate(v, tables).max_time_s
            for k, v in plans.items()
        }
        tasks.append(
            {
                "task": ti,
                "tables": len(tables),
                "batch": batch,
                "table_mem_mb": round(topo.device_capacity_bytes / 1e6, 3)
                if kind == "pool"
                else None,
                "scoring": res.scoring,
                "job_of": job_of,
                "predicted_ms": pred,
            }
        )
    rows: list[dict[str, Any]] = []
    for rnd in range(max(1, repeats)):
        # The first round in order, each other one in another (seeded) order, so no plan is
        # always measured first, or right after the same neighbour, on a host whose load drifts;
        # a round builds every plan once and measures them in PASSES interleaved passes of 10
        # steps (a plan's round figure: the median of its passes), as bench costcheck does.
        order = list(range(len(jobs)))
        if rnd:
            random.Random(rnd).shuffle(order)
        got = run_passes([jobs[i] for i in order], world, PASSES, 10, 3, rnd)
        rows.extend(
            {"job": i, "round": rnd, "ms_per_step": g["ms_per_step"]} for i, g in zip(order, got)
        )
    out: list[dict[str, Any]] = []
    print(
        f"MEASURED: {n_tasks} tasks ({kind}) on {world} gloo ranks here; topology: {base_topo.name}"
    )
    print(
        f"{'task':>4} {'tables':>6} {'planner ms':>11} {'best baseline':>20} {'ms':>8} {'gain':>7}"
        f" {'held-out':>9}  {'pred planner / best':>20}"
    )

    def held_out(t: dict[str, Any]) -> dict[str, Any] | None:
        """The best baseline picked on the even rounds, compared with the planner on the odd
        ones: free of the winner's curse of picking the minimum of several noisy baselines on
        the rounds that then measure it (None with fewer than 2 rounds)."""
        if repeats < 2:
            return None

        def med(label: str, parity: int) -> float:
            i = t["job_of"][label]
            return statistics.median(
                r["ms_per_step"] for r in rows if r["job"] == i and r["round"] % 2 == parity
            )

        sel = {k: med(k, 0) for k in t["job_of"] if k != "planner"}
        pick = min(sel, key=lambda k: (sel[k], k))
        p_ms, b_ms = med("planner", 1), med(pick, 1)
        return {
            "baseline": pick,
            "planner_ms": p_ms,
            "baseline_ms": b_ms,
            "gain": 1 - p_ms / b_ms,
            "tie": t["job_of"][pick] == t["job_of"]["planner"],
        }

    for t in tasks:
        med = {
            i: statistics.median(r["ms_per_step"] for r in rows if r["job"] == i)
            for i in set(t["job_of"].values())
        }
        ms = {k: med[i] for k, i in t["job_of"].items()}
        base = {k: v for k, v in ms.items() if k != "planner"}
        best = min(base, key=lambda k: (base[k], k))
        gain = 1 - ms["planner"] / base[best]
        same = [k for k in base if t["job_of"][k] == t["job_of"]["planner"]]
        tie = any(base[k] == base[best] for k in same)  # the best baseline's plan itself
        pr = t["predicted_ms"]
        held = held_out(t)
        held_s = "-" if held is None else "tie" if held["tie"] else f"{held['gain']:.1%}"
        print(
            f"{t['task']:>4} {t['tables']:>6} {ms['planner']:>11.2f} {best:>20} "
            f"{base[best]:>8.2f} {gain:>7.1%} {held_s:>9}  {pr['planner']:>9.2f} / {pr[best]:<9.2f}"
            + (f" (planner = {', '.join(same)})" if same else "")
        )
        out.append(
            {
                "task": t["task"],
                "tables": t["tables"],
                "batch": t["batch"],
                "table_mem_mb": t["table_mem_mb"],
                "cost_model": t["scoring"].to_dict() if t["scoring"] else {},
                "planner_ms": ms["planner"],
                "best_baseline": best,
                "best_baseline_ms": base[best],
                "baselines_ms": base,
                "predicted_ms": {k: round(v, 3) for k, v in pr.items()},
                "planner_same_as": same,
                "tie": tie,
                "gain": gain,
                "held_out": held,
            }
        )
    wins = sum(o["gain"] > 0 and not o["tie"] for o in out)
    ties = sum(o["tie"] for o in out)
    print(
        f"planner faster than the best (measured) baseline on {wins}/{len(out)} tasks, "
        f"the same plan on {ties}, slower on {len(out) - wins - ties}"
    )
    held_all = [o["held_out"] for o in out if o["held_out"] is not None]
    h_wins = sum(h["gain"] > 0 and not h["tie"] for h in held_all)
    h_ties = sum(h["tie"] for h in held_all)
    ratio = math.exp(
        statistics.mean(math.log(o["planner_ms"] / o["best_baseline_ms"]) for o in out)
    )
    if held_all:
        print(
            f"held out (best baseline picked on the even rounds, compared on the odd ones): "
            f"faster on {h_wins}/{len(held_all)}, the same plan on {h_ties}, slower on "
            f"{len(held_all) - h_wins - h_ties}"
        )
    print(f"planner / best baseline, geometric mean over the tasks: {ratio:.3f}")
    print(
        json.dumps(
            {
                "bench": "planner_measure",
                "kind": kind,
                "world": world,
                "repeats": repeats,
                "wins": wins,
                "ties": ties,
                "held_out_wins": h_wins if held_all else None,
                "held_out_ties": h_ties if held_all else None,
                "planner_over_best_geomean": ratio,
                "tasks": out,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
