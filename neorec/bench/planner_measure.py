"""``neorec bench planner --measure``: the planner's plan and every greedy baseline's plan of a few
small tasks, each run for real on 2 gloo ranks here (``bench dist --embedding-only``'s sharded
step), ms per step; with ``--measure-ceiling K`` also the K best table-wise plans by each cost
model (every table-wise plan within the memory limit scored), and how much faster the fastest
plan measured is than the best baseline's: what any planner could win on these tasks here."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

from neorec.bench.planner_tasks import make_pool, mem_limit_gb
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.learned_cost import LearnedCostModel
from neorec.sharding.learned_placements import POOL_MAX_DIM, POOL_MAX_ROWS
from neorec.sharding.planner import Planner
from neorec.sharding.planner_baselines import BASELINES, greedy_baseline, plan_key
from neorec.sharding.planner_shortlist import TUNE_ROUNDS, shortlist
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan, table_wise

__all__ = [
    "MEASURE_KINDS",
    "PASSES",
    "POOL_MAX_ROWS",
    "POOL_MAX_DIM",
    "MeasureOptions",
    "measure_tasks",
]

PASSES = 5
"""Interleaved passes per round of ``--measure`` (10 steps each)."""


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


def _nonneg(text: str) -> int:
    """``--measure-ceiling`` on the command line: a whole number >= 0."""
    try:
        k = int(text)
    except ValueError:
        k = -1
    if k < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, not {text!r}")
    return k


CEILING_MAX_TABLES = 14
"""``--measure-ceiling`` scores every table-wise plan of a task: 2^(tables - 1) of them on 2
ranks (the first table's rank fixed: the mirror image is the same plan)."""


def top_table_wise(
    tables: Sequence[TableSpec], cm: CostModel, model: LearnedCostModel | None, k: int
) -> dict[str, ShardingPlan]:
    """The ``k`` best table-wise plans of ``tables`` on 2 ranks by the analytical model
    (``analytical_top{i}``) and, with ``model``, by the learned one (``learned_top{i}``): every
    plan that fits ``cm``'s memory (``PlanCost.fits``), scored (ties by order)."""
    if len(tables) > CEILING_MAX_TABLES:
        raise ValueError(
            f"--measure-ceiling scores every table-wise plan: at most {CEILING_MAX_TABLES} "
            f"tables, not {len(tables)}"
        )
    plans, costs = [], []
    for a in itertools.product((0, 1), repeat=len(tables) - 1):
        plan = ShardingPlan(2, 2, [table_wise(t, r) for t, r in zip(tables, (0, *a))])
        cost = cm.evaluate(plan, tables)
        if cost.fits:  # the planner's own memory check
            plans.append(plan)
            costs.append(cost)
    scores = {"analytical": [c.max_time_s for c in costs]}
    if model is not None:
        scores["learned"] = [model.step_s(cm, p, tables, c) for p, c in zip(plans, costs)]
    out = {}
    for name, sc in scores.items():
        order = sorted(range(len(plans)), key=lambda i: (sc[i], i))
        out.update({f"{name}_top{i}": plans[j] for i, j in enumerate(order[:k])})
    return out


MEASURE_KINDS = ("pool", "mix")
"""``--measure-kind``: ``pool``, bench planner's tasks made small (``pool_task``); ``mix``, random
table mixes of 4-8 tables without a memory limit (``learned_placements.random_mix``)."""


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


@dataclasses.dataclass(frozen=True)
class MeasureOptions:
    """What ``measure_result`` measures and how (checked there, not here): its flags."""

    topology: str = ""
    """A topology JSON (``--topology``); empty: this machine's local CPU topology."""
    repeats: int = 3
    """Rounds of measurement (``--repeats``)."""
    cost_model: str = "auto"
    """The planner's scoring (``--cost-model``)."""
    kind: str = "pool"
    """The tasks: one of ``MEASURE_KINDS`` (``--measure-kind``)."""
    pool_batch: int | None = None
    """The pool tasks' global batch (``--measure-batch``); None: 1024."""
    ceiling: int = 0
    """Each task's ``top_table_wise`` plans measured too (``--measure-ceiling``); 0: none."""
    tune: int = 0
    """The planner's shortlist of this many plans measured to pick one (``--planner-tune``)."""
    tune_rounds: int = TUNE_ROUNDS
    """The shortlist's rounds (``--planner-tune-rounds``)."""
    copies: int = 1
    """Copies of each plan built per round (``--measure-copies``)."""


def measure_tasks(*args: Any, **kwargs: Any) -> int:
    """``measure_result``, its table and its JSON line (the last line of stdout)."""
    print(json.dumps(measure_result(*args, **kwargs)))
    return 0


def measure_result(
    n_tasks: int, seed: int = 0, options: MeasureOptions = MeasureOptions()
) -> dict[str, Any]:
    """``--measure``: ``n_tasks`` small tasks of ``seed`` on 2 gloo ranks here (``options.kind``:
    see ``MEASURE_KINDS``; ``options.pool_batch``: the pool tasks' global batch, default 1024; a
    mix draws its own); the planner's plan (scored by the topology's learned model when it has one
    fitted here; its candidates include the baselines' plans) and every greedy baseline's plan,
    each distinct plan measured for real (``bench dist --embedding-only``'s sharded step, medians
    over ``options.repeats`` rounds; plans that differ only by which rank is which are one plan);
    prints ms/step and returns the JSON result. A planner plan identical to the best baseline's is
    a tie (the same measurement), not a win.

    ``options.ceiling`` > 0 (``--measure-ceiling``): also each task's ``top_table_wise`` plans;
    the fastest of all its measured plans (picked on the even rounds) against the best baseline
    (picked the same way), both compared on the odd rounds: how much faster than the greedy
    baselines any plan measured here was (needs ``options.repeats`` >= 2)."""
    from neorec.measure.jobs import run_passes
    from neorec.measure.plan_tune import tune as tune_plans
    from neorec.sharding.learned_placements import plan_job, random_mix

    topology, repeats, cost_model = options.topology, options.repeats, options.cost_model
    kind, pool_batch, ceiling = options.kind, options.pool_batch, options.ceiling
    tune, tune_rounds, copies = options.tune, options.tune_rounds, options.copies

    if kind not in MEASURE_KINDS:
        raise ValueError(f"--measure-kind must be one of {', '.join(MEASURE_KINDS)}, not {kind!r}")
    if pool_batch is not None and kind != "pool":
        raise ValueError(f"--measure-batch applies to --measure-kind pool ({kind} draws its own)")
    pool_batch = 1024 if pool_batch is None else _checked_batch(pool_batch)
    if copies < 1:
        raise ValueError(f"--measure-copies must be >= 1, not {copies}")
    if tune == 1 or tune < 0 or tune_rounds < 1:
        raise ValueError(
            f"--planner-tune must be 0 or >= 2 plans, with >= 1 rounds, not {tune} and "
            f"{tune_rounds}"
        )
    if ceiling < 0 or (ceiling and repeats < 2):
        raise ValueError(
            f"--measure-ceiling must be >= 0 and needs --repeats >= 2, not {ceiling} with {repeats}"
        )
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
        planner = Planner(topo, batch, opt, allow_host=False, cost_model=cost_model)
        res = planner.plan(tables)
        model = res.scoring.model if res.scoring else None
        plans: dict[str, ShardingPlan] = {"planner": res.plan}
        tuning = None
        if tune:
            # neorec plan --tune: the shortlist measured in its own rounds (fresh ranks, before
            # and apart from this bench's rounds, which measure the pick again with the others)
            cands = shortlist(planner, res, tune)
            tuning = tune_plans(cands, tables, batch, opt, tune_rounds)
            plans["planner_model"] = res.plan  # the cost model's own pick, measured too
            plans["planner"] = next(c.plan for c in cands if c.label == tuning["picked"])
        for name in BASELINES:
            # seed 0: the random baseline's plan is the one among the planner's candidates
            plan = greedy_baseline(name, tables, cm, seed=0)
            if plan is not None:
                plans[name] = plan
        if ceiling:
            plans.update(top_table_wise(tables, cm, model, ceiling))
        job_of: dict[str, int] = {}
        keys: dict[str, int] = {}  # plans equal up to which rank is which: measured once
        for label, plan in plans.items():
            key = plan_key(plan.to_dict())
            if key in keys:
                job_of[label] = keys[key]
                continue
            job_of[label] = keys[key] = len(jobs)
            jobs.append(plan_job(tables, batch, opt, plan, task=ti))
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
                "tuning": tuning,
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
        # With copies > 1 each plan is built that many times in the round (its own batches and
        # memory each): its figures are every copy's, and the copies' spread is the noise floor.
        block = [(i, c) for i in order for c in range(copies)]
        got = run_passes([jobs[i] for i, _ in block], world, PASSES, 10, 3, rnd)
        rows.extend(
            {"job": i, "copy": c, "round": rnd, "ms_per_step": g["ms_per_step"]}
            for (i, c), g in zip(block, got)
        )
    out: list[dict[str, Any]] = []
    print(
        f"MEASURED: {n_tasks} tasks ({kind}) on {world} gloo ranks here; topology: {base_topo.name}"
    )
    print(
        f"{'task':>4} {'tables':>6} {'planner ms':>11} {'best baseline':>20} {'ms':>8} {'gain':>7}"
        f" {'held-out':>9}  {'pred planner / best':>20}"
    )

    def med_of(t: dict[str, Any], label: str, parity: int) -> float:
        """Median ms/step of ``label``'s plan of task ``t`` over the even (0) or odd (1) rounds."""
        i = t["job_of"][label]
        return statistics.median(
            r["ms_per_step"] for r in rows if r["job"] == i and r["round"] % 2 == parity
        )

    def by_round(t: dict[str, Any], label: str, parity: int) -> dict[int, float]:
        """``label``'s plan of task ``t``: its ms/step per even (0) or odd (1) round (the median
        over its copies)."""
        i = t["job_of"][label]
        got: dict[int, list[float]] = {}
        for r in rows:
            if r["job"] == i and r["round"] % 2 == parity:
                got.setdefault(r["round"], []).append(r["ms_per_step"])
        return {k: statistics.median(v) for k, v in got.items()}

    def held_out(t: dict[str, Any]) -> dict[str, Any] | None:
        """The best baseline picked on the even rounds, compared with the planner on the odd
        ones: free of the winner's curse of picking the minimum of several noisy baselines on
        the rounds that then measure it (None with fewer than 2 rounds)."""
        if repeats < 2:
            return None
        sel = {k: med_of(t, k, 0) for k in t["job_of"] if k in BASELINES}
        pick = min(sel, key=lambda k: (sel[k], k))
        p_ms, b_ms = med_of(t, "planner", 1), med_of(t, pick, 1)
        # Paired by round: the two plans ran in the same processes and block of each round, so
        # a round's drift (the host's load, the processes' luck) cancels in their ratio.
        p_r, b_r = by_round(t, "planner", 1), by_round(t, pick, 1)
        ratios = [p_r[k] / b_r[k] for k in sorted(p_r)]
        # per odd round, for bench.stats.paired_ratio (planner_seeds)
        p_rounds, b_rounds = [p_r[k] for k in sorted(p_r)], [b_r[k] for k in sorted(p_r)]
        return {
            "baseline": pick,
            "planner_ms": p_ms,
            "baseline_ms": b_ms,
            "gain": 1 - p_ms / b_ms,
            "tie": t["job_of"][pick] == t["job_of"]["planner"],
            "paired_ratio": statistics.median(ratios),
            "rounds_faster": sum(x < 1 for x in ratios),
            "rounds_slower": sum(x > 1 for x in ratios),
            "planner_rounds_ms": p_rounds,
            "baseline_rounds_ms": b_rounds,
        }

    def fastest_of_all(t: dict[str, Any], held: dict[str, Any]) -> dict[str, Any]:
        """``--measure-ceiling``: the fastest of every plan measured (picked on the even rounds,
        baselines first on a tie) against ``held``'s best baseline, both on the odd rounds; its
        ``same_as``: every label of that plan (a greedy baseline's among them or not)."""
        sel = {k: med_of(t, k, 0) for k in t["job_of"]}
        pick = min(sel, key=lambda k: (sel[k], k not in BASELINES, k))
        f_ms = med_of(t, pick, 1)
        same = sorted(k for k, i in t["job_of"].items() if i == t["job_of"][pick])
        return {
            "fastest": pick,
            "same_as": same,
            "fastest_ms": f_ms,
            "baseline_ms": held["baseline_ms"],
            "ratio": f_ms / held["baseline_ms"],
            "is_baseline": any(k in BASELINES for k in same),
        }

    def copy_spread(i: int) -> float:
        """(max - min) / mean of job ``i``'s copies' medians over the rounds."""
        m = [
            statistics.median(r["ms_per_step"] for r in rows if r["job"] == i and r["copy"] == c)
            for c in range(copies)
        ]
        return (max(m) - min(m)) / statistics.fmean(m)

    for t in tasks:
        med = {
            i: statistics.median(r["ms_per_step"] for r in rows if r["job"] == i)
            for i in set(t["job_of"].values())
        }
        spread = (
            statistics.median(copy_spread(i) for i in set(t["job_of"].values()))
            if copies > 1
            else None
        )
        ms = {k: med[i] for k, i in t["job_of"].items()}
        base = {k: v for k, v in ms.items() if k in BASELINES}
        best = min(base, key=lambda k: (base[k], k))
        gain = 1 - ms["planner"] / base[best]
        same = [k for k in base if t["job_of"][k] == t["job_of"]["planner"]]
        tie = any(base[k] == base[best] for k in same)  # the best baseline's plan itself
        pr = t["predicted_ms"]
        held = held_out(t)
        held_s = "-" if held is None else "tie" if held["tie"] else f"{held['gain']:.1%}"
        ceil = fastest_of_all(t, held) if ceiling and held is not None else None
        print(
            f"{t['task']:>4} {t['tables']:>6} {ms['planner']:>11.2f} {best:>20} "
            f"{base[best]:>8.2f} {gain:>7.1%} {held_s:>9}  {pr['planner']:>9.2f} / {pr[best]:<9.2f}"
            + (f" (planner = {', '.join(same)})" if same else "")
        )
        if spread is not None:
            print(
                f"{'':>4} {'':>6} copies of one plan differ by {spread:.1%} (median over the "
                f"task's plans): the planner's gain is "
                + ("within" if abs(gain) <= spread else "beyond")
                + " that"
            )
        if ceil is not None:
            print(
                f"{'':>4} {'':>6} fastest of {len(set(t['job_of'].values()))} plans measured: "
                f"{'/'.join(ceil['same_as'])} {ceil['fastest_ms']:.2f} ms, "
                f"/ best baseline {ceil['ratio']:.3f} (odd rounds)"
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
                "ceiling": ceil,
                "plans_ms": ms,
                "copy_spread": spread,
                "tuning": t["tuning"],
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
    paired = None
    if held_all:
        paired = math.exp(statistics.mean(math.log(h["paired_ratio"]) for h in held_all))
        fast, slow = (sum(h[k] for h in held_all) for k in ("rounds_faster", "rounds_slower"))
        print(
            f"held out, paired by round (planner / that baseline in the same round, the median "
            f"over the odd rounds): geometric mean {paired:.3f}; the planner faster in {fast} "
            f"task-rounds, slower in {slow}"
        )
    model_ratio = None
    if tune:
        model_ratio = math.exp(
            statistics.mean(
                math.log(o["plans_ms"]["planner_model"] / o["best_baseline_ms"]) for o in out
            )
        )
        print(
            f"tuned: the cost model's own pick / best baseline {model_ratio:.3f}; the tuned "
            f"pick was the model's on {sum(o['tuning']['picked'] == 'planner' for o in out)}, "
            f"a greedy baseline's on {sum(o['tuning']['picked'] in BASELINES for o in out)} "
            f"of {len(out)} tasks"
        )
    ceils = [o["ceiling"] for o in out if o["ceiling"] is not None]
    ceil_ratio = math.exp(statistics.mean(math.log(c["ratio"]) for c in ceils)) if ceils else None
    if ceils:
        print(
            f"ceiling: the fastest of every plan measured (the planner's, the baselines', "
            f"{ceiling} best table-wise by each model; picked on the even rounds) / best "
            f"baseline on the odd rounds, geometric mean {ceil_ratio:.3f}; it was a greedy "
            f"baseline's plan on {sum(c['is_baseline'] for c in ceils)}/{len(ceils)} tasks"
        )
    return {
        "bench": "planner_measure",
        "seed": seed,
        "kind": kind,
        "world": world,
        "repeats": repeats,
        "wins": wins,
        "ties": ties,
        "held_out_wins": h_wins if held_all else None,
        "ceiling_k": ceiling,
        "ceiling_over_best_geomean": ceil_ratio,
        "held_out_ties": h_ties if held_all else None,
        "held_out_paired_geomean": paired,
        "planner_over_best_geomean": ratio,
        "planner_tune": tune,
        "copies": copies,
        "model_pick_over_best_geomean": model_ratio,
        "tasks": out,
    }
