"""The learned cost model's designed calibration set (issue 23): whole-plan kinds, the greedy
baselines' and planner's plans next to random mixes, repeated measurements as medians; the
``typed`` regressor (analytical time per sharding type re-weighted); the planner's candidates
include the greedy baselines' plans, so by the model that scores plans it never loses to them."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.learned_features import FEATURES, plan_features
from neorec.sharding.learned_placements import (
    designed_jobs,
    fit,
    predict_job,
    sample_from_job,
    samples_from_rows,
)
from neorec.sharding.planner import Planner, plan_tables
from neorec.sharding.planner_baselines import BASELINES, baseline_candidates, greedy_baseline
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan, ShardingType, plan_by_type


def test_designed_jobs_cover_the_checked_kinds_with_repeats() -> None:
    topo = Topology.local_cpu(2)
    jobs = designed_jobs(topo, 2, 2, 120, seed=0, repeats=3)
    assert len(jobs) >= 120
    designs = Counter(j["design"] for j in jobs)
    for kind in ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel",
                 "mixed", "planner", "random"):  # fmt: skip
        assert designs[kind] > 0, (kind, designs)
    assert any(k in designs for k in BASELINES)
    # each placement is measured 3 times, in a row within its block, with one id
    per = Counter(j["placement"] for j in jobs)
    assert set(per.values()) == {3}
    block = [j["placement"] for j in jobs if j["mix"] == jobs[0]["mix"]]
    n = len(block) // 3
    assert block == block[:n] * 3  # the block's placements, 3 rounds in a row
    # a placement id names one plan of one mix
    by: dict[str, Any] = {}
    for j in jobs:
        assert by.setdefault(j["placement"], (j["mix"], j["plan"])) == (j["mix"], j["plan"])
    # deterministic; another seed is other mixes (held out)
    assert designed_jobs(topo, 2, 2, 120, seed=0, repeats=3) == jobs
    other = designed_jobs(topo, 2, 2, 60, seed=1, repeats=1)
    assert not {j["mix"] for j in other} & {j["mix"] for j in jobs}
    # every plan is valid for its tables
    for j in jobs[:: max(1, len(jobs) // 30)]:
        ShardingPlan.from_dict(j["plan"]).validate()
    with pytest.raises(ValueError, match="repeats"):
        designed_jobs(topo, 2, 2, 10, repeats=0)


def test_samples_are_medians_of_repeats() -> None:
    jobs = designed_jobs(Topology.local_cpu(2), 2, 2, 8, seed=3, repeats=3)
    two = [i for i, j in enumerate(jobs) if j["placement"] in ("d3b0p0", "d3b0p1")]
    assert len(two) == 6  # the block goes round 3 times: p0, p1, ..., p0, p1, ...
    rows = []
    for k, i in enumerate(two):
        v = (10.0, 30.0, 11.0)[k // 2]  # one outlier per placement
        rows.append(
            {"job": i, "ms_per_step": v, "fwd_ms": v / 2, "bwd_ms": v / 2, "comm_wait_ms": 1.0}
        )
    samples = samples_from_rows(jobs, rows)
    assert len(samples) == 2
    for s in samples:
        assert s["measured"]["step"] == 11.0 and s["repeats"] == 3
        assert s["step_range"] == [10.0, 30.0]
    # a budget cut mid-round keeps what was measured
    cut = samples_from_rows(jobs, rows[:3])
    assert [s["repeats"] for s in cut] == [2, 1]


def _bench_tables(alpha: float = 1.05) -> list[TableSpec]:
    return [TableSpec(name=f"b{i}", rows=100_000, dim=32, pooling_factor=20.0, zipf_alpha=alpha)
            for i in range(8)]  # fmt: skip


def test_features_split_the_analytical_step_by_type() -> None:
    topo = Topology.local_cpu(2)
    cm = CostModel(topo, 1024)
    f = {n: i for i, n in enumerate(FEATURES)}
    for kind in ("table_wise", "row_wise", "column_wise", "data_parallel", "mixed"):
        types = None
        if kind == "mixed":
            cyc = ["row_wise", "table_wise", "column_wise", "data_parallel"]
            types = {t.name: cyc[i % 4] for i, t in enumerate(_bench_tables())}
        plan = plan_by_type(_bench_tables(), 2, 2, "table_wise" if types else kind, types)
        x, base = plan_features(cm, plan, _bench_tables())
        parts = [x[f[f"crit_{t.value}"]] + x[f[f"side_{t.value}"]] for t in ShardingType]
        whole = sum(parts) + x[f["share_fixed"]] + x[f["share_excess"]]
        assert whole == pytest.approx(1.0, abs=1e-9), kind  # the shares add up to the step
        assert base["step"] == pytest.approx(1000 * cm.evaluate(plan, _bench_tables()).max_time_s)
        if kind != "mixed":
            own = ShardingType(kind)
            assert all(p == 0 for t, p in zip(ShardingType, parts) if t is not own), kind
            assert x[f["rowsplit_alpha"]] == (1.05 if kind == "row_wise" else 0.0)


def _typed_truth(job: dict[str, Any], base: dict[str, float], topo: Topology) -> dict[str, float]:
    """A machine where row-split work costs 0.6x the analytical model's and column-wise 1.4x,
    the rest as predicted, plus 0.3 ms per step: the typed model's form, not one factor."""
    specs = [TableSpec(**t) for t in job["tables"]]
    plan = ShardingPlan.from_dict(job["plan"])
    cm = CostModel(topo.with_world(2, 2), int(job["batch"]), job["optimizer"])
    x, _ = plan_features(cm, plan, specs)
    f = {n: i for i, n in enumerate(FEATURES)}
    w = {"row_wise": 0.6, "table_row_wise": 0.6, "column_wise": 1.4}
    share = sum(
        (x[f[f"crit_{t.value}"]] + x[f[f"side_{t.value}"]]) * w.get(t.value, 1.0)
        for t in ShardingType
    )
    share += x[f["share_fixed"]] + x[f["share_excess"]]
    rng = random.Random(str(job["plan"]))
    return {k: (v * share + 0.3) * rng.uniform(0.99, 1.01) for k, v in base.items()}


