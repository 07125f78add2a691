"""``neorec bench planner --measure``'s bookkeeping, with the measurement faked: each distinct
plan is measured once per round, a planner plan identical to the best baseline's is a tie (not
a win), the random baseline is the one among the planner's candidates (seed 0)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

import neorec.measure.jobs as measure_jobs
from neorec.bench.planner_measure import PASSES, MeasureOptions, measure_tasks


@pytest.mark.parametrize("kind", ["pool", "mix"])
def test_measure_counts_ties_and_measures_each_plan_once(
    kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[list[dict[str, Any]]] = []

    times: dict[str, float] = {}

    def fake_run_jobs(jobs: list[dict], nproc: int, deadline: float, *a: Any, **k: Any) -> list:
        calls.append(jobs)
        # a plan's time is fixed at its first sight; the first round is in job order, where
        # each task's first job is the planner's plan: the fastest of its task
        seen_tasks: set[int] = set()
        for i, j in enumerate(jobs):
            key = json.dumps(j["plan"]["tables"], sort_keys=True)
            if key not in times:
                times[key] = 11.0 + i if j["task"] in seen_tasks else 10.0
            seen_tasks.add(j["task"])
        out = []
        for i, j in enumerate(jobs):
            ms = times[json.dumps(j["plan"]["tables"], sort_keys=True)]
            out.append({"job": i, "ms_per_step": ms, "fwd_ms": ms / 2, "bwd_ms": ms / 2,
                        "comm_wait_ms": 0.0})  # fmt: skip
        return out

    monkeypatch.setattr(measure_jobs, "run_jobs", fake_run_jobs)
    batch = 2048 if kind == "pool" else None  # a mix draws its own batch
    opts = MeasureOptions(repeats=2, cost_model="analytical", kind=kind, pool_batch=batch)
    assert measure_tasks(3, seed=0, options=opts) == 0
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    assert data["bench"] == "planner_measure" and len(data["tasks"]) == 3
    assert data["kind"] == kind
    # pool tasks plan within bench planner's per-rank memory limit; mixes have none
    assert all((t["table_mem_mb"] is not None) == (kind == "pool") for t in data["tasks"])
    if kind == "pool":  # --measure-batch sets the pool tasks' batch
        assert {t["batch"] for t in data["tasks"]} == {2048}
    assert len(calls) == 2  # one run per round
    for jobs in calls:  # every distinct plan built once per round, measured in PASSES passes
        keys = [json.dumps(j["plan"]["tables"], sort_keys=True) for j in jobs]
        assert len(keys) == len(set(keys)) * PASSES
        n = len(keys) // PASSES
        assert jobs == jobs[:n] * PASSES  # the passes go round the same block in turn
        assert len({j["placement"] for j in jobs[:n]}) == n
        assert all(j["block"] == jobs[0]["block"] for j in jobs)
    for t in data["tasks"]:
        assert t["best_baseline_ms"] == min(t["baselines_ms"].values())
        assert t["planner_ms"] == 10.0
        # the planner's plan is the fastest: a tie when a baseline made the same plan, else a win
        assert t["tie"] == bool(t["planner_same_as"])
        assert t["gain"] == (0.0 if t["tie"] else pytest.approx(1 - 10.0 / t["best_baseline_ms"]))
        for same in t["planner_same_as"]:
            assert t["baselines_ms"][same] == t["planner_ms"]
        assert set(t["predicted_ms"]) == {"planner", *t["baselines_ms"]}
    wins = sum(t["gain"] > 0 and not t["tie"] for t in data["tasks"])
    ties = sum(t["tie"] for t in data["tasks"])
    assert f"on {wins}/3 tasks, the same plan on {ties}" in out
    assert (data["wins"], data["ties"]) == (wins, ties)
    # held out: a plan's time is the same every round here, so the pick and the gain agree
    for t in data["tasks"]:
        h = t["held_out"]
        assert h["baseline_ms"] == t["best_baseline_ms"] and h["tie"] == t["tie"]
        assert h["gain"] == pytest.approx(1 - 10.0 / h["baseline_ms"]) and h["planner_ms"] == 10.0
    assert (data["held_out_wins"], data["held_out_ties"]) == (wins, ties)
    # paired by round: every round the same times here, so each ratio is the held-out one
    for t in data["tasks"]:
        h = t["held_out"]
        assert h["paired_ratio"] == pytest.approx(h["planner_ms"] / h["baseline_ms"])
        assert (h["rounds_faster"], h["rounds_slower"]) == ((0, 0) if h["tie"] else (1, 0))
    want = math.exp(sum(math.log(t["held_out"]["paired_ratio"]) for t in data["tasks"]) / 3)
    assert data["held_out_paired_geomean"] == pytest.approx(want)
    assert "held out, paired by round" in out


def test_measure_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="--measure-kind must be one of pool, mix"):
        measure_tasks(1, options=MeasureOptions(kind="tasks"))


@pytest.mark.parametrize("batch", ["0", "1023", "-4", "big"])
def test_measure_batch_is_checked(batch: str, capsys: pytest.CaptureFixture[str]) -> None:
    from neorec.bench.planner import main

    with pytest.raises(SystemExit) as e:  # before any task is made or measured
        main(["--measure", "--measure-batch", batch])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--measure-batch" in err and "positive even" in err
    with pytest.raises(ValueError, match="--measure-batch must be a positive even number"):
        measure_tasks(1, options=MeasureOptions(pool_batch=int(batch) if batch != "big" else 3))


@pytest.mark.parametrize("args", [["--measure", "--measure-kind", "mix"], []])
def test_measure_batch_only_for_pool_tasks(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from neorec.bench.planner import main

    with pytest.raises(SystemExit) as e:  # a mix draws its own batch: not silently ignored
        main([*args, "--measure-batch", "4096"])
    assert e.value.code == 2
    assert (
        "--measure-batch applies to --measure with --measure-kind pool" in capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="--measure-batch applies to --measure-kind pool"):
        measure_tasks(1, options=MeasureOptions(kind="mix", pool_batch=4096))


def test_plan_key_is_one_plan_up_to_rank_labels() -> None:
    from neorec.sharding.planner_baselines import plan_key
    from neorec.sharding.tables import TableSpec
    from neorec.sharding.types import ShardingPlan, column_wise, row_wise, table_wise

    ts = [TableSpec(name=f"k{i}", rows=100 * (i + 1), dim=8) for i in range(3)]

    def tw(ranks: list[int], world: int = 2, rph: int = 2) -> dict:
        return ShardingPlan(world, rph, [table_wise(t, r) for t, r in zip(ts, ranks)]).to_dict()

    assert plan_key(tw([0, 1, 1])) == plan_key(tw([1, 0, 0]))  # mirror images: one plan
    assert plan_key(tw([0, 1, 1])) != plan_key(tw([0, 0, 1]))  # another split of the tables
    assert plan_key(tw([0, 1, 1], 2, 1)) != plan_key(tw([1, 0, 0], 2, 1))  # two hosts: kept
    cw = [column_wise(ts[0], [0, 1]), row_wise(ts[1], [0, 1])]
    cw_mirror = [column_wise(ts[0], [1, 0]), row_wise(ts[1], [0, 1])]
    a, b = (ShardingPlan(2, 2, p).to_dict() for p in (cw, cw_mirror))
    assert plan_key(a) != plan_key(b)  # the row-wise table's halves sit differently


def test_top_table_wise_scores_every_plan_within_memory() -> None:
    """The analytical top plans are the best of a brute force over every table-wise plan that
    fits; a plan over the memory limit is never among them; too many tables are refused."""
    import dataclasses
    import itertools

    from neorec.bench.planner_measure import CEILING_MAX_TABLES, top_table_wise
    from neorec.sharding.cost_model import CostModel
    from neorec.sharding.planner_baselines import _tw_bytes
    from neorec.sharding.tables import TableSpec
    from neorec.sharding.topology import Topology
    from neorec.sharding.types import ShardingPlan, table_wise

    tables = [
        TableSpec(name=f"t{i}", rows=1000 * (i + 1), dim=(8, 16, 32, 64)[i % 4],
                  pooling_factor=1.0 + 3 * i)
        for i in range(6)
    ]  # fmt: skip
    topo = Topology.local_cpu(2)
    mem = [_tw_bytes(CostModel(topo, 512, "rowwise_adagrad"), t) for t in tables]
    # the largest table alone fills most of a rank: few others can join it
    cap_gb = 0.6 * sum(mem) / 1e9
    topo = dataclasses.replace(topo, device_memory_gb=cap_gb + topo.device_reserve_gb)
    cm = CostModel(topo, 512, "rowwise_adagrad")
    cap = topo.device_capacity_bytes
    top = top_table_wise(tables, cm, None, 3)
    assert sorted(top) == ["analytical_top0", "analytical_top1", "analytical_top2"]
    every = []
    for a in itertools.product((0, 1), repeat=len(tables)):
        load = [sum(m for m, r in zip(mem, a) if r == q) for q in (0, 1)]
        plan = ShardingPlan(2, 2, [table_wise(t, r) for t, r in zip(tables, a)])
        every.append((cm.evaluate(plan, tables).max_time_s, max(load) <= cap))
    assert any(not fits for _, fits in every)  # the limit binds
    best_fit = min(s for s, fits in every if fits)
    got = [cm.evaluate(top[f"analytical_top{i}"], tables).max_time_s for i in range(3)]
    assert got[0] == pytest.approx(best_fit) and got == sorted(got)
    for p in top.values():
        ranks = {tp.name: tp.shards[0].rank for tp in p.tables}
        assert max(sum(m for m, t in zip(mem, tables) if ranks[t.name] == q) for q in (0, 1)) <= cap
    many = [dataclasses.replace(tables[0], name=f"m{i}") for i in range(CEILING_MAX_TABLES + 1)]
    with pytest.raises(ValueError, match=f"at most {CEILING_MAX_TABLES} tables"):
        top_table_wise(many, cm, None, 1)


def test_measure_ceiling_picks_the_fastest_plan_of_all(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With ``ceiling``, each task's top table-wise plans are measured too (never counted as
    baselines); the fastest plan of all is reported against the best baseline."""
    times: dict[str, float] = {}
    last: dict[int, str] = {}

    def fake_run_jobs(jobs: list[dict], nproc: int, deadline: float, *a: Any, **k: Any) -> list:
        for j in jobs:  # each task's last distinct plan (a top plan when one is new): fastest
            last[j["task"]] = json.dumps(j["plan"]["tables"], sort_keys=True)
        for i, j in enumerate(jobs):
            key = json.dumps(j["plan"]["tables"], sort_keys=True)
            times.setdefault(key, 5.0 if key == last[j["task"]] else 10.0 + i)
        return [
            {"job": i, "ms_per_step": times[json.dumps(j["plan"]["tables"], sort_keys=True)],
             "fwd_ms": 1.0, "bwd_ms": 1.0, "comm_wait_ms": 0.0}
            for i, j in enumerate(jobs)
        ]  # fmt: skip

    monkeypatch.setattr(measure_jobs, "run_jobs", fake_run_jobs)
    opts = MeasureOptions(repeats=2, cost_model="analytical", ceiling=2)
    assert measure_tasks(3, seed=0, options=opts) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["ceiling_k"] == 2
    from neorec.sharding.planner_baselines import BASELINES

    ratios = []
    for t in data["tasks"]:
        assert set(t["baselines_ms"]) <= set(BASELINES)  # top plans are not baselines
        c = t["ceiling"]
        assert t["plans_ms"][c["fastest"]] == 5.0  # every label's median, the top plans' too
        assert any(k.startswith("analytical_top") for k in t["plans_ms"])
        assert c["fastest_ms"] == 5.0 and c["fastest"] in c["same_as"]
        assert c["baseline_ms"] == t["held_out"]["baseline_ms"]
        assert c["ratio"] == pytest.approx(5.0 / c["baseline_ms"])
        assert c["is_baseline"] == any(k in BASELINES for k in c["same_as"])
        ratios.append(c["ratio"])
    assert any(not t["ceiling"]["is_baseline"] for t in data["tasks"])
    assert data["ceiling_over_best_geomean"] == pytest.approx(
        math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    )


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--measure-ceiling", "2"], "--measure-ceiling applies to --measure"),
        (["--measure", "--measure-ceiling", "2", "--repeats", "1"], "needs --repeats >= 2"),
        (["--measure", "--measure-ceiling", "-1"], "must be a whole number >= 0"),
    ],
)
def test_measure_ceiling_is_checked(
    args: list[str], msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from neorec.bench.planner import main

    with pytest.raises(SystemExit) as e:  # before any task is made or measured
        main(args)
    assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs --repeats >= 2"):
        measure_tasks(1, options=MeasureOptions(repeats=1, ceiling=1))


def test_planner_tune_measures_the_pick_again_next_to_the_model_pick(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--planner-tune K``: the planner's plan is the fastest of its shortlist (measured in
    rounds of its own, before the bench's), then measured again in the bench's rounds next to the
    baselines and the cost model's own pick (``planner_model``)."""
    import zlib

    from neorec.sharding.planner_baselines import plan_key

    def ms_of(plan: dict) -> float:  # every plan its own time, the same in every round
        return 5.0 + zlib.crc32(plan_key(plan).encode()) % 1000 / 100

    blocks: list[int] = []

    def fake_run_jobs(jobs: list[dict], nproc: int, deadline: float, *a: Any, **k: Any) -> list:
        blocks.append(len(jobs))
        return [
            {"job": i, "ms_per_step": ms_of(j["plan"]), "fwd_ms": 1.0, "bwd_ms": 1.0,
             "comm_wait_ms": 0.0}
            for i, j in enumerate(jobs)
        ]  # fmt: skip

    monkeypatch.setattr(measure_jobs, "run_jobs", fake_run_jobs)
    opts = MeasureOptions(repeats=2, cost_model="analytical", tune=4, tune_rounds=2)
    assert measure_tasks(2, seed=0, options=opts) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["planner_tune"] == 4 and data["model_pick_over_best_geomean"] > 0
    assert len(blocks) == 2 * 2 + 2  # each task's 2 tuning rounds, then the bench's 2 rounds
    for t in data["tasks"]:
        tu = t["tuning"]
        assert len(tu["measured"]) == 4 and tu["measured"][0]["label"] == "planner"
        best = min(tu["measured"], key=lambda m: m["ms_per_step"])
        assert tu["picked"] == best["label"]
        # measured again by the bench: the same plan, so the same (fake) time
        assert t["plans_ms"]["planner"] == pytest.approx(best["ms_per_step"])
        assert "planner_model" in t["plans_ms"]
        assert t["plans_ms"]["planner"] <= t["plans_ms"]["planner_model"]


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--planner-tune", "3"], "--planner-tune applies to --measure"),
        (["--measure", "--planner-tune", "1"], "--planner-tune needs K >= 2"),
        (["--measure", "--planner-tune", "3", "--planner-tune-rounds", "0"], "rounds >= 1"),
        (["--measure-copies", "2"], "--measure-copies needs --measure"),
    ],
)
def test_planner_tune_is_checked(
    args: list[str], msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from neorec.bench.planner import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(ValueError, match="--planner-tune must be 0 or >= 2"):
        measure_tasks(1, options=MeasureOptions(tune=1))


def test_measure_copies_report_the_noise_floor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``copies``: every plan built that many times per round; the spread of one plan's copies
    is each task's noise floor (here the second copy is always 10% slower)."""
    blocks: list[list[dict]] = []

    def fake_run_jobs(jobs: list[dict], nproc: int, deadline: float, *a: Any, **k: Any) -> list:
        blocks.append(jobs)
        return [
            {"job": i, "ms_per_step": 10.0 * (1.1 if j["seed"] % 2 else 1.0), "fwd_ms": 1.0,
             "bwd_ms": 1.0, "comm_wait_ms": 0.0}
            for i, j in enumerate(jobs)
        ]  # fmt: skip

    monkeypatch.setattr(measure_jobs, "run_jobs", fake_run_jobs)
    opts = MeasureOptions(repeats=2, cost_model="analytical", copies=2)
    assert measure_tasks(2, seed=0, options=opts) == 0
    out = capsys.readouterr().out
    data = json.loads(out.strip().splitlines()[-1])
    assert data["copies"] == 2
    for jobs in blocks:  # each distinct plan twice per round, each copy its own placement
        keys = [json.dumps(j["plan"]["tables"], sort_keys=True) for j in jobs[: len(jobs) // 5]]
        assert all(keys.count(k) == 2 for k in keys)
        assert len({j["placement"] for j in jobs}) == len(jobs) // PASSES
    for t in data["tasks"]:
        assert t["copy_spread"] == pytest.approx(1.0 / 10.5)
    assert "copies of one plan differ by 9.5%" in out
    with pytest.raises(ValueError, match="--measure-copies must be >= 1"):
        measure_tasks(1, options=MeasureOptions(copies=0))


def _seed_result(seed: int, pairs: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """A ``measure_result`` with one task per (planner ms, baseline ms) per held-out round."""
    tasks = [
        {"held_out": {"planner_rounds_ms": p, "baseline_rounds_ms": b}, "batch": 4096}
        for p, b in pairs
    ]
    return {"seed": seed, "tasks": tasks, "held_out_wins": 0, "held_out_ties": 0}


def test_summarize_seeds_paired_ratio_per_seed_and_pooled() -> None:
    """Per seed and pooled: the geometric mean of planner / baseline over the held-out
    task-rounds with its t interval (bench.stats.paired_ratio), and over the tasks."""
    from neorec.bench.planner_seeds import summarize_seeds
    from neorec.bench.stats import t975

    a = _seed_result(7, [([9.0, 9.5], [10.0, 10.0]), ([10.0, 10.4], [10.0, 10.0])])
    b = _seed_result(8, [([8.0, 8.0], [10.0, 10.0])])
    s = summarize_seeds([a, b])
    logs = [math.log(x) for x in (0.9, 0.95, 1.0, 1.04)]
    one = s["per_seed"][0]["paired_ratio"]
    m = sum(logs) / 4
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 3)
    assert one["value"] == pytest.approx(math.exp(m))
    assert one["hi"] == pytest.approx(math.exp(m + t975(3) * sd / 2))
    assert one["n"] == 4 and one["lo"] < 1 < one["hi"]
    by_task = s["per_seed"][0]["paired_ratio_by_task"]
    assert by_task["n"] == 2
    assert by_task["value"] == pytest.approx(math.exp(sum(logs) / 4))
    assert s["paired_ratio"]["n"] == 6 and s["paired_ratio_by_task"]["n"] == 3
    pooled = [*logs, math.log(0.8), math.log(0.8)]
    assert s["paired_ratio"]["value"] == pytest.approx(math.exp(sum(pooled) / 6))
    assert s["excludes_1"] == (not s["paired_ratio"]["lo"] <= 1 <= s["paired_ratio"]["hi"])
    # seed 8 alone: every round 0.8, no spread: an interval of one point, excluding 1
    only = s["per_seed"][1]["paired_ratio"]
    assert only["value"] == pytest.approx(0.8) and only["hi"] == pytest.approx(0.8)


def test_seed_base_measures_each_seed_and_reports_intervals(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench planner --measure --seed-base S --seeds N: N seeds' tasks, one JSON line with the
    seeds, the per-seed and pooled intervals and the CPU; bad flags are argparse errors."""
    from neorec.bench.planner import main

    def fake_run_jobs(jobs: list[dict], nproc: int, deadline: float, *a: Any, **k: Any) -> list:
        return [
            {
                "job": i,
                "ms_per_step": 10.0 + (i % 7) * 0.1,
                "fwd_ms": 5.0,
                "bwd_ms": 5.0,
                "comm_wait_ms": 0.0,
            }  # fmt: skip
            for i in range(len(jobs))
        ]

    monkeypatch.setattr(measure_jobs, "run_jobs", fake_run_jobs)
    argv = ["--measure", "--measure-tasks", "2", "--repeats", "2", "--cost-model", "analytical"]
    assert main([*argv, "--seed-base", "40", "--seeds", "2"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["bench"] == "planner_measure_seeds" and data["seeds"] == [40, 41]
    assert [r["seed"] for r in data["results"]] == [40, 41]
    assert [s["seed"] for s in data["per_seed"]] == [40, 41]
    assert set(data["paired_ratio"]) == {"value", "lo", "hi", "n"}
    assert data["paired_ratio"]["n"] == 2 * 2  # 2 seeds x 2 tasks x 1 odd round
    assert data["paired_ratio_by_task"]["n"] == 4
    assert isinstance(data["excludes_1"], bool) and "cpu" in data
    for bad in (["--seeds", "0"], ["--repeats", "1"]):
        with pytest.raises(SystemExit):
            main([*argv, "--seed-base", "40", *bad])
    with pytest.raises(SystemExit):
        main(["--seed-base", "40"])  # without --measure
