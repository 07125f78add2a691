"""A bootstrap over clusters (users) and seeds: the 95% interval of a statistic of an eval set
that covers which users were evaluated, not only which seeds initialized the models.

A replicate draws the clusters with replacement (every row of a drawn cluster comes along, as
often as the cluster is drawn) and, when there are several seeds, the seeds with replacement;
the statistic is computed on the drawn rows and seeds. The interval is the 2.5% and 97.5%
quantiles of the replicates (percentile bootstrap), around the statistic of the full data.
Statistics that share one set of draws are paired: a difference of two models on the same
replicate's rows is the paired difference's replicate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from neorec.bench.stats import Interval

__all__ = ["cluster_rows", "cluster_bootstrap", "percentile_interval"]

Statistic = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(row indices, seed indices) -> a vector of statistics (each row/seed may repeat)."""


def cluster_rows(clusters: np.ndarray) -> list[np.ndarray]:
    """The row indices of each distinct value of ``clusters`` (in sorted cluster order)."""
    c = np.asarray(clusters)
    order = np.argsort(c, kind="stable")
    cuts = np.flatnonzero(c[order][1:] != c[order][:-1]) + 1
    return np.split(order, cuts)


def percentile_interval(value: float, replicates: np.ndarray, n: int) -> Interval:
    """``value`` with the 2.5% / 97.5% quantiles of ``replicates`` (linear interpolation) as its
    95% interval; ``n`` is the number of clusters resampled."""
    lo, hi = np.quantile(np.asarray(replicates, np.float64), [0.025, 0.975])
    return Interval(float(value), float(lo), float(hi), n)


def cluster_bootstrap(
    stat: Statistic, clusters: np.ndarray, seeds: int, reps: int, rng_seed: int = 0
) -> list[Interval]:
    """Each component of ``stat`` on all rows and seeds, with its percentile interval over
    ``reps`` replicates that redraw the clusters (and, with ``seeds`` > 1, the seeds)."""
    if reps < 2:
        raise ValueError(f"a bootstrap needs at least 2 replicates, got {reps}")
    groups = cluster_rows(clusters)
    rng = np.random.default_rng(rng_seed)
    full = np.asarray(stat(np.arange(len(clusters)), np.arange(seeds)), np.float64)
    out = np.empty((reps, full.size))
    for r in range(reps):
        drawn = rng.integers(0, len(groups), len(groups))
        rows = np.concatenate([groups[g] for g in drawn])
        s = rng.integers(0, seeds, seeds) if seeds > 1 else np.zeros(1, np.int64)
        out[r] = stat(rows, s)
    return [percentile_interval(v, out[:, i], len(groups)) for i, v in enumerate(full)]
