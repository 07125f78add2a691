"""The bootstrap over clusters and seeds (``neorec.bench.bootstrap``) on cases whose replicates
can be listed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from neorec.bench.bootstrap import cluster_bootstrap, cluster_rows, percentile_interval


def test_cluster_rows_groups_every_row_of_a_cluster() -> None:
    groups = cluster_rows(np.array([7, 3, 7, 3, 5]))
    assert [g.tolist() for g in groups] == [[1, 3], [4], [0, 2]]


def test_percentile_interval_by_hand() -> None:
    # 101 replicates 0..100: the 2.5% and 97.5% quantiles are 2.5 and 97.5 exactly
    iv = percentile_interval(50.0, np.arange(101.0), 9)
    assert (iv.value, iv.lo, iv.hi, iv.n) == (50.0, 2.5, 97.5, 9)


def test_two_single_row_clusters_give_the_three_possible_means() -> None:
    # clusters {0} and {1}: a replicate draws two of them, so its mean is 0, 1/2 or 1
    x = np.array([0.0, 1.0])
    seen: list[float] = []

    def mean(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        seen.append(float(x[rows].mean()))
        return np.array([x[rows].mean()])

    (iv,) = cluster_bootstrap(mean, np.array([10, 20]), seeds=1, reps=400, rng_seed=1)
    assert iv.value == 0.5 and iv.n == 2
    assert set(seen[1:]) == {0.0, 0.5, 1.0}  # (the first call is the full data)
    # P(0) = P(1) = 1/4: more than 2.5% of 400 replicates at each end
    assert (iv.lo, iv.hi) == (0.0, 1.0)


def test_a_cluster_is_drawn_whole() -> None:
    # rows 0,1 are user a (x = 0), rows 2,3 user b (x = 1): resampling rows could give 1/4 or
    # 3/4, resampling users never does
    x = np.array([0.0, 0.0, 1.0, 1.0])
    seen: set[float] = set()

    def mean(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        assert len(rows) == 4  # two users of two rows each
        seen.add(float(x[rows].mean()))
        return np.array([x[rows].mean()])

    cluster_bootstrap(mean, np.array(["a", "a", "b", "b"]), seeds=1, reps=200)
    assert seen == {0.0, 0.5, 1.0}


def test_seeds_are_redrawn_and_paired_statistics_share_the_draw() -> None:
    # one cluster, two seeds of values 0 and 1: the seed mean is 0, 1/2 or 1; the second
    # statistic is the first minus a constant, so its replicates are the first's shifted
    per_seed = np.array([0.0, 1.0])

    def stat(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        m = per_seed[seeds].mean()
        return np.array([m, m - 0.25])

    a, d = cluster_bootstrap(stat, np.zeros(3, np.int64), seeds=2, reps=400, rng_seed=2)
    assert (a.value, a.lo, a.hi) == (0.5, 0.0, 1.0)
    assert (d.value, d.lo, d.hi) == (0.25, -0.25, 0.75)
    assert a.n == d.n == 1


def test_constant_data_gives_a_zero_width_interval_and_is_reproducible() -> None:
    def stat(rows: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        return np.array([3.0, float(len(rows))])

    users = np.array([1, 1, 2])
    (c, n), again = (
        cluster_bootstrap(stat, users, seeds=1, reps=50, rng_seed=5),
        cluster_bootstrap(stat, users, seeds=1, reps=50, rng_seed=5),
    )
    assert (c.value, c.lo, c.hi) == (3.0, 3.0, 3.0)
    assert n.value == 3 and 2 <= n.lo <= n.hi <= 4  # 2, 3 or 4 rows a replicate
    assert [n] == again[1:]
    with pytest.raises(ValueError, match="at least 2 replicates"):
        cluster_bootstrap(stat, users, seeds=1, reps=1)
