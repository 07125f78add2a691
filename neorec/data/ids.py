"""Id samplers shared by synthetic data and benchmarks: uniform and Zipf over a table's rows."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["zipf_ids", "uniform_ids", "scatter_ranks"]

_CDF_CACHE: dict[tuple[int, float], Tensor] = {}


def _zipf_cdf(rows: int, alpha: float) -> Tensor:
    key = (rows, alpha)
    if key not in _CDF_CACHE:
        p = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-alpha)
        cdf = torch.cumsum(p, 0)
        _CDF_CACHE.clear()  # keep at most one large table around
        _CDF_CACHE[key] = cdf / cdf[-1]
    return _CDF_CACHE[key]


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
    u = torch.rand(n, dtype=torch.float64, generator=generator)
    ranks = torch.searchsorted(_zipf_cdf(rows, alpha), u).clamp_(max=rows - 1)
    return scatter_ranks(ranks, rows, salt)


def uniform_ids(rows: int, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` uniform ids in [0, rows)."""
    return torch.randint(0, rows, (n,), dtype=torch.int64, generator=generator)
