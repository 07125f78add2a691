"""``neorec bench movielens``'s figures from its eval predictions: per-seed metrics of the DLRM and
the regression, their t intervals over seeds, the bootstrap over eval users (and seeds) that
covers the data, and the printed table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from neorec.bench.bootstrap import cluster_bootstrap
from neorec.bench.stats import Interval, mean_interval, paired_difference
from neorec.metrics import auc, binary_metrics, log_loss

__all__ = ["METRICS", "per_seed_metrics", "user_intervals", "summarize", "print_table"]

METRICS = ("auc", "logloss", "ne")
"""The eval metrics kept per seed."""
BOOT_STATS = ("dlrm_auc", "lr_auc", "auc_diff", "dlrm_logloss", "lr_logloss", "logloss_diff")
"""The statistics of one bootstrap replicate (DLRM: the mean over the replicate's seeds)."""


def per_seed_metrics(
    dlrm: np.ndarray, lr: np.ndarray, labels: np.ndarray
) -> dict[str, dict[str, list[float]]]:
    """Per model and metric the value on each seed (``dlrm`` [seeds, n]; the regression is the
    same on every seed)."""
    out: dict[str, dict[str, list[float]]] = {m: {k: [] for k in METRICS} for m in ("dlrm", "lr")}
    ref = binary_metrics(lr, labels)
    for probs in dlrm:
        mine = binary_metrics(probs, labels)
        for k in METRICS:
            out["dlrm"][k].append(float(mine[k]))
            out["lr"][k].append(float(ref[k]))
    return out


def user_intervals(
    dlrm: np.ndarray,
    lr: np.ndarray,
    labels: np.ndarray,
    users: np.ndarray,
    reps: int,
    rng_seed: int = 0,
) -> dict[str, Interval]:
    """AUC and log loss of both models and DLRM - LR, each with its interval from a bootstrap over
    ``users`` (the eval rows' user ids) and the DLRM's seeds (rows of ``dlrm``); the differences
    paired on each replicate's rows."""

    def stat(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        y = labels[rows]
        d_auc = float(np.mean([auc(dlrm[s, rows], y) for s in seeds]))
        d_ll = float(np.mean([log_loss(dlrm[s, rows], y) for s in seeds]))
        l_auc, l_ll = auc(lr[rows], y), log_loss(lr[rows], y)
        return np.array([d_auc, l_auc, d_auc - l_auc, d_ll, l_ll, d_ll - l_ll])

    ivs = cluster_bootstrap(stat, users, len(dlrm), reps, rng_seed)
    return dict(zip(BOOT_STATS, ivs, strict=True))


def _ci(iv: Interval) -> dict[str, Any]:
    """An interval's JSON form; one seed's unbounded ends as null (JSON has no infinity)."""
    return {
        k: v if not isinstance(v, float) or math.isfinite(v) else None
        for k, v in iv.to_dict().items()
    }


def summarize(
    per_seed: dict[str, dict[str, list[float]]],
    seeds: Sequence[int],
    extra: dict[str, Any],
    users: dict[str, Interval] | None = None,
) -> dict[str, Any]:
    """The JSON record: per-model means with t intervals over seeds (``*_ci``), the paired
    differences DLRM - LR over seeds (``auc_diff``, ``logloss_diff``), and with ``users`` the
    bootstrap intervals over users and seeds (``*_ci_users``, ``*_diff_users``)."""
    models = {
        name: {
            **{k: mean_interval(v).value for k, v in vals.items()},
            **{f"{k}_ci": _ci(mean_interval(v)) for k, v in vals.items()},
            **{f"{k}_per_seed": list(v) for k, v in vals.items()},
        }
        for name, vals in per_seed.items()
    }
    d, lr = per_seed["dlrm"], per_seed["lr"]
    out = {
        "bench": "movielens",
        **extra,
        "seeds": list(seeds),
        "dlrm": models["dlrm"],
        "lr": models["lr"],
        "auc_diff": _ci(paired_difference(d["auc"], lr["auc"])),
        "logloss_diff": _ci(paired_difference(d["logloss"], lr["logloss"])),
    }
    if users is not None:
        for model in ("dlrm", "lr"):
            for k in ("auc", "logloss"):
                out[model][f"{k}_ci_users"] = _ci(users[f"{model}_{k}"])
        out["auc_diff_users"] = _ci(users["auc_diff"])
        out["logloss_diff_users"] = _ci(users["logloss_diff"])
    return out


def _iv(x: dict[str, Any]) -> str:
    lo, hi = x["lo"], x["hi"]
    return "[n/a]" if lo is None else f"[{lo:+.4f}, {hi:+.4f}]"


def print_table(r: dict[str, Any]) -> None:
    """Both models' mean eval AUC / log loss with 95% intervals, and DLRM - LR (over users and
    seeds when the record has them, else over seeds)."""
    ch = r["settings"]
    boot = r.get("bootstrap")
    over = f"users and seeds, {boot['reps']} replicates" if boot else "seeds"
    print(f"MovieLens ({r['layout']}, {r['split']['train']:,} train / {r['split']['eval']:,} eval "
          f"ratings), seeds {r['seeds']}, {r['cpu']}; settings "
          f"{'fixed (--quick)' if r['quick'] else 'chosen on seeds ' + str(r['select_seeds'])}: "
          f"DLRM lr x{ch['lr_scale']:g} dim {ch['dim']} {ch['epochs']} epochs, LR C {ch['C']:g}; "
          f"95% intervals over {over}")  # fmt: skip
    sfx = "_users" if boot else ""
    print(f"{'model':<24}{'eval AUC':>10}  {'95% CI':<20}{'log loss':>10}  {'95% CI':<20}")
    for name, label in (("dlrm", "DLRM (neorec)"), ("lr", "logistic regression")):
        m = r[name]
        print(f"{label:<24}{m['auc']:>10.4f}  {_iv(m['auc_ci' + sfx]):<20}"
              f"{m['logloss']:>10.4f}  {_iv(m['logloss_ci' + sfx]):<20}")  # fmt: skip
    da, dl = r["auc_diff" + sfx], r["logloss_diff" + sfx]
    print(
        f"{'DLRM - LR':<24}{da['value']:>+10.4f}  {_iv(da):<20}{dl['value']:>+10.4f}  {_iv(dl):<20}"
    )
    if boot:
        print(f"{'DLRM - LR, seeds only':<24}{'':>10}  {_iv(r['auc_diff']):<20}{'':>10}  "
              f"{_iv(r['logloss_diff']):<20}")  # fmt: skip
