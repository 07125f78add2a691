"""``neorec.storage.admission``: the dynamic table's threshold admission in front of a hashed table,
against its specification (exact counts, the id map's sketch, a plain table with masked ids)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neorec.config import ConfigError
from neorec.ops.id_map import IdMap
from neorec.sparse import SparseFeatures
from neorec.storage.admission import AdmissionFilter, CountMinAdmission, sketch_bytes


def test_admits_at_the_threshold_th_sighting() -> None:
    # wide sketch, few ids, no halving: the estimate is the exact count of sightings so far
    adm = CountMinAdmission(threshold=3, width=1 << 16, seed=5)
    rng = np.random.default_rng(0)
    seen: dict[int, int] = {}
    for _ in range(20):
        ids = rng.integers(-(2**62), 2**62, size=4)[rng.integers(0, 4, size=7)]
        got = adm.admitted(torch.from_numpy(ids))
        for x in ids.tolist():
            seen[x] = seen.get(x, 0) + 1
        assert got.tolist() == [seen[x] >= 3 for x in ids.tolist()]
    # eval reads the sketch and changes nothing
    before = adm.sketch.copy()
    probe = torch.tensor(list(seen) + [123], dtype=torch.int64)
    assert adm.admitted(probe, count=False).tolist() == [seen[x] >= 3 for x in seen] + [False]
    assert np.array_equal(before, adm.sketch)


def test_same_sketch_as_the_id_map() -> None:
    # a fresh map with room for every id counts every sighting, as the filter does: same decisions
    ids = torch.tensor([7, 7, 7, 9, 9, 11, 7, 9, 2**40, 2**40, 2**40, 2**40], dtype=torch.int64)
    for seed in (0, 3):
        im = IdMap(64, admission="threshold", threshold=3, seed=seed, sketch_cols=1024)
        adm = CountMinAdmission(3, 1024, seed=seed)
        im.map(ids)
        mine = adm.admitted(ids)
        assert np.array_equal(adm.sketch, im.sketch.numpy())
        mapped = set(im.id_of[im.live.bool()].tolist())
        assert set(ids[mine].tolist()) == mapped == {7, 9, 2**40}


def test_counters_halve_after_the_period() -> None:
    adm = CountMinAdmission(threshold=2, width=1024)
    ids = torch.full((10 * 1024,), 42, dtype=torch.int64)  # one period of sightings
    assert bool(adm.admitted(ids).all())
    assert adm.total == 5 * 1024 and int(adm.sketch.max()) == 5 * 1024  # halved once
    assert sketch_bytes(1024) == 4 * 4 * 1024


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        CountMinAdmission(0, 1024)
    with pytest.raises(ConfigError, match="power of two"):
        CountMinAdmission(2, 1000)


def test_hashed_table_behind_the_filter_is_a_masked_plain_table() -> None:
    rows, dim, thr = 5, 3, 2
    w = torch.randn(rows, dim, requires_grad=True)
    filt = AdmissionFilter(["a", "b"], thr, 1 << 14, seed=1)
    seen: dict[tuple[str, int], int] = {}
    bags = {"a": [[1, 2, 1], [3], [], [1, 4]], "b": [[8, 8], [9], [8, 10], [11]]}
    for step in range(3):
        sp = SparseFeatures.from_lists(bags)
        got_sp = filt(sp)
        emb = torch.nn.functional.embedding_bag(
            got_sp.values % rows, w, got_sp.offsets()[:-1], mode="sum"
        )
        # the specification: a plain table of ``rows`` rows, ids masked until their thr-th sighting
        for k in bags:
            for bag in bags[k]:
                for x in bag:
                    seen[(k, x)] = seen.get((k, x), 0) + 1
        ref = torch.stack(
            [
                sum(
                    (w[x % rows] * float(seen[(k, x)] >= thr) for x in bag),
                    torch.zeros(dim),
                )
                for k in bags
                for bag in bags[k]
            ]
        )
        assert got_sp.lengths.numel() == 8  # the bags stay
        assert torch.allclose(emb, ref)
        (g,) = torch.autograd.grad(emb.sum(), w)
        (g_ref,) = torch.autograd.grad(ref.sum(), w)
        assert torch.allclose(g, g_ref)
        if step == 0:  # nothing admitted on first sight except ids seen twice in the batch
            admitted = {x % rows for (k, x), n in seen.items() if n >= thr}
            assert admitted == {1, 8 % rows}
            assert all(float(g[r].abs().sum()) == 0 for r in range(rows) if r not in admitted)
