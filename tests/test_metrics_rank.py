"""Full-corpus ranking metrics against a brute-force reference: ties, seen-item exclusion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from neorec.metrics_rank import per_user_metrics, rank_metrics, target_ranks


def brute_rank(scores: list[float], target: int, seen: set[int], exclude: bool) -> int:
    """Sort the candidates by score, the target last among equals; its position."""
    cands = [i for i in range(1, len(scores)) if not (exclude and i in seen and i != target)]
    order = sorted(cands, key=lambda i: (-scores[i], i == target))
    return order.index(target)


def test_ranks_match_brute_force_with_ties_and_seen() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = int(rng.integers(2, 9))
        b = int(rng.integers(1, 5))
        scores = rng.integers(0, 3, size=(b, v + 1)).astype(np.float32)  # many ties
        targets = rng.integers(1, v + 1, size=b)
        seen = [rng.choice(np.arange(1, v + 1), size=int(rng.integers(0, v + 1)), replace=False)
                for _ in range(b)]  # fmt: skip
        for exclude in (False, True):
            got = target_ranks(scores, targets, seen, exclude)
            want = [brute_rank(scores[i].tolist(), int(targets[i]), set(seen[i].tolist()), exclude)
                    for i in range(b)]  # fmt: skip
            assert got.tolist() == want


def test_constant_scores_rank_last_and_padding_is_no_candidate() -> None:
    s = np.zeros((1, 6))
    s[0, 0] = 100.0  # the padding column outscores everything: ignored
    assert target_ranks(s, np.array([3])).tolist() == [4]
    assert target_ranks(s, np.array([3]), [np.array([1, 2, 3])], True).tolist() == [2]


def test_metric_values() -> None:
    m = per_user_metrics(np.array([0, 9, 10, 49, 50]))
    assert m["hr@10"].tolist() == [1, 1, 0, 0, 0]
    assert m["hr@50"].tolist() == [1, 1, 1, 1, 0]
    assert m["ndcg@10"][1] == pytest.approx(1 / math.log2(11))
    assert m["mrr@10"].tolist() == [1.0, 0.1, 0, 0, 0]
    assert m["mrr"][4] == pytest.approx(1 / 51)
    agg = rank_metrics(np.array([0, 1]))
    assert agg["hr@10"] == 1.0 and agg["mrr"] == 0.75 and agg["n"] == 2


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="outside"):
        target_ranks(np.zeros((1, 3)), np.array([0]))
    with pytest.raises(ValueError, match="non-finite"):
        target_ranks(np.array([[0, np.nan, 1.0]]), np.array([1]))
    with pytest.raises(ValueError, match="histories"):
        target_ranks(np.zeros((1, 3)), np.array([1]), None, True)
