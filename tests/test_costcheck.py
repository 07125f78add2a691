"""``neorec bench costcheck`` end to end on a tiny table set (2 gloo ranks, a fixed topology)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neorec.bench.costcheck import main
from neorec.measure.calibrate import measure_row_split, measure_tbe, measure_unfused
from neorec.sharding.topology import Topology


def test_costcheck_small(tmp_path: Path) -> None:
    topo = tmp_path / "topo.json"
    Topology.local_cpu(2).save(topo)
    out = tmp_path / "out.json"
    small = ["--tables", "3", "--rows", "500", "--dim", "8", "--batch", "32", "--pooling", "2"]
    args = ["--topology", str(topo), "--plans", "table_wise,mixed,planner", "--json-out", str(out)]
    rand = ["--random-plans", "1", "--random-seed", "46"]  # a small mix: 2 tables, 35k weights
    steps = ["--iters", "2", "--passes", "2", "--warmup", "1", "--repeats", "2"]
    rc = main([*args, *small, *rand, *steps])
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


def test_costcheck_anchors_a_learned_model_to_the_references(tmp_path: Path) -> None:
    """A learned model fitted with speed references: costcheck measures them in the round and
    multiplies the model's prediction by the speed they show (reported next to the unanchored
    prediction); a bad --passes is one line."""
    from neorec.sharding.learned_fit import fit, predict_job, sample_from_job
    from neorec.sharding.learned_placements import REFERENCE_KINDS, random_jobs

    topo = Topology.local_cpu(2)
    samples = []
    for job in random_jobs(12, 2, 2, 7):
        m = predict_job(topo, job, None)
        row = {"ms_per_step": m["step"], "fwd_ms": m["fwd"], "bwd_ms": m["bwd"]}
        s = sample_from_job(job, {**row, "comm_wait_ms": m["comm"]})
        # this synthetic calibration's references ran at 1 ms/step: any real machine is slower
        samples.append({**s, "speed": 1.0, "reference_ms": dict.fromkeys(REFERENCE_KINDS, 1.0)})
    model = fit(topo, samples)
    assert model.reference["ms"] == dict.fromkeys(REFERENCE_KINDS, 1.0)
    topo.learned_cost = model.to_dict()
    path = tmp_path / "topo.json"
    topo.save(path)
    out = tmp_path / "out.json"
    small = ["--tables", "2", "--rows", "300", "--dim", "8", "--batch", "32", "--pooling", "2"]
    args = ["--topology", str(path), "--plans", "table_wise", "--random-plans", "0"]
    steps = ["--iters", "2", "--passes", "2", "--warmup", "1", "--repeats", "1"]
    assert main([*args, *small, *steps, "--json-out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["cost_model"]["kind"] == "learned" and data["anchored"]
    (speed,) = data["speeds"]
    assert speed > 1.0  # the references took more than 1 ms/step here
    (r,) = data["results"]
    assert r["predicted_ms"] == pytest.approx(speed * r["unanchored_ms"], rel=2e-3)
    with pytest.raises(SystemExit, match="--passes"):
        main([*args, *small, "--iters", "2", "--passes", "3"])


def test_measure_tbe_small() -> None:
    m = measure_tbe(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, repeat=2)
    assert m["tbe_gbs"] > 0 and m["tbe_fwd_ms"] > 0 and m["tbe_bwd_ms"] > 0


def test_measure_unfused_and_row_split_small() -> None:
    m = measure_unfused(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, repeat=2)
    assert m["unfused_gbs"] > 0 and m["unfused_bwd_ms"] > 0
    s = measure_row_split(rows=1000, tables=2, batch=32, pooling=2, repeat=2)
    assert s["row_split_gbs"] > 0 and s["row_split_ms"] > 0


def test_measure_dp_update_small() -> None:
    from neorec.measure.calibrate import measure_dp_update

    m = measure_dp_update(1, rows=1000, dim=8, tables=2, batch=32, pooling=2, ranks=3, repeat=2)
    assert m["dp_update_gbs"] > 0 and m["dp_update_ms"] > 0


def test_summarize_range_holds_its_rounded_median() -> None:
    """The rounds' range is rounded as their median is: two rounds of 4.074999999999999 ms (a
    CI run's) have the median 4.07 after rounding, below their unrounded minimum."""
    from neorec.bench.costcheck import summarize

    ms = 4.074999999999999
    row = {"type": "a", "ms_per_step": ms, "fwd_ms": 1.0, "bwd_ms": 1.0, "comm_wait_ms": 0.0}
    m = summarize([row, dict(row)], [("a", None)])["a"]  # type: ignore[list-item]
    assert m["min_ms"] <= m["ms_per_step"] <= m["max_ms"]
    assert m["ms_per_step"] == 4.07


