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

__all__ = [
    "auc",
    "log_loss",
    "normalized_entropy",
    "calibration",
    "binary_metrics",
    "t_quantile",
]

_EPS = 1e-12

# Student t quantiles for 1..30 degrees of freedom, then the normal's.
_T_QUANTILES = {
    0.95: (
        6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
        1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
    ),
    0.975: (
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ),
}  # fmt: skip
_NORMAL = {0.95: 1.645, 0.975: 1.96}


def t_quantile(q: float, dof: int) -> float:
    """Student's t quantile ``q`` (0.95: a one-sided 95% bound; 0.975: a two-sided 95% interval)
    with ``dof`` degrees of freedom; infinite below one."""
    if q not in _T_QUANTILES:
        raise ValueError(f"quantile must be one of {sorted(_T_QUANTILES)}, got {q}")
    if dof < 1:
        return math.inf
    table = _T_QUANTILES[q]
    return table[dof - 1] if dof <= len(table) else _NORMAL[q]


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
