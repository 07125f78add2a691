"""Expected row-cache hit rates from a table's id skew (the cached tiers' input to the cost model).

Lookups are modelled as independent draws from the table's id distribution (what the synthetic
generators of ``neorec.data.ids`` produce): Zipf(alpha) or the locality-calibrated mix
(``alpha=None``). For a cache of C rows:

- ``lfu``: the C most popular rows stay resident; hit rate = their share of lookups.
- ``lru``: Che's approximation: the characteristic time T solves sum_i (1 - exp(-p_i T)) = C, and
  hit rate = sum_i p_i (1 - exp(-p_i T)).

Both are per-lookup hit rates. Ranks are grouped into at most a few thousand buckets of nearly equal
probability, so the cost is independent of the table size.

NumPy (float64), no torch: the rank probabilities are ports of ``neorec.data.ids``'s
``zipf_rank_prob`` and ``locality_rank_prob`` (the sampler stays there, in torch; tests hold the two
equal), with the locality distribution's constants copied from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np

from neorec.config import TableConfig
from neorec.sharding.tables import TableSpec

__all__ = [
    "LOCALITY_REF_BATCH",
    "LOCALITY_LEVELS",
    "LOCALITY_WEIGHTS",
    "zipf_rank_prob",
    "locality_rank_prob",
    "rank_buckets",
    "expected_hit_rate",
    "expected_hit_rates",
    "cache_hit_rates",
]

# ---- rank probabilities (as neorec.data.ids samples them) -------------------------------------
# The locality-calibrated id distribution (``neorec.data.ids`` samples it): in a batch of
# LOCALITY_REF_BATCH samples, level j's rows are touched about LOCALITY_LEVELS[j] times each, and
# LOCALITY_WEIGHTS[j] is its share of the lookups; level 0 is the cold rest of the table. The
# weights were fitted (``neorec.data.locality.calibrate_locality``) to Meta's published locality
# statistics at batch 65,536.
LOCALITY_REF_BATCH = 65_536
"""Batch size at which the locality levels' reuse holds."""
LOCALITY_LEVELS: tuple[float, ...] = (0.5, *(2.0 ** (j - 0.5) for j in range(1, 16)), 2.0**16)
"""Lookups per row and batch of each level."""
LOCALITY_WEIGHTS: tuple[float, ...] = (
    0.05042, 0.1144, 0.07792, 0.13945, 0.17624, 0.13453, 0.07435, 0.03783, 0.01549,
    0.01181, 0.01098, 0.05011, 0.04827, 0.03464, 0.01064, 0.00163, 0.01131,
)  # fmt: skip
"""Share of lookups of each level."""

_ZIPF_HEAD = 4096  # ranks summed exactly; the rest integrated (as neorec.data.ids samples them)


@functools.lru_cache(maxsize=256)
def _zipf_norm(rows: int, alpha: float) -> float:
    """Normalizer of Zipf(alpha) over ``rows`` ranks: the first ranks summed, the tail integrated."""
    k = min(rows, _ZIPF_HEAD)
    head = float(np.cumsum(np.arange(1, k + 1, dtype=np.float64) ** -alpha)[-1])
    tail = 0.0
    if rows > k:
        lo, hi = k + 0.5, rows + 0.5
        tail = (
            math.log(hi / lo)
            if alpha == 1.0
            else (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)
        )
    return head + tail


def zipf_rank_prob(ranks: np.ndarray, rows: int, alpha: float) -> np.ndarray:
    """Probability of each (0-based) rank under ``neorec.data.ids.zipf_ids`` (uniform for 0)."""
    if alpha == 0:
        return np.full(np.shape(ranks), 1.0 / rows, dtype=np.float64)
    return (np.asarray(ranks, dtype=np.float64) + 1) ** -alpha / _zipf_norm(rows, alpha)


