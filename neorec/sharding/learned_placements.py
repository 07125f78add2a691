"""The designed set of placements the learned cost model is fitted and validated on, and the
speed references measured next to them.

The designed set (``designed_jobs``) cycles through four kinds of blocks, each block measured
``repeats`` times in a row (a sample is the median of its placement's measurements):

- ``bench``: a mix drawn like ``bench costcheck``'s tables (4-8 tables of 2.5e4-1.26e5 rows, dims
  16-64, pooling 5-30, Zipf skew, often all alike) placed whole-plan by kind as costcheck places
  them (all table-wise, row-wise, column-wise, table-row-wise, data-parallel, a mixed cycle),
  plus the greedy baselines' plans and the planner's (analytical) plan;
- ``task``: a random mix of 4-8 tables (``bench planner --measure``'s kind of task) placed by the
  greedy baselines, the planner and one random placement;
- ``pool``: ``bench planner --measure``'s own kind of task (``pool_mix``: 6-12 tables drawn as
  ``bench planner``'s pool, batch 4096) placed by the greedy baselines, the planner and two random
  table-wise partitions: contrasts between the plans the planner chooses among;
- ``random``: three random mixes (2-8 tables: rows, dims, pooling, one Zipf skew, batch,
  optimizer), each placed once at random (a sharding type per table, random ranks and shard
  geometry) and once as a whole-plan kind drawn at random (``random_<kind>``).

A seed picks the mixes, so other seeds are held out (``neorec bench costcheck --random-plans``,
``bench planner --measure``). The speed references (``reference_jobs``) are one fixed mix placed
three ways, measured with every block: they say how fast the machine is at that moment. The
measured placements become calibration samples and the fit in ``neorec.sharding.learned_fit``.
Split out of ``neorec.sharding.learned_cost``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from neorec.sharding.cost_model import TableSpec
from neorec.sharding.learned_cost import specs_dicts
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.planner_baselines import plan_key
from neorec.sharding.tables import OPTIMIZERS, pool_table
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan

__all__ = [
    "DESIGN_CYCLE",
    "POOL_MAX_ROWS",
    "POOL_MAX_DIM",
    "REFERENCE_KINDS",
    "reference_jobs",
    "reference_ms",
    "speed_of",
    "bench_like_mix",
    "kind_plans",
    "designed_jobs",
    "random_mix",
    "pool_mix",
    "random_placement",
    "random_jobs",
    "plan_job",
]


# ---- the designed set of placements -----------------------------------------------------------
def random_mix(
    rng: Any, mix: str, n_tables: tuple[int, int] = (2, 8)
) -> tuple[list[TableSpec], int, str]:
    """A random table mix (``n_tables`` tables, 2-8: rows 1e3..1e5 log-uniform, dims 8..64,
    pooling 1..30, one Zipf skew), a global batch and a fused optimizer, from ``rng``
    (``random.Random``)."""
    n = rng.randint(*n_tables)
    alpha = rng.choice((0.0, 0.8, 1.05, 1.2))
    tables = [
        TableSpec(
            name=f"{mix}_t{i}",
            rows=int(10 ** rng.uniform(3.0, 5.0)),
            dim=rng.choice((8, 16, 32, 64)),
            pooling_factor=float(max(1, round(math.exp(rng.uniform(0.0, math.log(30.0)))))),
            zipf_alpha=alpha,
        )
        for i in range(n)
    ]
    batch = rng.choice((512, 1024, 1024, 2048))
    opt = rng.choices(OPTIMIZERS, (0.1, 0.8, 0.1))[0]
    return tables, batch, opt


POOL_MAX_ROWS = 300_000
POOL_MAX_DIM = 128
"""``pool`` blocks' (and ``bench planner --measure``'s) tables: ``pool_table``'s of at most these
rows and columns, small enough for 2 gloo ranks here."""


def pool_mix(rng: Any, mix: str) -> tuple[list[TableSpec], int, str]:
    """``bench planner --measure``'s kind of task: 6-12 tables drawn as ``bench planner``'s pool
    (``pool_table``: heavy-tailed pooling, dims 4-128) of at most ``POOL_MAX_ROWS`` rows and
    ``POOL_MAX_DIM`` columns, Zipf 1.05, a global batch of 4096, row-wise Adagrad."""
    n = rng.randint(6, 12)
    tables: list[TableSpec] = []
    while len(tables) < n:
        t = pool_table(rng, f"{mix}_t{len(tables)}")
        if t.rows <= POOL_MAX_ROWS and t.dim <= POOL_MAX_DIM:
            tables.append(dataclasses.replace(t, zipf_alpha=1.05))
    return tables, 4096, "rowwise_adagrad"


def table_wise_partition(rng: Any, tables: Sequence[TableSpec], world: int) -> ShardingPlan:
    """Every table whole on a random rank (the plans a table-wise planner chooses among)."""
    from neorec.sharding.types import table_wise

    out = [table_wise(t, rng.randrange(world)) for t in tables]
    plan = ShardingPlan(world, 1, out, {"source": "neorec.sharding.learned_cost partition"})
    validate_plan(plan)
    return plan


def random_placement(rng: Any, tables: Sequence[TableSpec], world: int, rph: int) -> ShardingPlan:
    """A random valid placement of ``tables``: a sharding type per table and random ranks."""
    from neorec.sharding.types import (
        column_wise,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )

    ranks = list(range(world))
    out = []
    for t in tables:
        kinds = ["tw", "tw", "dp"] + (["rw", "cw"] if world > 1 else []) + (["twrw"] * (rph > 1))
        k = rng.choice(kinds)
        if k == "dp":
            out.append(data_parallel(t, world))
        elif k == "tw":
            out.append(table_wise(t, rng.randrange(world)))
        elif k == "rw":
            m = rng.randint(2, world)
            out.append(row_wise(t, sorted(rng.sample(ranks, m))))
        elif k == "cw":
            n = rng.choice([s for s in (2, 4) if s <= t.dim // 4] or [2])
            start = rng.randrange(world)
            out.append(column_wise(t, [ranks[(start + i) % world] for i in range(world)], n))
        else:
            out.append(table_row_wise(t, rng.randrange(world // rph), rph))
    plan = ShardingPlan(world, rph, out, {"source": "neorec.sharding.learned_cost random"})
    validate_plan(plan)
    return plan


def random_jobs(
    n_mixes: int, world: int, rph: int, seed: int = 0, per_mix: int = 2
) -> list[dict[str, Any]]:
    """``n_mixes`` random table mixes x ``per_mix`` random placements each, as measurable jobs
    (``neorec.measure.jobs.run_jobs``): tables, batch, optimizer, alpha, plan and the mix label.
    Different seeds give other mixes (``neorec bench costcheck --random-plans`` holds them out)."""
    import random

    rng = random.Random(seed)
    jobs = []
    for m in range(n_mixes):
        mix = f"s{seed}m{m}"
        tables, batch, opt = random_mix(rng, mix)
        for _ in range(per_mix):
            plan = random_placement(rng, tables, world, rph)
            jobs.append(plan_job(tables, batch, opt, plan, mix=mix))
    return jobs


DESIGN_CYCLE = ("random", "bench", "random", "task", "pool")
"""Blocks of ``designed_jobs`` in turn (a bench block has ~10 placements, a task block ~6, a
pool block ~8, a random one 6 + ``SMALL_MIXES``; a pool block's steps are the longest: batch 4096
and up to 12 tables)."""
SMALL_MIXES = 3
"""Extra random mixes of 2-3 tables per random block (one random placement each)."""


def bench_like_mix(rng: Any, mix: str) -> tuple[list[TableSpec], int, str]:
    """A mix drawn like ``bench costcheck``'s tables: 4-8 tables of 2.5e4-1.26e5 rows (log-
    uniform), dims 16-64, pooling 5-30, one Zipf skew, all tables alike half the time; global
    batch 512 or (mostly) 1024; row-wise Adagrad mostly."""
    n = rng.randint(4, 8)
    alpha = rng.choice((0.0, 0.8, 1.05, 1.05, 1.2))
    same = rng.random() < 0.5

    def draw() -> tuple[int, int, float]:
        return (
            int(10 ** rng.uniform(4.4, 5.1)),
            rng.choice((16, 32, 32, 64)),
            float(rng.choice((5, 10, 15, 20, 20, 25, 30))),
        )

    first = draw()
    tables = []
    for i in range(n):
        rows, dim, pool = first if same else draw()
        tables.append(
            TableSpec(name=f"{mix}_t{i}", rows=rows, dim=dim, pooling_factor=pool, zipf_alpha=alpha)
        )
    batch = rng.choice((512, 1024, 1024, 1024))
    opt = rng.choices(OPTIMIZERS, (0.1, 0.8, 0.1))[0]
    return tables, batch, opt


def kind_plans(
    rng: Any, tables: Sequence[TableSpec], world: int, rph: int
) -> list[tuple[str, ShardingPlan]]:
    """Whole-plan kinds as ``bench costcheck`` places them (``plan_by_type``): every table
    table-wise (round robin), row-wise, column-wise (one slice per rank), table-row-wise (when
    hosts have > 1 rank), data-parallel, and a mixed cycle of types from a random offset."""
    from neorec.sharding.fixed_plan import plan_by_type

    kinds = ["table_wise", "row_wise", "column_wise", "data_parallel"]
    kinds += ["table_row_wise"] if rph > 1 else []
    out = [(k, plan_by_type(tables, world, rph, k)) for k in kinds]
    cycle = ["row_wise", "table_wise", "column_wise", "data_parallel"]
    cycle += ["table_row_wise"] if rph > 1 else []
    off = rng.randrange(len(cycle))
    types = {t.name: cycle[(i + off) % len(cycle)] for i, t in enumerate(tables)}
    out.append(("mixed", plan_by_type(tables, world, rph, "table_wise", types)))
    return out


def searched_plans(
    topo: Topology, tables: Sequence[TableSpec], batch: int, opt: str
) -> list[tuple[str, ShardingPlan]]:
    """The greedy baselines' plans and the planner's (analytical model), duplicates dropped."""
    from neorec.sharding.planner import Planner
    from neorec.sharding.planner_baselines import baseline_candidates

    p = Planner(topo, batch, opt, allow_host=False, cost_model="analytical")
    out = [("planner", p.plan(tables).plan), *baseline_candidates(p, tables)]
    uniq: list[tuple[str, ShardingPlan]] = []
    for label, plan in out:
        if all(plan.tables != q.tables for _, q in uniq):
            uniq.append((label, plan))
    return uniq


def plan_job(
    tables: Sequence[TableSpec], batch: int, optimizer: str, plan: ShardingPlan, **labels: Any
) -> dict[str, Any]:
    """``plan`` of ``tables`` as one measurable job (``neorec.measure.jobs.run_passes``): the
    tables, batch, optimizer, the ids' Zipf alpha (one for all tables: the first's) and the plan,
    with ``labels`` (``mix``, ``task``, ``label``, ...) first, which the runtime ignores."""
    return {
        **labels,
        "tables": specs_dicts(tables),
        "batch": batch,
        "optimizer": optimizer,
        "alpha": tables[0].zipf_alpha,
        "plan": plan.to_dict(),
    }


def designed_jobs(
    topo: Topology, world: int, rph: int, n_jobs: int, seed: int = 0, repeats: int = 3
) -> list[dict[str, Any]]:
    """About ``n_jobs`` measurements of the designed set (see the module docstring): blocks of
    placements cycling through ``DESIGN_CYCLE``, each block's jobs ``repeats`` times in a row
    (every job carries its ``placement`` id; ``samples_from_rows`` takes the median). Cut off by
    a time budget, a run still has whole blocks of every kind."""
    import random

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = random.Random(seed)
    topo = topo.with_world(world, rph)
    jobs: list[dict[str, Any]] = []
    block = 0
    while len(jobs) < n_jobs:
        kind = DESIGN_CYCLE[block % len(DESIGN_CYCLE)]
        mix = f"d{seed}b{block}"
        block += 1
        todo: list[dict[str, Any]] = []
        if kind == "bench":
            tables, batch, opt = bench_like_mix(rng, mix)
            plans = kind_plans(rng, tables, world, rph)
            plans += searched_plans(topo, tables, batch, opt)
            todo += [plan_job(tables, batch, opt, p, mix=mix, design=label) for label, p in plans]
        elif kind == "pool":
            # the planner's target tasks: their plans differ by a few percent, so the contrasts
            # between plans of one mix (greedy keys, the planner's, random partitions) teach the
            # model what orders them
            tables, batch, opt = pool_mix(rng, mix)
            plans = searched_plans(topo, tables, batch, opt)
            plans += [("partition", table_wise_partition(rng, tables, world)) for _ in range(2)]
            todo += [plan_job(tables, batch, opt, p, mix=mix, design=label) for label, p in plans]
        elif kind == "task":
            tables, batch, _ = random_mix(rng, mix)
            while len(tables) < 4:
                tables, batch, _ = random_mix(rng, mix)
            opt = "rowwise_adagrad"
            plans = searched_plans(topo, tables, batch, opt)
            plans.append(("random", random_placement(rng, tables, world, rph)))
            todo += [plan_job(tables, batch, opt, p, mix=mix, design=label) for label, p in plans]
        else:
            for m in range(3):
                tables, batch, opt = random_mix(rng, f"{mix}m{m}")
                p = random_placement(rng, tables, world, rph)
                todo.append(plan_job(tables, batch, opt, p, mix=f"{mix}m{m}", design="random"))
                # and one whole-plan kind of the same small mix (every table column-wise, say):
                # one type per table drawn at random rarely makes one of these for few tables
                label, p = rng.choice(kind_plans(rng, tables, world, rph))
                todo.append(
                    plan_job(tables, batch, opt, p, mix=f"{mix}m{m}", design=f"random_{label}")
                )
            for m in range(3, 3 + SMALL_MIXES):
                # mixes of 2-3 tables: the cheapest to measure (their steps are mostly the
                # collectives' fixed latency) and the least well predicted; without these they
                # are 2 in 7 of the random mixes, a tenth of the samples
                tables, batch, opt = random_mix(rng, f"{mix}m{m}", (2, 3))
                p = random_placement(rng, tables, world, rph)
                todo.append(
                    plan_job(tables, batch, opt, p, mix=f"{mix}m{m}", design="random_small")
                )
        uniq: list[dict[str, Any]] = []
        seen: set[str] = set()
        for j in todo:  # a kind's plan can be a baseline's (all table-wise, round robin)
            key = j["mix"] + plan_key(j["plan"])  # one plan up to which rank is which
            if key not in seen:
                seen.add(key)
                uniq.append({**j, "placement": f"{mix}p{len(uniq)}"})
        # the references first: a block the budget cuts short still has its speed measured
        refs = [{**r, "placement": f"{mix}{r['placement']}"} for r in reference_jobs(world, rph)]
        uniq = refs + uniq
        uniq = [{**j, "block": mix, "seed": len(jobs) + n} for n, j in enumerate(uniq)]
        for _ in range(repeats):  # interleaved passes over the block (run_jobs)
            jobs.extend(uniq)
    return jobs


# ---- the machine's speed at the moment: reference placements ----------------------------------
REFERENCE_KINDS = ("table_wise", "row_wise", "data_parallel")
"""How the reference mix is placed: the work of the three kinds of plan (lookups on their owner,
row-split lookups with their exchange, the data-parallel gradient all-reduce)."""


def reference_jobs(world: int, rph: int) -> list[dict[str, Any]]:
    """The speed references: one fixed mix (4 tables x 40,000 rows x dim 32, pooling 15, Zipf
    1.05, batch 1024, row-wise Adagrad) placed each way of ``REFERENCE_KINDS``. Measured with
    every calibration block and every check round, interleaved with the placements there, they
    say how fast this machine is at that moment relative to the calibration's median: the learned
    model is fitted on times divided by that speed and predicts at the calibration's speed, and
    a check that measured the references multiplies by its own speed (``speed_of``)."""
    from neorec.sharding.fixed_plan import plan_by_type

    tables = [
        TableSpec(name=f"ref_t{i}", rows=40_000, dim=32, pooling_factor=15.0, zipf_alpha=1.05)
        for i in range(4)
    ]
    return [
        {
            **plan_job(
                tables,
                1024,
                "rowwise_adagrad",
                plan_by_type(tables, world, rph, k),
                mix="reference",
                design="reference",
            ),
            "reference": k,
            "placement": f"ref_{k}",
        }
        for k in REFERENCE_KINDS
    ]


def reference_ms(
    jobs: Sequence[dict[str, Any]], rows: Sequence[dict]
) -> dict[str, dict[str, float]]:
    """Per block (``jobs``' ``block``; ``""`` for none), the median measured ms/step of each
    reference kind among ``run_jobs`` ``rows`` (kinds not measured there are absent)."""
    import statistics

    got: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        j = jobs[r["job"]]
        if j.get("design") == "reference":
            got.setdefault(str(j.get("block", "")), {}).setdefault(j["reference"], []).append(
                float(r["ms_per_step"])
            )
    return {b: {k: statistics.median(v) for k, v in d.items()} for b, d in got.items()}


def speed_of(measured: dict[str, float], reference: dict[str, float]) -> float:
    """The machine's speed factor: geometric mean over the reference kinds measured in both of
    ``measured`` ms / ``reference`` ms (> 1: slower than when the model was fitted); 1.0 when
    none is shared."""
    ks = [k for k in REFERENCE_KINDS if k in measured and k in reference]
    if not ks:
        return 1.0
    return math.exp(sum(math.log(measured[k] / reference[k]) for k in ks) / len(ks))
