"""Micro-benchmarks that calibrate the planner's ``Topology`` on this machine (``--calibrate``).

Measured with torch: random row gathers and scatter-adds of embedding rows (device memory
bandwidth as TBE sees it), a large memcpy (host <-> device; on CPU the same memory) and a copy
between two processes' shared buffers (intra-host all-to-all, approximated by a memcpy through
shared memory). Inter-host bandwidth cannot be measured on one machine and stays an assumption
unless given. Prints a table and a JSON line, and writes the topology JSON.

The constants the cost model uses are then measured the way a training step uses them:

- ``device_bw_gbs``: one fused TBE step (the real backend's pooled forward + backward-update with
  the fused optimizer) on one rank's thread share, run by all ranks of the host at once (they
  share cores, caches and DRAM; slowest rank), converted to bandwidth with the cost model's own
  byte accounting (``CostModel.shard_cost`` at 1 GB/s), so predicted = measured on that shape;
- ``unfused_bw_gbs``: the runtime's unfused row update (the backend's ``row_grads`` +
  ``update_table_rows``, taken for column-wise row-wise Adagrad) on the same shape, the same way
  (all ranks at once, cost-model bytes);
- ``dp_update_bw_gbs``: a data-parallel table's backward on one rank (``row_grads`` of its ids,
  then ``apply_row_grads`` over two ranks' (id, row sum) pairs, as after the all-gather), the
  same way;
- ``row_split_bw_gbs``: the runtime's ``input_dist`` under a row-wise plan minus a table-wise one
  (bucketing ids by row range), as id bytes per second;
- ``collective_latency_us`` and ``intra_host_bw_gbs``: ``world_size`` gloo processes running the
  runtime's ``all_to_all`` (tiny messages for the latency, large ones for the bandwidth of the
  bytes that leave a rank).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.distributed.comm import close_host_transports, init_host_transport
from neorec.machine import cpu_share
from neorec.measure.calibrate_learned import (
    DEFAULT_BUDGET_S,
    _print_model,
    _refit,
    calibrate_learned,
)
from neorec.ops.memory import keep_freed_heap
from neorec.sharding.topology import GB, Topology

__all__ = [
    "measure",
    "measure_tbe",
    "measure_unfused",
    "measure_dp_update",
    "measure_row_split",
    "measure_comm",
    "calibrate",
    "main",
]


from neorec.measure.calibrate_micro import (
    _torch_threads,
    measure,
    measure_dp_update,
    measure_tbe,
    measure_unfused,
)


def measure_row_split(
    rows: int = 100_000, tables: int = 4, batch: int = 1024, pooling: int = 20, repeat: int = 9
) -> dict[str, float]:
    """Throughput (GB/s of 8-byte ids) of the runtime's row-wise input split.

    ``ShardedEmbeddingBagCollection.input_dist`` of one batch (``batch`` samples, ``pooling``
    uniform ids per table) under a row-wise plan minus the same under a table-wise plan: the
    bucketing of ids by row range (and the longer lengths) that only row-split tables pay.
    Collective over the default group when one is initialized (every rank calls it), else on a
    one-process gloo group made (and destroyed) here: row-wise with one shard still takes the split
    path.
    """
    with _process_group():
        return _row_split(dist.get_world_size(), rows, tables, batch, pooling, repeat)


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """The default process group if there is one, else a one-process gloo group for the block."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            dist.destroy_process_group()


def measure_overhead(tables: int = 8, batch: int = 512, repeat: int = 15) -> dict[str, float]:
    """Fixed host time of a sharded embedding step: ``ShardedEmbeddingBagCollection`` forward +
    backward on one rank (a one-process gloo group: no collective latency) with ``tables`` tiny
    tables (16 rows x dim 4, one id per bag, so bytes cost nothing) and with one: per shard
    ``(t_tables - t_1) / (tables - 1)``, per step ``t_1`` minus that shard share."""
    with _process_group():
        return _overhead(tables, batch, repeat)