def test_error_summary_reports_anchored_and_unanchored_for_both_models() -> None:
    """Each (model, anchoring, plan set): mean |error| with its interval over the plans, and the
    max; without references to anchor to, anchored is the unanchored error."""
    from neorec.bench.costcheck import error_summary

    def row(meas: float, learned: float, raw: float, ana: float, ana_anch: float) -> dict:
        return {
            "measured_ms": meas,
            "predicted_ms": learned,
            "unanchored_ms": raw,
            "analytical_ms": ana,
            "analytical_anchored_ms": ana_anch,
        }

    fixed = [row(10.0, 11.0, 8.0, 5.0, 6.0), row(20.0, 19.0, 26.0, 30.0, 24.0)]
    rand = [row(4.0, 4.0, 3.0, 2.0, 2.5)]
    e = error_summary(fixed, rand)
    learned_a, learned_u = e["learned"]["anchored"], e["learned"]["unanchored"]
    assert learned_a["fixed"]["mean"] == pytest.approx((0.1 + 0.05) / 2)
    assert learned_a["fixed"]["max"] == pytest.approx(0.1)
    assert learned_a["random"]["mean"] == pytest.approx(0.0)
    assert learned_a["all"]["n"] == 3 and learned_a["all"]["mean"] == pytest.approx(0.05)
    assert learned_u["all"]["mean"] == pytest.approx((0.2 + 0.3 + 0.25) / 3)
    assert learned_u["all"]["max"] == pytest.approx(0.3)
    iv = learned_u["all"]["mean_interval"]
    assert iv["lo"] < iv["value"] < iv["hi"] and iv["n"] == 3
    assert e["analytical"]["unanchored"]["all"]["max"] == pytest.approx(0.5)
    assert e["analytical"]["anchored"]["fixed"]["mean"] == pytest.approx((0.4 + 0.2) / 2)
    plain = error_summary(fixed, [], anchored=False)
    assert plain["learned"]["anchored"] == plain["learned"]["unanchored"]
    assert "random" not in plain["learned"]["anchored"]


