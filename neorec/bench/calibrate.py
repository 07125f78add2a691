"""Micro-benchmarks that calibrate the planner's ``Topology`` on this machine (``--calibrate``).

Measured with torch: random row gathers and scatter-adds of embedding rows (device memory
bandwidth as TBE sees it), a large memcpy (host <-> device; on CPU the same memory) and a copy
between two processes' shared buffers (intra-host all-to-all, approximated by a memcpy through
shared memory). Inter-host bandwidth cannot be measured on one machine and stays an assumption
unless given. Prints a table and a JSON line, and writes the topology JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable

import torch

from neorec.sharding.topology import GB, Topology

__all__ = ["measure", "calibrate", "main"]


def _best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(rows: int = 2_000_000, dim: int = 64, ids: int = 500_000) -> dict[str, float]:
    """Bandwidths in GB/s: row gather, row scatter-add update, memcpy, shared-memory copy."""
    g = torch.Generator().manual_seed(0)
    table = torch.rand(rows, dim, generator=g)
    idx = torch.randint(0, rows, (ids,), generator=g)
    grads = torch.rand(ids, dim, generator=g)
    row_bytes = ids * dim * 4
    gather = _best_of(lambda: torch.index_select(table, 0, idx))
    update = _best_of(lambda: table.index_add_(0, idx, grads, alpha=-1e-9))
    big = torch.empty(64 * 1024 * 1024 // 4)
    dst = torch.empty_like(big)
    memcpy = _best_of(lambda: dst.copy_(big))
    shared = big.clone().share_memory_()
    shm = _best_of(lambda: dst.copy_(shared))
    return {
        "gather_gbs": row_bytes / gather / GB,
        # read + write of each touched row
        "update_gbs": 2 * row_bytes / update / GB,
        "memcpy_gbs": 2 * big.numel() * 4 / memcpy / GB,
        "shm_copy_gbs": 2 * big.numel() * 4 / shm / GB,
    }


def calibrate(
    world_size: int, ranks_per_host: int = 0, inter_host_bw_gbs: float = 0.0
) -> tuple[Topology, dict[str, float]]:
    """A Topology for ``world_size`` ranks on this machine, from ``measure()``."""
    m = measure()
    threads = max(1, torch.get_num_threads())
    # Ranks on one host share memory bandwidth; each gets its share when all run at once.
    share = max(1, min(world_size, os.cpu_count() or 1)) / threads
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    rph = ranks_per_host or world_size
    per_rank_mem = 0.8 * ram_gb / rph
    device_bw = min(m["gather_gbs"], m["update_gbs"]) * share / max(1, rph)
    topo = Topology(
        world_size=world_size,
        ranks_per_host=rph,
        device_memory_gb=round(per_rank_mem, 3),
        device_reserve_gb=round(min(1.0, per_rank_mem / 4), 3),
        host_memory_gb=0.0,
        device_bw_gbs=round(max(device_bw, 1e-3), 4),
        host_device_bw_gbs=round(max(m["memcpy_gbs"] / max(1, rph), 1e-3), 4),
        intra_host_bw_gbs=round(max(m["shm_copy_gbs"] / max(1, rph), 1e-3), 4),
        inter_host_bw_gbs=inter_host_bw_gbs or round(max(m["shm_copy_gbs"] / max(1, rph), 1e-3), 4),
        shard_overhead_us=20.0,
        collective_latency_us=200.0,
        name=f"calibrated on {socket.gethostname()} ({os.cpu_count()} cores, torch {torch.__version__})",
    )
    return topo, m


def main(argv: list[str] | None = None) -> int:
    """Measure, print a table and a JSON line, write the topology JSON."""
    ap = argparse.ArgumentParser(prog="python -m neorec.bench.calibrate", description=__doc__)
    ap.add_argument("--out", default="topology.json")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=0)
    ap.add_argument("--inter-host-bw-gbs", type=float, default=0.0, help="assumed, not measured")
    args = ap.parse_args(argv)
    topo, m = calibrate(args.world_size, args.ranks_per_host, args.inter_host_bw_gbs)
    topo.save(args.out)
    print(f"{'measurement':<16} {'GB/s':>10}")
    for k, v in m.items():
        print(f"{k:<16} {v:>10.3f}")
    print(f"topology for {topo.world_size} ranks written to {args.out}")
    print(json.dumps({"bench": "calibrate", **m, "topology": topo.to_dict()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