def _overhead(tables: int, batch: int, repeat: int) -> dict[str, float]:
    from neorec.config import TableConfig
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection
    from neorec.modules.collection import CollectionSpec
    from neorec.sharding.fixed_plan import plan_by_type
    from neorec.sparse import SparseFeatures

    world = dist.get_world_size()
    med = {}
    for n in (1, tables):
        cfgs = [TableConfig(name=f"o{i}", rows=16, dim=4) for i in range(n)]
        plan = plan_by_type(cfgs, world, world, "table_wise")
        ebc = ShardedEmbeddingBagCollection(cfgs, CollectionSpec(), plan=plan)
        g = torch.Generator().manual_seed(0)
        sparse = SparseFeatures(
            [c.name for c in cfgs],
            torch.randint(0, 16, (n * batch,), generator=g),
            torch.ones(n * batch, dtype=torch.int64),
        )
        times = []
        for i in range(repeat + 2):
            t0 = time.perf_counter()
            ebc(sparse).sum().backward()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        med[n] = statistics.median(times)
    per_shard = max(0.0, (med[tables] - med[1]) / max(1, tables - 1))
    return {
        "shard_overhead_us": 1e6 * per_shard,
        "step_overhead_us": 1e6 * max(0.0, med[1] - per_shard),
    }


def _row_split(
    world: int, rows: int, tables: int, batch: int, pooling: int, repeat: int
) -> dict[str, float]:
    from neorec.config import TableConfig
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection
    from neorec.modules.collection import CollectionSpec
    from neorec.sharding.fixed_plan import plan_by_type
    from neorec.sparse import SparseFeatures

    g = torch.Generator().manual_seed(0)
    cfgs = [TableConfig(name=f"t{i}", rows=rows, dim=4) for i in range(tables)]
    n = tables * batch * pooling
    sparse = SparseFeatures(
        [c.name for c in cfgs],
        torch.randint(0, rows, (n,), generator=g),
        torch.full((tables * batch,), pooling, dtype=torch.int64),
    )
    med = {}
    for kind in ("table_wise", "row_wise"):
        plan = plan_by_type(cfgs, world, world, kind)
        ebc = ShardedEmbeddingBagCollection(cfgs, CollectionSpec(), plan=plan)
        times = []
        for i in range(repeat + 1):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            pending = ebc.input_dist(sparse)
            if i:
                times.append(time.perf_counter() - t0)
            pending.wait()
        med[kind] = statistics.median(times)
    split = max(med["row_wise"] - med["table_wise"], 1e-6)
    return {"row_split_ms": 1000 * split, "row_split_gbs": n * 8 / split / GB}


