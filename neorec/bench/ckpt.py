"""``neorec bench ckpt``: Check-N-Run checkpoint bytes, storage, pause and quality.

Bytes: one synthetic training run (ids from the locality generator calibrated to Meta's published
reuse statistics, ../shared/data) checkpoints every ``--interval`` steps under several settings at
once (each its own manager, tracker and directory). Per setting: bytes written per checkpoint and
in total, storage held under ``keep_last`` (mean over the run), against full float32 checkpoints.
Settings marked ``*`` (full baselines every time) are measured on one checkpoint and scaled,
because encoding every row at 2-4 bits each time adds nothing but minutes.

Quality (``neorec.bench.ckpt_quality``): on the default model and teacher data, a model that
learns (its reference NE and AUC are reported), NE after 1 or 4 restores from each stored form
(bits, adaptive range, optimizer-state bits), paired by seed over ``--seeds`` (held out from the
seeds the default was chosen on), with 95% intervals.

    python -m neorec.bench.ckpt [--tables 16] [--scale 256] [--steps 80] [--interval 10]
        [--seeds 100-104] [--quality-steps 400] [--storage memory|dram|ssd]

``--storage dram|ssd`` puts the bytes run's tables behind the row cache (``--cache-fraction`` of
their rows): bytes and pause of checkpoints of tiered tables.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from neorec.bench.ckpt_quality import DEFAULT_Q, DEV_SEEDS, QSETTINGS, run_seed, summarize
from neorec.bench.stats import parse_seeds
from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint.manager import CheckpointManager, list_checkpoints
from neorec.checkpoint.storage import open_storage
from neorec.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EmbeddingConfig,
    ModelConfig,
    StorageConfig,
    TrainConfig,
)
from neorec.data.ids import LOCALITY_REF_BATCH
from neorec.data.locality import (
    REFERENCE_LOOKUP_SHARE,
    batch_reuse_histograms,
    histogram_distance,
    production_like_tables,
)
from neorec.data.synthetic import SyntheticClickData
from neorec.train.trainer import train_step

__all__ = ["main", "SETTINGS", "DEFAULT"]

DEFAULT = "adaptive/8/opt32"
"""The default checkpoint setting (CheckpointConfig's defaults)."""

# name -> (policy, bits, opt_bits, measured every checkpoint?)
SETTINGS: dict[str, tuple[str, int, int, bool]] = {
    "full/32": ("full", 32, 32, True),
    "one_shot/32": ("one_shot", 32, 32, True),
    "consecutive/32": ("consecutive", 32, 32, True),
    "adaptive/32": ("adaptive", 32, 32, True),
    "full/8": ("full", 8, 16, False),
    "full/4": ("full", 4, 16, False),
    "full/3": ("full", 3, 16, False),
    "full/2": ("full", 2, 16, False),
    DEFAULT: ("adaptive", 8, 32, True),
    "adaptive/8/opt16": ("adaptive", 8, 16, True),
    "adaptive/8/opt0": ("adaptive", 8, 0, True),
    "adaptive/4/opt16": ("adaptive", 4, 16, True),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench ckpt", description=__doc__)
    p.add_argument("--tables", type=int, default=16, help="production-like tables")
    p.add_argument("--scale", type=float, default=256.0, help="rows and batch divided by this")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--interval", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--keep-last", type=int, default=2, help="baselines kept (storage figure)")
    p.add_argument(
        "--storage",
        choices=("memory", "dram", "ssd"),
        default="memory",
        help="bytes run: where the tables live (dram / ssd: behind the row cache, stores in the "
        "temp dir; training is bitwise that of memory tables, so the quality half is too)",
    )
    p.add_argument("--cache-fraction", type=float, default=0.1, help="dram / ssd: rows cached")
    p.add_argument("--seeds", default="100-104", help="quality: reported seeds (a-b or a,b,c)")
    p.add_argument("--quality-steps", type=int, default=400, help="quality: steps per run")
    p.add_argument("--quality-interval", type=int, default=50, help="quality: checkpoint every")
    p.add_argument("--quality-batch", type=int, default=512, help="quality: batch size")
    p.add_argument("--eval-samples", type=int, default=20480, help="quality: eval samples")
    p.add_argument("--quality", default="", help="quality: comma-separated subset of settings")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--settings", default="", help="comma-separated subset of the settings")
    p.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_config(args: argparse.Namespace, store: Path | None = None) -> Config:
    """Model and data of the bytes run (dram / ssd tables: their stores in ``store``)."""
    tables = production_like_tables(args.tables, scale=args.scale, dim=args.dim)
    batch = max(1, round(LOCALITY_REF_BATCH / args.scale))
    if args.storage != "memory":  # a cache of --cache-fraction, or of one batch's ids at most
        tables = [
            replace(t, storage=args.storage, cache_rows=_cache_rows(t, batch, args.cache_fraction))
            for t in tables
        ]
    return Config(
        model=ModelConfig(bottom_mlp=[64, args.dim], top_mlp=[64, 1]),
        embedding=EmbeddingConfig(tables=tables, lr=args.lr),
        data=DataConfig(
            batch_size=batch,
            train_samples=batch * args.steps,
            eval_samples=batch,  # no eval in the bytes run
            seed=args.seed,
        ),
        train=TrainConfig(seed=args.seed, progress=False),
        storage=StorageConfig(dir=str(store or "")),
    )


def _cache_rows(t: Any, batch: int, fraction: float) -> int:
    """Rows cached of table ``t``: ``fraction`` of them, at least the most ids a batch looks up."""
    most = batch * math.ceil(max(1.0, float(t.pooling_factor))) * len(t.features)
    return min(int(t.rows), max(math.ceil(fraction * t.rows), most))


def _managers(
    model: Any, opt: Any, root: Path, names: list[str], keep: int
) -> dict[str, CheckpointManager]:
    out = {}
    for n in names:
        policy, bits, opt_bits, _ = SETTINGS[n]
        cfg = CheckpointConfig(
            policy=policy,
            bits=bits,
            opt_bits=opt_bits,
            # retention is replayed from the manifests below; keep files for the restores
            keep_last=1000,
            async_write=n == DEFAULT,
            fsync=False,
        )
        out[n] = CheckpointManager(cfg, model, opt, str(root / n.replace("/", "_")))
    return out


def _storage_held(history: list[dict[str, Any]], keep: int) -> list[int]:
    """Bytes held after each checkpoint if only the last ``keep`` baselines (+ chains) stayed."""
    held = []
    for i in range(len(history)):
        seen = history[: i + 1]
        baselines = [m["name"] for m in seen if m["kind"] == "baseline"][-keep:]
        held.append(sum(m["bytes"] for m in seen if m["baseline"] in baselines))
    return held


def _bytes_run(args: argparse.Namespace, names: list[str], tmp: Path) -> dict[str, Any]:
    """The bytes half: one run on production-like tables; bytes, storage and pause per setting."""
    cfg = make_config(args, tmp / "store")
    bs = cfg.data.batch_size
    data = SyntheticClickData(
        cfg.data, cfg.embedding.tables, cfg.model.num_dense, locality_ref_batch=bs
    )
    _, share = batch_reuse_histograms(data.batch("train", 0, bs).sparse)
    calib = histogram_distance(share, REFERENCE_LOOKUP_SHARE)
    total_rows = sum(t.rows for t in cfg.embedding.tables)
    print(
        f"bench ckpt: {len(cfg.embedding.tables)} tables ({args.storage}), {total_rows:,} rows x "
        f"{args.dim}, "
        f"batch {bs}, {args.steps} steps, checkpoint every {args.interval}; reuse vs reference "
        f"(max lookup-share diff) {calib:.3f}",
        flush=True,
    )
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    every = [n for n in names if SETTINGS[n][3]]
    once = [n for n in names if not SETTINGS[n][3]]
    mgrs = _managers(model, opt, tmp, every, args.keep_last)
    pauses: dict[str, list[float]] = {n: [] for n in every}
    dirty: list[float] = []
    for s in range(args.steps):
        train_step(model, opt, data.batch("train", s, bs), s + 1)
        step = s + 1
        if step % args.interval:
            continue
        tracker = mgrs["full/32"].tracker
        assert tracker is not None  # fixed tables only in this bench
        dirty.append(float(tracker.masks["mp"].float().mean()))
        for n, m in mgrs.items():
            pauses[n].append(m.save(step))
        if step == args.steps:
            for m in _managers(model, opt, tmp, once, args.keep_last).values():
                m.save(step)
                m.close()
    for m in mgrs.values():
        m.close()
    rows: dict[str, dict[str, Any]] = {}
    n_ckpt = args.steps // args.interval
    for n in names:
        hist = list_checkpoints(open_storage(str(tmp / n.replace("/", "_"))))
        if SETTINGS[n][3]:
            per = [m["bytes"] for m in hist]
            held = _storage_held(hist, args.keep_last)
        else:  # a full baseline every time: every checkpoint is this big
            per = [hist[-1]["bytes"]] * n_ckpt
            held = [b * min(i + 1, args.keep_last) for i, b in enumerate(per)]
        rows[n] = {
            "bytes_per_ckpt": statistics.mean(per),
            "bytes_total": sum(per),
            "storage_mean": statistics.mean(held),
            "storage_end": held[-1],
            "baselines": sum(m["kind"] == "baseline" for m in hist) if SETTINGS[n][3] else n_ckpt,
            "pause_ms": statistics.mean(pauses[n]) if n in pauses else float("nan"),
            "pause_max_ms": max(pauses[n]) if n in pauses else float("nan"),
        }
    ref = rows["full/32"]
    for r in rows.values():
        r["write_reduction"] = ref["bytes_per_ckpt"] / r["bytes_per_ckpt"]
        r["storage_reduction"] = ref["storage_mean"] / r["storage_mean"]
    return {
        "tables": len(cfg.embedding.tables),
        "storage": args.storage,
        "rows": total_rows,
        "batch": bs,
        "reuse_distance": round(calib, 4),
        "dirty_fraction": round(statistics.mean(dirty), 4),
        "settings": rows,
    }


def _print_bytes(res: dict[str, Any]) -> None:
    print(
        f"\n{'setting':<18} {'MiB/ckpt':>9} {'MiB total':>10} {'held MiB':>9} {'write x':>8} "
        f"{'storage x':>9} {'baselines':>9} {'pause ms':>9}"
    )
    for n, r in res["settings"].items():
        mark = "*" if not SETTINGS[n][3] else ("<- default" if n == DEFAULT else "")
        print(
            f"{n:<18} {r['bytes_per_ckpt'] / 2**20:>9.2f} {r['bytes_total'] / 2**20:>10.2f} "
            f"{r['storage_mean'] / 2**20:>9.2f} {r['write_reduction']:>8.2f} "
            f"{r['storage_reduction']:>9.2f} {r['baselines']:>9} {r['pause_ms']:>9.1f} {mark}"
        )
    print(
        f"rows modified per interval: mean {100 * res['dirty_fraction']:.1f}% of all rows",
        flush=True,
    )


def _quality_settings(args: argparse.Namespace) -> list[Any]:
    """The quality settings ``--quality`` names (all by default); one error naming unknown ones."""
    wanted = [q for q in args.quality.split(",") if q]
    known = {q.name: q for q in QSETTINGS}
    bad = [q for q in wanted if q not in known]
    if bad:
        raise ConfigError(f"--quality {','.join(bad)}: unknown; settings are {', '.join(known)}")
    return [known[q] for q in wanted] if wanted else list(QSETTINGS)


def _quality(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The quality half (``neorec.bench.ckpt_quality``) on ``--seeds``; prints its table."""
    seeds = parse_seeds(args.seeds, "--seeds")
    settings = _quality_settings(args)
    print(
        f"\nquality: the default model (8 tables x 10,000 x 16), batch {args.quality_batch}, "
        f"{args.quality_steps} steps, cosine lr decay, checkpoint every {args.quality_interval}; "
        f"seeds {seeds}",
        flush=True,
    )
    per_seed = []
    for seed in seeds:
        r = run_seed(
            seed,
            settings,
            args.quality_steps,
            args.quality_batch,
            args.quality_interval,
            args.eval_samples,
            tmp / "quality",
        )
        print(f"  seed {seed}: reference NE {r['reference']['ne']:.5f}", flush=True)
        per_seed.append(r)
    out = summarize(per_seed, settings)
    out["seeds"] = seeds
    out["dev_seeds"] = list(DEV_SEEDS)
    out["held_out"] = not set(seeds) & set(DEV_SEEDS)
    print(f"\n{'setting':<18} {'bits':>4} {'range':>8} {'opt':>4} {'restores':>8}  NE change [95%]")
    for name, r in out["settings"].items():
        i = r["ne_change_interval"]
        mark = "<- default" if name == DEFAULT_Q.name else ""
        print(
            f"{name:<18} {r['bits']:>4} {'adaptive' if r['adaptive_range'] else 'min/max':>8} "
            f"{r['opt_bits']:>4} {r['restores']:>8}  {100 * i['value']:+.4f}% "
            f"[{100 * i['lo']:+.4f}, {100 * i['hi']:+.4f}] {mark}"
        )
    print(
        f"reference (uninterrupted) NE {out['reference_ne']:.4f}, AUC {out['reference_auc']:.4f} "
        f"(mean over seeds); held out from the default's choice: {out['held_out']}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print tables and a JSON line."""
    args = parse(argv)
    parse_seeds(args.seeds, "--seeds")  # bad flags: one error before any work
    _quality_settings(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [s for s in args.settings.split(",") if s] or list(SETTINGS)
    names = ["full/32", *[n for n in names if n != "full/32"]]
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="neorec-bench-ckpt-"))
    t0 = time.perf_counter()
    try:
        b = _bytes_run(args, names, tmp)
        _print_bytes(b)
        q = _quality(args, tmp)
    finally:  # an interrupted run leaves no checkpoints behind either
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    d, dq = b["settings"].get(DEFAULT), q["settings"].get(DEFAULT_Q.name)
    if d is not None and dq is not None:  # the default's quality, next to its bytes
        d["ne_change"], d["ne_change_interval"] = dq["ne_change"], dq["ne_change_interval"]
    summary: dict[str, Any] = {
        "bench": "ckpt",
        **{k: v for k, v in b.items() if k != "settings"},
        "dim": args.dim,
        "steps": args.steps,
        "interval": args.interval,
        "keep_last": args.keep_last,
        "reference_ne": q["reference_ne"],
        "reference_auc": q["reference_auc"],
        "settings": _rounded(b["settings"]),
        "quality": {
            **{k: v for k, v in q.items() if k != "settings"},
            "steps": args.quality_steps,
            "interval": args.quality_interval,
            "batch": args.quality_batch,
            "settings": q["settings"],
        },
        "default": DEFAULT,
        "default_quality": DEFAULT_Q.name,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if d is not None and dq is not None:
        summary["targets"] = {
            "write_reduction>=6": d["write_reduction"] >= 6,
            "storage_reduction>=2.5": d["storage_reduction"] >= 2.5,
            "reference_ne<=0.95": q["reference_ne"] <= 0.95,
            "ne_change_hi<=0.0005": dq["ne_change_interval"]["hi"] <= 5e-4,
        }
    print(json.dumps(summary))
    return 0


def _rounded(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Floats to 6 significant digits (an NE change of 1e-6 keeps its digits)."""
    return {
        n: {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in r.items()}
        for n, r in rows.items()
    }


if __name__ == "__main__":
    raise SystemExit(main())
