"""Next-item ranking metrics against the full item corpus: HR@K, NDCG@K, MRR@K, MRR, in NumPy.

The protocol (docs/data.md, "Sequential MovieLens"): every item index 1..V is a candidate (0 is
padding, never one); the target's rank is the number of candidates scored strictly above it plus
the number of *other* candidates scored equal to it (ties are pessimistic: the target ranks last
among its equals, so a constant scorer gets the worst rank, never a lucky one). With
``exclude_seen`` the items of the user's history (the model's input) are removed from the
candidates, except the target itself, which always stays. Per user, with 0-based rank ``r``:
HR@K = [r < K], NDCG@K = [r < K] / log2(r + 2), MRR@K = [r < K] / (r + 1), MRR = 1 / (r + 1);
reported as means over users (float64 sums).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["target_ranks", "rank_metrics", "per_user_metrics", "KS"]

KS = (10, 50)
"""The cut-offs reported."""


def target_ranks(
    scores: np.ndarray,
    targets: np.ndarray,
    seen: Sequence[np.ndarray] | None = None,
    exclude_seen: bool = False,
) -> np.ndarray:
    """0-based rank of each row's target among candidates 1..V of ``scores [B, V + 1]``
    (column 0 ignored), ties pessimistic; ``seen[b]``: row b's history (item indices), removed
    from the candidates when ``exclude_seen`` (the target stays)."""
    s = np.asarray(scores)
    t = np.asarray(targets, np.int64)
    if s.ndim != 2 or len(t) != s.shape[0]:
        raise ValueError(f"scores {s.shape} and targets {t.shape}: want [B, V + 1] and [B]")
    if len(t) and (t.min() < 1 or t.max() >= s.shape[1]):
        raise ValueError(f"a target lies outside the candidates 1..{s.shape[1] - 1}")
    if not np.isfinite(s[:, 1:]).all():
        raise ValueError("non-finite scores")
    if exclude_seen and seen is None:
        raise ValueError("exclude_seen needs the users' histories")
    cand = s[:, 1:]
    mine = s[np.arange(len(t)), t][:, None]
    above = cand > mine
    equal = cand == mine
    if exclude_seen and seen is not None:
        if len(seen) != len(t):
            raise ValueError(f"{len(seen)} histories for {len(t)} targets")
        keep = np.ones(cand.shape, bool)
        for b, h in enumerate(seen):
            keep[b, np.asarray(h, np.int64) - 1] = False
        keep[np.arange(len(t)), t - 1] = True
        above &= keep
        equal &= keep
    # the target equals itself: one of the equal candidates is the target
    return (above.sum(1) + equal.sum(1) - 1).astype(np.int64)


def per_user_metrics(ranks: np.ndarray, ks: Sequence[int] = KS) -> dict[str, np.ndarray]:
    """Each user's hr@K, ndcg@K, mrr@K (for every K) and mrr, from 0-based ranks."""
    r = np.asarray(ranks, np.float64)
    out: dict[str, np.ndarray] = {}
    for k in ks:
        hit = r < k
        out[f"hr@{k}"] = hit.astype(np.float64)
        out[f"ndcg@{k}"] = np.where(hit, 1.0 / np.log2(r + 2.0), 0.0)
        out[f"mrr@{k}"] = np.where(hit, 1.0 / (r + 1.0), 0.0)
    out["mrr"] = 1.0 / (r + 1.0)
    return out


def rank_metrics(ranks: np.ndarray, ks: Sequence[int] = KS) -> dict[str, float]:
    """Means over users of :func:`per_user_metrics`, and the number of users ``n``."""
    if len(ranks) == 0:
        raise ValueError("no users to evaluate")
    out = {k: float(v.sum() / len(v)) for k, v in per_user_metrics(ranks, ks).items()}
    out["n"] = float(len(ranks))
    return out
