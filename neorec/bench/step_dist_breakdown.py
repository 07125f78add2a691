"""``neorec bench step --breakdown --nproc N``: a distributed step's time split into phases, each
next to its floor (``docs/performance.md``, "The distributed step against its floors").

N gloo ranks on this machine each run the trainer's own distributed step: the model of
``builder.distributed_model`` under the config's plan (``builder.resolve_plan``), the trainer's
pipeline (``train.pipeline``) and ``train.steps.train_step`` with the NaN guard, on the rank's
slice of the same global batches as the one-process breakdown. Steps alternate between timed by
phase and untimed (whose medians give the whole step); a barrier precedes each step, outside it.

Marks: the pipeline's staging (wrapped here: the batch taken, its checks, then the rest of the
input distribution: the split by shard and the lengths' all-to-all); the sharded collection's
``marks`` (the ids' wait, the lookup, the pooled all-to-all, and in backward the dense
backward's end, the gradients' all-to-all, the TBE update); the step's seams (``step_timing``).
What ``backward()`` still does after the TBE update is DDP's wait for its gradient all-reduce
(``allreduce``); a DDP comm hook's all-reduce (codecs, or the blocks' tree on 4+ ranks) runs
inside the dense backward, and the time ``CommStats`` records for it is moved to ``allreduce``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.bench.floors import Floors, measure_floors
from neorec.bench.step_phases import (
    COMM_PHASE,
    DIST_PHASES,
    LocalLookup,
    StepShape,
    dist_phase_work,
    phase_floor_ms,
    summarize,
)
from neorec.bench.step_timing import (
    PhaseTimer,
    attach_timer,
    fresh_batches,
    make_batches,
    print_table,
    result_fields,
    row_state_bytes,
    step_shape,
)
from neorec.builder import apply_system, dense_optimizer, distributed_model, resolve_plan
from neorec.data.batch import Batch
from neorec.distributed.comm import close_host_transports, host_transport
from neorec.errors import ConfigError
from neorec.measure.jobs import free_port
from neorec.modules.collection_parts import checked_batch
from neorec.train.pipeline import make_pipeline
from neorec.train.steps import Step

__all__ = ["run_dist_breakdown", "attach_dist_timer", "local_lookup"]


def check_args(cfg: Any, a: argparse.Namespace) -> None:
    """Refuse what the distributed breakdown does not run, in one line, before any rank."""
    if a.nproc < 2:
        raise ConfigError(f"bench step --breakdown --nproc {a.nproc}: N must be >= 2 (or 1)")
    if cfg.data.batch_size % a.nproc:
        raise ConfigError(
            f"bench step --breakdown --nproc {a.nproc}: data.batch_size {cfg.data.batch_size} "
            "must be divisible by it"
        )
    if cfg.lowp.mode != "off":
        raise ConfigError("bench step --breakdown --nproc: lowp.mode must be off (one process)")
    if any(t.storage != "memory" or t.kind == "dynamic" for t in cfg.embedding.tables):
        raise ConfigError("bench step --breakdown --nproc: fixed tables in memory only")


def run_dist_breakdown(cfg: Any, a: argparse.Namespace) -> int:
    """Spawn the ranks; print the table (max over ranks) and one JSON line."""
    check_args(cfg, a)
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(a.nproc, free_port(), cfg, a, q), nprocs=a.nproc, join=True)
    ranks: list[dict] = q.get()
    result = combine(cfg, a, ranks)
    print_table(result, DIST_PHASES)
    print(
        f"{a.nproc} ranks x {result['threads']} threads, all-to-alls over {result['transport']} "
        f"(DDP's all-reduce over gloo); phases sum / step by rank: "
        + ", ".join(f"{x:.3f}" for x in result["phase_sum_over_step_by_rank"])
    )
    print(json.dumps(result))
    return 0


def _rank(rank: int, world: int, port: int, cfg: Any, a: argparse.Namespace, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // world))
    apply_system(cfg.system, distributed=True)
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        mine = measure_rank(cfg, a, rank, world)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            q.put(every)
        dist.barrier()
    finally:
        close_host_transports()
        dist.destroy_process_group()


def _wrap_staging(model: Any, timer: PhaseTimer) -> None:
    """Mark the pipeline's staging of a batch: taken (``batch_prep``), checked (``batch_prep``:
    the checks ``input_dist`` would run, run here first and the batch marked checked, so they
    run once), then the rest of ``input_dist`` (the split by shard, the lengths' all-to-all)."""
    inner, ebc = model.stage_input_dist, model.ebc

    def staged(sparse: Any, host: Any = None) -> None:
        timer.mark("batch_prep")
        src = host if host is not None else sparse
        if checked_batch(ebc, src) is src:
            src.checked_for = ebc  # type: ignore[attr-defined]
        timer.mark("batch_prep")
        inner(sparse, host)
        timer.mark("input_dist")

    model.stage_input_dist = staged


def attach_dist_timer(model: Any, opt: Any, timer: PhaseTimer) -> tuple[Any, _AroundStep]:
    """Attach ``timer`` to a distributed step from outside: the sharded collection's marks
    (``ebc.marks``), the step's seams (``step_timing.attach_timer``; ``backward()`` returns after
    the TBE update, marked by the collection, so what ends it is DDP's all-reduce wait,
    ``allreduce``) and a pipeline hook around the step (``_AroundStep``). Returns the guard to
    step with and the hook."""
    model.ebc.marks = timer  # (it marks only while the timer is active)
    guard = attach_timer(model, opt, timer, backward_end="allreduce")
    return guard, _AroundStep(timer, model.comm_stats)


class _AroundStep:
    """Before the step: ``input_dist`` ends (from the staging's end: nothing but the call).
    After it: a DDP comm hook's all-reduce ran inside the dense backward, so the time
    ``CommStats`` records for it moves to ``allreduce``; the step ends."""

    def __init__(self, timer: PhaseTimer, stats: Any) -> None:
        self.timer, self.stats, self.hooked0 = timer, stats, 0.0

    def before_step(self, step: int) -> None:
        """Mark ``input_dist``; note the comm hook's time so far."""
        self.timer.mark("input_dist")
        self.hooked0 = self.stats.wait_s.get("allreduce_dense", 0.0)

    def after_step(self, step: int, loss: Any) -> None:
        """Move the comm hook's time to ``allreduce``; end the step."""
        timer = self.timer
        if timer.active:
            moved = self.stats.wait_s.get("allreduce_dense", 0.0) - self.hooked0
            timer.cur["dense_backward"] = timer.cur.get("dense_backward", 0.0) - moved
            timer.cur["allreduce"] = timer.cur.get("allreduce", 0.0) + moved
        timer.end()


def measure_rank(cfg: Any, a: argparse.Namespace, rank: int, world: int) -> dict:
    """This rank's phase medians, step median, bytes per collective and per step, its share of
    the lookup; rank 0's also the floors (measured after the steps, alone)."""
    batches = make_batches(cfg, 4, a.alpha)
    b = cfg.data.batch_size // world
    model = distributed_model(cfg, resolve_plan(cfg, world))
    ebc, stats = model.ebc, model.comm_stats
    if not hasattr(ebc, "marks"):
        raise ConfigError("bench step --breakdown --nproc: a sharded collection of fixed tables")
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    timer = PhaseTimer()
    guard, around = attach_dist_timer(model, opt, timer)
    _wrap_staging(model, timer)

    local = [x.slice(rank * b, (rank + 1) * b) for x in batches]
    bf16 = bool(a.bf16 or cfg.train.bf16_dense)
    pipe = make_pipeline(
        cfg.train.pipeline, model, opt, fresh_batches(local), Step(guard=guard), bf16=bf16,
        hooks=[around],
    )  # fmt: skip
    whole: list[float] = []
    for i in range(a.warmup + 2 * a.iters):
        timer.active = i >= a.warmup and i % 2 == 0  # phases on every other step
        if i == a.warmup:
            stats.reset()
        dist.barrier()
        timer.begin()
        t0 = time.perf_counter()
        pipe.progress(i + 1)
        if i >= a.warmup and not timer.active:
            whole.append(time.perf_counter() - t0)
    pipe.close()
    guard.check()
    steps = 2 * a.iters
    plan = {n: "bf16" for n, _ in model.dense_arch.named_modules()} if bf16 else {}
    out = {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "transport": "shm" if host_transport(ebc.group) is not None else "gloo",
        "pipeline": cfg.train.pipeline,
        "ms": timer.medians_ms(),
        "step_ms": 1000 * statistics.median(whole),
        "timed_step_ms": 1000 * statistics.median(sum(x.values()) for x in timer.steps),
        "sent": {k: v / steps for k, v in stats.bytes_sent.items()},
        "lookup": local_lookup(ebc, batches),
        "shape": step_shape(_local_cfg(cfg, b), model, local, plan),
        "state": {d: row_state_bytes(cfg.embedding.optimizer, d) for d in ebc.layout.dims},
        "sharding": sorted({t.sharding_type.value for t in ebc.plan.tables}),
    }
    del model, ebc, opt, pipe
    gc.collect()
    dist.barrier()
    # Rank 0 alone, with a rank's threads (the others wait): the fastest a rank moves bytes.
    out["floors"] = measure_floors(array_mb=a.floor_mb, gemm_n=a.gemm_n) if rank == 0 else None
    dist.barrier()
    return out


def _local_cfg(cfg: Any, b: int) -> Any:
    """``cfg`` with a rank's batch of ``b`` samples (the dense side's phase model)."""
    local = copy.deepcopy(cfg)
    local.data.batch_size = b
    return local


def local_lookup(ebc: Any, batches: list[Batch]) -> LocalLookup:
    """This rank's share of the lookup of the global ``batches`` (mean over them): each local
    unit's ids (its feature's ids in its shard's rows) and each local table's distinct rows."""
    units, lay = ebc.local_units, ebc.layout
    ids = [0.0] * len(units)
    rows = [0.0] * lay.num_tables
    for bt in batches:
        per_table: list[list[torch.Tensor]] = [[] for _ in range(lay.num_tables)]
        for j, u in enumerate(units):
            v = bt.sparse.feature(ebc.feature_names[u.feature])[0]
            if u.row_split:
                v = v[(v >= u.shard.row_start) & (v < u.shard.row_end)]
            ids[j] += v.numel() / len(batches)
            per_table[lay.feature_table[j]].append(v)
        for t, vs in enumerate(per_table):
            rows[t] += torch.unique(torch.cat(vs)).numel() / len(batches) if vs else 0
    return LocalLookup(
        bags=batches[0].size,
        unit_ids=tuple(round(n) for n in ids),
        unit_dims=tuple(u.dim for u in units),
        table_rows=tuple(round(n) for n in rows),
        table_dims=tuple(lay.dims),
    )


def combine(cfg: Any, a: argparse.Namespace, ranks: list[dict]) -> dict:
    """The ranks' figures as one breakdown: the step is the slowest rank's median, and so are the
    phases (they add up to it; a phase's max over ranks, ``ms_max_over_ranks``, would count a
    wait twice: one rank's dense backward is the other's wait in the gradients' all-to-all);
    each phase's work is the largest any rank did (so its floor too)."""
    floors: Floors = ranks[0]["floors"]
    works = [dist_phase_work(r["shape"], r["lookup"], r["sent"], r["state"]) for r in ranks]
    work = {
        p: max((w[p] for w in works), key=lambda x: phase_floor_ms(x, floors)[0])
        for p in DIST_PHASES
    }
    slow = max(ranks, key=lambda r: r["step_ms"])
    ms = {p: slow["ms"].get(p, 0.0) for p in DIST_PHASES}
    out = summarize(work, ms, floors, slow["step_ms"])
    for p in out["phases"]:
        p["ms_max_over_ranks"] = round(max(r["ms"].get(p["name"], 0.0) for r in ranks), 5)
        p["ms_by_rank"] = [round(r["ms"].get(p["name"], 0.0), 5) for r in ranks]
    shape: StepShape = ranks[0]["shape"]
    result = result_fields(cfg, a, out, floors, {}, shape)
    by_rank = [sum(r["ms"].values()) / r["step_ms"] for r in ranks]
    sent = {k for r in ranks for k in r["sent"]}
    return {
        **result,
        "nproc": a.nproc,
        "transport": ranks[0]["transport"],
        "pipeline": ranks[0]["pipeline"],
        "threads": ranks[0]["threads"],
        "local_batch": shape.batch,
        "sharding": ranks[0]["sharding"],
        "slowest_rank": slow["rank"],
        "step_ms_by_rank": [round(r["step_ms"], 4) for r in ranks],
        "timed_step_ms_by_rank": [round(r["timed_step_ms"], 4) for r in ranks],
        "phase_sum_over_step_by_rank": [round(x, 4) for x in by_rank],
        "bytes_sent_per_step": [{k: round(v) for k, v in r["sent"].items()} for r in ranks],
        "collectives_not_modelled": sorted(sent - COMM_PHASE.keys()),
    }