def test_costcheck_held_out_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--world-size 4 --random-batch B: the random plans are placed on 4 ranks at batch B, every
    plan is measured (faked here) and the errors are reported both ways; bad values are one line
    before any measurement."""
    from neorec.measure import jobs as measure_jobs

    seen: list[list[dict]] = []

    def fake_run_passes(jobs, nproc, passes, iters, warmup=3, block=0):  # noqa: ANN001, ANN202
        assert nproc == 4
        seen.append(jobs)
        return [
            {"ms_per_step": 5.0 + i, "fwd_ms": 2.0, "bwd_ms": 3.0, "comm_wait_ms": 0.0}
            for i in range(len(jobs))
        ]

    monkeypatch.setattr(measure_jobs, "run_passes", fake_run_passes)
    topo = tmp_path / "topo.json"
    Topology.local_cpu(2).save(topo)
    out = tmp_path / "out.json"
    small = ["--tables", "4", "--rows", "500", "--dim", "8", "--batch", "64", "--pooling", "2"]
    args = ["--topology", str(topo), "--plans", "table_wise", "--json-out", str(out)]
    held = ["--world-size", "4", "--random-batch", "3072", "--random-plans", "3"]
    steps = ["--random-seed", "4242", "--iters", "2", "--passes", "2", "--repeats", "2"]
    assert main([*args, *small, *held, *steps]) == 0
    data = json.loads(out.read_text())
    assert len(seen) == 2  # one block per round
    randoms = seen[0][1:4]
    assert all(j["batch"] == 3072 and j["plan"]["world_size"] == 4 for j in randoms)
    assert data["world_size"] == 4 and data["random_batch"] == 3072 and data["seeds"] == [4242]
    assert [r["batch"] for r in data["random_results"]] == [3072] * 3
    assert set(data["errors"]) == {"learned", "analytical"}
    paired = data["learned_minus_analytical"]
    assert set(paired) == {"anchored", "unanchored"} and paired["anchored"]["random"]["n"] == 3
    for how in ("anchored", "unanchored"):
        assert data["errors"]["learned"][how]["random"]["n"] == 3
    assert "cpu" in data
    # one fixed plan: a mean without an interval (None: the JSON line stays strict JSON)
    assert data["errors"]["learned"]["anchored"]["fixed"]["mean_interval"]["lo"] is None
    assert "Infinity" not in out.read_text()
    # one line, before any measurement
    seen.clear()
    for bad, what in (("3071", "--random-batch"), ("-4", "--random-batch")):
        with pytest.raises(SystemExit, match=what):
            main([*args, *small, "--world-size", "4", "--random-batch", bad, "--random-plans", "1"])
    with pytest.raises(SystemExit, match="--world-size"):
        main([*args, *small, "--world-size", "1"])
    assert not seen


def test_paired_errors_say_which_model_wins_by_hand() -> None:
    """learned |error| - analytical |error| per plan, its mean and t interval over the plans;
    the winner only where the interval excludes 0."""
    import math

    from neorec.bench.costcheck import paired_errors
    from neorec.bench.costcheck_errors import winner

    def row(meas: float, learned: float, ana: float, raw: float = 0.0) -> dict:
        raw = raw or learned
        return {
            "measured_ms": meas,
            "predicted_ms": learned,
            "unanchored_ms": raw,
            "analytical_ms": ana,
            "analytical_anchored_ms": ana,
        }

    # every plan: learned 10% off, analytical 30% off -> -0.2 on each, a zero-width interval
    better = [row(10.0, 11.0, 13.0), row(20.0, 18.0, 14.0)]
    p = paired_errors(better, [row(4.0, 4.4, 5.2)])
    assert p["anchored"]["all"]["value"] == pytest.approx(-0.2)
    assert p["anchored"]["all"]["lo"] == pytest.approx(-0.2) == p["anchored"]["all"]["hi"]
    assert {p["anchored"][s]["winner"] for s in ("all", "fixed")} == {"learned"}
    assert p["anchored"]["random"] == {"value": -0.2, "lo": None, "hi": None, "n": 1,
                                       "winner": "neither"}  # fmt: skip
    # the unanchored learned prediction 50% off: -> +0.2 on each plan, the analytical model wins
    worse = [row(10.0, 11.0, 13.0, raw=15.0), row(20.0, 18.0, 14.0, raw=30.0)]
    assert paired_errors(worse, [])["unanchored"]["all"]["winner"] == "analytical"
    # differences -0.3, -0.15, -0.375: mean -0.275, sd sqrt(0.013125), t(2) = 4.3027
    mixed = [row(10.0, 11.0, 6.0), row(20.0, 19.0, 24.0), row(4.0, 4.0, 2.5)]
    d = paired_errors(mixed, [])["anchored"]["all"]
    half = 4.302653 * math.sqrt(0.013125 / 3)
    assert d["value"] == pytest.approx(-0.275)
    assert (d["lo"], d["hi"]) == (pytest.approx(-0.275 - half, abs=1e-4),
                                  pytest.approx(-0.275 + half, abs=1e-4))  # fmt: skip
    assert d["winner"] == "neither"  # the interval [-0.56, +0.01] holds 0
    # no references to anchor to: anchored is unanchored
    plain = paired_errors(worse, [], anchored=False)
    assert plain["anchored"] == plain["unanchored"]
    assert [winner(-2, -1), winner(1, 2), winner(-1, 1), winner(None, None)] == [
        "learned", "analytical", "neither", "neither"
    ]  # fmt: skip