def _level_sum(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis (the 16-17 locality levels) in the order of torch's CPU sum (4 lanes,
    4 partial vectors added in turn, then the leftover values and the lanes one by one), so the
    layout and the rank probabilities equal ``neorec.data.ids``'s bitwise (NumPy's pairwise sum
    differs in the last bit, which the probabilities of cold rows, differences of the CDF, show)."""
    n = x.shape[-1]
    nv = n // 4
    vec = x[..., : 4 * nv].reshape(*x.shape[:-1], nv, 4)
    part = [np.zeros((*x.shape[:-1], 4)) for _ in range(4)]
    whole = nv - nv % 4
    for i in range(whole):
        part[i % 4] = part[i % 4] + vec[..., i, :]
    for i in range(whole, nv):
        part[0] = part[0] + vec[..., i, :]
    lanes = ((part[0] + part[1]) + part[2]) + part[3]
    out = np.zeros(x.shape[:-1])
    for i in range(4 * nv, n):
        out = out + x[..., i]
    for lane in range(4):
        out = out + lanes[..., lane]
    return out


def _locality_layout(
    rows: int, ref_lookups: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """(level probabilities [L], level start [L], level width [L], virtual size V) of one table,
    as ``neorec.data.ids.locality_layout``."""
    w = np.asarray(LOCALITY_WEIGHTS, dtype=np.float64)
    w = w / _level_sum(w)
    width = w * ref_lookups / np.asarray(LOCALITY_LEVELS, dtype=np.float64)
    hot = float(_level_sum(width[1:]))
    virtual = max(float(rows), hot + float(width[0]))
    start = np.zeros_like(width)
    start[1:] = np.cumsum(width[1:]) - width[1:]
    # level 0 (cold) covers everything the hot levels leave free
    start[0] = hot
    width[0] = virtual - hot
    return w, start, width, virtual


def _locality_row_cdf(rows: int, ref_lookups: float) -> tuple[np.ndarray, np.ndarray]:
    """Breakpoints (x, F(x)) of the piecewise-linear CDF of the row coordinate of locality ids."""
    w, start, width, virtual = _locality_layout(rows, ref_lookups)
    lo, hi = start * (rows / virtual), (start + width) * (rows / virtual)
    xs = np.unique(np.concatenate([lo, hi]))
    fs = _level_sum(w * np.clip((xs[:, None] - lo) / (hi - lo), 0, 1))
    return xs, fs


def _interp(x: np.ndarray, xs: np.ndarray, fs: np.ndarray) -> np.ndarray:
    """Linear interpolation of (xs, fs) at x, constant outside."""
    i = np.clip(np.searchsorted(xs, x), 1, xs.size - 1)
    x0, x1, f0, f1 = xs[i - 1], xs[i], fs[i - 1], fs[i]
    t = np.clip((x - x0) / (x1 - x0), 0, 1)
    return f0 + t * (f1 - f0)


def locality_rank_prob(ranks: np.ndarray, rows: int, ref_lookups: float) -> np.ndarray:
    """Probability of each rank under ``neorec.data.ids.locality_ids`` (exact, also where levels
    share a row)."""
    xs, fs = _locality_row_cdf(rows, float(ref_lookups))
    r = np.asarray(ranks, dtype=np.float64)
    return _interp(r + 1, xs, fs) - _interp(r, xs, fs)


# ---- hit rates --------------------------------------------------------------------------------
_BUCKETS = 4096


def _logspace(lo: float, hi: float, steps: int) -> np.ndarray:
    """``10 ** linspace(lo, hi, steps)`` stepped from both ends, as ``torch.logspace`` steps."""
    step = (hi - lo) / (steps - 1)
    idx = np.arange(steps, dtype=np.float64)
    half = steps // 2
    x = np.where(idx < half, lo + step * idx, hi - step * (steps - idx - 1))
    return 10.0**x


def rank_buckets(
    rows: int, alpha: float | None, pooling: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(rows per bucket [K], per-row lookup probability [K]) of a table's id distribution."""
    if rows <= _BUCKETS:
        edges = np.arange(rows + 1, dtype=np.float64)
    else:
        head = np.arange(512, dtype=np.float64)
        tail = _logspace(math.log10(512), math.log10(rows), _BUCKETS - 512)
        # The last edge is ``rows`` in float32, as the model has always had it (above 2**24 rows
        # that can be a row or two off; the effect on a hit rate is ~1e-9).
        last = float(np.float32(rows))
        edges = np.unique(np.concatenate([head, np.round(tail), [last]]))
    lo, hi = edges[:-1], edges[1:]
    count = hi - lo
    mid = np.floor((lo + hi - 1) / 2).astype(np.int64)
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
        order = np.argsort(-p, kind="stable")
        count, p = count[order], p[order]
        cum = np.cumsum(count)
        take = np.minimum(np.maximum(cap - (cum - count), 0), count)
        return float((take * p).sum())
    if policy != "lru":
        raise ValueError(f"policy must be lru or lfu, got '{policy}'")
    lo, hi = 0.0, 1.0
    while float((count * -np.expm1(-p * hi)).sum()) < cap:
        hi *= 2
    for _ in range(100):  # bisection on the characteristic time
        t = (lo + hi) / 2
        if float((count * -np.expm1(-p * t)).sum()) < cap:
            lo = t
        else:
            hi = t
    return float((count * p * -np.expm1(-p * hi)).sum())


