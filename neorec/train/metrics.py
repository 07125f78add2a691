"""Click-prediction metrics: AUC, log loss, normalized entropy (NE), calibration.

Sums over samples are taken in NumPy (float64, one thread, pairwise), not in torch: a torch
reduction over a large tensor splits it per thread, so its last bits depend on the thread count,
and one process (all cores) and N ranks (one thread each) must report bitwise the same metrics of
the same predictions. AUC sums half-integer ranks, which is exact in any order.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["auc", "log_loss", "normalized_entropy", "calibration", "binary_metrics", "MetricState"]

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
