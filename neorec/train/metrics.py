"""Click-prediction metrics: AUC, log loss, normalized entropy (NE), calibration.

Sums over samples are taken in NumPy (float64, one thread, pairwise), not in torch: a torch
reduction over a large tensor splits it per thread, so its last bits depend on the thread count,
and one process (all cores) and N ranks (one thread each) must report bitwise the same metrics of
the same predictions. AUC sums half-integer ranks, which is exact in any order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "auc",
    "log_loss",
    "normalized_entropy",
    "calibration",
    "binary_metrics",
    "MetricState",
    "dynamic_counters",
    "dynamic_fields",
    "DynamicLine",
]

_EPS = 1e-12


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties get half credit); NaN if one class only."""
    scores = scores.double().flatten()
    labels = labels.double().flatten()
    pos = float(labels.sum())
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    s = scores[order]
    # Average ranks over tied scores.
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each tie group
    ranks = avg_rank[inverse]
    rank_sum_pos = float((ranks * labels[order]).sum())
    return (rank_sum_pos - pos * (pos + 1) / 2) / (pos * neg)


def _f64(x: Tensor) -> np.ndarray:
    return x.detach().cpu().double().flatten().numpy()


def log_loss(probs: Tensor, labels: Tensor) -> float:
    """Mean binary cross-entropy of probabilities."""
    p = np.clip(_f64(probs), _EPS, 1 - _EPS)
    y = _f64(labels)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _entropy(ctr: float) -> float:
    if ctr <= 0.0 or ctr >= 1.0:
        return 0.0
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


def normalized_entropy(probs: Tensor, labels: Tensor) -> float:
    """Log loss divided by the entropy of the observed CTR (1.0 = no better than the base rate)."""
    h = _entropy(float(np.mean(_f64(labels))))
    return log_loss(probs, labels) / h if h > 0 else float("nan")


def calibration(probs: Tensor, labels: Tensor) -> float:
    """Predicted CTR over observed CTR (1.0 = calibrated)."""
    obs = float(np.sum(_f64(labels)))
    return float(np.sum(_f64(probs))) / obs if obs > 0 else float("nan")


def binary_metrics(probs: Tensor, labels: Tensor) -> dict[str, float]:
    """All metrics of a set of predicted probabilities."""
    return {
        "auc": auc(probs, labels),
        "logloss": log_loss(probs, labels),
        "ne": normalized_entropy(probs, labels),
        "calibration": calibration(probs, labels),
        "ctr": float(np.mean(_f64(labels))),
        "samples": int(labels.numel()),
    }


class MetricState:
    """Accumulates predictions and labels over an eval pass (state_dict for checkpoints)."""

    def __init__(self) -> None:
        self.probs: list[Tensor] = []
        self.labels: list[Tensor] = []

    def update(self, probs: Tensor, labels: Tensor) -> None:
        """Add a batch."""
        self.probs.append(probs.detach().float().cpu())
        self.labels.append(labels.detach().float().cpu())

    def compute(self) -> dict[str, float]:
        """Metrics over everything added."""
        if not self.probs:
            raise ValueError("no predictions were added")
        return binary_metrics(torch.cat(self.probs), torch.cat(self.labels))

    def state_dict(self) -> dict[str, Tensor]:
        """Concatenated predictions and labels."""
        if not self.probs:
            return {"probs": torch.empty(0), "labels": torch.empty(0)}
        return {"probs": torch.cat(self.probs), "labels": torch.cat(self.labels)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore."""
        self.probs = [state["probs"]] if state["probs"].numel() else []
        self.labels = [state["labels"]] if state["labels"].numel() else []


# ---- dynamic tables (issue 21): admitted / evicted / unadmitted lookups, occupancy -------------
_DYN_COUNTS = ("admitted", "evicted", "unadmitted", "lookups")


def dynamic_counters(ebc: Any) -> dict[str, float]:
    """Running totals of the dynamic tables of a collection, flat: ``dyn.<table>.<count>`` for
    admitted, evicted, unadmitted (lookups that got no slot), lookups, occupancy and capacity
    (empty without dynamic tables)."""
    stats = getattr(ebc, "stats", None)
    if not callable(stats):
        return {}
    out: dict[str, float] = {}
    for t, v in stats().items():
        if isinstance(v, dict) and "total" in v and "occupancy" in v:
            for k in _DYN_COUNTS:
                out[f"dyn.{t}.{k}"] = float(v["total"][k])
            out[f"dyn.{t}.occupancy"] = float(v["occupancy"])
            out[f"dyn.{t}.capacity"] = float(v["capacity"])
    return out


def dynamic_fields(now: dict[str, float], before: dict[str, float], steps: float) -> dict[str, Any]:
    """The ``dynamic`` entry of an events.jsonl line: per table, admitted / evicted / unadmitted
    lookups per step over the window from ``before`` to ``now`` (``dynamic_counters`` values),
    the unadmitted fraction of its lookups, and the occupancy (live ids) and capacity now."""
    tables = sorted({k.split(".")[1] for k in now if k.startswith("dyn.") and k.count(".") >= 2})
    out: dict[str, Any] = {}
    for t in tables:

        def delta(k: str, t: str = t) -> float:
            return now[f"dyn.{t}.{k}"] - before.get(f"dyn.{t}.{k}", 0.0)

        lookups = delta("lookups")
        out[t] = {
            **{f"{k}_per_step": delta(k) / max(steps, 1.0) for k in _DYN_COUNTS[:3]},
            "unadmitted_fraction": delta("unadmitted") / lookups if lookups else None,
            "occupancy": int(now[f"dyn.{t}.occupancy"]),
            "capacity": int(now[f"dyn.{t}.capacity"]),
        }
    return {"dynamic": out} if out else {}


class DynamicLine:
    """The progress line's part for dynamic tables: per table, occupancy / capacity and the
    admitted (+), evicted (-) and unadmitted lookups per step since the previous line."""

    def __init__(self, ebc: Any) -> None:
        self.ebc = ebc
        self.before = dynamic_counters(ebc)
        self.steps = float(getattr(ebc, "step", 0))

    def __call__(self) -> str:
        """The text (empty without dynamic tables)."""
        now = dynamic_counters(self.ebc)
        step = float(getattr(self.ebc, "step", 0))
        fields = dynamic_fields(now, self.before, step - self.steps).get("dynamic", {})
        self.before, self.steps = now, step
        parts = [
            f"{t} {v['occupancy']}/{v['capacity']} +{v['admitted_per_step']:.1f} "
            f"-{v['evicted_per_step']:.1f} unadm {v['unadmitted_per_step']:.1f}/step"
            for t, v in fields.items()
        ]
        return "  ".join(parts)
