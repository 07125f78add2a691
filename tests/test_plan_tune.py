"""``neorec plan --tune K`` (issue 23): the planner's shortlist (its plan, the greedy baselines',
the model's best alternatives; distinct, fitting), the pick of the fastest measured plan (the
measurement faked, and once for real on 2 gloo ranks), and every bad use refused up front."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from test_learned_cost import _samples

import neorec.sharding.planner_shortlist as shortlist_mod
from neorec.cli.plan import main as plan_main
from neorec.measure.plan_tune import tune
from neorec.sharding.cost_model import TableSpec
from neorec.sharding.learned_fit import fit
from neorec.sharding.plan_json import parse_plan_dict
from neorec.sharding.planner import Planner
from neorec.sharding.planner_baselines import baseline_candidates, plan_key
from neorec.sharding.planner_shortlist import (
    TUNE_MAX_RANKS,
    Shortlisted,
    check_tune,
    shortlist,
    with_plan,
)
from neorec.sharding.topology import Topology
from neorec.sharding.types import PlanValidationError


def _tables(n: int = 8, seed: int = 4, alpha: float = 1.05) -> list[TableSpec]:
    rng = random.Random(seed)
    return [
        TableSpec(name=f"t{i}", rows=rng.randint(500, 20_000), dim=rng.choice((8, 16, 32, 64)),
                  pooling_factor=float(rng.randint(1, 12)), zipf_alpha=alpha)
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("learned", [False, True])
def test_shortlist_is_the_plan_then_the_baselines_then_the_models_best(learned: bool) -> None:
    topo = Topology.local_cpu(2)
    if learned:
        topo.learned_cost = fit(topo, _samples(topo, 24, seed=0)).to_dict()
    planner = Planner(topo, 1024, allow_host=False, cost_model="learned" if learned else "auto")
    tables = _tables()
    res = planner.plan(tables)
    assert res.candidates  # the search's starts and the baselines, kept for the shortlist
    sl = shortlist(planner, res, 12)
    assert sl[0].label == "planner" and sl[0].plan.tables == res.plan.tables
    keys = [plan_key(c.plan.to_dict()) for c in sl]
    assert len(keys) == len(set(keys)) and len(sl) <= 12  # distinct up to rank relabelling
    # every greedy baseline's plan is on it (as itself, or as the planner's plan), in order
    base = [n for n, _ in baseline_candidates(planner, tables)]
    named = [c.label for c in sl if c.label in base]
    assert named == [n for n in base if n in named]
    for _, p in baseline_candidates(planner, tables):
        assert plan_key(p.to_dict()) in keys
    alts = sl[1 + len(named) :]
    assert alts and all(c.label.startswith(("search", "move ")) for c in alts)
    assert [c.predicted_ms for c in alts] == sorted(c.predicted_ms for c in alts)
    for c in sl:  # fits, and the prediction is the scoring model's
        cost = planner.cm.evaluate(c.plan, tables)
        assert cost.fits
        want = (
            1000 * planner.scoring.model.step_s(planner.cm, c.plan, tables, cost)
            if learned
            else 1000 * cost.max_time_s
        )
        assert c.predicted_ms == pytest.approx(want)
    again = shortlist(planner, planner.plan(tables), 12)  # deterministic
    assert [(c.label, c.plan.tables) for c in again] == [(c.label, c.plan.tables) for c in sl]
    assert [c.label for c in shortlist(planner, res, 1)] == ["planner"]
    with pytest.raises(ValueError, match="k >= 1"):
        shortlist(planner, res, 0)


def test_with_plan_rescores_the_picked_plan() -> None:
    topo = Topology.local_cpu(2)
    planner = Planner(topo, 1024, allow_host=False)
    tables = _tables()
    res = planner.plan(tables)
    other = shortlist(planner, res, 6)[-1].plan
    out = with_plan(planner, res, other)
    assert out.plan.tables == other.tables
    assert out.cost.max_time_s == pytest.approx(planner.cm.evaluate(other, tables).max_time_s)
    assert out.plan.meta["predicted_step_embedding_s"] == pytest.approx(out.cost.max_time_s)
    assert res.plan.tables != other.tables  # the original result is untouched


def _fake(times: dict[str, list[float]], calls: list[list[str]]):
    """A measurement: plan i's time in round r is ``times[label][r]`` (found by plan key)."""

    def measure(jobs: list[dict], world: int, passes: int, iters: int, rnd: int) -> list:
        assert world == 2 and passes == 5 and iters == 10
        labels = [label_of[plan_key(j["plan"])] for j in jobs]
        calls.append(labels)
        return [{"ms_per_step": times[lb][rnd]} for lb in labels]

    label_of: dict[str, str] = {}
    return measure, label_of


