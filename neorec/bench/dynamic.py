"""``neorec bench dynamic``: a dynamic (managed-id) table vs a hashed fixed table of the same memory.

The task is the drifting stream (``data.source = "stream"``): each window ids appear and old ones
retire. Every model trains window by window (incremental: one model through all windows) and is
evaluated on each window's eval split; the table reports the mean eval NE over windows for

- ``full``: a plain table with a row for every id (the id space; an upper bound on memory),
- ``hashed``: a plain table of M rows indexed by ``id % M`` (distinct ids collide),
- ``dynamic``: a dynamic table holding the ids themselves (LRU eviction, unadmitted ids read a
  shared default row) with as many slots as fit in the same memory as the hashed table's M rows
  (its id map costs ``neorec.ops.id_map.map_bytes_per_slot`` per slot, ~90-120 bytes),

at two memory budgets M, over ``--seeds`` seeds; the NE gap is also given per seed (paired: the
same stream and init seed for both tables), since the stream's level of NE varies by seed far
more than the tables differ. Defaults: 4 tables x 10,000 ids of dim 64 and 102,400 samples a
window (each id looked up ~10 times a window). With the earlier defaults (40,000 ids of dim 16,
51,200 samples: ~1 lookup per id a window) every table was under-trained: the full table was worse
than the hashed one, whose shared rows learn faster, and a map's bytes per slot outweighed a row. It also reports the dynamic table's training
throughput against the hashed table's (same batches) and the id map's operations per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from neorec.config import Config, load_config
from neorec.sparse import SparseFeatures

__all__ = ["main", "dynamic_slots"]


def dynamic_slots(memory: int, row_bytes: int) -> int:
    """Slots of an lru dynamic table that fit in ``memory`` bytes with their rows and map."""
    from neorec.ops.id_map import map_bytes_per_slot

    cap = max(1, memory // row_bytes)
    for _ in range(4):  # the map's bytes a slot depend (a little) on the capacity
        cap = max(1, int(memory // (row_bytes + map_bytes_per_slot(cap))))
    return cap


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench dynamic", description=__doc__)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=10_000, help="id space per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window-samples", type=int, default=102_400)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--budgets", default="0.125,0.25", help="M as fractions of --rows")
    p.add_argument("--seeds", type=int, default=2)
    return p.parse_args(argv)


def _cfg(a: argparse.Namespace, seed: int) -> Config:
    return load_config(
        None,
        [
            "data.source='stream'",
            f"data.windows={a.windows}",
            f"data.window_samples={a.window_samples}",
            "data.eval_samples=10240",
            "data.id_churn=0.3",
            "data.drift=0.1",
            f"data.batch_size={a.batch}",
            f"data.seed={100 + seed}",
            f"embedding.num_tables={a.tables}",
            f"embedding.rows={a.rows}",
            f"embedding.dim={a.dim}",
            f"model.bottom_mlp=[64, {a.dim}]",
            f"train.seed={seed}",
        ],
    )


def _model(cfg: Config, kind: str, m: int) -> Any:
    from copy import deepcopy

    from neorec.modules.dlrm import build_dlrm

    c = deepcopy(cfg)
    for t in c.embedding.tables:
        if kind == "hashed":
            t.rows = m
        elif kind == "dynamic":
            t.kind, t.capacity, t.eviction, t.unadmitted = "dynamic", m, "lru", "default_row"
    return build_dlrm(c)


def _hash_ids(sp: SparseFeatures, m: int) -> SparseFeatures:
    return SparseFeatures(sp.keys, sp.values % m, sp.lengths, sp.weights)


def _run(cfg: Config, kind: str, m: int) -> dict[str, Any]:
    """Train window by window; eval NE per window; seconds of training steps."""
    from neorec.data.stream import DriftingClickData
    from neorec.train.metrics import binary_metrics

    model = _model(cfg, kind, m)
    opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=cfg.train.dense_lr)
    bs = cfg.data.batch_size
    nes, train_s, steps = [], 0.0, 0
    for w in range(cfg.data.windows):
        data = DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=w)
        for i in range(cfg.data.window_samples // bs):
            b = data.batch("train", i, bs)
            sp = _hash_ids(b.sparse, m) if kind == "hashed" else b.sparse
            t0 = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(model(b.dense, sp), b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - t0
            steps += 1
        ps, ys = [], []
        with torch.no_grad():
            for i in range(cfg.data.eval_samples // bs):
                b = data.batch("eval", i, bs)
                sp = _hash_ids(b.sparse, m) if kind == "hashed" else b.sparse
                ps.append(torch.sigmoid(model(b.dense, sp)).double())
                ys.append(b.labels.double())
        nes.append(binary_metrics(torch.cat(ps), torch.cat(ys))["ne"])
    out: dict[str, Any] = {
        "ne": statistics.mean(nes),
        "ne_by_window": nes,
        "steps_per_s": steps / train_s,
    }
    if kind == "dynamic":
        out["stats"] = model.ebc.stats()
    return out


def _map_ops(a: argparse.Namespace) -> float:
    """Id map lookups + inserts + evictions per second on a churning id stream."""
    from neorec.ops.id_map import IdMap

    cap = a.rows // 8
    im = IdMap(cap, eviction="lru", seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(i * 500, i * 500 + a.rows, (65_536,), generator=g) for i in range(20)]
    t0 = time.perf_counter()
    for ids in batches:
        im.map(ids)
    return sum(b.numel() for b in batches) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    torch.set_num_threads(1)
    budgets = [float(x) for x in a.budgets.split(",") if x.strip()]
    row_bytes = 4 * a.dim + 4  # weights + row-wise Adagrad state
    rows: list[dict[str, Any]] = []
    for frac in budgets:
        m = max(1, int(a.rows * frac))
        cap = dynamic_slots(m * row_bytes, row_bytes)
        res: dict[str, list[dict[str, Any]]] = {"hashed": [], "dynamic": []}
        for seed in range(a.seeds):
            cfg = _cfg(a, seed)
            res["hashed"].append(_run(cfg, "hashed", m))
            res["dynamic"].append(_run(cfg, "dynamic", cap))
        h = [r["ne"] for r in res["hashed"]]
        d = [r["ne"] for r in res["dynamic"]]
        rows.append(
            {
                "budget_fraction": frac,
                "hashed_rows": m,
                "dynamic_slots": cap,
                "bytes_per_table": m * row_bytes,
                "ne_hashed_mean": statistics.mean(h),
                "ne_hashed_spread": max(h) - min(h),
                "ne_dynamic_mean": statistics.mean(d),
                "ne_dynamic_spread": max(d) - min(d),
                "ne_gap_rel": statistics.mean(d) / statistics.mean(h) - 1,
                "ne_gap_rel_per_seed": [round(y / x - 1, 6) for x, y in zip(h, d)],
                "throughput_ratio": statistics.mean(r["steps_per_s"] for r in res["dynamic"])
                / statistics.mean(r["steps_per_s"] for r in res["hashed"]),
                "dynamic_stats": res["dynamic"][-1].get("stats"),
            }
        )
    full = [_run(_cfg(a, s), "full", a.rows)["ne"] for s in range(a.seeds)]
    ops = _map_ops(a)
    print(f"{'budget':>8}{'hashed rows':>13}{'dyn slots':>11}{'NE hashed':>11}{'NE dynamic':>12}"
          f"{'gap':>9}{'dyn/hashed speed':>18}")  # fmt: skip
    for r in rows:
        print(
            f"{r['budget_fraction']:>8.3f}{r['hashed_rows']:>13,}{r['dynamic_slots']:>11,}"
            f"{r['ne_hashed_mean']:>11.4f}{r['ne_dynamic_mean']:>12.4f}"
            f"{100 * r['ne_gap_rel']:>8.2f}%{r['throughput_ratio']:>17.2f}x"
        )
        per_seed = ", ".join(f"{100 * g:+.2f}%" for g in r["ne_gap_rel_per_seed"])
        print(f"{'':>8} dynamic vs hashed NE per seed (paired): {per_seed}")
    print(
        f"full table ({a.rows:,} rows) NE {statistics.mean(full):.4f}; id map {ops / 1e6:.2f} M ids/s"
    )
    result = {
        "bench": "dynamic",
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "windows": a.windows,
        "seeds": a.seeds,
        "budgets": rows,
        "ne_full_mean": statistics.mean(full),
        "map_ids_per_s": ops,
    }
    print(json.dumps(result, default=str))
    return 0