def _typed_samples(topo: Topology, seed: int, n: int) -> list[dict[str, Any]]:
    out = []
    for j in designed_jobs(topo, 2, 2, n, seed=seed, repeats=1):
        m = _typed_truth(j, predict_job(topo, j, None), topo)
        row = {"ms_per_step": m["step"], "fwd_ms": m["fwd"], "bwd_ms": m["bwd"]}
        out.append(sample_from_job(j, {**row, "comm_wait_ms": m["comm"]}))
    return out


@pytest.fixture(scope="module")
def typed_fit() -> tuple[Topology, Any]:
    topo = Topology.local_cpu(2)
    model = fit(topo, _typed_samples(topo, 0, 160))
    return topo, model


def test_typed_model_learns_per_type_factors(typed_fit: tuple[Topology, Any]) -> None:
    topo, model = typed_fit
    v = model.validation["step"]
    assert v["kept"] in ("typed", "typed_0.3", "typed_stumps"), v
    assert v["mean_abs_error"] < 0.03 and v["candidates"]["analytical"]["mean_abs_error"] > 0.1
    # on other mixes, the bench's own kinds of plans included, within a few percent
    errs = []
    for s in _typed_samples(topo, 9, 40):
        p = predict_job(topo, s, model)["step"]
        errs.append(abs(p - s["measured"]["step"]) / s["measured"]["step"])
    assert max(errs) < 0.06, max(errs)


def test_learned_planner_never_worse_than_the_baselines(typed_fit: tuple[Topology, Any]) -> None:
    import copy

    topo, model = typed_fit
    topo = copy.deepcopy(topo)
    topo.learned_cost = model.to_dict()
    rng = random.Random(8)
    for k in range(4):
        tables = [TableSpec(name=f"t{k}_{i}", rows=rng.randint(1000, 100_000),
                            dim=rng.choice((8, 16, 32, 64)), pooling_factor=rng.randint(1, 30))
                  for i in range(rng.randint(3, 8))]  # fmt: skip
        p = Planner(topo, 1024, allow_host=False)
        assert p.scoring.kind == "learned"
        res = p.plan(tables)
        mine = model.step_s(p.cm, res.plan, tables)
        assert res.predicted_step_s == pytest.approx(mine)
        for name, plan in baseline_candidates(p, tables):
            assert mine <= model.step_s(p.cm, plan, tables) * (1 + 1e-9), (k, name)
        assert p.plan(tables).plan.tables == res.plan.tables  # deterministic


def test_planner_never_worse_than_the_baselines_by_its_model() -> None:
    topo = Topology.local_cpu(2)
    rng = random.Random(4)
    for k in range(6):
        tables = [TableSpec(name=f"t{k}_{i}", rows=rng.randint(1000, 100_000),
                            dim=rng.choice((8, 16, 32, 64)), pooling_factor=rng.randint(1, 30))
                  for i in range(rng.randint(3, 8))]  # fmt: skip
        p = Planner(topo, 1024, allow_host=False)
        res = p.plan(tables)
        cands = baseline_candidates(p, tables)
        assert cands and [n for n, _ in cands][0] == "random"
        for name, plan in cands:
            assert plan.tables == greedy_baseline(name, tables, p.cm).tables
            worse = p.cm.evaluate(plan, tables).max_time_s
            assert res.cost.max_time_s <= worse * (1 + 1e-9), (k, name)
        again = plan_tables(tables, topo, 1024, allow_host=False)
        assert again.plan.tables == res.plan.tables  # deterministic


def test_baselines_skip_constrained_tables() -> None:
    topo = Topology.local_cpu(2)
    tables = _bench_tables()[:3]
    p = Planner(topo, 1024, allow_host=False)
    assert baseline_candidates(p, tables)
    pinned = [tables[0].__class__(**{**tables[0].__dict__, "ranks": (1,)}), *tables[1:]]
    assert baseline_candidates(p, pinned) == []
    rw_only = [
        tables[0].__class__(**{**tables[0].__dict__, "allowed_types": (ShardingType.ROW_WISE,)}),
        *tables[1:],
    ]
    assert baseline_candidates(p, rw_only) == []


def test_bad_typed_params_are_named(typed_fit: tuple[Topology, Any]) -> None:
    import copy
    import json

    from neorec.sharding.learned_cost import LearnedCostModel, LearnedModelError
    from neorec.sharding.learned_features import _TYPED_COLS

    _, model = typed_fit
    good = json.loads(json.dumps(model.to_dict()))
    for bad in (
        {"kind": "typed", "coef": [1.0, 2.0]},
        {"kind": "typed_stumps", "coef": [1.0], "base": 0.0, "stumps": []},
        {"kind": "typed", "coef": [float("nan")] * _TYPED_COLS},
    ):
        d = copy.deepcopy(good)
        d["targets"]["fwd"] = bad
        with pytest.raises(LearnedModelError, match="targets.fwd"):
            LearnedCostModel.from_dict(d, "t.json")
    old = {**good, "format": "neorec.learned_cost/1"}  # a model of the earlier features
    with pytest.raises(LearnedModelError, match="refit"):
        LearnedCostModel.from_dict(old, "t.json")