def _tune_with(sl: list[Shortlisted], times: dict[str, list[float]], calls: list[list[str]]):
    measure, label_of = _fake(times, calls)
    label_of.update({plan_key(c.plan.to_dict()): c.label for c in sl})
    n = len(next(iter(times.values())))
    return tune(sl, _tables(), 1024, "rowwise_adagrad", rounds=n, measure=measure)


def test_tune_keeps_the_fastest_median_when_its_lead_is_clear_of_the_noise() -> None:
    topo = Topology.local_cpu(2)
    planner = Planner(topo, 1024, allow_host=False)
    sl = shortlist(planner, planner.plan(_tables()), 4)
    assert len(sl) == 4 and sl[0].label == "planner"
    p, a, b, c = (x.label for x in sl)
    times = {
        p: [10.0, 10.2, 9.9],
        a: [9.0, 9.1, 8.9],  # 1 ms faster in every round: clear
        b: [8.0, 12.0, 12.0],  # the fastest once, not in the median
        c: [11.0, 11.0, 11.0],
    }
    calls: list[list[str]] = []
    rec = _tune_with(sl, times, calls)
    assert rec["picked"] == rec["fastest"] == a and rec["clear"]
    assert rec["lead_ms"] == pytest.approx(10.0 - 9.0)
    se = [1.2533 * statistics.stdev(times[x]) / 3**0.5 for x in (p, a)]
    assert rec["noise_ms"] == pytest.approx(2 * (se[0] ** 2 + se[1] ** 2) ** 0.5)
    got = {m["label"]: m for m in rec["measured"]}
    for lb, ts in times.items():
        assert got[lb]["rounds_ms"] == ts and got[lb]["ms_per_step"] == statistics.median(ts)
    assert got[p]["predicted_ms"] == sl[0].predicted_ms
    assert calls[0] == [x.label for x in sl]  # the first round in shortlist order
    assert all(sorted(x) == sorted(calls[0]) for x in calls) and calls[1] != calls[0]
    assert (rec["world"], rec["batch"], rec["rounds"]) == (2, 1024, 3)
    # a lead within the noise keeps the planner's own plan, and says so
    noisy = {**times, a: [9.0, 30.0, 9.5], b: [12.0] * 3}
    rec = _tune_with(sl, noisy, [])
    assert rec["fastest"] == a and rec["picked"] == p and not rec["clear"]
    assert rec["lead_ms"] == pytest.approx(0.5) and rec["noise_ms"] > 0.5
    # with 2 rounds no noise is estimated: the fastest median is kept
    rec = _tune_with(sl, {p: [10.0, 10.0], a: [9.9, 9.9], b: [11.0] * 2, c: [12.0] * 2}, [])
    assert rec["picked"] == a and rec["noise_ms"] is None and rec["clear"]
    # a tie goes to the earlier plan: the planner's own first
    rec = _tune_with(sl, {x.label: [7.0] for x in sl}, [])
    assert rec["picked"] == rec["fastest"] == p


def test_tune_refuses_what_the_runtime_would_not_run() -> None:
    tables = _tables(3)
    plan = Planner(Topology.local_cpu(2), 64, allow_host=False).plan(tables).plan
    ok = Shortlisted("planner", plan, 1.0)
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        tune([ok], tables, 63, "sgd", measure=lambda *a: [])
    mixed = [*tables[:2], TableSpec(name="z", rows=100, dim=8, zipf_alpha=0.0)]
    with pytest.raises(ValueError, match="one Zipf alpha"):
        tune([ok], mixed, 64, "sgd", measure=lambda *a: [])
    cached = plan.to_dict()
    cached["tables"][0]["storage"] = "dram"
    cached["tables"][0]["cache_fraction"] = 0.1

    bad = Shortlisted("x", parse_plan_dict(cached), 1.0)
    with pytest.raises(PlanValidationError, match="storage 'dram"):
        tune([ok, bad], tables, 64, "sgd", measure=lambda *a: [])


