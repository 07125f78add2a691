"""The README rows that state a verdict (``neorec.bench.report_render``) on small records: which
cost model wins, ExFM's target met per cell, the TWRW reduction, MovieLens above LR only when
both intervals agree."""

from __future__ import annotations

from typing import Any

from neorec.bench import report_render as render


def _iv(v: float, lo: float | None, hi: float | None, n: int = 5) -> dict[str, Any]:
    return {"value": v, "lo": lo, "hi": hi, "n": n}


def test_costcheck_row_names_the_winner_per_anchoring_and_set() -> None:
    err = {"mean": 0.1, "mean_interval": _iv(0.1, 0.05, 0.15), "max": 0.2, "n": 3}
    errors = {m: {h: {"all": err} for h in ("anchored", "unanchored")} for m in ("learned", "analytical")}  # fmt: skip
    paired = {
        "anchored": {"all": {**_iv(-0.035, -0.103, 0.033), "winner": "neither"},
                     "fixed": {**_iv(-0.05, -0.09, -0.01), "winner": "learned"}},
        "unanchored": {"all": {**_iv(0.05, 0.02, 0.08), "winner": "analytical"}},
    }  # fmt: skip
    row = render.costcheck(
        {
            "errors": errors,
            "learned_minus_analytical": paired,
            "world_size": 4,
            "random_batch": 3072,
        }
    )
    assert "anchored: learned mean \\|err\\| 10.0% [5.0, 15.0], analytical 10.0%" in row
    assert "-3.5 points [-10.3, +3.3] paired by plan: **neither wins** (fixed plans learned)" in row
    assert "unanchored" in row and "**analytical wins**" in row and "3 plans, 4 ranks" in row


def test_distill_rows_every_cell_and_the_target_by_its_lower_end() -> None:
    gap = {
        "vs_fresh_fm": _iv(0.56, 0.417, 0.694),
        "vs_fresh_fm_recalibrated": _iv(0.433, 0.297, 0.568),
        "vs_stale_fm": _iv(2.5, -1.0, 6.0),
    }
    cell = {"gap_closed": gap, "ne_minus_alone": {"aux+adapter": _iv(-0.0065, -0.0097, -0.0033)}}
    j = {
        "per_bias": {"0": {"per_k": {"1": cell, "2": cell}}},
        "seeds": [100, 101, 102],
        "dev_seeds": [0, 1],
        "stream_seeds": {"dev": [1234, 1235], "reported": [1334, 1335, 1336]},
    }
    g = render.distill_gap(j)
    assert g.count("fresh 0.560 [0.417, 0.694] **met**") == 2
    assert g.count("recalibrated 0.433 [0.297, 0.568] not met") == 2  # 0.297 < 0.3
    assert "stale 2.5 [-1.0, 6.0] not met" in g
    d = render.distill(j)
    assert d.count("NE vs alone") == 2 and "on their own streams" in d
    assert "(the same stream)" in render.distill({**j, "stream_seeds": None})


def test_twrw_row_states_both_reductions() -> None:
    rows = [
        {"type": t, "codecs": "fp32", "inter_host_pooled_bytes": b}
        for t, b in (("row_wise_host", 1_048_576), ("table_row_wise", 524_288), ("row_wise", 2_097_152))
    ]  # fmt: skip
    j = {
        "results": rows,
        "inter_host_reduction": {"vs_row_wise_host": 2.0, "vs_row_wise": 4.0},
        "ranks_per_host": 2, "nproc": 4, "tables": 4, "rows": 20000, "dim": 32, "batch": 1024,
    }  # fmt: skip
    row = render.twrw(j)
    assert row.startswith("**2.00×** fewer pooled bytes between hosts than row-wise over the same")
    assert "(524,288 vs 1,048,576 B/step" in row and "4.00× vs row-wise over all 4 ranks" in row


def test_movielens_above_lr_only_when_both_intervals_agree() -> None:
    model = {"auc_ci_users": _iv(0.80, 0.79, 0.81), "ne": 0.78}
    j = {
        "dlrm": model, "lr": {**model, "ne": 0.79}, "bootstrap": {"users": 943},
        "seeds": [100, 101], "select_seeds": [0, 1],
        "auc_diff_users": _iv(0.005, 0.001, 0.009), "logloss_diff_users": _iv(-0.005, -0.009, -0.001),
        "auc_diff": _iv(0.005, -0.006, 0.016, 2),
    }  # fmt: skip
    assert "above LR not established" in render.movielens(j)
    both = render.movielens({**j, "auc_diff": _iv(0.005, 0.002, 0.008, 2)})
    assert "**above LR beyond noise**" in both and "the 943 eval users and seeds 100-101" in both
    old = {k: v for k, v in j.items() if k != "bootstrap"}
    old["dlrm"] = {**model, "auc_ci": _iv(0.80, 0.79, 0.81)}
    old["lr"] = {"auc": 0.79}
    assert "they do not cover the data" in render.movielens(old)
