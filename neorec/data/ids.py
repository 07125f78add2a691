"""Id samplers shared by synthetic data and benchmarks: uniform, Zipf and locality-calibrated."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from neorec.sharding.hit_rate import LOCALITY_LEVELS, LOCALITY_REF_BATCH, LOCALITY_WEIGHTS

__all__ = [
    "zipf_ids",
    "uniform_ids",
    "scatter_ranks",
    "locality_ids",
    "locality_layout",
    "LOCALITY_LEVELS",
    "LOCALITY_WEIGHTS",
    "LOCALITY_REF_BATCH",
]

_ZIPF_HEAD = 4096  # ranks sampled from an exact CDF; the rest by inverting the integral
_HEAD_CACHE: dict[tuple[int, float], tuple[Tensor, float]] = {}


def _zipf_head(rows: int, alpha: float) -> tuple[Tensor, float]:
    """(unnormalized CDF of the first min(rows, _ZIPF_HEAD) ranks, tail mass) of Zipf(alpha)."""
    key = (rows, alpha)
    if key not in _HEAD_CACHE:
        k = min(rows, _ZIPF_HEAD)
        cdf = torch.cumsum(torch.arange(1, k + 1, dtype=torch.float64).pow_(-alpha), 0)
        tail = _zipf_integral(k + 0.5, rows + 0.5, alpha) if rows > k else 0.0
        if len(_HEAD_CACHE) > 256:  # bounded: many tables of distinct sizes are fine
            _HEAD_CACHE.clear()
        _HEAD_CACHE[key] = (cdf, tail)
    return _HEAD_CACHE[key]


def _zipf_integral(lo: float, hi: float, alpha: float) -> float:
    """Integral of t^-alpha over [lo, hi] (the tail mass of ranks lo+0.5 .. hi-0.5)."""
    if alpha == 1.0:
        return math.log(hi / lo)
    return (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)


def scatter_ranks(ranks: Tensor, rows: int, salt: int = 0) -> Tensor:
    """Map popularity ranks to row ids by a fixed affine permutation (hot rows spread out)."""
    a = 2_654_435_761 + 2 * salt
    while math.gcd(a, rows) != 1:
        a += 1
    return (ranks * (a % rows) + (salt * 40_503) % rows) % rows


def zipf_ids(
    rows: int, n: int, alpha: float, generator: torch.Generator | None = None, salt: int = 0
) -> Tensor:
    """``n`` ids in [0, rows) with P(rank k) proportional to 1/(k+1)^alpha; alpha=0 is uniform."""
    if alpha == 0:
        return uniform_ids(rows, n, generator)
    head, tail = _zipf_head(rows, alpha)
    u = torch.rand(n, dtype=torch.float64, generator=generator) * (float(head[-1]) + tail)
    ranks = torch.searchsorted(head, u).clamp_(max=rows - 1)
    in_tail = u >= head[-1]
    if bool(in_tail.any()):
        # invert the midpoint integral: ranks >= _ZIPF_HEAD cost O(1) memory for any table size
        m = u[in_tail] - float(head[-1])
        lo = head.numel() + 0.5
        if alpha == 1.0:
            x = lo * torch.exp(m)
        else:
            x = (lo ** (1 - alpha) + (1 - alpha) * m).pow(1 / (1 - alpha))
        ranks[in_tail] = torch.floor(x - 0.5).to(torch.int64).clamp_(head.numel(), rows - 1)
    return scatter_ranks(ranks, rows, salt)


def uniform_ids(rows: int, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` uniform ids in [0, rows)."""
    return torch.randint(0, rows, (n,), dtype=torch.int64, generator=generator)


# ---- locality-calibrated ids ---------------------------------------------------------------------
# A table's lookups are spread over "levels": level j >= 1 holds rows that a batch of
# LOCALITY_REF_BATCH samples touches about LOCALITY_LEVELS[j] times each; level 0 is the cold
# remainder of the table, drawn uniformly (mostly singletons). LOCALITY_WEIGHTS[j] is the share of
# lookups going to level j. The weights were fitted (neorec.data.locality.calibrate_locality) so that
# the pooled per-batch reuse histogram of a production-like table mix at batch 65,536 matches the
# mean of Meta's published locality statistics; a table too small to hold all levels is folded
# (every level shrunk in proportion), which raises its reuse as it does in production. The
# constants are defined once, torch-free, in neorec.sharding.hit_rate (the planner reads them too).


def locality_layout(
    rows: int, ref_lookups: float, weights: tuple[float, ...] = LOCALITY_WEIGHTS
) -> tuple[Tensor, Tensor, Tensor, float]:
    """(level probabilities [L], level start [L], level width [L], virtual size V) of one table.

    Levels live on a virtual rank axis [0, V); a rank v maps to row ``floor(v * rows / V)``.
    """
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    width = w * ref_lookups / torch.tensor(LOCALITY_LEVELS, dtype=torch.float64)
    hot = float(width[1:].sum())
    virtual = max(float(rows), hot + float(width[0]))
    start = torch.zeros_like(width)
    start[1:] = torch.cumsum(width[1:], 0) - width[1:]
    # level 0 (cold) covers everything the hot levels leave free
    start[0] = hot
    width[0] = virtual - hot
    return w, start, width, virtual


