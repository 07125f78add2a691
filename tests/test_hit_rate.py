"""The planner's hit-rate model in NumPy (``neorec.sharding.hit_rate``) against the samplers'
torch rank probabilities (``neorec.data.ids``) and the torch model it replaced."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data import ids
from neorec.sharding import hit_rate

ROOT = Path(__file__).resolve().parents[1]
ROWS = [1, 2, 7, 100, 4096, 4097, 5000, 123_457, 2_000_000, 42_987_918, 60_000_001, 10**9 + 7]
"""Table sizes: tiny, around the bucketing's 4096, and above 2**24 (not float32-exact)."""
ALPHAS = [0.0, 0.5, 0.8, 1.0, 1.05, 1.2, 2.0]
REF_LOOKUPS = [1.0, 0.5 * 65_536, 3.5 * 65_536, 400 * 65_536]
FRACTIONS = [0.0, 1e-4, 0.001, 0.01, 0.05, 0.1, 0.3, 0.7, 0.99, 1.0]


def _ranks(rows: int) -> np.ndarray:
    """Every rank of a small table; the head, a spread and the last ranks of a large one."""
    spread = np.linspace(0, rows - 1, 2000).astype(np.int64)
    return np.unique(np.concatenate([np.arange(min(rows, 5000)), spread, [rows - 1]]))


# ---- the torch model this module replaced (neorec/storage/model.py, as it was) -----------------
def _torch_rank_buckets(rows: int, alpha: float | None, pooling: float = 1.0):
    if rows <= 4096:
        edges = torch.arange(rows + 1, dtype=torch.float64)
    else:
        head = torch.arange(512, dtype=torch.float64)
        tail = torch.logspace(math.log10(512), math.log10(rows), 4096 - 512, dtype=torch.float64)
        edges = torch.unique(torch.cat([head, tail.round(), torch.tensor([float(rows)])]))
    lo, hi = edges[:-1], edges[1:]
    count = hi - lo
    mid = torch.floor((lo + hi - 1) / 2).to(torch.int64)
    if alpha is None:
        p = ids.locality_rank_prob(mid, rows, max(pooling, 1e-3) * ids.LOCALITY_REF_BATCH)
    else:
        p = ids.zipf_rank_prob(mid, rows, alpha)
    p = p / (p * count).sum()
    return count, p


def _torch_hit_rate(rows: int, cache_fraction: float, alpha: float | None, policy: str) -> float:
    cap = cache_fraction * rows
    if cap >= rows:
        return 1.0
    if cap <= 0:
        return 0.0
    count, p = _torch_rank_buckets(rows, alpha)
    if policy == "lfu":
        order = torch.argsort(p, descending=True)
        count, p = count[order], p[order]
        cum = torch.cumsum(count, 0)
        take = (cap - (cum - count)).clamp(min=0).minimum(count)
        return float((take * p).sum())
    lo, hi = 0.0, 1.0
    while float((count * -torch.expm1(-p * hi)).sum()) < cap:
        hi *= 2
    for _ in range(100):
        t = (lo + hi) / 2
        if float((count * -torch.expm1(-p * t)).sum()) < cap:
            lo = t
        else:
            hi = t
    return float((count * p * -torch.expm1(-p * hi)).sum())


def _torch_hit_rates(rows, fractions, alpha, policy, pooling) -> list[float]:
    fr = [float(f) for f in fractions]
    out = [1.0 if f * rows >= rows else 0.0 for f in fr]
    todo = [i for i, f in enumerate(fr) if 0 < f * rows < rows]
    if not todo:
        return out
    count, p = _torch_rank_buckets(rows, alpha, pooling)
    cap = torch.tensor([fr[i] * rows for i in todo], dtype=torch.float64)
    if policy == "lfu":
        order = torch.argsort(p, descending=True)
        count, p = count[order], p[order]
        cum = torch.cumsum(count, 0)
        take = (cap[None, :] - (cum - count)[:, None]).clamp(min=0).minimum(count[:, None])
        rates = (take * p[:, None]).sum(0)
    else:
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


# ---- rank probabilities -------------------------------------------------------------------------
@pytest.mark.parametrize("rows", ROWS)
def test_zipf_rank_prob_is_the_samplers(rows: int) -> None:
    r = _ranks(rows)
    for alpha in ALPHAS:
        want = ids.zipf_rank_prob(torch.from_numpy(r), rows, alpha).numpy()
        got = hit_rate.zipf_rank_prob(r, rows, alpha)
        if alpha == 0:
            assert np.array_equal(got, want)  # uniform: 1 / rows
        else:  # NumPy's and torch's pow may differ in the last bit
            np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


@pytest.mark.bitwise
@pytest.mark.parametrize("rows", ROWS)
def test_locality_rank_prob_is_the_samplers_bitwise(rows: int) -> None:
    r = _ranks(rows)
    for ref in REF_LOOKUPS:
        want = ids.locality_rank_prob(torch.from_numpy(r), rows, ref).numpy()
        got = hit_rate.locality_rank_prob(r, rows, ref)
        assert np.array_equal(got, want), (rows, ref)


# ---- hit rates ----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", ROWS)
def test_rank_buckets_are_the_torch_models(rows: int) -> None:
    for alpha in [None, *ALPHAS]:
        for pooling in [0.5, 3.5] if alpha is None else [1.0]:
            c0, p0 = _torch_rank_buckets(rows, alpha, pooling)
            c1, p1 = hit_rate.rank_buckets(rows, alpha, pooling)
            assert np.array_equal(c1, c0.numpy()), (rows, alpha)
            np.testing.assert_allclose(p1, p0.numpy(), rtol=1e-14, atol=0)


@pytest.mark.parametrize("rows", ROWS)
def test_hit_rates_are_the_torch_models(rows: int) -> None:
    for alpha in [None, 0.5, 0.8, 1.05, 1.2]:
        for policy in ("lru", "lfu"):
            for pooling in [0.5, 3.5, 30.0] if alpha is None else [1.0]:
                want = _torch_hit_rates(rows, FRACTIONS, alpha, policy, pooling)
                got = hit_rate.expected_hit_rates(rows, FRACTIONS, alpha, policy, pooling)
                assert got == pytest.approx(want, rel=1e-12, abs=0), (alpha, policy, pooling)
            for f in (0.001, 0.1, 0.5):
                want1 = _torch_hit_rate(rows, f, alpha, policy)
                got1 = hit_rate.expected_hit_rate(rows, f, alpha, policy)
                assert got1 == pytest.approx(want1, rel=1e-12, abs=0), (alpha, policy, f)


def test_planning_cached_tiers_loads_no_torch() -> None:
    """The cached tiers' hit rates (Zipf and locality ids) are computed without torch."""
    code = (
        "import sys\n"
        "from neorec.sharding.planner import plan_tables\n"
        "from neorec.sharding.tables import TableSpec\n"
        "from neorec.sharding.topology import Topology\n"
        "tables = [TableSpec(name='z', rows=60_000_000, dim=64, pooling_factor=4, zipf_alpha=1.05),\n"
        "          TableSpec(name='l', rows=20_000_000, dim=32, pooling_factor=8)]\n"
        "topo = Topology(world_size=2, device_memory_gb=2.5, device_reserve_gb=0.5,\n"
        "                host_memory_gb=4.0, ssd_capacity_gb=100.0)\n"
        "res = plan_tables(tables, topo, 1024, allow_cached_tiers=True)\n"
        "assert res.plan.cached_tables(), res.plan.format_table()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"