def test_check_tune_names_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = _tables(3)
    check_tune(tables, 2, 2, 1)  # fine
    for args, msg in [
        ((tables, 2, 1, 1), "K >= 2"),
        ((tables, 2, 4, 0), "--tune-rounds must be >= 1"),
        ((tables, 1, 4, 2), "must be 2..8"),
        ((tables, TUNE_MAX_RANKS + 1, 4, 2), "plan for a larger cluster without --tune"),
        (([*tables, TableSpec(name="u", rows=10, dim=4)], 2, 4, 2), "one Zipf alpha"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_tune(*args)
    monkeypatch.setattr("neorec.machine.available_memory_bytes", lambda: 10**6)
    with pytest.raises(ValueError, match="builds 4 plans of these tables at once here"):
        check_tune(tables, 2, 4, 2)
    assert shortlist_mod.TUNE_MEMORY_SHARE == 0.5


def _csv(tmp_path: Path, tables: list[TableSpec]) -> str:
    p = tmp_path / "t.csv"
    p.write_text(
        "name,rows,dim,pooling_factor,zipf_alpha\n"
        + "".join(f"{t.name},{t.rows},{t.dim},{t.pooling_factor},{t.zipf_alpha}\n" for t in tables)
    )
    return str(p)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--tune", "1"], "--tune needs K >= 2"),
        (["--tune", "3", "--tune-rounds", "0"], "--tune-rounds >= 1"),
        (["--tune-rounds", "2"], "--tune-rounds needs --tune K"),
        (["--tune", "2", "--towers", "1"], "drop --towers or --tune"),
        (["--tune", "2", "--world-size", "16"], "the world size must be 2..8"),
    ],
)
def test_plan_tune_flags_are_checked(
    tmp_path: Path, extra: list[str], msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--tables", _csv(tmp_path, _tables(4)), "--world-size", "2", "--batch-size", "64"]
    assert plan_main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neorec: error: ") and msg in err[0]


def test_plan_tune_measures_for_real_and_keeps_the_fastest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 gloo ranks, 3 tiny tables, 2 plans, 1 round: the report, the JSON and the written plan
    carry what was measured, and the plan kept is the fastest of them."""
    tables = [
        TableSpec(name=f"s{i}", rows=200 * (i + 1), dim=8, pooling_factor=2.0, zipf_alpha=1.05)
        for i in range(3)
    ]
    out = tmp_path / "plan.json"
    args = ["--tables", _csv(tmp_path, tables), "--world-size", "2", "--batch-size", "64"]
    args += ["--tune", "2", "--tune-rounds", "1", "--json", "--out", str(out)]
    assert plan_main(args) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tu = rep["tuning"]
    assert len(tu["measured"]) == 2 and tu["measured"][0]["label"] == "planner"
    fastest = min(tu["measured"], key=lambda m: m["ms_per_step"])
    assert tu["picked"] == fastest["label"] and fastest["ms_per_step"] > 0
    assert (tu["world"], tu["rounds"], tu["batch"]) == (2, 1, 64)
    meta: dict[str, Any] = json.loads(out.read_text())["meta"]
    assert meta["tuning"]["picked"] == tu["picked"]
    assert set(meta["tuning"]["measured_ms"]) == {m["label"] for m in tu["measured"]}


def test_plan_tune_report_marks_the_pick(tmp_path: Path) -> None:
    from neorec.sharding.planner import format_report

    topo = Topology.local_cpu(2)
    planner = Planner(topo, 1024, allow_host=False)
    res = planner.plan(_tables())
    res.tuning = {
        "picked": "size_greedy", "world": 2, "batch": 1024, "rounds": 3, "passes": 5, "iters": 10,
        "fastest": "size_greedy", "lead_ms": 0.5, "noise_ms": 0.2, "clear": True,
        "measured": [
            {"label": "planner", "ms_per_step": 5.0, "predicted_ms": 4.0},
            {"label": "size_greedy", "ms_per_step": 4.5, "predicted_ms": 4.2},
        ],
    }  # fmt: skip
    text = format_report(res)
    assert "MEASURED (--tune): 2 plans run on 2 gloo ranks here" in text
    assert "picked: size_greedy (not the cost model's own pick)" in text
    assert "  * size_greedy" in text and "    planner" in text
    assert "size_greedy led the planner's plan by 0.500 ms, clear of the noise (0.200 ms" in text
    assert res.to_dict()["tuning"]["picked"] == "size_greedy"
    res.tuning.update(picked="planner", clear=False, noise_ms=0.9)
    text = format_report(res)
    assert "picked: planner\n" in text and "within the noise (0.900 ms" in text
