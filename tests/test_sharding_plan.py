"""ShardingPlan as data: constructors, JSON round-trip, validation errors."""

from __future__ import annotations

import json

import pytest

from neorec.config import TableConfig
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.plan_checks import check_model, check_storage, validate_plan
from neorec.sharding.plan_json import load_plan, parse_plan_dict, parse_plan_text
from neorec.sharding.types import (
    PlanValidationError,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    column_wise,
    data_parallel,
    row_wise,
    split_evenly,
    table_row_wise,
    table_wise,
)


def _t(name: str = "t", rows: int = 10, dim: int = 8) -> TableConfig:
    return TableConfig(name=name, rows=rows, dim=dim)


def test_split_evenly_uneven_and_fewer_items_than_parts() -> None:
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(3, 5) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        split_evenly(0, 2)


def test_row_wise_uneven_split() -> None:
    tp = row_wise(_t(rows=10), [0, 1, 2])
    assert [(s.rank, s.row_start, s.row_end) for s in tp.shards] == [
        (0, 0, 4),
        (1, 4, 7),
        (2, 7, 10),
    ]
    assert all((s.col_start, s.col_end) == (0, 8) for s in tp.shards)
    validate_plan(ShardingPlan(4, 4, [tp]))


def test_row_wise_fewer_rows_than_ranks_gives_fewer_shards() -> None:
    tp = row_wise(_t(rows=2), [0, 1, 2, 3])
    assert [(s.rank, s.rows) for s in tp.shards] == [(0, 1), (1, 1)]
    validate_plan(ShardingPlan(4, 2, [tp]))


def test_column_wise_slices_round_robin() -> None:
    tp = column_wise(_t(dim=10), [1, 3], n_slices=3)
    assert [(s.rank, s.col_start, s.col_end) for s in tp.shards] == [
        (1, 0, 4),
        (3, 4, 7),
        (1, 7, 10),
    ]
    validate_plan(ShardingPlan(4, 2, [tp]))
    with pytest.raises(ValueError, match="n_slices"):
        column_wise(_t(dim=4), [0], n_slices=5)


def test_table_row_wise_stays_on_host() -> None:
    tp = table_row_wise(_t(rows=7), host=1, ranks_per_host=4)
    assert [s.rank for s in tp.shards] == [4, 5, 6, 7]
    assert [s.rows for s in tp.shards] == [2, 2, 2, 1]
    small = table_row_wise(_t(rows=3), host=1, ranks_per_host=4)
    assert [s.rank for s in small.shards] == [4, 5, 6]
    validate_plan(ShardingPlan(8, 4, [tp]))


def test_json_round_trip_and_shards_on_rank(tmp_path) -> None:
    plan = ShardingPlan(
        4,
        2,
        [
            data_parallel(_t("dp"), 4),
            table_wise(_t("tw"), 3, storage="host"),
            row_wise(_t("rw", rows=5), [0, 1, 2, 3]),
            column_wise(_t("cw", dim=6), [2, 3]),
            table_row_wise(_t("twrw"), 1, 2),
        ],
        {"note": "hand"},
    )
    validate_plan(plan)
    again = parse_plan_text(plan.to_json())
    assert again == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    on3 = [(t.name, s) for t, s in plan.shards_on_rank(3)]
    assert [n for n, _ in on3] == ["dp", "tw", "rw", "cw", "twrw"]
    assert plan.table("tw").storage == "host"
    text = plan.format_table()
    assert "TWRW" in text and "r3[0:10,0:8]" in text


def test_hand_written_plan_short_type_names() -> None:
    d = {
        "world_size": 2,
        "tables": [
            {
                "name": "a",
                "rows": 4,
                "dim": 2,
                "type": "RW",
                "shards": [
                    {"rank": 0, "rows": [0, 2], "cols": [0, 2]},
                    {"rank": 1, "rows": [2, 4], "cols": [0, 2]},
                ],
            },
        ],
    }
    plan = parse_plan_dict(d)
    validate_plan(plan)
    assert plan.tables[0].sharding_type is ShardingType.ROW_WISE
    assert plan.ranks_per_host == 2


