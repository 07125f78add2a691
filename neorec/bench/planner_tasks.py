"""``neorec bench planner``'s tasks: tables drawn from a pool with production-like spread, sharded
on one host of 4 or 8 ranks under a per-rank memory limit; and the paper-scale table list.
``bench planner --measure`` draws its small tasks from the same pool and limit."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.planner_baselines import _tw_bytes
from neorec.sharding.tables import pool_table
from neorec.sharding.topology import GB, Topology

__all__ = [
    "make_pool",
    "paper_scale_tables",
    "write_tables_csv",
    "Task",
    "mem_limit_gb",
    "make_tasks",
]


def make_pool(n: int = 856, seed: int = 0) -> list[TableSpec]:
    """A pool of tables with production-like spread (seeded; ``pool_table``)."""
    rng = random.Random(seed)
    return [pool_table(rng, f"pool{i}") for i in range(n)]


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
