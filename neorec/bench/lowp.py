"""``neorec bench lowp``: eval quality of LoKA precision modes vs fp32 over several seeds.

Each (seed, variant) pair trains the config from scratch (model seed = ``train.seed``, seeds
``--seed-base`` .. ``--seed-base + --seeds - 1``; the data is the same for all, labels from the
synthetic teacher) and evaluates; the table gives each variant's eval NE (mean, spread over
seeds), its relative difference from the first variant paired by seed with a 95% interval
(``docs/benchmarks.md``), and the training time. Variants are ``--modes`` (``lowp.mode`` of the
dense sites; ``autocast``: plain ``torch.autocast(bfloat16)`` of the dense part,
``train.bf16_dense``), or with ``--emb`` the stored precision of the embedding tables and its
rounding (``fp32,fp16:nearest,bf16:stochastic,fp8:nearest``), with the tables' memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from neorec.bench.stats import mean_interval
from neorec.config import load_config

__all__ = ["main"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench lowp", description=__doc__)
    p.add_argument("--config", default=None, help="TOML config (default: the built-in default)")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--modes", default="off,auto", help="lowp modes, comma-separated")
    p.add_argument(
        "--emb",
        default="",
        help="instead of modes: embedding precisions[:rounding], e.g. fp32,fp16:nearest,fp8",
    )
    p.add_argument("--seeds", type=int, default=3, help="model seeds (at least 2 for intervals)")
    p.add_argument(
        "--seed-base", type=int, default=0, help="first model seed (seeds nobody tuned on)"
    )
    p.add_argument("--threads", type=int, default=0, help="train.threads (0 = all cores)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    from neorec.train.trainer import Trainer

    variants = _variants(a)
    for sets in variants.values():
        load_config(a.config, [*a.set, *sets])  # every variant checked before any training
    modes = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(a.seed_base, a.seed_base + a.seeds):
            for mode in modes:
                sets = [
                    *a.set,
                    f"train.seed={seed}",
                    *variants[mode],
                    f"train.run_dir='{Path(tmp) / f'{mode}-{seed}'}'",
                    "train.progress=false",
                    f"train.threads={a.threads}",
                ]
                cfg = load_config(a.config, sets)
                t0 = time.perf_counter()
                m = Trainer(cfg).fit()
                runs[mode].append(
                    {
                        "seed": seed,
                        "ne": m["eval"]["ne"],
                        "auc": m["eval"]["auc"],
                        "train_s": m["train"]["seconds"],
                        "wall_s": time.perf_counter() - t0,
                        "low_precision_sites": (m.get("lowp") or {}).get("low_precision_sites", 0),
                        "table_mb": _table_bytes(cfg) / 2**20,
                    }
                )
    base = modes[0]
    result: dict[str, Any] = {
        "bench": "lowp",
        "config": a.config,
        "sets": a.set,
        "seeds": list(range(a.seed_base, a.seed_base + a.seeds)),
        "modes": {},
    }
    w = max(8, *(len(m) + 2 for m in modes))
    print(f"{'variant':<{w}}{'NE mean':>10}{'NE min':>10}{'NE max':>10}"
          f"{'vs ' + base + ' (95% interval)':>34}{'train s':>9}{'lowp sites':>12}"
          f"{'table MB':>10}")  # fmt: skip
    for mode in modes:
        ne = [r["ne"] for r in runs[mode]]
        rel = [r["ne"] / b["ne"] - 1 for r, b in zip(runs[mode], runs[base])]
        row = {
            "ne_mean": statistics.mean(ne),
            "ne_min": min(ne),
            "ne_max": max(ne),
            "rel_vs_base_mean": statistics.mean(rel),
            "rel_vs_base": mean_interval(rel).to_dict(),
            "rel_vs_base_max_abs": max(abs(x) for x in rel),
            "train_s_mean": statistics.mean(r["train_s"] for r in runs[mode]),
            "low_precision_sites": runs[mode][0]["low_precision_sites"],
            "table_mb": runs[mode][0]["table_mb"],
            "runs": runs[mode],
        }
        result["modes"][mode] = row
        iv = row["rel_vs_base"]
        cell = f"{100 * iv['value']:+.3f}% [{100 * iv['lo']:+.3f}, {100 * iv['hi']:+.3f}]"
        print(
            f"{mode:<{w}}{row['ne_mean']:>10.5f}{row['ne_min']:>10.5f}{row['ne_max']:>10.5f}"
            f"{cell:>34}{row['train_s_mean']:>9.1f}{row['low_precision_sites']:>12}"
            f"{row['table_mb']:>10.2f}"
        )
    print(json.dumps(result))
    return 0


def _variants(a: argparse.Namespace) -> dict[str, list[str]]:
    """Label -> config overrides of each variant."""
    if not a.emb:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        return {
            m: ["train.bf16_dense=true"] if m == "autocast" else [f"lowp.mode={m!r}"] for m in modes
        }
    out = {}
    for spec in (x.strip() for x in a.emb.split(",")):
        if not spec:
            continue
        prec, _, rounding = spec.partition(":")
        out[spec] = [f"embedding.precision={prec!r}", f"embedding.rounding={rounding or 'auto'!r}"]
    return out


def _table_bytes(cfg: Any) -> int:
    """Bytes of the stored embedding rows (without optimizer state)."""
    from neorec.ops.lowp_rows import bytes_per_row

    return sum(t.rows * bytes_per_row(t.precision or "fp32", t.dim) for t in cfg.embedding.tables)
