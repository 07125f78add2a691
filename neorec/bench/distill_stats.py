"""``neorec bench distill``'s figures from its runs (``neorec.bench.distill``): per vertical and
staleness, the setups' NE paired by seed with 95% intervals, ``gap_closed`` against the stale and
the fresh FM, the lrs the tuning chose, throughput ratios to ``alone``; and the printed table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from neorec.bench.stats import Interval, mean_interval, paired_difference, paired_ratio

__all__ = ["SETUPS", "GAP_REFS", "GAP_TARGET", "target_met", "summarize", "print_table"]

SETUPS = ("alone", "plain", "aux", "aux+adapter")
"""Student setups, in table order."""

GAP_REFS = {
    "vs_stale_fm": "stale",
    "vs_fresh_fm": "fresh",
    "vs_fresh_fm_recalibrated": "recal",
}
"""``gap_closed`` keys -> the FM NE it is measured against: the stale FM logits the student
learns from, the fresh FM (window w on window w), the fresh FM after its best constant shift on
the eval labels."""

GAP_TARGET = 0.3
"""ExFM's target: the full student closes at least this share of the gap to the FM; met in a
cell only where the interval's lower end clears it (``target_met``)."""

Runs = dict[str, list[list[float]]]


def target_met(gap: Mapping[str, Any], target: float = GAP_TARGET) -> bool:
    """Whether a ``gap_closed`` interval ``{value, lo, hi, n}`` meets ``target``: its lower end at
    or above it (one seed, no interval: not met)."""
    lo = gap["lo"]
    return lo is not None and math.isfinite(lo) and lo >= target


def _iv(x: Interval) -> dict[str, Any]:
    d = x.to_dict()
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


def _means(per_seed: list[list[float]], k: int) -> list[float]:
    """Per seed the mean over the distilled windows w >= k."""
    return [statistics.fmean(s[k:]) for s in per_seed]


def _gaps(alone: list[float], full: list[float], ref: list[float]) -> list[float]:
    return [(al - f) / (al - r) if al != r else float("nan") for al, f, r in zip(alone, full, ref)]


def summarize(
    rep: Runs,
    dev: Runs,
    chosen: dict[str, float],
    speed: dict[str, dict[str, list[float]]],
    teacher: dict[str, list[float]],
    biases: list[str],
    ks: list[int],
    lrs: list[float],
    windows: int,
) -> dict[str, Any]:
    """The JSON result (without the run's seeds, CPU and sizes: ``distill.run`` adds those)."""
    out: dict[str, Any] = {
        "bench": "distill",
        "windows": windows,
        "staleness": ks,
        "vertical_biases": [float(b) for b in biases],
        "lr_grid": lrs,
        "swept": (
            "train.dense_lr over lr_grid, for every setup (alone included), per vertical_bias "
            "and k; chosen by the mean NE over the distilled windows on dev_seeds"
        ),
        "teacher_ne": {b: [round(x, 5) for x in teacher[b]] for b in biases},
        "gap_target": {
            "min": GAP_TARGET,
            "rule": "met where the 95% interval's lower end is at or above the target",
        },
        "per_bias": {},
        "throughput_vs_alone": {},
        "samples_per_s": {},
    }
    for b in biases:
        fresh = rep[f"{b}/fresh"]
        per_k: dict[str, Any] = {}
        for k in ks:
            ne = {s: _means(rep[f"{b}/{k}/{s}/{chosen[f'{b}/{k}/{s}']:g}"], k) for s in SETUPS}
            ref = {"stale": _means(rep[f"{b}/{k}/stale"], k), "fresh": _means(fresh, k)}
            ref["recal"] = _means(rep[f"{b}/recal"], k)
            row: dict[str, Any] = {
                "distilled_windows": list(range(k, windows)),
                "lr": {s: chosen[f"{b}/{k}/{s}"] for s in SETUPS},
                "dev_ne": {
                    s: {
                        f"{lr:g}": round(statistics.fmean(_means(dev[f"{b}/{k}/{s}/{lr:g}"], k)), 5)
                        for lr in lrs
                    }
                    for s in SETUPS
                },
                "ne": {s: _iv(mean_interval(ne[s])) for s in SETUPS},
                "ne_per_window": {
                    s: [
                        round(statistics.fmean(r[w] for r in rep[f"{b}/{k}/{s}/{lr:g}"]), 5)
                        for w in range(windows)
                    ]
                    for s, lr in ((s, chosen[f"{b}/{k}/{s}"]) for s in SETUPS)
                },
                "ne_minus_alone": {
                    s: _iv(paired_difference(ne[s], ne["alone"])) for s in SETUPS[1:]
                },
                "fm_ne": {key: _iv(mean_interval(ref[what])) for key, what in GAP_REFS.items()},
                "stale_fm_minus_alone": _iv(paired_difference(ref["stale"], ne["alone"])),
                "gap_closed": {
                    key: _iv(mean_interval(_gaps(ne["alone"], ne["aux+adapter"], ref[what])))
                    for key, what in GAP_REFS.items()
                },
                "full_minus_plain": _iv(paired_difference(ne["aux+adapter"], ne["plain"])),
            }
            row["gap_target_met"] = {key: target_met(g) for key, g in row["gap_closed"].items()}
            per_k[str(k)] = row
        out["per_bias"][b] = {"fm_fresh_ne_per_window": _per_window(fresh), "per_k": per_k}
    for kk, rates in speed.items():
        out["samples_per_s"][kk] = {s: round(statistics.fmean(rates[s]), 1) for s in SETUPS}
        out["throughput_vs_alone"][kk] = {
            s: _iv(paired_ratio(rates[s], rates["alone"])) for s in SETUPS[1:]
        }
    return out


