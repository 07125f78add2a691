"""``neorec bench dmt``: flat sharding vs DMT towers (SPTT), side by side in one run.

Speed and bytes: ``--nproc`` gloo ranks on this machine, taken as ``nproc / ranks_per_host``
hosts, train the same config twice on the same batches: the flat model (``DistributedModel``,
tables placed table-wise over all ranks) and the towered one (``DistributedTowerModel``, tower t's
tables table-wise over host t's ranks, a compressing tower module). Every all-to-all counts the
bytes it sends to ranks of another host; the table gives inter-host bytes per step (summed over
ranks) and ms per step (the slowest rank's median), after warm-up steps.

Quality: the grouped-teacher task (``data.teacher_groups``), unsharded (the distributed forms
compute the unsharded models' functions, tested): eval NE of the flat model, of the towered model
with the learned partition and with a random one, over ``--seeds`` seeds
(``neorec.bench.towers_quality``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["main"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench dmt", description=__doc__)
    p.add_argument("--nproc", type=int, default=4, help="gloo ranks")
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks per simulated host")
    p.add_argument("--tables", type=int, default=16)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--pooling", type=float, default=2.0)
    p.add_argument("--batch", type=int, default=1024, help="global batch")
    p.add_argument("--module", default="dot", help="tower module (dot, dcn, mlp, identity)")
    p.add_argument("--out-vectors", type=int, default=1, help="k: vectors per tower output")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seeds", type=int, default=3, help="quality: seeds (0 = skip quality)")
    p.add_argument("--quality-steps", type=int, default=1500, help="quality: train steps")
    return p.parse_args(argv)


def _cfg(a: argparse.Namespace, towers: int) -> Any:
    from neorec.config import load_config

    return load_config(
        None,
        [
            f"embedding.num_tables={a.tables}",
            f"embedding.rows={a.rows}",
            f"embedding.dim={a.dim}",
            f"embedding.pooling_factor={a.pooling}",
            f"model.bottom_mlp=[64, {a.dim}]",
            f"data.batch_size={a.batch}",
            "sharding.default_type='table_wise'",
            f"towers.count={towers}",
            f"towers.module='{a.module}'",
            f"towers.out_vectors={a.out_vectors}",
            "towers.partitioner='balanced'",
        ],
    )


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _measure(rank, world, a, out)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, a: argparse.Namespace, out: str) -> None:
    from neorec.build import (
        dense_optimizer,
        distributed_model,
        resolve_plan,
        tower_groups,
        towered_model,
    )
    from neorec.data.synthetic import SyntheticClickData
    from neorec.distributed.towers import tower_features
    from neorec.modules.towers import build_tower_dense
    from neorec.train.steps import train_step

    rph = a.ranks_per_host
    hosts = world // rph
    cfg = _cfg(a, hosts)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    b = a.batch // world
    batches = [data.batch("train", i, a.batch).slice(rank * b, (rank + 1) * b) for i in range(8)]
    groups = tower_groups(cfg)
    assert groups is not None
    feats = tower_features(cfg.embedding.tables, groups)

    def build_dense() -> Any:
        return build_tower_dense(
            cfg.model, [len(f) for f in feats], a.dim, cfg.towers.module, cfg.towers.out_vectors
        )

    flat = distributed_model(cfg, resolve_plan(cfg, world, rph))
    flat.comm_stats.ranks_per_host = rph
    models: dict[str, Any] = {"flat": flat, "dmt": towered_model(cfg, groups, build_dense)}
    result: dict[str, Any] = {}
    for name, model in models.items():
        opt = dense_optimizer(cfg.train, model.dense_parameters())
        times = []
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                model.comm_stats.reset()
                model.comm_stats.ranks_per_host = rph
            dist.barrier()
            t0 = time.perf_counter()
            train_step(model, opt, batches[i % len(batches)], i + 1)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        inter = sum(model.comm_stats.inter_host.values()) / a.steps
        total = sum(model.comm_stats.bytes_sent.values()) / a.steps
        mine = torch.tensor([inter, total, statistics.median(times)], dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        result[name] = {
            "inter_host_bytes": float(sum(p[0] for p in parts)),
            "embedding_bytes": float(sum(p[1] for p in parts)),
            "ms_per_step": 1000 * float(max(p[2] for p in parts)),
            "by_collective": dict(model.comm_stats.inter_host),
        }
    result["groups"] = groups
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _speed(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "dmt.json")
        port = _port()
        mp.spawn(_rank, args=(a.nproc, port, a, out), nprocs=a.nproc, join=True)
        return dict(json.loads(Path(out).read_text()))


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quality(a: argparse.Namespace, towers: int) -> dict[str, Any]:
    """Eval NE of flat / learned / random towers on the grouped task (its lines go to stderr)."""
    import contextlib
    import sys

    from neorec.bench import towers_quality as tq

    torch.set_num_threads(1)
    with contextlib.redirect_stdout(sys.stderr):
        q = tq.run(seeds=a.seeds, steps=a.quality_steps, groups=towers, module=a.module)
    return dict(q)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    if (
        a.nproc < 2
        or a.ranks_per_host < 1
        or a.nproc % a.ranks_per_host
        or (a.nproc // a.ranks_per_host < 2)
    ):
        raise SystemExit(
            f"neorec bench dmt: --nproc {a.nproc} must be at least 2 hosts of --ranks-per-host "
            f"{a.ranks_per_host} ranks each"
        )
    if a.batch % a.nproc:
        raise SystemExit(f"neorec bench dmt: --batch {a.batch} must divide by --nproc {a.nproc}")
    hosts = a.nproc // a.ranks_per_host
    sp = _speed(a)
    flat, dmt = sp["flat"], sp["dmt"]
    result: dict[str, Any] = {
        "bench": "dmt",
        "nproc": a.nproc,
        "ranks_per_host": a.ranks_per_host,
        "hosts": hosts,
        "tables": a.tables,
        "dim": a.dim,
        "pooling": a.pooling,
        "batch": a.batch,
        "tower_module": a.module,
        "out_vectors": a.out_vectors,
        "inter_host_bytes_flat": round(flat["inter_host_bytes"]),
        "inter_host_bytes_dmt": round(dmt["inter_host_bytes"]),
        "inter_host_bytes_reduction": round(
            flat["inter_host_bytes"] / max(dmt["inter_host_bytes"], 1.0), 2
        ),
        "ms_per_step_flat": round(flat["ms_per_step"], 2),
        "ms_per_step_dmt": round(dmt["ms_per_step"], 2),
        "inter_host_by_collective": {"flat": flat["by_collective"], "dmt": dmt["by_collective"]},
        "groups": sp["groups"],
    }
    print(f"{'':<8}{'inter-host B/step':>20}{'all emb B/step':>18}{'ms/step':>10}")
    for name, r in (("flat", flat), ("dmt", dmt)):
        print(
            f"{name:<8}{r['inter_host_bytes']:>20,.0f}{r['embedding_bytes']:>18,.0f}"
            f"{r['ms_per_step']:>10.2f}"
        )
    print(f"inter-host bytes reduction: {result['inter_host_bytes_reduction']:.2f}x")
    if a.seeds:
        q = _quality(a, hosts)
        result["quality"] = q
        print(
            f"\neval NE on the grouped-teacher task ({a.seeds} seeds, {a.quality_steps} steps, "
            f"{hosts} towers, module {a.module}; unsharded forms of the same models):"
        )
        print(f"{'model':<16}{'NE mean':>10}{'NE std':>10}")
        for k in ("flat", "learned", "random", "balanced", "planted", "teacher"):
            m, sd = q.get(f"ne_{k}_mean"), q.get(f"ne_{k}_std")
            if m is not None:
                result[f"ne_{k}"] = m
                print(f"{k:<16}{m:>10.4f}{sd:>10.4f}")
        if "ne_flat" in result and "ne_learned" in result:
            result["ne_learned_vs_flat_rel"] = result["ne_learned"] / result["ne_flat"] - 1
            result["ne_random_vs_learned_rel"] = q.get("random_vs_learned_rel_mean")
            print(
                f"learned vs flat: {100 * result['ne_learned_vs_flat_rel']:+.2f}%; "
                f"random vs learned: {100 * (q.get('random_vs_learned_rel_mean') or 0):+.2f}%"
            )
    print(json.dumps(result))
    return 0
