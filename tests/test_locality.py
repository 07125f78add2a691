"""Locality statistics: reference parsing, histogram measurement, calibrated id generator."""

from __future__ import annotations

import pytest
import torch

from neorec.data import ids as idlib
from neorec.data.locality import (
    NUM_BINS,
    REFERENCE_LOOKUP_SHARE,
    REFERENCE_LOOKUP_SHARE_BY_FILE,
    histogram_distance,
    mean_lookup_share,
    parse_locality_file,
    production_like_tables,
    reference_files,
    reuse_histograms,
)

FILES = reference_files()
needs_files = pytest.mark.skipif(not FILES, reason="reference locality files not found")


@needs_files
def test_parse_reference_files_and_embedded_means() -> None:
    for f in FILES:
        blocks = parse_locality_file(f)
        assert len(blocks) >= 16
        for b in blocks:
            assert len(b.col_share) == len(b.lookup_share) == NUM_BINS
            assert abs(sum(b.lookup_share) - 1) < 0.01
            assert b.num_indices > b.num_unique > 0
        mean = mean_lookup_share(blocks)
        assert histogram_distance(mean, REFERENCE_LOOKUP_SHARE_BY_FILE[f.name]) < 1e-4
    assert abs(sum(REFERENCE_LOOKUP_SHARE) - 1) < 0.01


def test_parse_rejects_truncated_block(tmp_path) -> None:
    bad = tmp_path / "x.txt"
    bad.write_text(
        "batch.pt\nAvg # of indices: 10\nAvg # of unique cols: 5\nHistogram of col sizes:\n(0, 1]: 1.0\n"
    )
    with pytest.raises(ValueError, match="x.txt"):
        parse_locality_file(bad)


def test_reuse_histograms_by_hand() -> None:
    # table a: row 1 once, row 2 twice, row 3 five times; table b: row 1 once (a different row)
    a = torch.tensor([1, 2, 2, 3, 3, 3, 3, 3])
    b = torch.tensor([1])
    col, look = reuse_histograms([a, b])
    # rows: 2 singletons (bin 0), one in (1,2] (bin 1), one in (4,8] (bin 3)
    assert col[0] == pytest.approx(0.5) and col[1] == pytest.approx(0.25)
    assert col[3] == pytest.approx(0.25)
    # lookups: 9 in total; 2 on singletons, 2 on the pair, 5 on the row of 5
    assert look[0] == pytest.approx(2 / 9) and look[1] == pytest.approx(2 / 9)
    assert look[3] == pytest.approx(5 / 9)
    # the 32768+ bin
    _, big = reuse_histograms([torch.zeros(32769, dtype=torch.int64)])
    assert big[NUM_BINS - 1] == 1.0
    _, edge = reuse_histograms([torch.zeros(32768, dtype=torch.int64)])
    assert edge[NUM_BINS - 2] == 1.0


def test_locality_ids_match_reference_at_small_representative_scale() -> None:
    # rows / 16 and batch / 16: the reuse shape of batch 65,536 (except the top bins)
    scale = 16
    batch = 65_536 // scale
    tables = production_like_tables(32, scale=scale)
    g = torch.Generator().manual_seed(0)
    ids = []
    for i, t in enumerate(tables):
        x = idlib.locality_ids(
            t.rows, round(t.pooling_factor * batch), t.pooling_factor * batch, g, i
        )
        assert int(x.min()) >= 0 and int(x.max()) < t.rows
        ids.append(x)
    _, look = reuse_histograms(ids)
    assert histogram_distance(look, REFERENCE_LOOKUP_SHARE) < 0.05


def test_locality_ids_huge_table_cheap_and_in_range() -> None:
    g = torch.Generator().manual_seed(1)
    x = idlib.locality_ids(3_000_000_000, 100_000, 20 * 65_536, g, salt=5)
    assert int(x.min()) >= 0 and int(x.max()) < 3_000_000_000
    z = idlib.zipf_ids(3_000_000_000, 100_000, 1.05, g, salt=5)
    assert int(z.min()) >= 0 and int(z.max()) < 3_000_000_000


def test_rank_probabilities_sum_to_one_and_invert_scatter() -> None:
    rows = 5000
    ranks = torch.arange(rows)
    for p in (
        idlib.locality_rank_prob(ranks, rows, 4 * 65_536),
        idlib.zipf_rank_prob(ranks, rows, 1.05),
        idlib.uniform_rank_prob(ranks, rows),
    ):
        assert float(p.sum()) == pytest.approx(1.0, abs=1e-6)
    ids = idlib.scatter_ranks(ranks, rows, salt=9)
    assert torch.equal(idlib.unscatter_ranks(ids, rows, salt=9), ranks)
    # empirical frequency of the hottest row agrees with its probability
    g = torch.Generator().manual_seed(2)
    x = idlib.locality_ids(rows, 200_000, 4 * 65_536, g, salt=9)
    r = idlib.unscatter_ranks(x, rows, salt=9)
    vals, counts = torch.unique(r, return_counts=True)
    top = int(counts.argmax())
    p_top = float(idlib.locality_rank_prob(vals[top : top + 1], rows, 4 * 65_536))
    assert int(counts[top]) / 200_000 == pytest.approx(p_top, rel=0.05)


def test_zipf_tail_approximation_matches_exact_cdf() -> None:
    rows, alpha = 100_000, 1.05
    g = torch.Generator().manual_seed(3)
    r = idlib.unscatter_ranks(idlib.zipf_ids(rows, 400_000, alpha, g, salt=1), rows, salt=1)
    exact = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    exact = exact / exact.sum()
    # share of draws beyond the exact head, and in a tail decade
    for lo, hi in ((4096, rows), (10_000, 100_000)):
        got = float(((r >= lo) & (r < hi)).double().mean())
        assert got == pytest.approx(float(exact[lo:hi].sum()), rel=0.02)
