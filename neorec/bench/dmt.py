"""``neorec bench dmt``: flat sharding vs DMT towers (SPTT), every inter-host byte counted.

Bytes and speed: ``--nproc`` gloo ranks on this machine, taken as ``nproc / ranks_per_host``
hosts, train the same config on the same batches three ways, step by step in a rotated order:
``flat`` (``DistributedModel``, tables table-wise over all ranks), ``towers_world``
(``DistributedTowerModel``, tower modules' gradients in the world-wide DDP) and ``towers_host``
(tower t's module synchronised only inside host t). Every all-to-all counts the bytes it sends to
ranks of another host; the dense gradients of every world-wide DDP go through one comm hook, the
hierarchical all-reduce of ``neorec.distributed.grad_sync`` (reduce in the host, all-reduce among
one rank per host, broadcast in the host), which counts the bytes it sends between hosts exactly:
``2 H (H - 1) ceil(n / H) * 4`` per bucket of n floats. The table gives bytes per step summed
over ranks, split into all-to-all and all-reduce, and ms per step (the slowest rank's).

Quality (``neorec.bench.towers_quality``, unsharded forms: the distributed ones compute the same
functions, tested): eval NE of flat, learned and random partitions on the same seeds
(``--seed-base``), on the ungrouped teacher and on the grouped one (``data.teacher_groups`` =
towers), as paired differences per seed with 95% intervals.
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
    p.add_argument("--seeds", type=int, default=5, help="quality: seeds (0 = skip quality)")
    p.add_argument(
        "--seed-base", type=int, default=100,
        help="quality: first seed (settings were chosen on seeds 0-2)",
    )  # fmt: skip
    p.add_argument("--quality-steps", type=int, default=1500, help="quality: train steps")
    p.add_argument(
        "--teachers", default="ungrouped,grouped",
        help="quality: teachers, comma-separated (ungrouped, grouped)",
    )  # fmt: skip
    a = p.parse_args(argv)
    teachers = [t for t in a.teachers.split(",") if t]
    bad = [t for t in teachers if t not in ("ungrouped", "grouped")]
    if bad or not teachers:
        p.error(f"--teachers: {a.teachers!r}: each must be 'ungrouped' or 'grouped'")
    a.teachers = teachers
    if a.seeds < 0 or a.quality_steps < 1 or a.steps < 1 or a.warmup < 0:
        p.error("--seeds, --steps, --warmup must be >= 0 and --quality-steps >= 1")
    return a


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


MODELS = ("flat", "towers_world", "towers_host")


def _measure(rank: int, world: int, a: argparse.Namespace, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from neorec.bench.stats import paired_ratio, rotated
    from neorec.builder import (
        dense_optimizer,
        distributed_model,
        resolve_plan,
        tower_groups,
        towered_model,
    )
    from neorec.data.synthetic import SyntheticClickData
    from neorec.distributed.grad_sync import HostLayout, hierarchical_hook
    from neorec.train.steps import train_step

    rph = a.ranks_per_host
    hosts = world // rph
    cfg = _cfg(a, hosts)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    b = a.batch // world
    batches = [data.batch("train", i, a.batch).slice(rank * b, (rank + 1) * b) for i in range(8)]
    groups = tower_groups(cfg)
    assert groups is not None
    layout = HostLayout(rph)

    flat = distributed_model(cfg, resolve_plan(cfg, world, rph))
    assert isinstance(flat.dense_arch, DistributedDataParallel)
    flat.dense_arch.register_comm_hook(None, hierarchical_hook(layout, flat.comm_stats))
    flat._ring_bytes = 0  # the hook counts the dense all-reduce (no ring estimate on top)
    models: dict[str, Any] = {"flat": flat}
    for sync in ("world", "host"):
        m = towered_model(cfg, groups, tower_sync=sync)
        m.world_ddp.register_comm_hook(None, hierarchical_hook(layout, m.comm_stats))
        models[f"towers_{sync}"] = m
    opts = {k: dense_optimizer(cfg.train, m.dense_parameters()) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            for m in models.values():
                m.comm_stats.reset()
                m.comm_stats.ranks_per_host = rph
        for k in rotated(list(models), i):
            dist.barrier()
            t0 = time.perf_counter()
            train_step(models[k], opts[k], batches[i % len(batches)], i + 1)
            if i >= a.warmup:
                times[k].append(time.perf_counter() - t0)
    result: dict[str, Any] = {}
    slowest: dict[str, list[float]] = {}
    for name, model in models.items():
        st = model.comm_stats
        inter_ar = sum(v for k, v in st.inter_host.items() if k.startswith("allreduce"))
        inter = sum(st.inter_host.values())
        sent = sum(st.bytes_sent.values())
        mine = torch.tensor(
            [inter - inter_ar, inter_ar, sent, *times[name]], dtype=torch.float64
        ) / torch.tensor([a.steps] * 3 + [1e-3] * a.steps, dtype=torch.float64)
        parts = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        tot = torch.stack(parts)
        slowest[name] = tot[:, 3:].max(0).values.tolist()  # per step: the slowest rank's ms
        result[name] = {
            "inter_host_a2a": float(tot[:, 0].sum()),
            "inter_host_allreduce": float(tot[:, 1].sum()),
            "inter_host_bytes": float(tot[:, :2].sum()),
            "bytes_sent": float(tot[:, 2].sum()),
            "ms_per_step": statistics.median(slowest[name]),
            "inter_host_by_collective": dict(st.inter_host),  # rank 0's
        }
    for name in MODELS[1:]:
        result[name]["ms_ratio_to_flat"] = paired_ratio(slowest[name], slowest["flat"]).to_dict()
    dense = models["towers_host"].dense_part
    result["params"] = {
        "dense_arch": sum(p.numel() for p in dense.dense_arch.parameters()),
        "towers": sum(p.numel() for p in dense.towers.parameters()),
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


def _quality(a: argparse.Namespace, towers: int, teacher: str) -> dict[str, Any]:
    """Eval NE of flat / learned / random towers on one teacher, paired by seed (its per-seed
    lines go to stderr)."""
    import contextlib
    import sys

    from neorec.bench import towers_quality as tq

    torch.set_num_threads(1)
    with contextlib.redirect_stdout(sys.stderr):
        q = tq.run(
            seeds=a.seeds, steps=a.quality_steps, towers=towers, module=a.module,
            seed_base=a.seed_base, teacher_groups=towers if teacher == "grouped" else 0,
        )  # fmt: skip
    return dict(q)


def _pct(iv: dict[str, Any]) -> str:
    return f"{100 * iv['value']:+.2f}% [{100 * iv['lo']:+.2f}, {100 * iv['hi']:+.2f}]"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    from neorec.machine import cpu_model_and_flags

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
    if a.tables < a.nproc // a.ranks_per_host:
        raise SystemExit(f"neorec bench dmt: --tables {a.tables} is fewer than the towers")
    hosts = a.nproc // a.ranks_per_host
    sp = _speed(a)
    flat = sp["flat"]
    result: dict[str, Any] = {
        "bench": "dmt",
        "cpu": cpu_model_and_flags()[0],
        "nproc": a.nproc,
        "ranks_per_host": a.ranks_per_host,
        "hosts": hosts,
        "tables": a.tables,
        "dim": a.dim,
        "pooling": a.pooling,
        "batch": a.batch,
        "tower_module": a.module,
        "out_vectors": a.out_vectors,
        "steps": a.steps,
        "allreduce": "hierarchical (reduce in host, all-reduce of leaders, broadcast in host)",
        "params": sp["params"],
        "groups": sp["groups"],
    }
    print(
        f"{'':<14}{'a2a inter B':>14}{'allreduce inter B':>19}{'inter-host B':>14}"
        f"{'all sent B':>13}{'ms/step':>9}   (per step, summed over ranks)"
    )
    for name in MODELS:
        r = sp[name]
        for k in ("inter_host_a2a", "inter_host_allreduce", "inter_host_bytes", "bytes_sent"):
            result[f"{k}_{name}"] = round(r[k])
        result[f"ms_per_step_{name}"] = round(r["ms_per_step"], 2)
        if name != "flat":
            result[f"ms_ratio_{name}_to_flat"] = r["ms_ratio_to_flat"]
            result[f"inter_host_reduction_{name}"] = round(
                flat["inter_host_bytes"] / max(r["inter_host_bytes"], 1.0), 3
            )
            result[f"a2a_inter_host_reduction_{name}"] = round(
                flat["inter_host_a2a"] / max(r["inter_host_a2a"], 1.0), 3
            )
        print(
            f"{name:<14}{r['inter_host_a2a']:>14,.0f}{r['inter_host_allreduce']:>19,.0f}"
            f"{r['inter_host_bytes']:>14,.0f}{r['bytes_sent']:>13,.0f}{r['ms_per_step']:>9.2f}"
        )
    result["inter_host_by_collective"] = {k: sp[k]["inter_host_by_collective"] for k in MODELS}
    for name in MODELS[1:]:
        print(
            f"inter-host bytes, flat / {name}: {result[f'inter_host_reduction_{name}']:.2f}x "
            f"(all-to-alls only: {result[f'a2a_inter_host_reduction_{name}']:.2f}x)"
        )
    if a.seeds:
        result["seeds"] = list(range(a.seed_base, a.seed_base + a.seeds))
        result["quality_steps"] = a.quality_steps
        for teacher in a.teachers:
            q = _quality(a, hosts, teacher)
            result[f"quality_{teacher}"] = q
            print(
                f"\neval NE, {teacher} teacher (seeds {a.seed_base}..{a.seed_base + a.seeds - 1}, "
                f"{a.quality_steps} steps, {hosts} towers, module {a.module}; unsharded forms):"
            )
            print(f"{'model':<10}{'NE mean':>10}")
            for k in ("flat", "learned", "random", "balanced", "planted", "teacher"):
                if f"ne_{k}_mean" in q:
                    print(f"{k:<10}{q[f'ne_{k}_mean']['value']:>10.4f}")
            ref = {m: q[f"{m}_flat_mean"]["value"] for m in ("ne", "auc")}
            result[f"reference_{teacher}"] = (
                ref  # flat towers: the model the others are set against
            )
            print(f"reference (flat): NE {ref['ne']:.4f}, AUC {ref['auc']:.4f}")
            print("paired, NE relative to the second (95% interval):")
            for x, y in tq_pairs():
                rel = q[f"rel_ne_{x}_vs_{y}"]
                result[f"rel_ne_{x}_vs_{y}_{teacher}"] = rel
                print(f"  {x} vs {y}: {_pct(rel)}")
            if "ari_learned" in q:
                print(f"  learned partition's adjusted Rand index to the planted groups: "
                      f"{q['ari_learned']}")  # fmt: skip
    print(json.dumps(result))
    return 0


def tq_pairs() -> tuple[tuple[str, str], ...]:
    """The paired differences of the quality part (``towers_quality.PAIRS``)."""
    from neorec.bench.towers_quality import PAIRS

    return PAIRS