def _bad(tp: TablePlan, world: int = 4, rph: int = 2) -> str:
    with pytest.raises(PlanValidationError) as e:
        validate_plan(ShardingPlan(world, rph, [tp]))
    return str(e.value)


def test_validation_overlapping_and_missing_rows() -> None:
    rw = ShardingType.ROW_WISE
    msg = _bad(TablePlan("t", 10, 4, rw, [Shard(0, 0, 6, 0, 4), Shard(1, 5, 10, 0, 4)]))
    assert "table 't'" in msg and "rows [5, 6) are covered more than once" in msg
    msg = _bad(TablePlan("t", 10, 4, rw, [Shard(0, 0, 4, 0, 4), Shard(1, 6, 10, 0, 4)]))
    assert "rows [4, 6) are not covered" in msg
    msg = _bad(TablePlan("t", 10, 4, rw, [Shard(0, 0, 4, 0, 4)]))
    assert "rows [4, 10) are not covered" in msg


def test_validation_bad_rank_and_bounds() -> None:
    tw = ShardingType.TABLE_WISE
    msg = _bad(TablePlan("t", 10, 4, tw, [Shard(7, 0, 10, 0, 4)]))
    assert "rank 7 does not exist" in msg and "shard 0" in msg
    msg = _bad(TablePlan("t", 10, 4, tw, [Shard(0, 0, 11, 0, 4)]))
    assert "rows must satisfy" in msg


def test_validation_column_wise_must_tile() -> None:
    cw = ShardingType.COLUMN_WISE
    msg = _bad(TablePlan("t", 10, 8, cw, [Shard(0, 0, 10, 0, 4), Shard(1, 0, 10, 3, 8)]))
    assert "columns [3, 4) are covered more than once" in msg
    msg = _bad(TablePlan("t", 10, 8, cw, [Shard(0, 0, 10, 0, 4), Shard(1, 0, 5, 4, 8)]))
    assert "must hold all rows" in msg


def test_validation_dp_twrw_and_plan_level() -> None:
    msg = _bad(TablePlan("d", 4, 2, ShardingType.DATA_PARALLEL, [Shard(0, 0, 4, 0, 2)]))
    assert "full replica on every rank" in msg
    twrw = TablePlan(
        "h", 4, 2, ShardingType.TABLE_ROW_WISE, [Shard(1, 0, 2, 0, 2), Shard(2, 2, 4, 0, 2)]
    )
    assert "one host" in _bad(twrw)
    with pytest.raises(PlanValidationError, match="divide"):
        validate_plan(ShardingPlan(4, 3, []))
    dup = table_wise(_t("x"), 0)
    with pytest.raises(PlanValidationError, match="more than once"):
        validate_plan(ShardingPlan(2, 2, [dup, dup]))


def test_plan_by_type_from_config_types() -> None:
    tables = [_t(f"t{i}", rows=3) for i in range(4)]
    plan = plan_by_type(tables, 4, 2, "table_wise", {"t1": "row_wise", "t2": "CW", "t3": "twrw"})
    kinds = [t.sharding_type.short for t in plan.tables]
    assert kinds == ["TW", "RW", "CW", "TWRW"]
    assert len(plan.table("t1").shards) == 3  # 3 rows on 4 ranks