def locality_ids(
    rows: int,
    n: int,
    ref_lookups: float,
    generator: torch.Generator | None = None,
    salt: int = 0,
) -> Tensor:
    """``n`` ids in [0, rows) with production-like per-batch reuse (O(1) memory in ``rows``).

    ``ref_lookups`` is the table's lookups in a batch of LOCALITY_REF_BATCH samples
    (pooling factor x LOCALITY_REF_BATCH); smaller batches then see less reuse, as in production.
    """
    cdf, first, offset, slope = _locality_sampler(rows, float(ref_lookups))
    u = torch.rand(n, dtype=torch.float64, generator=generator)
    # level by grid lookup + one correction (a cell holds at most one level boundary)
    level = first[(u * _GRID).to(torch.int64)]
    level += (u >= cdf[level]).to(torch.int64)
    # one uniform picks the level and, rescaled within it, the row (53 bits are plenty)
    ranks = torch.addcmul(offset[level], u, slope[level]).to(torch.int64).clamp_(0, rows - 1)
    return scatter_ranks(ranks, rows, salt)


_GRID = 4096
_SAMPLER_CACHE: dict[tuple[int, float], tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _locality_sampler(rows: int, ref_lookups: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(level cdf + sentinel, grid -> first level, offset, slope): row = offset + u * slope."""
    key = (rows, ref_lookups)
    if key not in _SAMPLER_CACHE:
        w, start, width, virtual = locality_layout(rows, ref_lookups)
        if float(w.min()) <= 1.0 / _GRID:
            raise ValueError(f"locality weights must all exceed 1/{_GRID}, got {w.tolist()}")
        cdf = torch.cumsum(w, 0)
        cdf[-1] = 1.0
        slope = width / w * (rows / virtual)
        offset = start * (rows / virtual) - (cdf - w) * slope
        cells = torch.arange(_GRID, dtype=torch.float64) / _GRID
        first = torch.searchsorted(cdf, cells, right=True)
        sentinel = torch.cat([cdf, cdf.new_full((1,), 2.0)])  # so cdf[level] exists for any level
        if len(_SAMPLER_CACHE) > 1024:
            _SAMPLER_CACHE.clear()
        _SAMPLER_CACHE[key] = (sentinel, first, offset, slope)
    return _SAMPLER_CACHE[key]


# ---- popularity of a given row (the synthetic teacher scales row effects by it) ------------------
def unscatter_ranks(ids: Tensor, rows: int, salt: int = 0) -> Tensor:
    """Inverse of :func:`scatter_ranks`: the popularity rank of each id."""
    a = 2_654_435_761 + 2 * salt
    while math.gcd(a, rows) != 1:
        a += 1
    inv = pow(a % rows, -1, rows) if rows > 1 else 0
    return ((ids - (salt * 40_503) % rows) % rows) * inv % rows


def uniform_rank_prob(ranks: Tensor, rows: int) -> Tensor:
    """Probability of each rank under :func:`uniform_ids`."""
    return torch.full(ranks.shape, 1.0 / rows, dtype=torch.float64)


def zipf_rank_prob(ranks: Tensor, rows: int, alpha: float) -> Tensor:
    """Probability of each (0-based) rank under :func:`zipf_ids`."""
    if alpha == 0:
        return uniform_rank_prob(ranks, rows)
    head, tail = _zipf_head(rows, alpha)
    return (ranks.to(torch.float64) + 1).pow(-alpha) / (float(head[-1]) + tail)


def locality_rank_prob(ranks: Tensor, rows: int, ref_lookups: float) -> Tensor:
    """Probability of each rank under :func:`locality_ids` (exact, also where levels share a row)."""
    xs, fs = _locality_row_cdf(rows, float(ref_lookups))
    r = ranks.to(torch.float64)
    return _interp(r + 1, xs, fs) - _interp(r, xs, fs)


def _locality_row_cdf(rows: int, ref_lookups: float) -> tuple[Tensor, Tensor]:
    """Breakpoints (x, F(x)) of the piecewise-linear CDF of the row coordinate of locality ids."""
    w, start, width, virtual = locality_layout(rows, ref_lookups)
    lo, hi = start * (rows / virtual), (start + width) * (rows / virtual)
    xs = torch.cat([lo, hi]).unique()
    fs = (w * ((xs[:, None] - lo) / (hi - lo)).clamp(0, 1)).sum(1)
    return xs, fs


def _interp(x: Tensor, xs: Tensor, fs: Tensor) -> Tensor:
    """Linear interpolation of (xs, fs) at x, constant outside."""
    i = torch.searchsorted(xs, x).clamp_(1, xs.numel() - 1)
    x0, x1, f0, f1 = xs[i - 1], xs[i], fs[i - 1], fs[i]
    t = ((x - x0) / (x1 - x0)).clamp_(0, 1)
    return f0 + t * (f1 - f0)
