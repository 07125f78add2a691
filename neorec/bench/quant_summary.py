"""``neorec bench quant``'s summaries: per width the paired NE change of PTQ and QAT against the
fp32 reference (95% t intervals over seeds), the targets' verdicts, the table, the README row.

The JSON keeps each width at its top level (``"int4": {"bytes_ratio", "ptq": {"ne_change",
"ne_change_hi", ...}, "qat": {...}}``), NE changes in %.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from neorec.bench.stats import mean_interval

__all__ = ["summarize", "select_summary", "print_table", "print_select", "quant_row", "TARGETS"]

TARGETS = {"int8": ("ptq", 0.02), "int4": ("qat", 0.1)}
"""Issue 53's targets: the arm and the NE change (in %) the interval's upper end must stay
within."""
INT4_BYTES = 0.2
"""int4 tables at most this share of the fp32 tables' bytes."""


def _change(nes: list[float], refs: list[float]) -> dict[str, Any]:
    """The paired relative NE change in %: mean, 95% interval, per seed."""
    per = [100.0 * (n / r - 1.0) for n, r in zip(nes, refs)]
    iv = mean_interval(per)
    finite = len(per) > 1
    return {
        "ne_change": iv.value,
        "ne_change_lo": iv.lo if finite else None,
        "ne_change_hi": iv.hi if finite else None,
        "per_seed": per,
    }


def _arm(rows: list[dict[str, Any]], refs: list[float]) -> dict[str, Any]:
    """One arm (PTQ or QAT) at one width over the seeds."""
    out = _change([r["ne"] for r in rows], refs)
    out["ne_mean"] = statistics.fmean(r["ne"] for r in rows)
    out["auc_mean"] = statistics.fmean(r["auc"] for r in rows)
    if "grid_rms" in rows[0]:
        out["grid_rms"] = statistics.fmean(r["grid_rms"] for r in rows)
    if "fp32_ne" in rows[0]:  # the QAT model before quantization: what the regularizer costs
        out["fp32"] = _change([r["fp32_ne"] for r in rows], refs)
    return out


