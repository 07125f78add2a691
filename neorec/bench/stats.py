"""The statistics every benchmark reports by (``docs/benchmarks.md``): paired differences and
ratios with a 95% interval, from rounds or seeds measured side by side.

Timings: each round measures every setting once, in a rotated order, so that a drift of the
machine's speed hits all settings alike; the ratio of two settings is the geometric mean of their
per-round ratios, its interval the t interval of the mean log ratio. Quality: the same seeds for
every setting, the mean paired difference per seed and its t interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from neorec.config import ConfigError
from neorec.metrics import t_quantile

__all__ = [
    "Interval",
    "t975",
    "mean_interval",
    "paired_difference",
    "paired_ratio",
    "rotated",
    "parse_seeds",
]


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (two-sided 95%)."""
    return t_quantile(0.975, dof)


@dataclass(frozen=True)
class Interval:
    """A 95% interval around an estimate, from ``n`` paired observations."""

    value: float
    lo: float
    hi: float
    n: int

    def excludes(self, x: float) -> bool:
        """Whether ``x`` lies outside the interval (the estimate differs from it beyond noise)."""
        return not self.lo <= x <= self.hi

    def to_dict(self) -> dict[str, Any]:
        """JSON form: value, lo, hi, n."""
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.value:.4g} [{self.lo:.4g}, {self.hi:.4g}]"


def mean_interval(xs: Sequence[float]) -> Interval:
    """The mean of ``xs`` and its t interval (one value: an unbounded interval)."""
    n = len(xs)
    if n == 0:
        raise ValueError("no observations")
    m = statistics.fmean(xs)
    if n == 1:
        return Interval(m, -math.inf, math.inf, 1)
    half = t975(n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean of ``a[i] - b[i]`` (paired by seed or round) with its 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of different lengths: {len(a)} and {len(b)}")
    return mean_interval([x - y for x, y in zip(a, b)])


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Geometric mean of ``a[i] / b[i]`` (paired by round) with its 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of different lengths: {len(a)} and {len(b)}")
    if any(x <= 0 for x in (*a, *b)):
        raise ValueError("ratios need positive values")
    iv = mean_interval([math.log(x / y) for x, y in zip(a, b)])
    return Interval(math.exp(iv.value), math.exp(iv.lo), math.exp(iv.hi), iv.n)


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` in round ``r``'s order: rotated by ``r``, so each takes every position in turn."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]


def parse_seeds(text: str, flag: str) -> list[int]:
    """A benchmark's seed list from ``a-b`` or ``a,b,c`` (non-negative integers); a one-line
    error naming ``flag`` otherwise."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            out = list(range(lo, hi + 1))
        else:
            out = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected a-b or a,b,c (integers)") from None
    if not out or min(out) < 0:
        raise ConfigError(f"{flag} {text!r}: expected non-negative seeds")
    return out
