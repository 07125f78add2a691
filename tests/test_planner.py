"""Planner: plans fit and cover every table, infeasible inputs explain themselves, determinism."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from neorec.sharding.commands import run_plan
from neorec.sharding.cost_model import CostModel, TableSpec, distinct_rows, load_tables
from neorec.sharding.planner import Planner, PlanningError, format_report, plan_tables
from neorec.sharding.topology import Topology
from neorec.sharding.types import (
    ShardingPlan,
    ShardingType,
    column_wise,
    data_parallel,
    row_wise,
    table_wise,
)

ROOT = Path(__file__).resolve().parents[1]


def _tables(rng: random.Random, n: int) -> list[TableSpec]:
    return [
        TableSpec(
            name=f"t{i}",
            rows=int(10 ** rng.uniform(2, 7)),
            dim=rng.choice([4, 8, 16, 32, 64, 128]),
            pooling_factor=min(100.0, math.exp(rng.gauss(1.0, 1.2))),
        )
        for i in range(n)
    ]


def _topo(world: int, rph: int, mem_gb: float, host_gb: float = 0.0) -> Topology:
    return Topology(
        world_size=world,
        ranks_per_host=rph,
        device_memory_gb=mem_gb + 0.5,
        device_reserve_gb=0.5,
        host_memory_gb=host_gb,
    )


def _check(result, tables: list[TableSpec]) -> None:
    plan = result.plan
    plan.validate()  # every row and column of every table exactly once
    assert sorted(t.name for t in plan.tables) == sorted(t.name for t in tables)
    cost = CostModel(result.topology, result.batch_size).evaluate(plan, tables)
    assert cost.fits, cost.overflows()
    assert cost.max_time_s == pytest.approx(result.cost.max_time_s)


def test_random_tasks_fit_and_cover() -> None:
    rng = random.Random(1)
    for _ in range(25):
        world, rph = rng.choice([(2, 2), (4, 2), (4, 4), (8, 4), (16, 8)])
        tables = _tables(rng, rng.randint(3, 40))
        need = sum(t.rows * t.dim * 4 + t.rows * 4 for t in tables) / 1e9
        host = rng.choice([0.0, need])
        topo = _topo(
            world, rph, mem_gb=max(0.05, need * rng.uniform(0.6, 2.0) / world), host_gb=host
        )
        try:
            result = plan_tables(tables, topo, batch_size=rng.choice([256, 4096]))
        except PlanningError as e:
            assert "do not fit" in str(e) and "fixes:" in str(e)
            continue
        _check(result, tables)


def test_deterministic() -> None:
    tables = _tables(random.Random(3), 60)
    topo = _topo(8, 4, mem_gb=2.0, host_gb=4.0)
    a = plan_tables(tables, topo, 2048)
    b = plan_tables(list(tables), topo, 2048)
    assert a.plan.to_json() == b.plan.to_json()


def test_large_table_is_split_and_host_tier_used_when_needed() -> None:
    big = TableSpec(name="big", rows=50_000_000, dim=64, pooling_factor=10)
    small = [TableSpec(name=f"s{i}", rows=1000, dim=64) for i in range(4)]
    topo = _topo(4, 4, mem_gb=6.0)
    res = plan_tables([big, *small], topo, 1024)
    _check(res, [big, *small])
    # Split by rows or columns (on one host, table-row-wise over its ranks is a row split too).
    assert res.plan.table("big").sharding_type in (
        ShardingType.ROW_WISE,
        ShardingType.TABLE_ROW_WISE,
        ShardingType.COLUMN_WISE,
    )
    # Too big for HBM on any split, fits with host memory as a slower tier.
    huge = TableSpec(name="huge", rows=200_000_000, dim=64)
    res = plan_tables([huge], _topo(4, 4, mem_gb=6.0, host_gb=240.0), 1024)
    assert res.plan.table("huge").storage == "host"
    assert "SIMULATION" in format_report(res)


def test_infeasible_gives_diagnostic() -> None:
    huge = TableSpec(name="huge", rows=200_000_000, dim=64)
    with pytest.raises(PlanningError) as e:
        plan_tables([huge, TableSpec(name="ok", rows=10, dim=4)], _topo(4, 4, mem_gb=6.0), 1024)
    msg = str(e.value)
    assert e.value.tables == ["huge"]
    assert "table 'huge'" in msg and "GB" in msg
    for fix in ("more ranks", "slower tier", "row-wise", "smaller dims"):
        assert fix in msg
    pinned = TableSpec(
        name="tw_only", rows=50_000_000, dim=64, allowed_types=(ShardingType.TABLE_WISE,)
    )
    with pytest.raises(PlanningError, match="allow row_wise"):
        plan_tables([pinned], _topo(4, 4, mem_gb=6.0), 1024)


def test_constraints_are_respected() -> None:
    tables = _tables(random.Random(5), 12)
    tables[0].allowed_types = (ShardingType.ROW_WISE,)
    tables[1].ranks = (2, 3)
    tables[2].allowed_types = (ShardingType.TABLE_WISE,)
    tables[2].ranks = (1,)
    res = plan_tables(tables, _topo(4, 2, mem_gb=20.0), 1024)
    plan = res.plan
    assert plan.tables[0].sharding_type is ShardingType.ROW_WISE
    assert {s.rank for s in plan.tables[1].shards} <= {2, 3}
    assert [s.rank for s in plan.tables[2].shards] == [1]


def test_beats_table_wise_round_robin_on_skewed_load() -> None:
    rng = random.Random(7)
    tables = _tables(rng, 40)
    tables[0].pooling_factor, tables[0].dim = 300.0, 128  # one very hot table
    topo = _topo(8, 8, mem_gb=50.0)
    res = Planner(topo, 8192, allow_host=False).plan(tables)
    naive = [table_wise(t, i % 8) for i, t in enumerate(tables)]
    base = CostModel(topo, 8192).evaluate(ShardingPlan(8, 8, naive), tables)
    assert res.cost.max_time_s < base.max_time_s


def test_load_tables_csv_and_json(tmp_path: Path) -> None:
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(
        "name,rows,dim,pooling_factor,allowed_types\na,100,8,2.5,\nb,1e6,16,1,RW;CW\n"
    )
    a, b = load_tables(csv_path)
    assert (a.rows, a.dim, a.pooling_factor) == (100, 8, 2.5)
    assert b.rows == 1_000_000 and b.allowed_types == (
        ShardingType.ROW_WISE,
        ShardingType.COLUMN_WISE,
    )
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"tables": [{"name": "c", "rows": 5, "dim": 4}]}))
    assert load_tables(js)[0].name == "c"
    with pytest.raises(ValueError, match="bad table record"):
        csv_path.write_text("name,rows,dim\nx,abc,4\n")
        load_tables(csv_path)


def _args(**kw):
    base = dict(
        config=None,
        tables=None,
        world_size=2,
        ranks_per_host=0,
        batch_size=0,
        topology=None,
        calibrate=False,
        json=False,
        out=None,
        show_plan=False,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_cli_default_config_json_and_out(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert run_plan(_args(world_size=2, json=True, out=str(out))) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 2 and len(report["ranks"]) == 2
    assert "simulation" in report["note"]
    assert len(ShardingPlan.load(out).tables) == 8


def test_cli_paper_scale_is_feasible(capsys) -> None:
    cfg = ROOT / "configs" / "paper_scale.toml"
    assert run_plan(_args(config=str(cfg), world_size=128, ranks_per_host=8, json=True)) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["num_tables"] >= 300 and rep["params"] >= 1e12
    assert rep["world_size"] == 128 and rep["ranks_per_host"] == 8


def test_cli_infeasible_exit_code(tmp_path: Path, capsys) -> None:
    tables = tmp_path / "t.csv"
    tables.write_text("name,rows,dim\nhuge,1000000000,128\n")
    assert run_plan(_args(tables=str(tables), world_size=2)) == 2
    assert "fixes:" in capsys.readouterr().err


# ---- cost model terms (what the sharded runtime does) ------------------------------------------
def test_distinct_rows_uniform_and_zipf_match_sampled_batches() -> None:
    import torch

    from neorec.data.ids import zipf_ids

    assert distinct_rows(1000, 0, 1.05) == 0.0
    assert distinct_rows(100_000, 20_480) == pytest.approx(100_000 * -math.expm1(-0.2048))
    g = torch.Generator().manual_seed(0)
    for rows, hits, alpha in [(100_000, 20_480, 1.05), (1000, 50_000, 1.05), (10**7, 65_536, 0.8)]:
        sampled = torch.unique(zipf_ids(rows, hits, alpha, g)).numel()
        assert distinct_rows(rows, hits, alpha) == pytest.approx(sampled, rel=0.05)
    # Skew touches fewer rows; never more than rows or hits.
    assert distinct_rows(100_000, 20_480, 1.05) < 0.5 * distinct_rows(100_000, 20_480)
    assert distinct_rows(50, 10**6, 1.2) <= 50 and distinct_rows(10**9, 7, 1.2) <= 7


def _cm(world: int = 2, **kw) -> CostModel:
    topo = Topology(world_size=world, device_memory_gb=100.0, **kw)
    return CostModel(topo, 4096)


def test_skew_lowers_update_cost_not_id_traffic() -> None:
    cm = _cm()
    u = TableSpec(name="u", rows=1_000_000, dim=64, pooling_factor=20)
    z = TableSpec(name="z", rows=1_000_000, dim=64, pooling_factor=20, zipf_alpha=1.05)
    cu = cm.shard_cost(u, ShardingType.TABLE_WISE, u.rows, u.dim)
    cz = cm.shard_cost(z, ShardingType.TABLE_WISE, z.rows, z.dim)
    assert cz.bwd_compute_s < cu.bwd_compute_s and cz.fwd_compute_s < cu.fwd_compute_s
    assert cz.fwd_comm_s == pytest.approx(cu.fwd_comm_s)


def test_column_wise_rowwise_adagrad_is_unfused_and_slows_its_rank() -> None:
    cm = _cm(unfused_bw_gbs=50.0)
    t = TableSpec(name="t", rows=1_000_000, dim=64, pooling_factor=10)
    cw_ada = cm.shard_cost(t, ShardingType.COLUMN_WISE, t.rows, 32)
    sgd = TableSpec(name="t", rows=1_000_000, dim=64, pooling_factor=10, optimizer="sgd")
    cw_sgd = cm.shard_cost(sgd, ShardingType.COLUMN_WISE, t.rows, 32)
    fused = cm.shard_cost(t, ShardingType.COLUMN_WISE, t.rows, 32, unfused=False)
    assert cw_ada.bwd_compute_s > 5 * fused.bwd_compute_s
    assert cw_ada.bwd_comm_s > cw_sgd.bwd_comm_s  # the subgroup's sums of squares
    assert cw_sgd.bwd_compute_s < fused.bwd_compute_s  # no optimizer state
    # A table-wise table next to a column slice is updated on the unfused path too.
    other = TableSpec(name="o", rows=100_000, dim=64, pooling_factor=10)
    alone = cm.evaluate(ShardingPlan(2, 2, [table_wise(other, 0)]), [other])
    both = cm.evaluate(
        ShardingPlan(2, 2, [table_wise(other, 0), column_wise(t, [0, 1], 2)]), [other, t]
    )
    tw_time = {n: s for n, _, s in alone.ranks[0].shards}["o"]
    assert {n: s for n, _, s in both.ranks[0].shards}["o"] > 2 * tw_time
    cw_plan = ShardingPlan(2, 2, [column_wise(t, [0, 1], 2)])
    assert cm.unfused_ranks(cw_plan, {"t": t}) == {0, 1}


def test_data_parallel_exchanges_touched_rows_not_the_table() -> None:
    cm = _cm(world=4)
    small = TableSpec(name="s", rows=10**8, dim=64, pooling_factor=1)
    c = cm.shard_cost(small, ShardingType.DATA_PARALLEL, small.rows, small.dim)
    dense_ring = 2 * 3 / 4 * small.rows * small.dim * 4 / (cm.topo.intra_host_bw_gbs * 1e9)
    assert c.bwd_comm_s < 0.01 * dense_ring
    # Updated rows: every rank applies the global batch's distinct rows.
    plan = ShardingPlan(4, 4, [data_parallel(small, 4)])
    cost = cm.evaluate(plan, [small])
    assert cost.sample_side_s == pytest.approx(cm.fixed_s(sharded=False, data_parallel=True))


def test_row_split_costs_the_sample_side_and_twrw_matches_rw_on_one_host() -> None:
    t = TableSpec(name="t", rows=1_000_000, dim=32, pooling_factor=20)
    fast, slow = _cm(world=4, row_split_bw_gbs=1000.0), _cm(world=4, row_split_bw_gbs=0.1)
    rw = ShardingType.ROW_WISE
    assert slow.sample_side_s(t, rw, 4) > fast.sample_side_s(t, rw, 4)
    tw = ShardingType.TABLE_WISE
    assert slow.sample_side_s(t, tw, 1) == pytest.approx(fast.sample_side_s(t, tw, 1))
    twrw = ShardingType.TABLE_ROW_WISE
    assert slow.sample_side_s(t, twrw, 4) == pytest.approx(slow.sample_side_s(t, rw, 4))
    a = slow.shard_cost(t, rw, 250_000, 32)
    b = slow.shard_cost(t, twrw, 250_000, 32)
    assert a.phases == pytest.approx(b.phases)


def test_planner_accounts_for_unfused_ranks() -> None:
    rng = random.Random(11)
    tables = _tables(rng, 24)
    for t in tables[:3]:
        t.allowed_types = (ShardingType.COLUMN_WISE,)
    topo = _topo(8, 4, mem_gb=50.0)
    res = plan_tables(tables, topo, 8192)
    _check(res, tables)
    cm = CostModel(topo, 8192)
    slow = cm.unfused_ranks(res.plan, {t.name: t for t in tables})
    # Column slices share ranks rather than slowing every rank down.
    assert 0 < len(slow) < 8
    naive = ShardingPlan(
        8,
        4,
        [
            row_wise(t, list(range(8))) if i < 3 else table_wise(t, i % 8)
            for i, t in enumerate(tables)
        ],
    )
    assert res.cost.max_time_s <= cm.evaluate(naive, tables).max_time_s
