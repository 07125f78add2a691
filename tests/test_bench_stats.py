"""The benchmarks' statistics (``neorec.bench.stats``) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from neorec.bench.stats import mean_interval, paired_difference, paired_ratio, rotated, t975


def test_t_quantiles() -> None:
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042 and t975(500) == 1.96
    assert t975(0) == math.inf


def test_mean_interval_by_hand() -> None:
    iv = mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, sd sqrt(2.5), t(4) = 2.776
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert iv.value == 3.0 and iv.n == 5
    assert iv.lo == pytest.approx(3 - half) and iv.hi == pytest.approx(3 + half)
    assert iv.excludes(0.0) and not iv.excludes(3.5)
    assert mean_interval([2.0]).lo == -math.inf  # one observation: no interval
    with pytest.raises(ValueError, match="no observations"):
        mean_interval([])


def test_paired_statistics() -> None:
    d = paired_difference([1.0, 2.0, 4.0], [0.5, 1.5, 3.5])  # every difference 0.5
    assert (d.value, d.lo, d.hi) == (0.5, 0.5, 0.5)
    r = paired_ratio([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])  # every ratio 2
    assert r.value == pytest.approx(2.0) and r.lo == pytest.approx(2.0)
    r = paired_ratio([1.0, 4.0], [2.0, 2.0])  # ratios 0.5 and 2: geometric mean 1
    assert r.value == pytest.approx(1.0) and r.lo < 0.5 and r.hi > 2.0
    with pytest.raises(ValueError, match="different lengths"):
        paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio([0.0], [1.0])


def test_rotation_puts_every_setting_in_every_place() -> None:
    items = ["a", "b", "c"]
    orders = [rotated(items, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(o) == items for o in orders)


def test_bench_dist_grid_interleaves_and_pairs_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench dist``'s transport x heap grid: every setting once per round, in rotated order,
    each row's ratio to the last setting paired by round (a fake runner stands in for the ranks)."""
    import neorec.bench.dist as bench_dist

    calls: list[tuple[str, str]] = []
    speed = {("shm", "on"): 1.0, ("shm", "off"): 1.2, ("gloo", "on"): 1.5, ("gloo", "off"): 2.0}

    def fake_ranks(a: object) -> list[dict[str, object]]:
        t, h = a.transport, a.keep_heap  # type: ignore[attr-defined]
        calls.append((t, h))
        drift = 1.0 + 0.1 * (len(calls) // 4)  # the machine slows down round by round
        ms = 10.0 * speed[(t, h)] * drift
        return [{"type": "table_wise", "codecs": "fp32", "pipeline": "x", "ms_per_step": ms}]

    monkeypatch.setattr(bench_dist, "run_ranks", fake_ranks)
    a = bench_dist.parse(["--transport", "shm,gloo", "--keep-heap", "on,off", "--rounds", "3"])
    grid = bench_dist.run_grid(a)
    assert len(calls) == 12 and calls[:4] != calls[4:8]  # rotated between rounds
    assert all(sorted(calls[4 * r : 4 * r + 4]) == sorted(speed) for r in range(3))
    row = grid["results"]["table_wise fp32 x"]
    assert grid["baseline"] == "gloo/off"
    for (t, h), v in speed.items():  # a drift within a round cancels in the paired ratio
        iv = row[f"{t}/{h}"]["vs_gloo_off"]
        assert iv["n"] == 3 and abs(iv["value"] - v / 2.0) < 0.05
    with pytest.raises(SystemExit):
        bench_dist.parse(["--transport", "shm,tcp"])


def test_bench_step_lowp_reports_paired_speedups(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench step --lowp``: every mode (the plain-autocast baseline included) steps in turn;
    each speedup over fp32 carries its interval over the paired steps."""
    import json

    from neorec.bench import step

    tiny = ["--tables", "2", "--rows", "500", "--dim", "8", "--batch", "64", "--pooling", "2"]
    assert step.main([*tiny, "--lowp", "off,autocast", "--iters", "4", "--warmup", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    iv = out["lowp"]["autocast"]["speedup_vs_off"]
    assert iv["n"] == 4 and iv["lo"] <= iv["value"] <= iv["hi"]
    assert out["lowp"]["off"]["speedup_vs_off"]["value"] == 1.0
    with pytest.raises(SystemExit, match="autocast"):  # the modes are named in the refusal
        step.main([*tiny, "--lowp", "off,tf32"])