def _reference(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    ne = [r["reference"]["ne"] for r in per_seed]
    auc = [r["reference"]["auc"] for r in per_seed]
    n, a = mean_interval(ne), mean_interval(auc)
    return {
        "ne": n.value,
        "ne_interval": n.to_dict() if len(ne) > 1 else None,
        "auc": a.value,
        "auc_interval": a.to_dict() if len(auc) > 1 else None,
        "ne_per_seed": ne,
        "learns": n.value < 1,
    }


def summarize(per_seed: list[dict[str, Any]], widths: list[str]) -> dict[str, Any]:
    """The reported result: the fp32 reference, per width ``bytes_ratio`` and both arms, the
    targets' verdicts."""
    refs = [r["reference"]["ne"] for r in per_seed]
    out: dict[str, Any] = {"reference": _reference(per_seed), "widths": widths}
    for kind in widths:
        w: dict[str, Any] = {
            "bytes_ratio": per_seed[0]["ptq"][kind]["bytes_ratio"],
            "ptq": _arm([r["ptq"][kind] for r in per_seed], refs),
        }
        if kind != "fp16":
            w["qat"] = _arm([r["qat"][0]["widths"][kind] for r in per_seed], refs)
        out[kind] = w
    out["targets"] = _verdicts(out)
    out["per_seed"] = per_seed
    return out


def _verdicts(r: dict[str, Any]) -> dict[str, Any]:
    """Each target met or not (never met when the reference learned nothing or with one seed)."""
    out: dict[str, Any] = {}
    for kind, (arm, limit) in TARGETS.items():
        if kind not in r:
            continue
        hi = r[kind][arm]["ne_change_hi"]
        met = hi is not None and hi <= limit and r["reference"]["learns"]
        out[f"{kind}_{arm}"] = {"limit_pct": limit, "ne_change_hi": hi, "met": met}
        if kind == "int4":
            out["int4_ptq"] = {
                "limit_pct": limit,
                "ne_change_hi": r[kind]["ptq"]["ne_change_hi"],
                "met": r[kind]["ptq"]["ne_change_hi"] is not None
                and r[kind]["ptq"]["ne_change_hi"] <= limit,
            }
            out["int4_bytes"] = {
                "limit": INT4_BYTES,
                "bytes_ratio": r[kind]["bytes_ratio"],
                "met": r[kind]["bytes_ratio"] <= INT4_BYTES,
            }
    return out


def select_summary(per_seed: list[dict[str, Any]], widths: list[str]) -> dict[str, Any]:
    """``--select``: per grid setting and width, QAT's paired NE change (and PTQ's, for scale);
    the chosen setting: the lowest mean upper end over the widths."""
    refs = [r["reference"]["ne"] for r in per_seed]
    ptq = {k: _arm([r["ptq"][k] for r in per_seed], refs) for k in widths}
    rows = []
    for i, first in enumerate(per_seed[0]["qat"]):
        arms = {k: _arm([r["qat"][i]["widths"][k] for r in per_seed], refs) for k in widths}
        his = [a["ne_change_hi"] if a["ne_change_hi"] is not None else a["ne_change"]
               for a in arms.values()]  # fmt: skip
        rows.append({"setting": first["setting"], "widths": arms, "score": statistics.fmean(his)})
    best = min(rows, key=lambda x: x["score"]) if rows else None
    return {
        "reference": _reference(per_seed),
        "ptq": ptq,
        "grid": rows,
        "chosen": best["setting"] if best else None,
        "per_seed": per_seed,
    }


def _cell(d: dict[str, Any]) -> str:
    if d["ne_change_hi"] is None:
        return f"{d['ne_change']:+.3f}% (one seed)"
    return f"{d['ne_change']:+.3f}% [{d['ne_change_lo']:+.3f}, {d['ne_change_hi']:+.3f}]"


def _ref_line(ref: dict[str, Any]) -> str:
    return (
        f"fp32 reference: NE {ref['ne']:.5f}, AUC {ref['auc']:.4f} over "
        f"{len(ref['ne_per_seed'])} seeds{'' if ref['learns'] else '  (NE >= 1: learned nothing)'}"
    )


def print_table(r: dict[str, Any]) -> None:
    """The reported result as a table."""
    q = r["qat_settings"]
    print(_ref_line(r["reference"]))
    print(
        f"QAT: {q['shape']}, strength {q['strength']:g}, last {q['start_fraction']:g} of the "
        f"run; chosen on seeds {q['chosen_on_seeds']}, reported on {r['seeds']}"
    )
    print(f"{'width':<7}{'bytes':>7}{'PTQ NE change (95%)':>32}{'QAT NE change (95%)':>32}"
          f"{'QAT fp32 (95%)':>32}")  # fmt: skip
    for kind in r["widths"]:
        w = r[kind]
        qat = _cell(w["qat"]) if "qat" in w else "-"
        fp = _cell(w["qat"]["fp32"]) if "qat" in w else "-"
        print(f"{kind:<7}{w['bytes_ratio']:>7.3f}{_cell(w['ptq']):>32}{qat:>32}{fp:>32}")
    for name, t in r["targets"].items():
        print(f"target {name}: {'met' if t['met'] else 'not met'} ({t})")
    for rank, errs in r.get("als_error_over_svd_by_rank", {}).items():
        cells = "  ".join(f"{it} it {v:.4f}" for it, v in errs.items())
        print(f"ALS error / SVD optimum, rank {rank} (worst seed): {cells}")


def print_select(r: dict[str, Any]) -> None:
    """``--select``'s grid as a table."""
    print(_ref_line(r["reference"]))
    for k, a in r["ptq"].items():
        print(f"PTQ {k}: {_cell(a)}")
    for row in r["grid"]:
        s = row["setting"]
        cells = ", ".join(f"{k} {_cell(a)} (fp32 {_cell(a['fp32'])}, grid {a['grid_rms']:.3f})"
                          for k, a in row["widths"].items())  # fmt: skip
        print(f"strength {s['strength']:g}, last {s['start_fraction']:g}: {cells}")
    print(f"chosen: {r['chosen']}")


def quant_row(j: Mapping[str, Any]) -> str:
    """The README row of ``neorec bench quant``."""
    ref = j["reference"]
    parts = [f"fp32 NE {ref['ne']:.4f}, AUC {ref['auc']:.4f}"]
    for kind in j["widths"]:
        w = j[kind]
        cell = f"{kind} ({w['bytes_ratio']:.3f}× bytes) PTQ {_cell(w['ptq'])}"
        if "qat" in w:
            cell += f", QAT {_cell(w['qat'])}"
        parts.append(cell)
    met = ", ".join(f"{k} {'met' if t['met'] else 'not met'}" for k, t in j["targets"].items())
    als = j.get("als_error_over_svd")
    if als:  # per iteration count, the worst seed (a result stored before it had none)
        its = ", ".join(
            f"{it} it {v:.4f}" for it, v in sorted(als.items(), key=lambda kv: int(kv[0]))
        )
        parts.append(f"ALS error / SVD optimum at rank {j['als_rank']}: {its}")
    return "; ".join(parts) + f"; targets: {met}; seeds {j['seeds']}"