def _comm_rank(rank: int, world: int, port: int, q, repeat: int, optimizer: str) -> None:
    from neorec.distributed.comm import all_to_all

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cpu_share().usable() // world))  # the CPUs it may use
    keep_freed_heap()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    init_host_transport()

    def run(per_peer: int) -> float:
        send = torch.zeros(per_peer * world)
        splits = [per_peer] * world
        times = []
        for i in range(repeat + 1):
            dist.barrier()
            t0 = time.perf_counter()
            all_to_all(send, splits, splits).wait()
            if i:
                times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    # The fused step on every rank at once: ranks of a host share its cores, caches and DRAM.
    dist.barrier()
    tbe = measure_tbe(torch.get_num_threads(), optimizer, repeat=15)
    slowest = torch.tensor([tbe["tbe_fwd_ms"] + tbe["tbe_bwd_ms"]])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    tbe["tbe_gbs"] *= (tbe["tbe_fwd_ms"] + tbe["tbe_bwd_ms"]) / float(slowest)
    dist.barrier()
    unf = measure_unfused(torch.get_num_threads(), optimizer, repeat=15)
    slowest = torch.tensor([unf["unfused_bwd_ms"]])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    unf["unfused_gbs"] *= unf["unfused_bwd_ms"] / float(slowest)
    dist.barrier()
    dpu = measure_dp_update(torch.get_num_threads(), optimizer, repeat=15)
    slowest = torch.tensor([dpu["dp_update_ms"]])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dpu["dp_update_gbs"] *= dpu["dp_update_ms"] / float(slowest)
    split = measure_row_split(repeat=15)
    slowest = torch.tensor([split["row_split_ms"]])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    split["row_split_gbs"] *= split["row_split_ms"] / float(slowest)
    small = run(1)
    big_elems = 4 * 1024 * 1024  # 16 MB to each peer
    big = run(big_elems)
    if rank == 0:
        off_rank = big_elems * 4 * (world - 1)
        q.put(
            {
                "concurrent_tbe_gbs": tbe["tbe_gbs"],
                "concurrent_unfused_gbs": unf["unfused_gbs"],
                "concurrent_dp_update_gbs": dpu["dp_update_gbs"],
                "concurrent_row_split_gbs": split["row_split_gbs"],
                "a2a_latency_us": 1e6 * small,
                "a2a_gbs": off_rank / max(big - small, 1e-9) / GB,
            }
        )
    close_host_transports()
    dist.destroy_process_group()


