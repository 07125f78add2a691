"""``neorec bench costcheck``'s errors: |predicted - measured| / measured of the learned and the
analytical cost model, each anchored (x the speed the round's references show against the
calibration's) and unanchored (the raw prediction), per plan set; and the paired difference
learned - analytical of each plan's |error| with its 95% interval, which says which model wins
(the interval below 0: learned; above 0: analytical; containing 0: neither)."""

from __future__ import annotations

import math
from typing import Any

from neorec.bench.stats import mean_interval, paired_difference

__all__ = [
    "ERROR_SETS",
    "PREDICTORS",
    "error_summary",
    "paired_errors",
    "winner",
    "print_errors",
]

ERROR_SETS = ("all", "fixed", "random")
PREDICTORS = {
    ("learned", "anchored"): "predicted_ms",
    ("learned", "unanchored"): "unanchored_ms",
    ("analytical", "anchored"): "analytical_anchored_ms",
    ("analytical", "unanchored"): "analytical_ms",
}
"""The errors reported, (model, anchoring) -> the row's predicted ms. Anchored: x the speed the
round's references show against the calibration's; unanchored: the raw prediction. Without a
learned model, "learned" is the analytical model (the one that predicted)."""


def error_summary(
    fixed: list[dict[str, Any]], rand: list[dict[str, Any]], anchored: bool = True
) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """|predicted - measured| / measured per (model, anchoring, plan set): the mean with its 95%
    interval over the plans (``{"value", "lo", "hi", "n"}``) and the max. Without ``anchored``
    (no references to anchor to) the anchored errors are the unanchored ones."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for (model, how), key in PREDICTORS.items():
        if not anchored:
            key = PREDICTORS[(model, "unanchored")]
        sets = {"all": fixed + rand, "fixed": fixed, "random": rand}
        got = {}
        for name in ERROR_SETS:
            errs = _abs_errors(sets[name], key)
            if errs:
                iv = mean_interval(errs)
                got[name] = {
                    "mean": round(iv.value, 4),
                    # one plan: no interval (None, not an unbounded float JSON cannot carry)
                    "mean_interval": {k: _json_num(v) for k, v in iv.to_dict().items()},
                    "max": round(max(errs), 4),
                    "n": len(errs),
                }
        out.setdefault(model, {})[how] = got
    return out


def _json_num(v: float | int) -> float | int | None:
    """A number for the JSON line: floats rounded, non-finite ones None."""
    if isinstance(v, float):
        return round(v, 4) if math.isfinite(v) else None
    return v


def print_errors(errors: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> None:
    """The error table: mean [95% interval] / max |error| per model, anchoring and plan set."""
    print(f"{'|error| %: mean [95%] / max':<28}" + "".join(f"{s:>30}" for s in ERROR_SETS))
    for model, hows in errors.items():
        for how, sets in hows.items():
            cells = []
            for name in ERROR_SETS:
                e = sets.get(name)
                if e is None:
                    cells.append(f"{'-':>30}")
                    continue
                iv = e["mean_interval"]
                span = "" if iv["lo"] is None else f" [{100 * iv['lo']:.1f}, {100 * iv['hi']:.1f}]"
                cells.append(f"{100 * e['mean']:.1f}{span} / {100 * e['max']:.1f}".rjust(30))
            print(f"{model + ', ' + how:<28}" + "".join(cells))


def _abs_errors(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [abs(r[key] - r["measured_ms"]) / r["measured_ms"] for r in rows]


def winner(lo: float | None, hi: float | None) -> str:
    """Which model's |error| is lower beyond noise, from the interval of learned - analytical:
    ``learned`` (all of it below 0), ``analytical`` (above 0), else ``neither`` (no interval
    with one plan: neither)."""
    if lo is None or hi is None:
        return "neither"
    if hi < 0:
        return "learned"
    return "analytical" if lo > 0 else "neither"


def paired_errors(
    fixed: list[dict[str, Any]], rand: list[dict[str, Any]], anchored: bool = True
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per anchoring and plan set: the mean over plans of learned |error| - analytical |error|
    (the same plan, the same measurement) with its 95% t interval (``{"value", "lo", "hi",
    "n"}``) and the ``winner``. Without ``anchored`` the anchored figures are the unanchored."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for how in ("anchored", "unanchored"):
        src = how if anchored else "unanchored"
        learned, ana = PREDICTORS[("learned", src)], PREDICTORS[("analytical", src)]
        got = {}
        for name, rows in (("all", fixed + rand), ("fixed", fixed), ("random", rand)):
            if rows:
                iv = paired_difference(_abs_errors(rows, learned), _abs_errors(rows, ana))
                d = {k: _json_num(v) for k, v in iv.to_dict().items()}
                got[name] = {**d, "winner": winner(d["lo"], d["hi"])}
        out[how] = got
    return out