def _per_window(per_seed: list[list[float]]) -> list[float]:
    return [round(statistics.fmean(s[w] for s in per_seed), 5) for w in range(len(per_seed[0]))]


def _cell(d: dict[str, Any], scale: float = 1.0, fmt: str = "+.4f") -> str:
    v, lo, hi = (scale * d[x] for x in ("value", "lo", "hi"))
    return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def print_table(r: dict[str, Any]) -> None:
    """The table: per vertical and k, each setup's lr, NE and its difference to alone; the FM
    references and gap_closed; throughput ratios."""
    seeds = r.get("seeds", [])
    print(
        f"ExFM on a drifting stream: {r['windows']} windows; lr (train.dense_lr over "
        f"{r['lr_grid']}) chosen per setup on dev seeds {r.get('dev_seeds')}; reported on seeds "
        f"{seeds}; eval NE of the serving head, mean over the distilled windows w >= k; "
        "[95% interval], paired by seed"
    )
    for b, per_bias in r["per_bias"].items():
        for k, row in per_bias["per_k"].items():
            print(f"-- vertical_bias {b}, staleness k = {k}")
            print(f"{'setup':<26}{'lr':>8}{'NE':>10}{'NE - alone [95%]':>34}")
            for s in SETUPS:
                diff = _cell(row["ne_minus_alone"][s]) if s != "alone" else ""
                print(f"{s:<26}{row['lr'][s]:>8g}{row['ne'][s]['value']:>10.4f}{diff:>34}")
            for key, what in (
                ("vs_stale_fm", "FM logits read (stale)"),
                ("vs_fresh_fm", "FM fresh"),
                ("vs_fresh_fm_recalibrated", "FM fresh, recalibrated"),
            ):
                fm = row["fm_ne"][key]["value"]
                gap = _cell(row["gap_closed"][key], fmt="+.3f")
                met = "met" if row["gap_target_met"][key] else "not met"
                print(f"{what:<26}{'':>8}{fm:>10.4f}   gap_closed {gap} (>= {GAP_TARGET}: {met})")
            print(f"stale FM - alone: {_cell(row['stale_fm_minus_alone'])}; aux+adapter - plain: "
                  f"{_cell(row['full_minus_plain'])}")  # fmt: skip
    for k, ratios in r["throughput_vs_alone"].items():
        base = r["samples_per_s"][k]["alone"]
        cells = "; ".join(f"{s} {_cell(ratios[s], fmt='.3f')}" for s in SETUPS[1:])
        print(f"throughput vs alone, k = {k} (alone {base:,.0f} samples/s): {cells}")
