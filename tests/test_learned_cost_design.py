"""The learned cost model's designed calibration set (issue 23): whole-plan kinds, the greedy
baselines' and planner's plans next to random mixes, repeated measurements as medians; the
``typed`` regressor (analytical time per sharding type re-weighted); the planner's candidates
include the greedy baselines' plans, so by the model that scores plans it never loses to them."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from neorec.bench.planner import make_pool
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.learned_features import FEATURES, plan_features
from neorec.sharding.learned_fit import fit, predict_job, sample_from_job, samples_from_rows
from neorec.sharding.learned_placements import (
    POOL_MAX_DIM,
    POOL_MAX_ROWS,
    REFERENCE_KINDS,
    designed_jobs,
    speed_of,
)
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.plan_json import parse_plan_dict
from neorec.sharding.planner import Planner, plan_tables
from neorec.sharding.planner_baselines import BASELINES, baseline_candidates, greedy_baseline
from neorec.sharding.tables import pool_table
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingType


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
    block = [j["placement"] for j in jobs if j["block"] == jobs[0]["block"]]
    n = len(block) // 3
    assert block == block[:n] * 3  # the block's placements, 3 rounds in a row
    # a placement id names one plan of one mix
    by: dict[str, Any] = {}
    for j in jobs:
        assert by.setdefault(j["placement"], (j["mix"], j["plan"])) == (j["mix"], j["plan"])
    # deterministic; another seed is other mixes (held out)
    assert designed_jobs(topo, 2, 2, 120, seed=0, repeats=3) == jobs
    other = designed_jobs(topo, 2, 2, 60, seed=1, repeats=1)
    mixes = {j["mix"] for j in jobs if j["design"] != "reference"}  # the references: one mix
    assert not {j["mix"] for j in other if j["design"] != "reference"} & mixes
    # every plan is valid for its tables
    for j in jobs[:: max(1, len(jobs) // 30)]:
        validate_plan(parse_plan_dict(j["plan"]))
    with pytest.raises(ValueError, match="repeats"):
        designed_jobs(topo, 2, 2, 10, repeats=0)


def test_pool_blocks_are_the_planner_bench_tasks() -> None:
    """``pool`` blocks place ``bench planner --measure``'s kind of task (6-12 pool tables within
    its row / column limits, Zipf 1.05, batch 4096, row-wise Adagrad) by the greedy keys, the
    planner and two random table-wise partitions: contrasts between plans of one task."""
    jobs = designed_jobs(Topology.local_cpu(2), 2, 1, 400, seed=0, repeats=1)
    pool_mixes = {j["mix"] for j in jobs if j["design"] == "partition"}
    assert len(pool_mixes) >= 2
    for mix in pool_mixes:
        mine = [j for j in jobs if j["mix"] == mix]
        assert {j["batch"] for j in mine} == {4096}
        assert {j["optimizer"] for j in mine} == {"rowwise_adagrad"}
        tables = mine[0]["tables"]
        assert 6 <= len(tables) <= 12
        assert all(t["rows"] <= POOL_MAX_ROWS and t["dim"] <= POOL_MAX_DIM for t in tables)
        assert {t["zipf_alpha"] for t in tables} == {1.05}
        designs = Counter(j["design"] for j in mine)
        assert designs["planner"] == 1 and any(k in designs for k in BASELINES)
        for j in mine:
            if j["design"] == "partition":
                plan = parse_plan_dict(j["plan"])
                assert {t.sharding_type for t in plan.tables} == {ShardingType.TABLE_WISE}


def test_pool_table_draws_the_bench_pool() -> None:
    """``bench planner``'s pool is ``pool_table``'s draws in order (the seeded pools unchanged)."""
    rng = random.Random(7)
    want = [pool_table(rng, f"pool{i}") for i in range(50)]
    assert make_pool(50, seed=7) == want
    assert {t.dim for t in make_pool(400, seed=0)} <= {4, 8, 16, 32, 64, 128, 256}
    assert make_pool(400, seed=0)[:3] != make_pool(400, seed=1)[:3]


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
    plan = parse_plan_dict(job["plan"])
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
        if j["design"] == "reference":  # speed references: not samples (samples_from_rows)
            continue
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
    assert v["kept"] in ("typed", "typed_0.3", "typed_stumps", "typed_trees"), v
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


def test_speed_references_anchor_the_fit_and_the_prediction() -> None:
    """Every block measures the references; a block measured while the machine ran 1.3x slower
    has its samples divided by that speed, so the model predicts at the calibration's median speed
    and, given a check's measured speed, at that one (``predict_job(..., speed)``)."""
    topo = Topology.local_cpu(2)
    jobs = designed_jobs(topo, 2, 2, 150, seed=4, repeats=2)
    refs = [j for j in jobs if j["design"] == "reference"]
    blocks = sorted({j["block"] for j in jobs})
    assert len(blocks) >= 3
    # each block lists every reference kind, as one placement of its own, in each pass
    for b in blocks:
        kinds = Counter(j["reference"] for j in refs if j["block"] == b)
        assert kinds == {k: 2 for k in REFERENCE_KINDS}, (b, kinds)
    assert {j["plan"]["tables"][0]["type"] for j in refs} == set(REFERENCE_KINDS)
    slow = {b: (1.3 if i % 2 else 1.0) for i, b in enumerate(blocks)}  # every other block slower
    truth: dict[int, float] = {}
    rows = []
    for i, j in enumerate(jobs):
        if j["design"] == "reference":
            v = {"table_wise": 4.0, "row_wise": 5.0, "data_parallel": 9.0}[j["reference"]]
        else:
            v = truth.setdefault(i, 1.2 * predict_job(topo, j, None)["step"])
        v *= slow[j["block"]]
        rows.append({"job": i, "ms_per_step": v, "fwd_ms": v / 2, "bwd_ms": v / 2,
                     "comm_wait_ms": v / 4})  # fmt: skip
    samples = samples_from_rows(jobs, rows)
    assert samples and all(s["design"] != "reference" for s in samples)
    speeds = {round(s["speed"], 6) for s in samples}
    # the median block speed is the reference: blocks are 1.0 or 1.3 of it, or 1/1.3 of it
    assert len(speeds) == 2 and max(speeds) / min(speeds) == pytest.approx(1.3)
    model = fit(topo, samples)
    assert set(model.reference["ms"]) == set(REFERENCE_KINDS)
    # fitted at the reference speed: the slow blocks' samples no longer look 1.3x slower
    s_ref = 1.0 if slow[blocks[0]] == 1.0 else 1.3  # which speed the median picked
    for s in samples[:20]:
        m = s["measured"]["step"] / s["speed"]
        assert predict_job(topo, s, model)["step"] == pytest.approx(m, rel=0.1)
        # and at a check's own speed: the prediction scales with it
        p2 = predict_job(topo, s, model, speed=1.5)["step"]
        assert p2 == pytest.approx(1.5 * predict_job(topo, s, model)["step"], rel=1e-9)
    assert s_ref in (1.0, 1.3)
    # speed_of: the geometric mean of the kinds both sides measured; 1.0 when none is shared
    ref = model.reference["ms"]
    now = {k: 2 * v for k, v in ref.items()}
    assert speed_of(now, ref) == pytest.approx(2.0)
    assert speed_of({"table_wise": 2 * ref["table_wise"]}, ref) == pytest.approx(2.0)
    assert speed_of({}, ref) == 1.0
    # the references come first in every block: a block the budget cuts short has its speed
    for b in blocks:
        first = next(j for j in jobs if j["block"] == b)
        assert first["design"] == "reference"
    # a block whose references were not measured: its samples are left out of the fit, counted
    cut = [r for r in rows if not (jobs[r["job"]]["block"] == blocks[0]
                                   and jobs[r["job"]]["design"] == "reference")]  # fmt: skip
    partial = samples_from_rows(jobs, cut)
    lost = sum(1 for s in partial if "speed" not in s)
    assert lost > 0 and all(s["block"] == blocks[0] for s in partial if "speed" not in s)
    refit = fit(topo, partial)
    assert refit.samples == len(partial) - lost
    assert refit.extra["dropped_without_speed"] == lost and refit.reference


def test_calibration_spawns_fresh_ranks_every_few_blocks() -> None:
    """Whole blocks per pair of rank processes (one pair for all of a 7-minute calibration
    slowed down as it went); every job in exactly one part, in order."""
    from neorec.measure.calibrate_learned import SPAWN_BLOCKS, _spawn_parts

    jobs = designed_jobs(Topology.local_cpu(2), 2, 2, 200, seed=5, repeats=3)
    parts = _spawn_parts(jobs, SPAWN_BLOCKS)
    assert len(parts) >= 2
    assert parts[0][0] == 0 and parts[-1][1] == len(jobs)
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no job twice
    for lo, hi in parts:
        blocks = [j["block"] for j in jobs[lo:hi]]
        assert len(set(blocks)) <= SPAWN_BLOCKS
        # no block is split between two parts (its passes share one built model)
        assert lo == 0 or jobs[lo - 1]["block"] != jobs[lo]["block"]
    assert _spawn_parts([], 4) == []
