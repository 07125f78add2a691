"""Per-batch reuse ("locality") statistics of embedding lookups, and the reference they are held to.

The reference is the locality summary Meta published with its embedding-lookup dataset
(``dlrm_datasets_locality_{2021,2022}.txt``, see /work/shared/data/README.md). For one batch, every
row is identified by (table, row) and counted; rows fall into reuse bins (0,1], (1,2], (2,4], ...,
(16384,32768], 32768+. Two histograms per batch:

- ``col_share``: share of distinct rows in each bin ("Histogram of col sizes");
- ``lookup_share``: share of lookups landing on rows of each bin ("Ratio of index distribution").

The distance between two batches is the largest absolute difference of their lookup shares.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.data.ids import LOCALITY_REF_BATCH, LOCALITY_WEIGHTS, locality_layout
from neorec.errors import DataError
from neorec.sparse import SparseFeatures

__all__ = [
    "BIN_LABELS",
    "NUM_BINS",
    "REFERENCE_LOOKUP_SHARE",
    "REFERENCE_LOOKUP_SHARE_BY_FILE",
    "LocalityBlock",
    "parse_locality_file",
    "locality_dir",
    "reference_files",
    "mean_lookup_share",
    "reuse_histograms",
    "batch_reuse_histograms",
    "histogram_distance",
    "production_like_tables",
    "expected_lookup_share",
    "calibrate_locality",
]

NUM_BINS = 17
BIN_LABELS: tuple[str, ...] = (
    "(0, 1]",
    *(f"({2 ** (j - 1)}, {2**j}]" for j in range(1, 16)),
    "(32768+",
)

# Mean lookup share of the blocks of each reference file, then the mean of the two files (each
# year weighs the same although 2021 has one more block). Kept here so that calibration and the
# benchmark work without the data files; tests check these against the files when present.
REFERENCE_LOOKUP_SHARE_BY_FILE: dict[str, tuple[float, ...]] = {
    "dlrm_datasets_locality_2021.txt": (
        0.05676, 0.04306, 0.07459, 0.09912, 0.11253, 0.09176, 0.06453, 0.05235, 0.04918,
        0.05000, 0.05371, 0.05741, 0.06000, 0.05153, 0.03759, 0.02582, 0.01994,
    ),
    "dlrm_datasets_locality_2022.txt": (
        0.02700, 0.02300, 0.04000, 0.06800, 0.10500, 0.12000, 0.09900, 0.07000, 0.05900,
        0.05400, 0.04000, 0.07175, 0.06400, 0.04700, 0.02100, 0.01713, 0.07506,
    ),
}  # fmt: skip
REFERENCE_LOOKUP_SHARE: tuple[float, ...] = tuple(
    (a + b) / 2 for a, b in zip(*REFERENCE_LOOKUP_SHARE_BY_FILE.values())
)

_GOLDEN = 0.6180339887498949


class LocalityFormatError(DataError):
    """A locality statistics file does not have the expected layout (names file:line)."""


@dataclass
class LocalityBlock:
    """One batch file's statistics from a reference file."""

    name: str
    num_indices: int
    num_unique: int
    col_share: list[float]
    lookup_share: list[float]


# ---- reference files ------------------------------------------------------------------------
_BIN_LINE = re.compile(r"^\((\d+)(?:, (\d+)\]|\+):\s*([0-9.]+)\s*$")


def parse_locality_file(path: str | Path) -> list[LocalityBlock]:
    """Blocks of a ``dlrm_datasets_locality_*.txt`` file, in file order."""
    path = Path(path)
    blocks: list[LocalityBlock] = []
    cur: dict[str, object] = {}
    target: list[float] | None = None
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("[") or line.startswith("Locality stats"):
            continue
        if line.startswith("Avg # of indices:"):
            cur["num_indices"] = int(line.split(":")[1])
        elif line.startswith("Avg # of unique cols:"):
            cur["num_unique"] = int(line.split(":")[1])
        elif line.startswith("Avg col size"):
            pass
        elif line.startswith("Histogram of col sizes"):
            target = cur.setdefault("col_share", [])  # type: ignore[assignment]
        elif line.startswith("Ratio of index distribution"):
            target = cur.setdefault("lookup_share", [])  # type: ignore[assignment]
        elif line.startswith("("):
            m = _BIN_LINE.match(line)
            if m is None or target is None:
                raise LocalityFormatError(f"{path.name}:{lineno}: unexpected bin line {line!r}")
            target.append(float(m.group(3)))
        else:  # a new block starts with the batch file's name
            _finish_block(cur, blocks, path, lineno)
            cur, target = {"name": line}, None
    _finish_block(cur, blocks, path, lineno=-1)
    return blocks


