"""The sample side's assembly (``neorec.distributed.columns``) against ``index_add``, its spec."""

from __future__ import annotations

import random

import pytest
import torch

from neorec.distributed.columns import Run, column_runs, place_columns


def _layout(rng: random.Random, owners: int, features: int, dp: bool):
    """Random feature dims; each feature on one owner, or split by rows over 2 owners (the same
    columns twice: partial sums), or by columns; a few features data-parallel when ``dp``."""
    dims = [rng.choice([1, 3, 4, 8, 16, 24, 64, 100]) for _ in range(features)]
    col0 = [0]
    for d in dims:
        col0.append(col0[-1] + d)
    per_owner: list[list[tuple[int, int]]] = [[] for _ in range(owners)]  # (out col, width)
    dp_feats = []
    for f, d in enumerate(dims):
        kind = rng.choice(["tw", "rw", "cw", "dp" if dp else "tw"])
        if kind == "dp":
            dp_feats.append(f)
        elif kind == "rw":
            for o in rng.sample(range(owners), 2):
                per_owner[o].append((col0[f], d))
        elif kind == "cw" and d > 1:
            half = d // 2
            per_owner[rng.randrange(owners)].append((col0[f], half))
            per_owner[rng.randrange(owners)].append((col0[f] + half, d - half))
        else:
            per_owner[rng.randrange(owners)].append((col0[f], d))
    # Units reach an owner in feature order (``_build_units``).
    for us in per_owner:
        us.sort()
    return dims, col0, per_owner, dp_feats


@pytest.mark.bitwise
@pytest.mark.parametrize("seed", range(12))
def test_place_columns_is_index_add_bitwise(seed):
    rng = random.Random(seed)
    owners, b = rng.choice([2, 3, 4]), rng.choice([0, 1, 5, 33])
    dims, col0, per_owner, dp_feats = _layout(rng, owners, rng.randint(1, 9), seed % 2 == 0)
    total = col0[-1]
    widths = [sum(w for _, w in us) for us in per_owner]
    dp_width = sum(dims[f] for f in dp_feats)
    g = torch.Generator().manual_seed(seed)
    recv = torch.randn(b * sum(widths), generator=g, requires_grad=True)
    dpv = torch.randn(b, dp_width, generator=g, requires_grad=True)
    grad = torch.randn(b, total, generator=g)

    # The spec: what output_dist did before, index_add column by column.
    cols = [c for us in per_owner for dst, w in us for c in range(dst, dst + w)]
    dp_cols = [c for f in dp_feats for c in range(col0[f], col0[f + 1])]
    blocks = [x.view(b, w) for x, w in zip(torch.split(recv, [b * w for w in widths]), widths)]
    want = torch.zeros(b, total).index_add(
        1, torch.tensor(cols, dtype=torch.int64), torch.cat(blocks, 1)
    )
    want = want.index_add(1, torch.tensor(dp_cols, dtype=torch.int64), dpv)
    (want * grad).sum().backward()
    want_g = (recv.grad.clone(), dpv.grad.clone())
    recv.grad = dpv.grad = None

    pieces = [(0, o, dst, w) for o, us in enumerate(per_owner) for dst, w in us]
    pieces += [(1, 0, col0[f], dims[f]) for f in dp_feats]
    runs = column_runs(pieces)
    got = place_columns([recv, dpv], [tuple(widths), (dp_width,)], runs, b, total)
    (got * grad).sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(recv.grad, want_g[0]) and torch.equal(dpv.grad, want_g[1])


def test_adjacent_pieces_merge_and_row_splits_add():
    # Owner 0 holds features 0 and 1 (contiguous on both sides: one run); feature 2 is split by
    # rows over both owners: owner 1's copy of its columns is added, not copied.
    runs = column_runs([(0, 0, 0, 4), (0, 0, 4, 8), (0, 0, 12, 2), (0, 1, 12, 2), (0, 1, 20, 3)])
    assert runs == (
        Run(0, 0, 0, 0, 14, False),
        Run(0, 1, 0, 12, 2, True),
        Run(0, 1, 2, 20, 3, False),
    )


def test_partial_overlap_is_refused():
    with pytest.raises(ValueError, match=r"output columns \[2, 6\) partly overlap"):
        column_runs([(0, 0, 0, 4), (0, 1, 2, 4)])
