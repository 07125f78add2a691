"""``neorec bench dynamic``: a dynamic (managed-id) table against hashed tables of the same memory,
with and without the dynamic table's admission filter.

The task is the drifting stream (``data.source = "stream"``): each window ids appear and old ones
retire. Every model trains window by window (one model through all windows) and is evaluated on
each window's eval split; a model's NE is the mean over windows. Table kinds, sizes and the
admission filter are in ``neorec.bench.dynamic_quality``: ``hashed`` (M rows), ``hashed_adm``
(the same hashed table behind the same threshold admission as the dynamic table, unadmitted ids
read zero and train nothing, rows + sketches in the same memory), ``dynamic`` (LRU, unadmitted
zeros, slots + id map + sketch in the same memory), and ``full`` (a row per id).

Two streams (``--streams``): ``default`` (the stream's defaults) and ``tuned``
(``id_shrink_visits`` 100, ``id_weight`` 3: each id's own effect is learnable). Per stream and
budget, the admission threshold of ``dynamic`` and of ``hashed_adm`` is each chosen from
``--thresholds`` (0: no filter) by mean NE on the development seeds 0..``--dev-seeds``-1; the
figures are then measured on ``--seeds`` other seeds from ``--seed-base``: NE differences and
ratios paired by seed with 95% intervals (``neorec.bench.stats``).

Throughput: the plain hashed table (M rows), ``hashed_adm`` and ``dynamic`` (the thresholds
chosen for ``--speed-stream``) train on the same batches, ``--rounds`` rounds in rotated order
(``stats.rotated``) after a warm-up pass; the ratios are paired by round (``stats.paired_ratio``).
The hashed tables' steps include hashing (and filtering) their ids, the dynamic table's its id
maps. Also the id map's operations per second.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from neorec.bench import dynamic_quality as q
from neorec.bench.stats import Interval, mean_interval, paired_difference, paired_ratio, rotated
from neorec.config import ConfigError
from neorec.machine import cpu_model_and_flags

__all__ = ["main", "dynamic_slots"]

dynamic_slots = q.dynamic_slots
KINDS = ("hashed", "hashed_adm", "dynamic")


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench dynamic", description=__doc__)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=10_000, help="id space per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--window-samples", type=int, default=102_400)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--eval-samples", type=int, default=10_240, help="eval samples a window")
    p.add_argument("--budgets", default="0.125,0.25", help="M as fractions of --rows")
    p.add_argument("--streams", default="default,tuned", help="of: " + ",".join(q.STREAMS))
    p.add_argument("--seeds", type=int, default=5, help="reported seeds")
    p.add_argument("--seed-base", type=int, default=10, help="first reported seed")
    p.add_argument("--dev-seeds", type=int, default=3, help="thresholds chosen on seeds 0..N-1")
    p.add_argument("--thresholds", default="0,4,16", help="admission thresholds tried (0: none)")
    p.add_argument("--churn", type=float, default=0.3, help="data.id_churn")
    p.add_argument("--drift", type=float, default=0.1, help="data.drift")
    p.add_argument("--ids", default="locality", choices=("locality", "zipf", "uniform"))
    p.add_argument(
        "--hash", default="mix", choices=("mix", "mod"), help="mix64(id) %% M or id %% M"
    )
    p.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    p.add_argument("--rounds", type=int, default=10, help="throughput rounds")
    p.add_argument("--speed-steps", type=int, default=100, help="steps a setting a round")
    p.add_argument("--speed-stream", default="tuned", choices=tuple(q.STREAMS))
    return p.parse_args(argv)


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise ConfigError(f"{flag} takes integers >= 0 like 0,16,64, got {text!r}")
    return sorted(set(out))


def check(a: argparse.Namespace) -> tuple[list[float], list[str], list[int]]:
    """(budgets, streams, thresholds); bad flags are a one-line ``ConfigError`` (before any
    training)."""
    for name in ("tables", "rows", "dim", "windows", "window_samples", "batch", "seeds"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("rounds", "speed_steps"):
        if getattr(a, name) < 2:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 2, got {getattr(a, name)}")
    if a.seeds < 2:
        raise ConfigError(f"--seeds must be >= 2 for a paired interval, got {a.seeds}")
    if min(a.window_samples, a.eval_samples) < a.batch:
        raise ConfigError(
            f"--window-samples ({a.window_samples:,}) and --eval-samples ({a.eval_samples:,}) "
            f"must each hold at least one --batch ({a.batch:,})"
        )
    try:
        budgets = [float(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        budgets = []
    if not budgets or any(not 0 < f <= 1 for f in budgets):
        raise ConfigError(f"--budgets takes fractions in (0, 1] like 0.125,0.25, got {a.budgets!r}")
    streams = [s.strip() for s in a.streams.split(",") if s.strip()]
    if not streams or any(s not in q.STREAMS for s in streams):
        raise ConfigError(f"--streams takes names of {list(q.STREAMS)}, got {a.streams!r}")
    grid = _ints(a.thresholds, "--thresholds")
    if len(grid) > 1 and a.dev_seeds < 1:
        raise ConfigError(f"--dev-seeds must be >= 1 to choose among --thresholds {grid}")
    if len(grid) > 1 and a.seed_base < a.dev_seeds:
        raise ConfigError(
            f"--seed-base {a.seed_base} reports on the development seeds 0..{a.dev_seeds - 1} "
            f"the thresholds are chosen on: use --seed-base >= {a.dev_seeds}"
        )
    if a.seed_base < 0:
        raise ConfigError(f"--seed-base must be >= 0, got {a.seed_base}")
    return budgets, streams, grid


def _iv(x: Interval) -> dict[str, Any]:
    return x.to_dict()


def quality(
    a: argparse.Namespace, stream: str, budgets: list[float], grid: list[int], seeds: list[int]
) -> dict[str, Any]:
    """One stream: thresholds chosen on the dev seeds, then every kind on ``seeds``."""
    dev = list(range(a.dev_seeds))
    ref = [q.train_eval(q.stream_cfg(a, stream, s), a, "full", a.rows, 0) for s in seeds]
    full = [r["ne"] for r in ref]  # the full table: the reference every kind is set against
    teacher = [q.teacher_ne(q.stream_cfg(a, stream, s)) for s in seeds]
    rows = []
    for frac in budgets:
        sel = q.select(a, stream, frac, grid, dev)
        thr = {"hashed": 0, **{k: sel[k]["threshold"] for k in ("hashed_adm", "dynamic")}}
        size = {k: q.sizes(a, frac, thr[k], k) for k in KINDS}
        res = {
            k: [q.train_eval(q.stream_cfg(a, stream, s), a, k, size[k], thr[k]) for s in seeds]
            for k in KINDS
        }
        ne = {k: [r["ne"] for r in res[k]] for k in KINDS}
        row: dict[str, Any] = {
            "budget_fraction": frac,
            "bytes_per_table": int(a.rows * frac) * (4 * a.dim + 4),
            "hashed_rows": size["hashed"],
            "hashed_adm_rows": size["hashed_adm"],
            "dynamic_slots": size["dynamic"],
            "threshold_hashed_adm": thr["hashed_adm"],
            "threshold_dynamic": thr["dynamic"],
            "dev_ne": {k: {str(t): v for t, v in sel[k]["dev_ne"].items()} for k in sel},
        }
        for k in KINDS:
            row[f"ne_{k}"] = _iv(mean_interval(ne[k]))
            row[f"ne_{k}_per_seed"] = ne[k]
            row[f"unadmitted_{k}"] = sum(r["unadmitted"] for r in res[k]) / len(seeds)
        for k in ("hashed", "hashed_adm"):
            row[f"ne_diff_dynamic_vs_{k}"] = _iv(paired_difference(ne["dynamic"], ne[k]))
            row[f"ne_ratio_dynamic_vs_{k}"] = _iv(paired_ratio(ne["dynamic"], ne[k]))
        row["ne_ratio_hashed_adm_vs_hashed"] = _iv(paired_ratio(ne["hashed_adm"], ne["hashed"]))
        rows.append(row)
    shrink, weight = q.STREAMS[stream]
    return {
        "id_shrink_visits": shrink,
        "id_weight": weight,
        "ne_full": _iv(mean_interval(full)),
        "ne_full_per_seed": full,
        "auc_full": _iv(mean_interval([r["auc"] for r in ref])),
        "ne_teacher_mean": sum(teacher) / len(teacher),
        "budgets": rows,
    }


def speed(
    a: argparse.Namespace, budgets: list[float], thresholds: list[dict[str, int]], seed: int
) -> list[dict[str, Any]]:
    """Per budget: plain hashed, hashed_adm and dynamic steps/s, interleaved round by round."""
    from neorec.data.stream import DriftingClickData

    cfg = q.stream_cfg(a, a.speed_stream, seed)
    data = DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=0)
    per = cfg.data.window_samples // a.batch
    batches = [data.batch("train", i % per, a.batch) for i in range(a.speed_steps)]
    out = []
    for frac, thr in zip(budgets, thresholds):
        kinds = {"plain": ("hashed", 0), "hashed_adm": ("hashed_adm", thr["hashed_adm"])}
        kinds["dynamic"] = ("dynamic", thr["dynamic"])
        tabs = {n: q.Table(cfg, a, k, q.sizes(a, frac, t, k), t) for n, (k, t) in kinds.items()}
        q.speed_round(tabs, batches)  # warm-up: the maps fill, the allocator settles
        got: dict[str, list[float]] = {n: [] for n in tabs}
        for r in range(a.rounds):
            order = rotated(list(tabs), r)
            for n, v in q.speed_round({n: tabs[n] for n in order}, batches).items():
                got[n].append(v)
        out.append(
            {
                "budget_fraction": frac,
                "thresholds": {n: t for n, (_, t) in kinds.items()},
                "steps_per_s": {n: _iv(mean_interval(v)) for n, v in got.items()},
                "ratio_dynamic_vs_plain": _iv(paired_ratio(got["dynamic"], got["plain"])),
                "ratio_dynamic_vs_hashed_adm": _iv(paired_ratio(got["dynamic"], got["hashed_adm"])),
                "ratio_hashed_adm_vs_plain": _iv(paired_ratio(got["hashed_adm"], got["plain"])),
            }
        )
    return out


def _map_ops(a: argparse.Namespace) -> float:
    """Id map lookups + inserts + evictions per second on a churning id stream."""
    from neorec.ops.id_map import IdMap

    im = IdMap(max(1, a.rows // 8), eviction="lru", seed=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(i * 500, i * 500 + a.rows, (65_536,), generator=g) for i in range(20)]
    t0 = time.perf_counter()
    for ids in batches:
        im.map(ids)
    return sum(b.numel() for b in batches) / (time.perf_counter() - t0)


def _pct(iv: dict[str, Any]) -> str:
    return f"{100 * (iv['value'] - 1):+.2f}% [{100 * (iv['lo'] - 1):+.2f}, {100 * (iv['hi'] - 1):+.2f}]"


def _x(iv: dict[str, Any]) -> str:
    return f"{iv['value']:.2f}x [{iv['lo']:.2f}, {iv['hi']:.2f}]"


def report(res: dict[str, Any]) -> None:
    """The tables."""
    print(f"seeds {res['seeds']} (thresholds chosen on {res['dev_seeds']}); CPU {res['cpu']}")
    for name, st in res["streams"].items():
        print(f"\nstream {name} (id_shrink_visits {st['id_shrink_visits']:g}, id_weight "
              f"{st['id_weight']:g}): full NE {st['ne_full']['value']:.4f}, teacher "
              f"{st['ne_teacher_mean']:.4f}")  # fmt: skip
        print(f"{'budget':>7}{'rows h/ha/dyn':>20}{'thr ha/dyn':>11}{'NE h':>8}{'NE ha':>8}"
              f"{'NE dyn':>8}  {'dyn/h - 1 (95%)':<26}{'dyn/ha - 1 (95%)':<26}unadm ha/dyn")  # fmt: skip
        for b in st["budgets"]:
            rows = f"{b['hashed_rows']}/{b['hashed_adm_rows']}/{b['dynamic_slots']}"
            thr = f"{b['threshold_hashed_adm']}/{b['threshold_dynamic']}"
            print(
                f"{b['budget_fraction']:>7.3f}{rows:>20}{thr:>11}{b['ne_hashed']['value']:>8.4f}"
                f"{b['ne_hashed_adm']['value']:>8.4f}{b['ne_dynamic']['value']:>8.4f}  "
                f"{_pct(b['ne_ratio_dynamic_vs_hashed']):<26}"
                f"{_pct(b['ne_ratio_dynamic_vs_hashed_adm']):<26}"
                f"{100 * b['unadmitted_hashed_adm']:.0f}%/{100 * b['unadmitted_dynamic']:.0f}%"
            )
    print(f"\nthroughput ({res['speed_stream']} stream, {res['rounds']} rounds, rotated):")
    for s in res["throughput"]:
        sps = " ".join(f"{n} {v['value']:.0f}" for n, v in s["steps_per_s"].items())
        print(
            f"{s['budget_fraction']:>7.3f} steps/s {sps}; dynamic/plain "
            f"{_x(s['ratio_dynamic_vs_plain'])}, dynamic/hashed_adm "
            f"{_x(s['ratio_dynamic_vs_hashed_adm'])}"
        )
    print(f"id map {res['map_ids_per_s'] / 1e6:.2f} M ids/s")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print tables and a JSON line."""
    a = parse(argv)
    budgets, streams, grid = check(a)
    for s in streams:
        q.stream_cfg(a, s, 0)  # the stream settings' own checks, before any training
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    seeds = list(range(a.seed_base, a.seed_base + a.seeds))
    st = {s: quality(a, s, budgets, grid, seeds) for s in streams}
    if a.speed_stream in st:
        thr = [
            {k: b[f"threshold_{k}"] for k in ("hashed_adm", "dynamic")}
            for b in st[a.speed_stream]["budgets"]
        ]
    else:  # not measured: the grid's largest threshold
        thr = [{"hashed_adm": max(grid), "dynamic": max(grid)} for _ in budgets]
    res: dict[str, Any] = {
        "bench": "dynamic",
        "cpu": cpu_model_and_flags()[0],
        "seeds": seeds,
        "dev_seeds": list(range(a.dev_seeds)) if len(grid) > 1 else [],
        "thresholds_grid": grid,
        "tables": a.tables,
        "rows": a.rows,
        "dim": a.dim,
        "windows": a.windows,
        "settings": {
            k: getattr(a, k)
            for k in ("window_samples", "eval_samples", "batch", "churn", "drift", "ids")
            + ("hash", "eviction", "speed_steps")
        },
        "streams": st,
        "speed_stream": a.speed_stream,
        "rounds": a.rounds,
        "throughput": speed(a, budgets, thr, seeds[0]),
        "map_ids_per_s": _map_ops(a),
    }
    res["wall_s"] = time.perf_counter() - t0
    report(res)
    print(json.dumps(res, default=str))
    return 0
