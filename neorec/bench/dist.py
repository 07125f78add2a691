"""``neorec bench dist --nproc N``: ms per step and bytes per collective for each sharding type.

Spawns N gloo ranks on this machine. Every rank trains a DistributedModel on the same global
batches under plans of one sharding type each (and a mixed plan), for each wire codec setting
(``--codecs``) and training pipeline (``--pipelines``), and reports the median step time (max over
ranks), the time a step waits on communication (median over steps, max over ranks), and the bytes
each collective sent per step (sum over ranks, bytes that leave a rank; DDP's own fp32 all-reduce
is counted as a ring: 2(W-1)/W x dense parameter bytes). With ``--ranks-per-host`` below N the
ranks are taken as hosts of that many ranks: the table-row-wise tables reduce inside them, and the
pooled-embedding bytes that cross hosts per step (all ranks; ``CommStats.inter_host``: outputs,
their gradients, the in-host stage's none) are printed per row (``xhost pooled B``), e.g. row-wise
against table-row-wise: ``--types row_wise,table_row_wise --ranks-per-host 2 --nproc 4``. The type
``row_wise_host`` is row-wise over the table-row-wise plan's shards (each table on the ranks of
one host): the same host layout without the in-host reduction, so the JSON's
``inter_host_reduction`` against it is what the reduction itself saves (against ``row_wise``,
over every rank, it also counts the shards spread over the other hosts).

``--embedding-only`` times only the embedding part of a step, which is what the planner's cost
model predicts: the sharded EBC's forward (input_dist -> compute -> output_dist) and backward with
the fused update, driven by ``(ebc(sparse) * fixed_random_grad).sum()``; no dense arch, no DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.bench.stats import paired_ratio, rotated
from neorec.bench.step import make_batches
from neorec.builder import dense_optimizer, distributed_model
from neorec.config import CommConfig, load_config
from neorec.distributed.comm import (
    TRANSPORTS,
    CommStats,
    close_host_transports,
    init_host_transport,
)
from neorec.measure.jobs import free_port, prepare_embedding, time_embedding
from neorec.ops.memory import keep_freed_heap
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.types import ShardingPlan, row_wise
from neorec.train.pipeline import make_pipeline
from neorec.train.trainer import train_step

__all__ = ["main", "run_ranks", "measure_embedding"]

TYPES = ["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "mixed"]
ROW_WISE_HOST = "row_wise_host"
"""Row-wise over the table-row-wise plan's shards (not a default type: asked by name)."""
POOLED = ("fwd_pooled", "bwd_grads", "fwd_host_reduce", "bwd_host_reduce")
"""The collectives of pooled embeddings and their gradients (``twrw``: the in-host stage)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench dist", description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    p.add_argument("--pooling", type=float, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated sharding types")
    p.add_argument("--ranks-per-host", type=int, default=0, help="default: nproc (one host)")
    p.add_argument(
        "--codecs",
        default="fp32",
        help="comma-separated wire codec settings, each FWD/BWD/ALLREDUCE or one name for all "
        "three (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8), e.g. fp32,fp16/bf16/bf16,fp8_e4m3",
    )
    p.add_argument("--fp8-scaling", default="row", choices=["row", "tensor"])
    p.add_argument(
        "--transport",
        default="auto",
        help="the all-to-alls: auto (shared memory on one host, the default), shm, or gloo; "
        "comma-separated: each is measured, in rotated order, every round",
    )
    p.add_argument(
        "--keep-heap",
        default="on",
        help="ranks keep freed heap memory (system.keep_heap): on (default) or off; on,off: both",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every transport x keep-heap setting, interleaved (fresh ranks each); "
        "ratios to the last setting with a 95%% interval over the rounds",
    )
    p.add_argument(
        "--pipelines", default="overlapped", help="comma-separated: overlapped, sequential"
    )
    p.add_argument("--json-out", default="", help="also write the results here")
    p.add_argument(
        "--embedding-only",
        action="store_true",
        help="time only the sharded embeddings (forward + backward with the fused update)",
    )
    a = p.parse_args(argv)
    for flag, allowed in (("transport", TRANSPORTS), ("keep_heap", ("on", "off"))):
        values = [v.strip() for v in getattr(a, flag).split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            p.error(f"--{flag.replace('_', '-')}: {bad or values!r}: choose from {list(allowed)}")
        setattr(a, flag + "s", values)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    return a


def _config(a: argparse.Namespace):
    return load_config(
        overrides=[
            f"embedding.num_tables={a.tables}",
            f"embedding.rows={a.rows}",
            f"embedding.dim={a.dim}",
            f"embedding.pooling_factor={a.pooling}",
            f"model.bottom_mlp=[64, {a.dim}]",
            "model.top_mlp=[128, 64, 1]",
            f"data.batch_size={a.batch}",
            "train.dense_optimizer='sgd'",
        ]
    )


def _plan(cfg, kind: str, world: int, rph: int):
    tables = cfg.embedding.tables
    if kind == ROW_WISE_HOST:
        twrw = plan_by_type(tables, world, rph, "table_row_wise")
        same = [row_wise(t, [s.rank for s in t.shards]) for t in twrw.tables]
        return ShardingPlan(world, rph, same, {"source": ROW_WISE_HOST})
    if kind != "mixed":
        return plan_by_type(tables, world, rph, kind)
    cycle = ["row_wise", "table_wise", "column_wise", "data_parallel", "table_row_wise"]
    types = {t.name: cycle[i % len(cycle)] for i, t in enumerate(tables)}
    return plan_by_type(tables, world, rph, "table_wise", types)


def _comm(spec: str, fp8_scaling: str, transport: str = "auto") -> CommConfig:
    """``fwd/bwd/allreduce`` or one codec name for all three."""
    parts = spec.split("/")
    fwd, bwd, ar = parts if len(parts) == 3 else parts * 3
    return CommConfig(
        forward=fwd, backward=bwd, allreduce=ar, fp8_scaling=fp8_scaling, transport=transport
    )


def _measure(cfg, plan, pipeline: str, batches, rank: int, world: int, a) -> dict:
    """Train warmup + iters steps; median ms/step, comm wait ms/step, bytes/step (all ranks)."""
    b = a.batch // world
    model = distributed_model(cfg, plan)
    model.comm_stats.ranks_per_host = a.ranks_per_host or world
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    n = a.warmup + a.iters
    # One batch more than steps: the overlapped pipeline's last step stages it, so every measured
    # step pays for one input distribution, as in a long run.
    local = (batches[i % len(batches)].slice(rank * b, (rank + 1) * b) for i in range(n + 1))
    pipe = make_pipeline(pipeline, model, opt, local, train_step)
    times, waits = [], []
    for i in range(n):
        if i == a.warmup:
            model.comm_stats.reset()
        dist.barrier()
        w0 = sum(model.comm_stats.wait_s.values())
        t0 = time.perf_counter()
        pipe.progress(i + 1)
        times.append(time.perf_counter() - t0)
        waits.append(sum(model.comm_stats.wait_s.values()) - w0)
    pipe.close()
    ms = torch.tensor([1000 * statistics.median(times[a.warmup :])])
    wait = torch.tensor([1000 * statistics.median(waits[a.warmup :])])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    dist.all_reduce(wait, op=dist.ReduceOp.MAX)
    sent = {k: v / a.iters for k, v in model.comm_stats.bytes_sent.items()}
    gathered: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, sent)
    total = {k: sum(g.get(k, 0) for g in gathered) for k in set().union(*gathered)}
    return {
        "ms_per_step": round(float(ms), 2),
        "comm_wait_ms": round(float(wait), 2),
        "bytes_per_step": total,
        "bytes_total": sum(total.values()),
        "inter_host_pooled_bytes": _inter_host_pooled(model.comm_stats, a.iters),
    }


def _inter_host_pooled(stats: CommStats, iters: int) -> int:
    """Pooled-embedding bytes per step that crossed hosts, all ranks (a collective)."""
    mine = torch.tensor([float(sum(stats.inter_host.get(n, 0) for n in POOLED))])
    dist.all_reduce(mine)
    return round(float(mine) / iters)


def measure_embedding(cfg, plan: ShardingPlan, batches, rank: int, world: int, a) -> dict:
    """Embedding part of warmup + iters steps: median ms/step (fwd, bwd) and bytes (all ranks)."""
    run = prepare_embedding(cfg, plan, batches, rank, world)
    stats = run["ebc"].comm_stats
    stats.ranks_per_host = getattr(a, "ranks_per_host", 0) or world
    row = time_embedding(run, a.warmup, a.iters)
    return {**row, "inter_host_pooled_bytes": _inter_host_pooled(stats, a.iters)}


def _rank(
    rank: int,
    world: int,
    port: int,
    a: argparse.Namespace,
    q,
    plans: list[tuple[str, ShardingPlan]] | None = None,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if a.keep_heap == "on":
        keep_freed_heap()  # as a training rank does (system.keep_heap)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    used = init_host_transport(a.transport)
    cfg = _config(a)
    batches = make_batches(cfg, 4, a.alpha)
    rows = []
    if plans is None:
        plans = [(k, _plan(cfg, k, world, a.ranks_per_host or world)) for k in a.types.split(",")]
    embedding_only = getattr(a, "embedding_only", False)
    for kind, plan in plans:
        for spec in a.codecs.split(","):
            cfg.comm = _comm(spec, a.fp8_scaling, a.transport)
            if embedding_only:
                row = measure_embedding(cfg, plan, batches, rank, world, a)
                rows.append(
                    {"type": kind, "codecs": spec, "pipeline": "embedding_only", **row}
                    | {"transport": used}
                )
                continue
            for pipeline in a.pipelines.split(","):
                row = _measure(cfg, plan, pipeline, batches, rank, world, a)
                rows.append(
                    {"type": kind, "codecs": spec, "pipeline": pipeline, **row}
                    | {"transport": used}
                )
    if rank == 0:
        q.put(rows)
    close_host_transports()
    dist.destroy_process_group()


def run_ranks(
    a: argparse.Namespace, plans: list[tuple[str, ShardingPlan]] | None = None
) -> list[dict]:
    """Spawn ``a.nproc`` gloo ranks and measure; ``plans`` (label, plan) replace ``a.types``."""
    if a.batch % a.nproc:
        raise SystemExit(f"--batch {a.batch} must be divisible by --nproc {a.nproc}")
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_rank, args=(a.nproc, free_port(), a, q, plans), nprocs=a.nproc, join=True)
    rows: list[dict] = q.get()
    return rows


def run_grid(a: argparse.Namespace) -> dict[str, Any]:
    """Every transport x keep-heap setting in each of ``a.rounds`` rounds, in rotated order, each
    in fresh ranks; per row (type, codecs, pipeline) and setting the rounds' ms/step, and the
    ratio to the last setting (the paired geometric mean over rounds, 95% interval)."""
    settings = [(t, h) for t in a.transports for h in a.keep_heaps]
    ms: dict[str, dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for t, h in rotated(settings, r):
            run = argparse.Namespace(**{**vars(a), "transport": t, "keep_heap": h})
            for row in run_ranks(run):
                key = f"{row['type']} {row['codecs']} {row['pipeline']}"
                ms.setdefault(key, {}).setdefault(f"{t}/{h}", []).append(row["ms_per_step"])
    base = "/".join(settings[-1])
    out: dict[str, Any] = {}
    for key, by in ms.items():
        out[key] = {
            s: {
                "ms_rounds": v,
                "ms_median": statistics.median(v),
                "vs_" + base.replace("/", "_"): paired_ratio(v, by[base]).to_dict(),
            }
            for s, v in by.items()
        }
    return {"baseline": base, "rounds": a.rounds, "results": out}


def _print_grid(a: argparse.Namespace, grid: dict[str, Any]) -> None:
    base = grid["baseline"]
    print(
        f"bench dist: {a.nproc} gloo ranks, {a.rounds} interleaved rounds, {a.tables} tables x "
        f"{a.rows:,} rows x dim {a.dim}, global batch {a.batch}, pooling {a.pooling}, zipf "
        f"{a.alpha}; ms/step (median over rounds), ratio to {base} (95% interval over rounds)"
    )
    print(f"{'row':<36}{'transport/heap':<16}{'ms/step':>9}  ratio [95% interval]")
    for key, by in grid["results"].items():
        for s, v in by.items():
            iv = v["vs_" + base.replace("/", "_")]
            print(
                f"{key:<36}{s:<16}{v['ms_median']:>9.2f}  "
                f"{iv['value']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}]"
            )


def inter_host_reduction(rows: list[dict]) -> dict[str, float]:
    """Pooled bytes between hosts of each row-wise layout measured over table-row-wise's (fp32
    codecs): ``vs_row_wise_host`` (the same host layout: the in-host reduction alone) and
    ``vs_row_wise`` (row-wise over every rank)."""
    by = {r["type"]: r["inter_host_pooled_bytes"] for r in rows if r["codecs"] == "fp32"}
    twrw = by.get("table_row_wise")
    if not twrw:
        return {}
    return {f"vs_{k}": by[k] / twrw for k in ("row_wise_host", "row_wise") if k in by}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    if a.rounds > 1 or len(a.transports) * len(a.keep_heaps) > 1:
        grid = run_grid(a)
        _print_grid(a, grid)
        keys = ("nproc", "tables", "rows", "dim", "batch", "pooling", "alpha", "embedding_only")
        line = json.dumps({"bench": "dist", **{k: getattr(a, k) for k in keys}, **grid})
        print(line)
        if a.json_out:
            with open(a.json_out, "w") as f:
                f.write(line + "\n")
        return 0
    rows = run_ranks(a)
    names = sorted({k for r in rows for k in r["bytes_per_step"]})
    head = (
        f"{'type':<16}{'codecs':<28}{'pipeline':<12}{'ms/step':>9}{'wait ms':>9}{'total B':>12}"
        + f"{'xhost pooled B':>16}"
        + "".join(f"{n:>16}" for n in names)
    )
    print(
        f"bench dist: {a.nproc} gloo ranks (all-to-alls: {rows[0]['transport'] if rows else '-'}), "
        f"{a.tables} tables x {a.rows:,} rows x dim {a.dim}, "
        f"global batch {a.batch}, pooling {a.pooling}, zipf {a.alpha}; bytes per step, all ranks; "
        f"hosts of {a.ranks_per_host or a.nproc} ranks"
    )
    print(head)
    for r in rows:
        cells = "".join(f"{r['bytes_per_step'].get(n, 0):>16,.0f}" for n in names)
        print(
            f"{r['type']:<16}{r['codecs']:<28}{r['pipeline']:<12}{r['ms_per_step']:>9.1f}"
            f"{r['comm_wait_ms']:>9.1f}{r['bytes_total']:>12,.0f}"
            f"{r['inter_host_pooled_bytes']:>16,}{cells}"
        )
    for k, v in inter_host_reduction(rows).items():
        print(f"table_row_wise: {v:.2f}x fewer pooled bytes between hosts than {k[3:]}")
    result = {
        "bench": "dist",
        "nproc": a.nproc,
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "batch": a.batch,
        "pooling": a.pooling,
        "alpha": a.alpha,
        "fp8_scaling": a.fp8_scaling,
        "embedding_only": a.embedding_only,
        "ranks_per_host": a.ranks_per_host or a.nproc,
        "results": rows,
        "inter_host_reduction": inter_host_reduction(rows),
    }
    line = json.dumps(result)
    print(line)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(line + "\n")
    return 0
