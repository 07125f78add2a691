"""Measured placements: sharded embedding steps of given plans on this machine's gloo ranks.

What ``neorec plan --calibrate`` (the learned cost model's placements) and ``neorec plan --tune``
(a planner's shortlist) measure, and ``bench costcheck`` / ``bench planner --measure`` report:
each job is a set of tables, a batch, an optimizer, Zipf ids and a plan; it runs as the real
sharded runtime's embedding step (input_dist -> compute -> output_dist, backward with the fused
update) in spawned gloo ranks, built once and stepped in interleaved passes.
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.builder import sharded_collection
from neorec.config import load_config
from neorec.data.synthetic import zipf_batches
from neorec.distributed.comm import close_host_transports, init_host_transport
from neorec.machine import cpu_share
from neorec.ops.memory import keep_freed_heap
from neorec.sharding.plan_json import parse_plan_dict
from neorec.sharding.types import ShardingPlan

__all__ = [
    "prepare_embedding",
    "time_embedding",
    "job_config",
    "run_jobs",
    "run_passes",
    "free_port",
]


def prepare_embedding(cfg, plan: ShardingPlan, batches, rank: int, world: int) -> dict:
    """What ``time_embedding`` steps: this rank's sharded EBC of ``plan``, its slices of
    ``batches`` and a fixed random output gradient (built once, stepped in several passes)."""
    b = cfg.data.batch_size // world
    ebc = sharded_collection(cfg, plan)
    local = [bt.slice(rank * b, (rank + 1) * b).sparse for bt in batches]
    g = torch.Generator().manual_seed(1000 + rank)
    grad = torch.randn(b, ebc.output_dim, generator=g)
    return {"ebc": ebc, "local": local, "grad": grad, "steps": 0}


def time_embedding(run: dict, warmup: int, iters: int) -> dict:
    """``warmup`` + ``iters`` embedding steps (forward + backward with the fused update) of a
    ``prepare_embedding`` run on every rank: the slowest rank's median ms per step (fwd, bwd,
    comm wait) and the bytes each collective sent per step (all ranks)."""
    ebc, local, grad = run["ebc"], run["local"], run["grad"]
    world = dist.get_world_size()
    n = warmup + iters
    times, fwds, waits = [], [], []
    for i in range(n):
        if i == warmup:
            ebc.comm_stats.reset()
        dist.barrier()
        w0 = sum(ebc.comm_stats.wait_s.values())
        t0 = time.perf_counter()
        out = ebc(local[run["steps"] % len(local)])
        t1 = time.perf_counter()
        (out * grad).sum().backward()
        t2 = time.perf_counter()
        run["steps"] += 1
        times.append(t2 - t0)
        fwds.append(t1 - t0)
        waits.append(sum(ebc.comm_stats.wait_s.values()) - w0)
    stats = torch.tensor(
        [1000 * statistics.median(x[warmup:]) for x in (times, fwds, waits)]
        + [1000 * statistics.median([t - f for t, f in zip(times, fwds)][warmup:])]
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    sent = {k: v / iters for k, v in ebc.comm_stats.bytes_sent.items()}
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, sent)
    total = {k: sum(g.get(k, 0) for g in gathered) for k in set().union(*gathered)}
    ms, fwd_ms, wait_ms, bwd_ms = (round(float(x), 2) for x in stats)
    return {
        "ms_per_step": ms,
        "fwd_ms": fwd_ms,
        "bwd_ms": bwd_ms,
        "comm_wait_ms": wait_ms,
        "bytes_per_step": total,
        "bytes_total": sum(total.values()),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- measured placements of mixed tables (calibration of the learned cost model) -------------
def job_config(job: dict):
    """The config of one measured placement: its own tables (rows, dim, pooling of each),
    global batch and fused optimizer (``neorec.measure.calibrate`` makes these jobs)."""
    import dataclasses

    from neorec.config import TableConfig

    cfg = load_config(
        overrides=[
            f"data.batch_size={int(job['batch'])}",
            f"embedding.optimizer='{job['optimizer']}'",
            "train.dense_optimizer='sgd'",
        ]
    )
    tables = [
        TableConfig(
            name=t["name"],
            rows=int(t["rows"]),
            dim=int(t["dim"]),
            pooling_factor=float(t["pooling_factor"]),
        )
        for t in job["tables"]
    ]
    cfg.embedding = dataclasses.replace(cfg.embedding, tables=tables)
    return cfg


def _jobs_rank(
    rank: int, world: int, port: int, jobs: list, deadline: float, opts: dict, q
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cpu_share().usable() // world))  # the CPUs it may use
    keep_freed_heap()  # as a training rank does (launch.init_rank_group)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    init_host_transport()
    rows = []
    t_start = time.time()
    built: dict[str, dict] = {}  # this block's placements, built once, stepped in each pass
    block = None
    for i, job in enumerate(jobs):
        # Rank 0 decides (one clock): no placement starts after the deadline.
        started = time.time()
        go = torch.tensor([1 if started < deadline else 0])
        dist.broadcast(go, 0)
        if not int(go):
            break
        key = job.get("placement")
        if key is None or job.get("block") != block:
            built.clear()  # the last block's modules go before this one's are built
            block = job.get("block")
        warmup = opts["warmup"]
        if key is not None and key in built:
            run = built[key]
            warmup = min(warmup, opts.get("rewarm", 1))  # warm again after the others' passes
        else:
            cfg = job_config(job)
            batches = zipf_batches(
                cfg.embedding.tables, cfg.data.batch_size, cfg.model.num_dense, 2,
                float(job["alpha"]), seed=int(job.get("seed", i)),
            )  # fmt: skip
            plan = parse_plan_dict(job["plan"])
            run = prepare_embedding(cfg, plan, batches, rank, world)
            if key is not None:
                built[key] = run
        row = time_embedding(run, warmup, opts["iters"])
        rows.append({"job": i, "started": started, **row})
        if rank == 0 and opts.get("progress"):
            left = max(0.0, deadline - time.time())
            done, total = opts.get("progress_at", (0, len(jobs)))
            print(
                f"  placement {done + i + 1}/{total}: {len(job['tables'])} tables, "
                f"{row['ms_per_step']:.1f} ms/step ({time.time() - t_start:.0f} s, "
                f"{left:.0f} s of the budget left)",
                flush=True,
            )
    built.clear()
    if rank == 0:
        q.put(rows)
    close_host_transports()
    dist.destroy_process_group()


def run_jobs(
    jobs: list[dict],
    nproc: int,
    deadline: float,
    iters: int = 10,
    warmup: int = 2,
    progress: bool = True,
    rewarm: int = 1,
    progress_at: tuple[int, int] | None = None,
) -> list[dict]:
    """Measure placements of mixed tables on ``nproc`` gloo ranks, in order, until ``deadline``
    (``time.time()``): no placement starts after it (one may run past it). Each job: ``tables``
    (name, rows, dim, pooling_factor), ``batch``, ``optimizer``, ``alpha`` (Zipf ids) and
    ``plan`` (a plan dict); optional ``seed`` (of its batches; default its index).

    Interleaved passes: jobs that carry a ``placement`` id and the same ``block`` as the job
    before them share their placement's built model: a placement is built at its first job
    (``warmup`` + ``iters`` steps) and each later job of it in the block is one more pass of
    ``rewarm`` + ``iters`` steps on the same model. A block listing its placements several times
    in turn (``[a, b, c, a, b, c, ...]``) so measures each of them spread over the block's time,
    not in one window of a host whose speed drifts by seconds. Returns one row per measured job
    (``job`` index, ``started`` (rank 0's ``time.time()`` when it began: before ``deadline``),
    ``ms_per_step``, ``fwd_ms``, ``bwd_ms``, ``comm_wait_ms``; the slowest rank's medians)."""
    if not jobs or time.time() >= deadline:
        return []
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    opts: dict[str, Any] = {
        "iters": iters,
        "warmup": warmup,
        "progress": progress,
        "rewarm": rewarm,
    }
    if progress_at is not None:  # (jobs before these, all jobs) when a caller runs them in parts
        opts["progress_at"] = progress_at
    args = (nproc, free_port(), jobs, deadline, opts, q)
    procs = mp.spawn(_jobs_rank, args=args, nprocs=nproc, join=False)
    # Read before joining: rank 0's rows can exceed a pipe's buffer, and its put would then wait
    # for this read while this process waited for it to exit (a deadlock with join=True).
    rows: list[dict] | None = None
    while rows is None:
        if not q.empty():
            rows = q.get()
        elif procs.join(timeout=0.5):  # every rank exited (a rank's failure raises here)
            rows = q.get() if not q.empty() else []
    while not procs.join():
        pass
    return rows


def run_passes(
    jobs: list[dict], nproc: int, passes: int, iters: int, warmup: int = 3, block: object = 0
) -> list[dict[str, float]]:
    """One block of ``jobs`` in fresh ranks: each built once and measured in ``passes``
    interleaved passes of ``iters`` steps (``run_jobs``); per job, the median over its passes of
    ``ms_per_step``, ``fwd_ms``, ``bwd_ms`` and ``comm_wait_ms``. A job with no measurement is a
    ``SystemExit`` naming it."""
    n = len(jobs)
    blk = [{**j, "placement": f"j{i}", "block": block, "seed": i} for i, j in enumerate(jobs)]
    rows = run_jobs(blk * passes, nproc, float("inf"), iters, warmup, progress=False)
    out = []
    for i in range(n):
        mine = [r for r in rows if r["job"] % n == i]
        if not mine:
            raise SystemExit(f"neorec: error: placement {i} of the block was not measured")
        out.append(
            {
                k: statistics.median(float(r[k]) for r in mine)
                for k in ("ms_per_step", "fwd_ms", "bwd_ms", "comm_wait_ms")
            }
        )
    return out
