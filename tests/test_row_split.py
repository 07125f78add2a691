"""The compiled row-range split of row-split tables' ids equals the torch specification bitwise."""

from __future__ import annotations

import pytest
import torch

from neorec.ops.row_split import native_lib, split_rows, split_rows_native, split_rows_torch

pytestmark = pytest.mark.bitwise


def _lib():
    lib = native_lib()
    if lib is None:
        pytest.skip("no C compiler: the torch split is the only one")
    return lib


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    if a[2] is None:
        assert b[2] is None
    else:
        assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 9, 13])
@pytest.mark.parametrize("weighted", [False, True])
def test_native_split_equals_torch(k: int, weighted: bool) -> None:
    lib = _lib()
    g = torch.Generator().manual_seed(k * 10 + weighted)
    for rows, b in ((1000, 64), (k, 5), (50_000, 700)):
        lengths = torch.randint(0, 6, (b,), generator=g)
        lengths[::7] = 0  # empty bags
        n = int(lengths.sum())
        vals = torch.randint(0, rows, (n,), generator=g)
        # Shard starts: k ascending row starts from 0 (uneven; k > 8 takes the binary search).
        cuts = torch.randperm(max(rows - 1, 1), generator=g)[: k - 1] + 1
        starts = [0] + sorted(cuts.tolist())
        if len(starts) < k:
            continue
        # Ids right at every boundary and just below it.
        edge = torch.tensor([s for s in starts] + [s - 1 for s in starts[1:]], dtype=torch.int64)
        if n >= edge.numel():
            vals[: edge.numel()] = edge
        w = torch.rand(n, generator=g) if weighted else None
        want = split_rows_torch(vals, lengths, starts, w)
        _same(split_rows_native(lib, vals, lengths, starts, w), want)
        _same(split_rows(vals, lengths, starts, w), want)
        # Each bucket's ids are shard-local and come from its row range.
        for j, piece in enumerate(want[1]):
            hi = (starts[j + 1] if j + 1 < k else rows) - starts[j]
            assert bool(((piece >= 0) & (piece < hi)).all())
        assert torch.equal(want[0].sum(0), lengths)


def test_split_refuses_bad_starts_and_lengths() -> None:
    lib = _lib()
    vals, lengths = torch.tensor([1, 5, 9]), torch.tensor([2, 1])
    for fn in (split_rows_torch, lambda *a: split_rows_native(lib, *a)):
        with pytest.raises(ValueError, match="ascending"):
            fn(vals, lengths, [0, 6, 3])
    with pytest.raises(ValueError, match="add up to 3 ids; they add up to 4"):
        split_rows_native(lib, vals, torch.tensor([2, 2]), [0, 6])
    # Negative lengths that still add up to n would send a bag past the ids: refused.
    with pytest.raises(ValueError, match=r"min -2\) must be non-negative"):
        split_rows_native(lib, vals, torch.tensor([5, -2]), [0, 6])
