"""``neorec bench dynamic``: a dynamic (managed-id) table vs a hashed fixed table of the same memory.

The task is the drifting stream (``data.source = "stream"``): each window ids appear and old ones
retire. Every model trains window by window (incremental: one model through all windows) and is
evaluated on each window's eval split; the table reports the mean eval NE over windows for

- ``full``: a plain table with a row for every id (the id space; an upper bound on memory),
- ``hashed``: a plain table of M rows indexed by ``mix64(id) % M`` (``--hash mod``: ``id % M``),
- ``dynamic``: a dynamic table holding the ids themselves with as many slots as fit in the same
  memory as the hashed table's M rows (its id map and admission sketch cost
  ``neorec.ops.id_map_size.map_bytes_per_slot`` a slot, ~135 bytes): LRU eviction, an id gets a
  slot on its 16th sighting (``--admit-threshold``), unadmitted ids are left out of their bags
  (``--unadmitted zeros``: measured a little better than a shared default row, whose trained
  vector for the tail's independent, zero-mean effects is mostly noise),

at two memory budgets M, over ``--seeds`` seeds; the NE gap is also given per seed (paired: the
same stream and init seed for both tables), since the stream's level of NE varies by seed far
more than the tables differ; and the teacher's NE (the best any model can do).

The stream's labels must reward exact per-id rows for the comparison to mean anything. With the
synthetic teacher's own per-id effects (``data.id_shrink_visits`` 4000: only ids seen thousands of
times carry much of theirs) a row per id is worth ~0.01 NE in all and the full table trains no
better than a hashed one, so no table kind can win (docs/dynamic.md). The defaults therefore use
``--id-shrink-visits 100 --id-weight 3`` (each id's own effect matters: the full table is 3-4%
better than the hashed one), 4 tables x 10,000 ids (5,000 active a window) of dim 64, 102,400
samples a window. Admission by threshold, not ``always``: with 800-1,900 slots for 5,000 active
ids, admitting every id makes the tail evict the mid-popular ids over and over (a quarter of the
lookups read a freshly initialised row), and the dynamic table loses to the hashed one. LRU, not
LFU: LFU keeps retired ids whose use counts are high.
It also reports the dynamic table's training throughput against the hashed table's (same batches;
the hashed table's steps include hashing its ids) and the id map's operations per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from neorec.config import Config, ConfigError, load_config
from neorec.sparse import SparseFeatures

__all__ = ["main", "dynamic_slots"]


def dynamic_slots(
    memory: int, row_bytes: int, admission: str = "always", eviction: str = "lru"
) -> int:
    """Slots of a dynamic table that fit in ``memory`` bytes with their rows and map (the map's
    bytes a slot as ``map_bytes_per_slot`` counts them for this admission and eviction)."""
    from neorec.ops.id_map_size import map_bytes_per_slot

    cap = max(1, memory // row_bytes)
    for _ in range(6):  # the map's bytes a slot depend (a little) on the capacity
        cap = max(1, int(memory // (row_bytes + map_bytes_per_slot(cap, admission, eviction))))
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
    p.add_argument("--eval-samples", type=int, default=10_240, help="eval samples a window")
    p.add_argument("--budgets", default="0.125,0.25", help="M as fractions of --rows")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--churn", type=float, default=0.3, help="data.id_churn")
    p.add_argument("--drift", type=float, default=0.1, help="data.drift")
    p.add_argument("--ids", default="locality", choices=("locality", "zipf", "uniform"))
    p.add_argument("--teacher-scale", type=float, default=1.0, help="data.teacher_scale")
    p.add_argument("--id-weight", type=float, default=3.0, help="data.id_weight (1: off)")
    p.add_argument(
        "--id-shrink-visits", type=float, default=100.0, help="data.id_shrink_visits (4000: off)"
    )
    p.add_argument(
        "--hash",
        default="mix",
        choices=("mix", "mod"),
        help="hashed rows: mix64(id) %% M or id %% M",
    )
    p.add_argument("--admit-threshold", type=int, default=16, help="0 = admit every id")
    p.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    p.add_argument("--unadmitted", default="zeros", choices=("default_row", "zeros"))
    return p.parse_args(argv)


def _budgets(a: argparse.Namespace) -> list[float]:
    """The budgets; bad flags are a one-line ``ConfigError`` (before any training)."""
    for name in ("tables", "rows", "dim", "windows", "window_samples", "batch", "seeds"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if min(a.window_samples, a.eval_samples) < a.batch:
        raise ConfigError(
            f"--window-samples ({a.window_samples:,}) and --eval-samples ({a.eval_samples:,}) "
            f"must each hold at least one --batch ({a.batch:,})"
        )
    if a.admit_threshold < 0:
        raise ConfigError(
            f"--admit-threshold must be >= 0 (0 = admit every id), got {a.admit_threshold}"
        )
    try:
        budgets = [float(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        budgets = []
    if not budgets or any(not 0 < f <= 1 for f in budgets):
        raise ConfigError(f"--budgets takes fractions in (0, 1] like 0.125,0.25, got {a.budgets!r}")
    return budgets


def _cfg(a: argparse.Namespace, seed: int) -> Config:
    return load_config(
        None,
        [
            "data.source='stream'",
            f"data.windows={a.windows}",
            f"data.window_samples={a.window_samples}",
            f"data.eval_samples={a.eval_samples}",
            f"data.id_churn={a.churn}",
            f"data.drift={a.drift}",
            f"data.id_distribution='{a.ids}'",
            f"data.teacher_scale={a.teacher_scale}",
            f"data.id_shrink_visits={a.id_shrink_visits}",
            f"data.id_weight={a.id_weight}",
            f"data.batch_size={a.batch}",
            f"data.seed={100 + seed}",
            f"embedding.num_tables={a.tables}",
            f"embedding.rows={a.rows}",
            f"embedding.dim={a.dim}",
            f"model.bottom_mlp=[64, {a.dim}]",
            f"train.seed={seed}",
        ],
    )


def _admission(a: argparse.Namespace) -> str:
    return "threshold" if a.admit_threshold > 0 else "always"


def _model(cfg: Config, a: argparse.Namespace, kind: str, m: int) -> Any:
    from copy import deepcopy

    from neorec.build import build_dlrm

    c = deepcopy(cfg)
    for t in c.embedding.tables:
        if kind == "hashed":
            t.rows = m
        elif kind == "dynamic":
            t.kind, t.capacity, t.eviction, t.unadmitted = "dynamic", m, a.eviction, a.unadmitted
            t.admission = _admission(a)
            t.admit_threshold = max(1, a.admit_threshold)
    return build_dlrm(c)


def _hash_ids(sp: SparseFeatures, m: int, how: str) -> SparseFeatures:
    """Ids to rows of an M-row table: ``mix64(id) % M`` (a hash, as production tables hash raw
    ids) or ``id % M``. On this stream ``id % M`` is kinder than a hash: an id's popularity rank
    is an affine scatter of it mod the active range, so ids sharing ``id % M`` have ranks M apart
    (a bucket never holds two of the hottest ids)."""
    if how == "mod":
        return SparseFeatures(sp.keys, sp.values % m, sp.lengths, sp.weights)
    from neorec.ops.id_map import _mix64_np

    h = _mix64_np(sp.values.numpy().astype(np.uint64)) % np.uint64(m)
    return SparseFeatures(sp.keys, torch.from_numpy(h.astype(np.int64)), sp.lengths, sp.weights)


def _run(cfg: Config, a: argparse.Namespace, kind: str, m: int) -> dict[str, Any]:
    """Train window by window; eval NE per window; seconds of training steps (the hashed
    table's include hashing its ids, the dynamic table's its id maps)."""
    from neorec.data.stream import DriftingClickData
    from neorec.metrics import binary_metrics

    model = _model(cfg, a, kind, m)
    opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=cfg.train.dense_lr)
    bs = cfg.data.batch_size
    nes, train_s, steps = [], 0.0, 0
    for w in range(cfg.data.windows):
        data = DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=w)
        for i in range(cfg.data.window_samples // bs):
            b = data.batch("train", i, bs)
            t0 = time.perf_counter()
            sp = _hash_ids(b.sparse, m, a.hash) if kind == "hashed" else b.sparse
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
                sp = _hash_ids(b.sparse, m, a.hash) if kind == "hashed" else b.sparse
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


def _teacher_ne(cfg: Config) -> float:
    """The teacher's eval NE (the best any model can do), mean over windows."""
    from neorec.data.stream import teacher_metrics_by_window

    return statistics.mean(
        m["ne"]
        for m in teacher_metrics_by_window(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    )


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


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    return {
        k: getattr(a, k)
        for k in ("window_samples", "eval_samples", "batch", "churn", "drift", "ids")
        + ("teacher_scale", "id_shrink_visits", "id_weight", "hash", "admit_threshold")
        + ("eviction",)
        + ("unadmitted",)
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    budgets = _budgets(a)
    _cfg(a, 0)  # the stream settings' own checks, before any training
    torch.set_num_threads(1)
    row_bytes = 4 * a.dim + 4  # weights + row-wise Adagrad state
    rows: list[dict[str, Any]] = []
    for frac in budgets:
        m = max(1, int(a.rows * frac))
        cap = dynamic_slots(m * row_bytes, row_bytes, _admission(a), a.eviction)
        res: dict[str, list[dict[str, Any]]] = {"hashed": [], "dynamic": []}
        for seed in range(a.seeds):
            cfg = _cfg(a, seed)
            res["hashed"].append(_run(cfg, a, "hashed", m))
            res["dynamic"].append(_run(cfg, a, "dynamic", cap))
        h = [r["ne"] for r in res["hashed"]]
        d = [r["ne"] for r in res["dynamic"]]
        tot = [r["stats"] for r in res["dynamic"]]
        lookups = sum(t["total"]["lookups"] for s in tot for t in s.values())
        unadm = sum(t["total"]["unadmitted"] for s in tot for t in s.values())
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
                "dynamic_unadmitted_share": unadm / max(1, lookups),
                "throughput_ratio": statistics.mean(r["steps_per_s"] for r in res["dynamic"])
                / statistics.mean(r["steps_per_s"] for r in res["hashed"]),
                "dynamic_stats": tot[-1],
            }
        )
    full = [_run(_cfg(a, s), a, "full", a.rows)["ne"] for s in range(a.seeds)]
    teacher = [_teacher_ne(_cfg(a, s)) for s in range(a.seeds)]
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
        print(
            f"{'':>8} dynamic vs hashed NE per seed (paired): {per_seed}; "
            f"unadmitted {100 * r['dynamic_unadmitted_share']:.0f}% of lookups"
        )
    print(
        f"full table ({a.rows:,} rows) NE {statistics.mean(full):.4f}, teacher NE "
        f"{statistics.mean(teacher):.4f}; id map {ops / 1e6:.2f} M ids/s"
    )
    result = {
        "bench": "dynamic",
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "windows": a.windows,
        "seeds": a.seeds,
        "settings": _settings(a),
        "budgets": rows,
        "ne_full_mean": statistics.mean(full),
        "ne_full_per_seed": full,
        "ne_teacher_mean": statistics.mean(teacher),
        "map_ids_per_s": ops,
    }
    print(json.dumps(result, default=str))
    return 0