def test_cached_storage_json_round_trip_validation_and_runtime_check(tmp_path) -> None:
    ssd = row_wise(_t("ssd", rows=100), [0, 1, 2, 3], storage="ssd")
    ssd.cache_fraction = 0.05
    dram = table_wise(_t("dram", rows=50), 1, storage="dram")
    dram.cache_fraction = 0.25
    plain = table_wise(_t("dev"), 2)
    plan = ShardingPlan(4, 2, [ssd, dram, plain])
    validate_plan(plan)
    d = plan.to_dict()
    assert d["tables"][0]["cache_fraction"] == 0.05 and "cache_fraction" not in d["tables"][2]
    again = parse_plan_text(plan.to_json())
    assert again == plan and again.table("ssd").cache_fraction == 0.05
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path) == plan
    assert [t.name for t in plan.cached_tables()] == ["ssd", "dram"]
    text = plan.format_table()
    assert "ssd@5%" in text and "dram@25%" in text
    # The distributed runtime runs device / host only: a cached tier is refused, not ignored.
    with pytest.raises(PlanValidationError, match="storage 'ssd@5%' is not supported"):
        check_storage(plan, who="the distributed runtime")
    check_storage(ShardingPlan(4, 2, [plain]))
    # ... also when it arrives as a hand-written plan file (sharding.plan).
    from neorec.builder import resolve_plan
    from neorec.config import Config, EmbeddingConfig, ModelConfig

    tables = [_t("ssd", rows=100), _t("dram", rows=50), _t("dev")]
    cfg = Config(model=ModelConfig(bottom_mlp=[16, 8]), embedding=EmbeddingConfig(tables=tables))
    cfg.sharding.plan = str(path)
    with pytest.raises(PlanValidationError, match="not supported by the distributed runtime"):
        resolve_plan(cfg, 4, 2)
    # A cached tier needs a cache fraction; other tiers must not have one; no DP / CW caches.
    bad = table_wise(_t("x"), 0, storage="ssd")
    assert "needs cache_fraction in (0, 1]" in _bad(bad)
    bad = table_wise(_t("x"), 0)
    bad.cache_fraction = 0.1
    assert "only for storage dram or ssd" in _bad(bad)
    bad = data_parallel(_t("x"), 4, storage="dram")
    bad.cache_fraction = 0.1
    assert "table-wise and row-split" in _bad(bad)


def test_load_names_the_file_table_and_field_on_one_line(tmp_path) -> None:
    path = tmp_path / "p.json"
    good = ShardingPlan(2, 2, [row_wise(_t("a", rows=4), [0, 1])]).to_dict()

    def shard0(**kw: object) -> str:
        d = json.loads(json.dumps(good))
        d["tables"][0]["shards"][0].update(kw)
        for k, v in kw.items():
            if v is None:
                del d["tables"][0]["shards"][0][k]
        return json.dumps(d)

    for text, wanted in [
        ("", "empty"),
        ("{", "not valid JSON"),
        ('{"world_size": 2, "tables": {}}', "'tables' must be a list"),
        (shard0(rows="0:2"), "table 'a' shard 0: 'rows' must be [start, end]"),
        (shard0(rank=0.5), "table 'a' shard 0: 'rank' must be an integer"),
        (shard0(rank=None), "table 'a' shard 0: field 'rank' is missing"),
    ]:
        path.write_text(text)
        with pytest.raises(PlanValidationError) as e:
            load_plan(path)
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg and wanted in msg, msg


def test_load_checks_the_model_and_world_size(tmp_path) -> None:
    path = tmp_path / "p.json"
    ShardingPlan(2, 2, [row_wise(_t("a", rows=4), [0, 1]), table_wise(_t("x"), 1)]).save(path)
    tables = [_t("a", rows=4), _t("b")]
    with pytest.raises(PlanValidationError) as e:
        load_plan(path, tables=tables, world_size=1)
    msg = str(e.value)
    assert "world_size 2, but 1 rank is running" in msg
    assert "['x'] are in the plan but not in the model" in msg
    assert "['b'] of the model have no entry" in msg
    plan = load_plan(path, tables=[_t("a", rows=4), _t("x")], world_size=2)
    assert plan.source == str(path) and [t.name for t in plan.tables] == ["a", "x"]
    with pytest.raises(PlanValidationError, match="the plan has 4 rows x 8 dims, the model 5 x 8"):
        check_model(plan, [_t("a", rows=5), _t("x")])
