"""Click-prediction metrics: AUC, log loss, normalized entropy (NE), calibration, in NumPy.

Inputs are anything NumPy reads as a vector (arrays, lists, CPU tensors). Sums over samples are
taken in float64 in one thread (NumPy's pairwise sum), never per thread, so one process (all
cores) and N ranks (one thread each) report bitwise the same metrics of the same predictions.
AUC sums half-integer ranks, which is exact in any order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["auc", "log_loss", "normalized_entropy", "calibration", "binary_metrics"]

_EPS = 1e-12


def as_f64(x: Any) -> np.ndarray:
    """``x`` as a flat float64 array (a tensor is detached and read from its device)."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).ravel()


def auc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties get half credit); NaN if one class only."""
    s, y = as_f64(scores), as_f64(labels)
    pos = float(y.sum())
    neg = y.size - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    s = s[order]
    # Average ranks over tied scores.
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    counts = np.diff(np.r_[starts, s.size]).astype(np.float64)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2  # 1-based average rank of each tie group
    ranks = np.repeat(avg_rank, counts.astype(np.int64))
    rank_sum_pos = float((ranks * y[order]).sum())
    return (rank_sum_pos - pos * (pos + 1) / 2) / (pos * neg)


def log_loss(probs: Any, labels: Any) -> float:
    """Mean binary cross-entropy of probabilities."""
    p = np.clip(as_f64(probs), _EPS, 1 - _EPS)
    y = as_f64(labels)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _entropy(ctr: float) -> float:
    if ctr <= 0.0 or ctr >= 1.0:
        return 0.0
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


def normalized_entropy(probs: Any, labels: Any) -> float:
    """Log loss divided by the entropy of the observed CTR (1.0 = no better than the base rate)."""
    h = _entropy(float(np.mean(as_f64(labels))))
    return log_loss(probs, labels) / h if h > 0 else float("nan")


def calibration(probs: Any, labels: Any) -> float:
    """Predicted CTR over observed CTR (1.0 = calibrated)."""
    obs = float(np.sum(as_f64(labels)))
    return float(np.sum(as_f64(probs))) / obs if obs > 0 else float("nan")


def binary_metrics(probs: Any, labels: Any) -> dict[str, float]:
    """All metrics of a set of predicted probabilities."""
    y = as_f64(labels)
    return {
        "auc": auc(probs, y),
        "logloss": log_loss(probs, y),
        "ne": normalized_entropy(probs, y),
        "calibration": calibration(probs, y),
        "ctr": float(np.mean(y)),
        "samples": int(y.size),
    }
