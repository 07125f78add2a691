"""Expected row-cache hit rates from a table's id skew (inputs of a tier-aware cost model).

Lookups are modelled as independent draws from the table's id distribution (what the synthetic
generators produce): Zipf(alpha) or the locality-calibrated mix (``alpha=None``). For a cache of C
rows:

- ``lfu``: the C most popular rows stay resident; hit rate = their share of lookups.
- ``lru``: Che's approximation: the characteristic time T solves sum_i (1 - exp(-p_i T)) = C, and
  hit rate = sum_i p_i (1 - exp(-p_i T)).

Both are per-lookup hit rates. Ranks are grouped into at most a few thousand buckets of nearly equal
probability, so the cost is independent of the table size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.data.ids import LOCALITY_REF_BATCH, locality_rank_prob, zipf_rank_prob

__all__ = ["expected_hit_rate", "expected_hit_rates", "rank_buckets"]

_BUCKETS = 4096


def rank_buckets(rows: int, alpha: float | None, pooling: float = 1.0) -> tuple[Tensor, Tensor]:
    """(rows per bucket [K], per-row lookup probability [K]) of a table's id distribution."""
    if rows <= _BUCKETS:
        edges = torch.arange(rows + 1, dtype=torch.float64)
    else:
        head = torch.arange(512, dtype=torch.float64)
        tail = torch.logspace(
            math.log10(512), math.log10(rows), _BUCKETS - 512, dtype=torch.float64
        )
        edges = torch.unique(torch.cat([head, tail.round(), torch.tensor([float(rows)])]))
    lo, hi = edges[:-1], edges[1:]
    count = hi - lo
    mid = torch.floor((lo + hi - 1) / 2).to(torch.int64)
    if alpha is None:
        # locality ids: exact per-rank probabilities are piecewise constant; sum the bucket exactly
        # where it is small, else take its midpoint
        p = locality_rank_prob(mid, rows, max(pooling, 1e-3) * LOCALITY_REF_BATCH)
    else:
        p = zipf_rank_prob(mid, rows, alpha)
    p = p / (p * count).sum()  # midpoints misestimate wide buckets slightly: renormalize
    return count, p


def expected_hit_rate(
    table: TableConfig | int,
    cache_fraction: float,
    alpha: float | None = None,
    policy: str = "lru",
) -> float:
    """Expected per-lookup hit rate of a ``cache_fraction`` cache over ``table``.

    ``alpha``: Zipf exponent of the ids, or None for the locality-calibrated distribution (which
    uses the table's pooling factor, as the generator does).
    """
    rows = table if isinstance(table, int) else table.rows
    pooling = 1.0 if isinstance(table, int) else table.pooling_factor
    cap = cache_fraction * rows
    if cap >= rows:
        return 1.0
    if cap <= 0:
        return 0.0
    count, p = rank_buckets(rows, alpha, pooling)
    if policy == "lfu":
        order = torch.argsort(p, descending=True)
        count, p = count[order], p[order]
        cum = torch.cumsum(count, 0)
        take = (cap - (cum - count)).clamp(min=0).minimum(count)
        return float((take * p).sum())
    if policy != "lru":
        raise ValueError(f"policy must be lru or lfu, got '{policy}'")
    lo, hi = 0.0, 1.0
    while float((count * -torch.expm1(-p * hi)).sum()) < cap:
        hi *= 2
    for _ in range(100):  # bisection on the characteristic time
        t = (lo + hi) / 2
        if float((count * -torch.expm1(-p * t)).sum()) < cap:
            lo = t
        else:
            hi = t
    return float((count * p * -torch.expm1(-p * hi)).sum())


def expected_hit_rates(
    rows: int,
    cache_fractions: list[float] | tuple[float, ...],
    alpha: float | None = None,
    policy: str = "lru",
    pooling: float = 1.0,
) -> list[float]:
    """``expected_hit_rate`` for several cache fractions of one table at once (the planner's
    candidates): the same model, one bucketing and one vectorized bisection for all fractions.

    ``pooling``: the table's pooling factor (used by the locality distribution, ``alpha=None``).
    """
    fr = [float(f) for f in cache_fractions]
    out = [1.0 if f * rows >= rows else 0.0 for f in fr]
    todo = [i for i, f in enumerate(fr) if 0 < f * rows < rows]
    if not todo:
        return out
    if policy not in ("lru", "lfu"):
        raise ValueError(f"policy must be lru or lfu, got '{policy}'")
    count, p = rank_buckets(rows, alpha, pooling)
    cap = torch.tensor([fr[i] * rows for i in todo], dtype=torch.float64)
    if policy == "lfu":
        order = torch.argsort(p, descending=True)
        count, p = count[order], p[order]
        cum = torch.cumsum(count, 0)
        take = (cap[None, :] - (cum - count)[:, None]).clamp(min=0).minimum(count[:, None])
        rates = (take * p[:, None]).sum(0)
    else:
        # Che's characteristic time by Newton's method: F(t) = sum count (1 - exp(-p t)) is
        # increasing and concave with F'(0) = 1, so Newton from t = 0 stays below the root and
        # converges monotonically (to the root bisection finds, in far fewer steps).
        c, q = count[:, None], p[:, None]
        t = torch.zeros_like(cap)
        for _ in range(200):
            miss = torch.exp(-q * t[None, :])
            f = (c * -torch.expm1(-q * t[None, :])).sum(0)
            gap = cap - f
            if bool((gap <= 1e-13 * cap).all()):
                break
            t = t + gap.clamp(min=0) / (c * q * miss).sum(0)
        rates = (c * q * -torch.expm1(-q * t[None, :])).sum(0)
    for j, i in enumerate(todo):
        out[i] = float(rates[j])
    return out