def _finish_block(
    cur: dict[str, object], blocks: list[LocalityBlock], path: Path, lineno: int
) -> None:
    if not cur:
        return
    try:
        block = LocalityBlock(**cur)  # type: ignore[arg-type]
    except TypeError:
        raise LocalityFormatError(
            f"{path.name}:{lineno}: block {cur.get('name')!r} is incomplete ({sorted(cur)})"
        ) from None
    for field in ("col_share", "lookup_share"):
        if len(getattr(block, field)) != NUM_BINS:
            raise LocalityFormatError(
                f"{path.name}: block {block.name!r}: {field} has "
                f"{len(getattr(block, field))} bins, expected {NUM_BINS}"
            )
    blocks.append(block)


def locality_dir() -> Path | None:
    """Directory of the reference files: $NEOREC_LOCALITY_DIR, else ../shared/data from the repo
    root or the working directory; None when not found."""
    env = os.environ.get("NEOREC_LOCALITY_DIR")
    candidates = [Path(env)] if env else []
    repo_root = Path(__file__).resolve().parents[2]
    candidates += [repo_root.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in candidates:
        if any(c.glob("dlrm_datasets_locality_*.txt")):
            return c
    return None


def reference_files() -> list[Path]:
    """The reference files found by :func:`locality_dir` (empty when absent)."""
    d = locality_dir()
    return sorted(d.glob("dlrm_datasets_locality_*.txt")) if d is not None else []


def mean_lookup_share(blocks: Sequence[LocalityBlock]) -> list[float]:
    """Mean lookup-share histogram over blocks."""
    return [sum(b.lookup_share[i] for b in blocks) / len(blocks) for i in range(NUM_BINS)]


# ---- measuring ---------------------------------------------------------------------------------
def reuse_histograms(ids_per_table: Iterable[Tensor]) -> tuple[Tensor, Tensor]:
    """(col_share [17], lookup_share [17]) float64 of one batch; one id tensor per table.

    Ids of different tables are different rows, so counting per table and summing equals counting
    (table, row) pairs over the whole batch (and sorts smaller arrays).
    """
    rows_per_bin = torch.zeros(NUM_BINS, dtype=torch.float64)
    lookups_per_bin = torch.zeros(NUM_BINS, dtype=torch.float64)
    for ids in ids_per_table:
        if ids.numel() == 0:
            continue
        _, counts = torch.unique(ids, return_counts=True)
        # bin of count c is the bit length of c-1: 1 -> 0, 2 -> 1, 3..4 -> 2, ..., >32768 -> 16
        bins = torch.frexp((counts - 1).to(torch.float64)).exponent.clamp_(max=NUM_BINS - 1)
        rows_per_bin += torch.bincount(bins, minlength=NUM_BINS).to(torch.float64)
        lookups_per_bin.index_add_(0, bins.to(torch.int64), counts.to(torch.float64))
    if rows_per_bin.sum() == 0:
        raise ValueError("reuse_histograms: the batch has no lookups")
    return rows_per_bin / rows_per_bin.sum(), lookups_per_bin / lookups_per_bin.sum()


def batch_reuse_histograms(
    sparse: SparseFeatures, feature_table: Mapping[str, str] | None = None
) -> tuple[Tensor, Tensor]:
    """Reuse histograms of a SparseFeatures batch; features mapped to one table share its rows."""
    by_table: dict[str, list[Tensor]] = {}
    for key in sparse.keys:
        table = feature_table.get(key, key) if feature_table is not None else key
        by_table.setdefault(table, []).append(sparse.feature(key)[0])
    return reuse_histograms(torch.cat(v) for v in by_table.values())


def histogram_distance(a: Sequence[float] | Tensor, b: Sequence[float] | Tensor) -> float:
    """Largest absolute difference between two lookup-share histograms."""
    ta = torch.as_tensor(a, dtype=torch.float64)
    tb = torch.as_tensor(b, dtype=torch.float64)
    return float((ta - tb).abs().max())


# ---- the calibration workload ------------------------------------------------------------------
def production_like_tables(
    num_tables: int = 128, scale: float = 1.0, dim: int = 16
) -> list[TableConfig]:
    """A production-like table mix: rows log-uniform in [1e3, 1e8] / scale, pooling 1..64.

    Pooling factors are log-uniform in [1, 64] (mean ~15, as the reference's lookups per table per
    sample: 15.8 in 2021, 13.6 in 2022), spread over the row range by a golden-ratio sequence so
    that few tables already cover it evenly. ``scale`` divides the rows: the same reuse as at batch
    65,536 is then reached at batch 65,536 / scale with ``ref_batch = 65536 / scale``.
    """
    out = []
    for i in range(num_tables):
        rows = max(1, round(10 ** (3 + 5 * (i + 0.5) / num_tables) / scale))
        pooling = 64 ** (((i + 0.5) * _GOLDEN) % 1.0)
        out.append(TableConfig(name=f"p{i}", rows=rows, dim=dim, pooling_factor=pooling))
    return out


_BIN_HI = torch.tensor([1.0] + [2.0**j for j in range(1, 16)], dtype=torch.float64)


def _bin_probs(lam: Tensor) -> Tensor:
    """P(bin) [k, 17] of a lookup's row count 1 + Poisson(lam) (the size-biased count)."""
    # P(1 + Pois(lam) <= h) = P(Pois(lam) <= h - 1) = Q(h, lam), the regularized upper gamma
    cdf = torch.special.gammaincc(_BIN_HI[None, :], lam[:, None])
    zeros = torch.zeros(lam.numel(), 1, dtype=torch.float64)
    cdf = torch.cat([zeros, cdf, zeros + 1], 1)
    return cdf[:, 1:] - cdf[:, :-1]


def _table_expected(
    weights: Sequence[float], rows: int, pooling: float, batch: int, ref_batch: int
) -> Tensor:
    w, _, width, virtual = locality_layout(rows, pooling * ref_batch, tuple(weights))
    # rows per level after folding; a level narrower than one row still lands on (part of) a row
    level_rows = (width * rows / virtual).clamp(min=1.0)
    lam = w * pooling * batch / level_rows
    return (w[:, None] * _bin_probs(lam)).sum(0)


def expected_lookup_share(
    tables: Sequence[TableConfig],
    batch_size: int,
    ref_batch: int = LOCALITY_REF_BATCH,
    weights: Sequence[float] = LOCALITY_WEIGHTS,
) -> Tensor:
    """Analytic expected lookup share [17] of locality ids (Poisson counts per level)."""
    total = torch.zeros(NUM_BINS, dtype=torch.float64)
    lookups = 0.0
    for t in tables:
        n = t.pooling_factor * len(t.features)
        total += n * _table_expected(weights, t.rows, t.pooling_factor, batch_size, ref_batch)
        lookups += n
    return total / lookups


def calibrate_locality(
    tables: Sequence[TableConfig] | None = None,
    target: Sequence[float] = REFERENCE_LOOKUP_SHARE,
    iters: int = 300,
) -> tuple[list[float], float]:
    """Fit level weights so the expected share of ``tables`` at batch 65,536 matches ``target``.

    Returns (weights, distance). Multiplicative updates (w *= (target / got)^0.8) converge because
    each level feeds mostly its own bin; this is how LOCALITY_WEIGHTS was produced.
    """
    tables = production_like_tables(128) if tables is None else tables
    tgt = torch.tensor(target, dtype=torch.float64)
    w = tgt.clone()
    best_w, best_d = w.tolist(), math.inf
    for _ in range(iters):
        got = expected_lookup_share(tables, LOCALITY_REF_BATCH, weights=w.tolist())
        d = histogram_distance(got, tgt)
        if d < best_d:
            best_w, best_d = w.tolist(), d
        w = w * (tgt / got.clamp(min=1e-9)) ** 0.8
        w = w / w.sum()
    return [round(x, 5) for x in best_w], best_d