def measure_comm(
    world_size: int, repeat: int = 9, optimizer: str = "rowwise_adagrad"
) -> dict[str, float]:
    """Latency (us) and bandwidth (GB/s of bytes leaving a rank) of gloo all-to-all here, and
    ``measure_tbe``'s bandwidth with all ``world_size`` processes running it at once (slowest)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    args = (world_size, port, q, repeat, optimizer)
    mp.spawn(_comm_rank, args=args, nprocs=world_size, join=True)
    out: dict[str, float] = q.get()
    return out


def calibrate(
    world_size: int,
    ranks_per_host: int = 0,
    inter_host_bw_gbs: float = 0.0,
    optimizer: str = "rowwise_adagrad",
    collectives: bool = True,
    log: Any = None,
) -> tuple[Topology, dict[str, float]]:
    """A Topology for ``world_size`` ranks on this machine, from ``measure()``, ``measure_tbe()``
    and (when ``collectives`` and ``world_size > 1``) ``measure_comm()``; ``log(line)`` as each
    measurement starts."""
    comm = collectives and world_size > 1
    stages = 6 + comm
    t0 = time.time()

    done = [0]

    def say(what: str) -> None:
        done[0] += 1
        if log is not None:
            log(f"calibrate [{done[0]}/{stages}] {what} ({time.time() - t0:.0f} s so far)")

    say("memory and copy bandwidth")
    m = measure()
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    rph = ranks_per_host or world_size
    per_rank_mem = 0.8 * ram_gb / rph
    # Row bandwidth of the fused step itself (not the raw gather / index_add above), on the
    # threads one rank gets when every rank of the host runs at once.
    rank_threads = max(1, (os.cpu_count() or 1) // max(1, rph))
    say("the fused TBE step")
    m.update(measure_tbe(rank_threads, optimizer))
    say("the unfused row update")
    m.update(measure_unfused(rank_threads, optimizer))
    say("the data-parallel table update")
    m.update(measure_dp_update(rank_threads, optimizer))
    device_bw, unfused_bw, dp_bw = m["tbe_gbs"], m["unfused_gbs"], m["dp_update_gbs"]
    split_bw = 0.0
    intra_bw = m["shm_copy_gbs"] / max(1, rph)
    latency_us = 200.0
    if comm:
        say("collectives between processes")
        # At most one process per core: a plan for a big cluster must not spawn its whole world.
        procs = max(2, min(rph, os.cpu_count() or 1))
        m.update(measure_comm(procs, optimizer=optimizer))
        intra_bw, latency_us = m["a2a_gbs"], m["a2a_latency_us"]
        device_bw = m["concurrent_tbe_gbs"]
        unfused_bw = m["concurrent_unfused_gbs"]
        dp_bw = m["concurrent_dp_update_gbs"]
        split_bw = m["concurrent_row_split_gbs"]
    say("row bucketization")
    if not split_bw:
        with _torch_threads(rank_threads):
            m.update(measure_row_split())
        split_bw = m["row_split_gbs"]
    say("per-call overhead")
    with _torch_threads(rank_threads):
        m.update(measure_overhead())
    topo = Topology(
        world_size=world_size,
        ranks_per_host=rph,
        device_memory_gb=round(per_rank_mem, 3),
        device_reserve_gb=round(min(1.0, per_rank_mem / 4), 3),
        host_memory_gb=0.0,
        device_bw_gbs=round(max(device_bw, 1e-3), 4),
        host_device_bw_gbs=round(max(m["memcpy_gbs"] / max(1, rph), 1e-3), 4),
        unfused_bw_gbs=round(max(unfused_bw, 1e-3), 4),
        dp_update_bw_gbs=round(max(dp_bw, 1e-3), 4),
        row_split_bw_gbs=round(max(split_bw, 1e-3), 4),
        intra_host_bw_gbs=round(max(intra_bw, 1e-3), 4),
        inter_host_bw_gbs=inter_host_bw_gbs or round(max(intra_bw, 1e-3), 4),
        shard_overhead_us=round(m["shard_overhead_us"], 1),
        collective_latency_us=round(latency_us, 1),
        step_overhead_us=round(m["step_overhead_us"], 1),
        name=f"calibrated on {socket.gethostname()} ({os.cpu_count()} cores, torch {torch.__version__})",
    )
    return topo, m


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table and a JSON line, write the topology JSON; with ``--budget-s`` > 0
    also measure random placements until the budget is spent and fit the learned cost model
    (stored in the topology; the samples in ``--samples-out``)."""
    ap = argparse.ArgumentParser(prog="python -m neorec.measure.calibrate", description=__doc__)
    ap.add_argument("--out", default="topology.json")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=0)
    ap.add_argument("--inter-host-bw-gbs", type=float, default=0.0, help="assumed, not measured")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="wall-clock budget of the whole calibration, placements included (0: constants only, "
        "no learned model)",
    )
    ap.add_argument(
        "--samples-out", default="", help="calibration samples (default: next to --out)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random placements")
    ap.add_argument(
        "--refit",
        default="",
        metavar="SAMPLES",
        help="no measurement: fit the learned model of the --out topology again on these samples",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.budget_s < 0:
        print(f"neorec: error: --budget-s must be >= 0, got {args.budget_s}", file=sys.stderr)
        return 2
    if args.refit:
        return _refit(args.out, args.refit)
    topo, m = calibrate(
        args.world_size,
        args.ranks_per_host,
        args.inter_host_bw_gbs,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(f"{'measurement':<20} {'value':>10}")
    for k, v in m.items():
        print(f"{k:<20} {v:>10.3f}")
    error = ""
    if args.budget_s > 0:
        from neorec.sharding.learned_cost import LearnedModelError
        from neorec.sharding.learned_fit import samples_path

        samples_out = args.samples_out or samples_path(args.out)
        try:
            model, _ = calibrate_learned(topo, t0 + args.budget_s, args.seed, True, samples_out)
            topo.learned_cost = model.to_dict()
            _print_model(model)
        except LearnedModelError as e:
            error = str(e)
    topo.save(args.out)
    print(f"topology for {topo.world_size} ranks written to {args.out} ({time.time() - t0:.0f} s)")
    from neorec.sharding.learned_cost import model_summary

    summary = {**topo.to_dict(), "learned_cost": model_summary(topo.learned_cost)}
    print(json.dumps({"bench": "calibrate", **m, "topology": summary}))
    if error:
        print(f"neorec: error: {error} (the topology was written without a learned model)",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
