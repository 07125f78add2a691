"""``neorec bench costcheck`` end to end on a tiny table set (2 gloo ranks, a fixed topology)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neorec.bench.calibrate import measure_row_split, measure_tbe, measure_unfused
from neorec.bench.costcheck import main
from neorec.sharding.topology import Topology


def test_costcheck_small(tmp_path: Path) -> None:
    topo = tmp_path / "topo.json"
    Topology.local_cpu(2).save(topo)
    out = tmp_path / "out.json"
    small = ["--tables", "3", "--rows", "500", "--dim", "8", "--batch", "32", "--pooling", "2"]
    args = ["--topology", str(topo), "--plans", "table_wise,mixed,planner", "--json-out", str(out)]
    rand = ["--random-plans", "1", "--random-seed", "46"]  # a small mix: 2 tables, 35k weights
    rc = main([*args, *small, *rand, "--iters", "2", "--warmup", "1", "--repeats", "2"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["plan"] for r in data["results"]] == ["table_wise", "mixed", "planner"]
    for r in data["results"]:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0
        rel = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        assert abs(r["error"] - rel) < 1e-2
        assert r["measured_min_ms"] <= r["measured_ms"] <= r["measured_max_ms"]
    assert data["repeats"] == 2
    assert data["max_abs_error"] >= data["mean_abs_error"] >= 0
    # one held-out random plan (a random table mix), counted in the errors
    (r,) = data["random_results"]
    assert r["predicted_ms"] > 0 and r["measured_ms"] > 0
    errs = [abs(x["error"]) for x in data["results"] + data["random_results"]]
    assert data["max_abs_error"] == pytest.approx(max(errs), abs=1e-3)
    assert data["random_max_abs_error"] == pytest.approx(abs(r["error"]), abs=1e-3)
    assert data["cost_model"]["kind"] == "analytical"  # this topology has no learned model
    # the analytical baseline's errors on the same measurements: here the model itself
    assert data["analytical_mean_abs_error"] == pytest.approx(data["mean_abs_error"], abs=2e-3)
    assert r["analytical_ms"] == pytest.approx(r["predicted_ms"], rel=1e-3)


def test_measure_tbe_small() -> None:
    m = measure_tbe(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, repeat=2)
    assert m["tbe_gbs"] > 0 and m["tbe_fwd_ms"] > 0 and m["tbe_bwd_ms"] > 0


def test_measure_unfused_and_row_split_small() -> None:
    m = measure_unfused(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, repeat=2)
    assert m["unfused_gbs"] > 0 and m["unfused_bwd_ms"] > 0
    s = measure_row_split(rows=1000, tables=2, batch=32, pooling=2, repeat=2)
    assert s["row_split_gbs"] > 0 and s["row_split_ms"] > 0


def test_measure_dp_update_small() -> None:
    from neorec.bench.calibrate import measure_dp_update

    m = measure_dp_update(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, ranks=3, repeat=2)
    assert m["dp_update_gbs"] > 0 and m["dp_update_ms"] > 0
