"""``neorec bench lowp``'s parts: the MovieLens-100K runs' configs and the paired summary.

The summary's verdict refuses to call a change "within noise" when the reference did not beat the
base rate (eval NE ≥ 1): there, every precision predicts as badly, and the interval says nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neorec.bench.stats import mean_interval, paired_difference
from neorec.config import Config

__all__ = ["movielens_task", "summarize", "verdict", "TARGET"]

TARGET = 0.001
"""LoKA's quality target: eval NE within 0.1% of fp32 (the interval inside ±0.1%)."""

MOVIELENS_CONFIG = "configs/movielens.toml"


def movielens_task(
    a: argparse.Namespace, tmp: Path, common: list[str]
) -> Callable[[int, list[str], str], Config]:
    """``make(seed, sets, name)`` over ML-100K's report split (train / the held-out last 10% of
    each user's ratings) with the settings ``neorec bench movielens`` chose on its selection seeds
    (``QUICK``)."""
    from neorec.bench import movielens as ml
    from neorec.data.movielens import read_movielens

    src = Path(a.input) if a.input else ml.fetch_ml100k(ml.cache_dir(), print)
    ratings, users, movies, _ = read_movielens(src)
    held, _val = ml.carve(ratings)
    pre = tmp / "movielens"
    ml.write_task(pre, ratings, users, movies, ~held, held)
    task = ml.Task(pre, {}, {}, {})  # dlrm_config reads only the folder
    config = a.config or MOVIELENS_CONFIG
    setting = ml.QUICK

    def make(seed: int, sets: list[str], name: str) -> Config:
        ns = argparse.Namespace(config=config, set=[*a.set, *sets, *common])
        run_dir = tmp / name
        shutil.rmtree(run_dir, ignore_errors=True)
        return ml.dlrm_config(ns, task, seed, setting, run_dir, int(setting["epochs"]))

    return make


def verdict(rel: dict[str, Any], ref_ne: float) -> str:
    """What a paired NE change (relative interval) shows, given the reference's mean NE."""
    if ref_ne >= 1:
        return "no verdict: the reference's NE >= 1 (it learned nothing)"
    if rel["n"] < 2 or rel["lo"] is None:
        return "no interval (one seed)"
    if rel["lo"] == rel["hi"] == 0:
        return "identical to the reference"
    inside = -TARGET <= rel["lo"] and rel["hi"] <= TARGET
    if rel["lo"] > 0:
        return "worse beyond noise" + (" (within 0.1%)" if inside else "")
    if rel["hi"] < 0:
        return "better beyond noise"
    return "within noise" + (", inside ±0.1%" if inside else ", interval wider than ±0.1%")


def summarize(runs: dict[str, list[dict[str, Any]]], variants: dict[str, Any]) -> dict[str, Any]:
    """Per variant: NE mean / spread, NE relative to the first variant paired by seed and the
    paired AUC difference (95% intervals), the verdict; the reference's absolute NE and AUC."""
    modes = list(variants)
    base = runs[modes[0]]
    ref_ne = mean_interval([r["ne"] for r in base])
    out: dict[str, Any] = {
        "reference": {
            "variant": modes[0],
            "ne": _ci(ref_ne),
            "auc": _ci(mean_interval([r["auc"] for r in base])),
            "learns": ref_ne.value < 1,
        },
        "modes": {},
    }
    for mode in modes:
        rs = runs[mode]
        ne = [r["ne"] for r in rs]
        rel = _ci(mean_interval([r["ne"] / b["ne"] - 1 for r, b in zip(rs, base)]))
        out["modes"][mode] = {
            "ne_mean": statistics.mean(ne),
            "ne_min": min(ne),
            "ne_max": max(ne),
            "auc_mean": statistics.mean(r["auc"] for r in rs),
            "rel_vs_base": rel,
            "rel_vs_base_mean": rel["value"],
            "auc_diff": _ci(paired_difference([r["auc"] for r in rs], [b["auc"] for b in base])),
            "verdict": verdict(rel, ref_ne.value) if mode != modes[0] else "reference",
            "train_s_mean": statistics.mean(r["train_s"] for r in rs),
            "low_precision_sites": rs[0]["low_precision_sites"],
            "fallbacks": sum(r["fallbacks"] for r in rs),
            "table_mb": rs[0]["table_mb"],
            "runs": rs,
        }
    return out


def _ci(iv: Any) -> dict[str, Any]:
    """An interval's JSON form; one seed's unbounded ends as null (JSON has no infinity)."""
    d: dict[str, Any] = iv.to_dict()
    for k in ("lo", "hi"):
        if d[k] is not None and not abs(d[k]) < float("inf"):
            d[k] = None
    return d
