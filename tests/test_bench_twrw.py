"""``neorec bench dist``'s ``row_wise_host`` layout (row-wise over the table-row-wise plan's
shards) and the inter-host reduction it reports (the README's ``twrw`` row); the bytes
themselves are counted and checked against this arithmetic in ``tests/test_twrw.py``."""

from __future__ import annotations

import pytest

from neorec.bench import dist as bench_dist
from neorec.sharding.types import ShardingType


def test_row_wise_host_keeps_the_table_row_wise_shards() -> None:
    a = bench_dist.parse(["--tables", "4", "--rows", "101", "--dim", "8", "--batch", "64"])
    cfg = bench_dist._config(a)
    twrw = bench_dist._plan(cfg, "table_row_wise", 4, 2)
    same = bench_dist._plan(cfg, "row_wise_host", 4, 2)
    assert (same.world_size, same.ranks_per_host) == (4, 2)
    for t, r in zip(twrw.tables, same.tables, strict=True):
        assert r.sharding_type is ShardingType.ROW_WISE
        assert r.name == t.name and r.shards == t.shards
    # tables round-robin over the hosts: each on the two ranks of one host
    assert [sorted({s.rank for s in t.shards}) for t in same.tables] == [[0, 1], [2, 3]] * 2


def test_inter_host_reduction_by_hand() -> None:
    def row(kind: str, xhost: int, codecs: str = "fp32") -> dict:
        return {"type": kind, "codecs": codecs, "inter_host_pooled_bytes": xhost}

    rows = [row("row_wise_host", 1000), row("table_row_wise", 500), row("row_wise", 2000)]
    got = bench_dist.inter_host_reduction([*rows, row("table_row_wise", 1, codecs="fp16")])
    assert got == {"vs_row_wise_host": pytest.approx(2.0), "vs_row_wise": pytest.approx(4.0)}
    assert bench_dist.inter_host_reduction(rows[:1]) == {}  # no table-row-wise row: nothing