def expected_hit_rates(
    rows: int,
    cache_fractions: list[float] | tuple[float, ...],
    alpha: float | None = None,
    policy: str = "lru",
    pooling: float = 1.0,
) -> list[float]:
    """``expected_hit_rate`` for several cache fractions of one table at once (the planner's
    candidates): the same model, one bucketing and one vectorized root search for all fractions.

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
    cap = np.asarray([fr[i] * rows for i in todo], dtype=np.float64)
    if policy == "lfu":
        order = np.argsort(-p, kind="stable")
        count, p = count[order], p[order]
        cum = np.cumsum(count)
        take = np.minimum(np.maximum(cap[None, :] - (cum - count)[:, None], 0), count[:, None])
        rates = (take * p[:, None]).sum(0)
    else:
        # Che's characteristic time by Newton's method: F(t) = sum count (1 - exp(-p t)) is
        # increasing and concave with F'(0) = 1, so Newton from t = 0 stays below the root and
        # converges monotonically (to the root bisection finds, in far fewer steps).
        c, q = count[:, None], p[:, None]
        t = np.zeros_like(cap)
        for _ in range(200):
            miss = np.exp(-q * t[None, :])
            f = (c * -np.expm1(-q * t[None, :])).sum(0)
            gap = cap - f
            if bool((gap <= 1e-13 * cap).all()):
                break
            t = t + np.maximum(gap, 0) / (c * q * miss).sum(0)
        rates = (c * q * -np.expm1(-q * t[None, :])).sum(0)
    for j, i in enumerate(todo):
        out[i] = float(rates[j])
    return out


# ---- the planner's hit rates of a table -------------------------------------------------------
_HIT_MEMO: dict[tuple[int, float | None, str, float, float], float] = {}


def _hit_key(table: TableSpec, fraction: float) -> tuple[int, float | None, str, float, float]:
    alpha = table.hit_alpha
    pooling = table.pooling_factor if alpha is None else 0.0  # only the locality model uses it
    return (table.rows, alpha, table.cache_policy, pooling, float(fraction))


def cache_hit_rates(table: TableSpec, fractions: Iterable[float]) -> list[float]:
    """Expected per-lookup hit rates of row caches of ``fractions`` of ``table``'s rows
    (``expected_hit_rates`` for the table's skew and policy; memoized).

    Uniform ids hit at the cache fraction; other distributions are computed together for every
    fraction not yet known.
    """
    fr = [float(f) for f in fractions]
    alpha = table.hit_alpha
    if alpha == 0.0:
        return [min(1.0, max(0.0, f)) for f in fr]
    todo = sorted({f for f in fr if _hit_key(table, f) not in _HIT_MEMO})
    if todo:
        rates = expected_hit_rates(
            table.rows, todo, alpha, table.cache_policy, max(table.pooling_factor, 1e-3)
        )
        if len(_HIT_MEMO) > 1 << 16:
            _HIT_MEMO.clear()
        for f, h in zip(todo, rates):
            _HIT_MEMO[_hit_key(table, f)] = h
    return [_HIT_MEMO[_hit_key(table, f)] for f in fr]
