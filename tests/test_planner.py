"""Planner: plans fit and cover every table, infeasible inputs explain themselves, determinism."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from neorec.sharding.commands import run_plan
from neorec.sharding.cost_model import CostModel, TableSpec, load_tables
from neorec.sharding.planner import Planner, PlanningError, format_report, plan_tables
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingType, table_wise

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
    assert res.plan.table("big").sharding_type in (ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
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
    from neorec.sharding.types import ShardingPlan

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
    from neorec.sharding.types import ShardingPlan

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
