"""``neorec bench planner``: the planner against DreamShard-style greedy baselines (simulation).

Tasks in the style of AutoShard / DreamShard: 50-100 tables drawn from a pool with
production-like spread (rows log-uniform 1e3..1e8, dims 4..256, heavy-tailed pooling factors),
sharded on 4 or 8 ranks of one host under a per-rank memory limit. The baselines place whole
tables (table-wise), sorted by their key, each onto the rank with the smallest sum of that key
among those it fits on: random, size, dim, lookup (dim x pooling), size-lookup
(dim x pooling x log10 rows). Every method is scored by the same ``CostModel``; the figure is the
slowest rank's predicted time. A benchmark, not a test: it prints a table and a JSON line.

``--measure`` instead measures (not predicts) a few small tasks on 2 gloo ranks here
(``neorec.bench.planner_measure``): the planner's plan and every greedy baseline's plan, each run
for real with the sharded runtime; ``--measure-ceiling K`` also the K best table-wise plans by
each cost model, and how much faster than the best baseline the fastest plan measured was;
``--seed-base S --seeds N`` measures the tasks of N seeds and reports the planner / best baseline
paired ratio with its 95% interval per seed and pooled (``neorec.bench.planner_seeds``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

from neorec.bench.planner_tasks import (
    Task,
    _topology,
    make_pool,
    make_tasks,
    paper_scale_tables,
    write_tables_csv,
)
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.planner import Planner, PlanningError
from neorec.sharding.planner_baselines import BASELINES, greedy_baseline
from neorec.sharding.planner_shortlist import TUNE_ROUNDS
from neorec.sharding.types import (
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
    kinds = ((True, False, False), (False, True, False), (False, False, True))
    fixed = min(cm.fixed_s(*k) for k in kinds)
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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and one JSON line."""
    from neorec.bench.planner_measure import (
        MEASURE_KINDS,
        MeasureOptions,
        _even_batch,
        _nonneg,
        measure_tasks,
    )

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
        "--measure-ceiling",
        type=_nonneg,
        default=0,
        metavar="K",
        help="--measure: also measure the K best table-wise plans of each task by each cost "
        "model (every table-wise plan within the memory limit scored) and report how much "
        "faster the fastest plan measured is than the best baseline's (needs --repeats >= 2)",
    )
    ap.add_argument(
        "--measure-copies",
        type=int,
        default=1,
        metavar="N",
        help="--measure: build and measure each plan N times per round (its own batches and "
        "memory each) and report how far one plan's copies differ: the noise floor",
    )
    ap.add_argument(
        "--planner-tune",
        type=int,
        default=0,
        metavar="K",
        help="--measure: the planner's plan is neorec plan --tune K's (K >= 2 plans measured in "
        "rounds of their own, the fastest kept); the cost model's own pick is measured too "
        "(planner_model)",
    )
    ap.add_argument(
        "--planner-tune-rounds",
        type=int,
        default=TUNE_ROUNDS,
        help=f"--planner-tune: its rounds (default {TUNE_ROUNDS}, as neorec plan --tune)",
    )
    ap.add_argument(
        "--topology", default="", help="--measure: topology JSON (calibrated; its learned model)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="--measure: rounds (median)")
    ap.add_argument(
        "--seed-base",
        type=int,
        default=None,
        metavar="S",
        help="--measure: measure the tasks of seeds S .. S+N-1 (--seeds N; seeds 0-2 were used "
        "in development) and report the planner / best baseline paired ratio with its 95%% "
        "interval per seed and pooled (neorec.bench.planner_seeds)",
    )
    ap.add_argument("--seeds", type=int, default=3, help="--seed-base: how many seeds")
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
    if args.measure_ceiling and not args.measure:
        ap.error("--measure-ceiling applies to --measure")
    if args.measure_ceiling and args.repeats < 2:
        ap.error(
            "--measure-ceiling needs --repeats >= 2 (the pick and the comparison use "
            "different rounds)"
        )
    if args.planner_tune and not args.measure:
        ap.error("--planner-tune applies to --measure")
    if args.planner_tune == 1 or args.planner_tune < 0 or args.planner_tune_rounds < 1:
        ap.error("--planner-tune needs K >= 2 (or 0) and --planner-tune-rounds >= 1")
    if args.measure_copies < 1 or (args.measure_copies > 1 and not args.measure):
        ap.error("--measure-copies needs --measure and N >= 1")
    if args.seed_base is not None and not args.measure:
        ap.error("--seed-base applies to --measure")
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1, not {args.seeds}")
    if args.seed_base is not None and args.repeats < 2:
        ap.error("--seed-base needs --repeats >= 2 (the pick and the comparison use other rounds)")
    options = MeasureOptions(
        topology=args.topology,
        repeats=args.repeats,
        cost_model=args.cost_model,
        kind=args.measure_kind,
        pool_batch=args.measure_batch,
        ceiling=args.measure_ceiling,
        tune=args.planner_tune,
        tune_rounds=args.planner_tune_rounds,
        copies=args.measure_copies,
    )
    if args.measure and args.seed_base is not None:
        from neorec.bench.planner_seeds import measure_seeds

        seeds = range(args.seed_base, args.seed_base + args.seeds)
        return measure_seeds(seeds, args.measure_tasks, options)
    if args.measure:
        return measure_tasks(args.measure_tasks, args.seed, options)
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


if __name__ == "__main__":
    sys.exit(main())
