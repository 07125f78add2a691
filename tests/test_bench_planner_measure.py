"""``neorec bench planner --measure``'s bookkeeping, with the measurement faked: each distinct
plan is measured once per round, a planner plan identical to the best baseline's is a tie (not
a win), the random baseline is the one among the planner's candidates (seed 0)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import neorec.bench.dist as bench_dist
from neorec.bench.planner import PASSES, measure_tasks


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

    monkeypatch.setattr(bench_dist, "run_jobs", fake_run_jobs)
    batch = 2048 if kind == "pool" else None  # a mix draws its own batch
    assert (
        measure_tasks(3, repeats=2, seed=0, cost_model="analytical", kind=kind, pool_batch=batch)
        == 0
    )
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


def test_measure_kind_is_checked() -> None:
    with pytest.raises(ValueError, match="--measure-kind must be one of pool, mix"):
        measure_tasks(1, kind="tasks")


@pytest.mark.parametrize("batch", ["0", "1023", "-4", "big"])
def test_measure_batch_is_checked(batch: str, capsys: pytest.CaptureFixture[str]) -> None:
    from neorec.bench.planner import main

    with pytest.raises(SystemExit) as e:  # before any task is made or measured
        main(["--measure", "--measure-batch", batch])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--measure-batch" in err and "positive even" in err
    with pytest.raises(ValueError, match="--measure-batch must be a positive even number"):
        measure_tasks(1, pool_batch=int(batch) if batch != "big" else 3)


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
        measure_tasks(1, kind="mix", pool_batch=4096)


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
