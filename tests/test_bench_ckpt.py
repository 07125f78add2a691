"""``neorec bench ckpt``'s quality half: the restore protocol, its statistics, its flags."""

from __future__ import annotations

import json
import math

import pytest

from neorec.bench import ckpt
from neorec.bench import ckpt_quality as cq
from neorec.config import ConfigError

TINY = [
    "embedding.num_tables=2",
    "embedding.rows=200",
    "embedding.dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
]


def test_restore_steps_spread_over_the_run() -> None:
    assert cq.restore_steps(400, 50, 1) == [200]
    assert cq.restore_steps(400, 50, 4) == [100, 150, 250, 300]
    assert all(s % 25 == 0 for s in cq.restore_steps(300, 25, 3))
    with pytest.raises(ValueError, match="do not fit"):
        cq.restore_steps(100, 50, 4)


def test_exact_checkpoints_restored_twice_change_nothing(tmp_path) -> None:
    """float32 rows and state: two restores reproduce the uninterrupted run bitwise (the
    protocol itself adds nothing); 2-bit rows restored once do change the model."""
    exact, coarse = cq.QSetting(32, False, 32, 2), cq.QSetting(2, False, 32, 1)
    r = cq.run_seed(7, [exact, coarse], 12, 32, 3, 256, tmp_path, TINY)
    assert r["ne"][exact.name] == r["reference"]["ne"]
    assert r["ne"][coarse.name] != r["reference"]["ne"]
    assert not (tmp_path / "s7").exists()  # its checkpoints are removed


def test_summary_pairs_by_seed() -> None:
    q = cq.QSetting(8, True, 32, 1)
    runs = [
        {"seed": s, "reference": {"ne": ne, "auc": 0.7}, "ne": {q.name: ne * (1 + d)}}
        for s, ne, d in [(0, 0.8, 1e-4), (1, 0.9, 3e-4), (2, 0.85, 2e-4)]
    ]
    out = cq.summarize(runs, [q])
    row = out["settings"][q.name]
    assert math.isclose(row["ne_change"], 2e-4, rel_tol=1e-9)
    iv = row["ne_change_interval"]
    assert iv["n"] == 3 and iv["lo"] < 2e-4 < iv["hi"]
    assert math.isclose(out["reference_ne"], 0.85)


def test_default_setting_is_the_config_default() -> None:
    d = cq.DEFAULT_Q.config()
    assert (cq.DEFAULT_Q.bits, cq.DEFAULT_Q.opt_bits) == (d.bits, d.opt_bits)
    assert cq.QSETTINGS[0] == cq.DEFAULT_Q and cq.DEFAULT_Q.restores == 1
    assert ckpt.SETTINGS[ckpt.DEFAULT][1:3] == (d.bits, d.opt_bits)


def test_unknown_quality_setting_is_one_error(capsys) -> None:
    with pytest.raises(ConfigError, match="--quality 9/opt32/x1: unknown"):
        ckpt.main(
            [
                "--tables",
                "2",
                "--scale",
                "4096",
                "--steps",
                "2",
                "--interval",
                "1",
                "--quality",
                "9/opt32/x1",
            ]
        )


def test_tiny_run_reports_every_setting_with_an_interval(capsys, monkeypatch) -> None:
    real = cq.quality_config
    monkeypatch.setattr(cq, "quality_config", lambda s, n, b, e, extra=None: real(s, n, b, e, TINY))
    argv = [
        "--tables",
        "2",
        "--scale",
        "4096",
        "--steps",
        "2",
        "--interval",
        "1",
        "--settings",
        "adaptive/8/opt32",
        "--seeds",
        "100-101",
        "--quality-steps",
        "8",
        "--quality-interval",
        "4",
        "--quality-batch",
        "32",
        "--eval-samples",
        "128",
        "--quality",
        "8/opt32/x1",
    ]
    assert ckpt.main(argv) == 0
    j = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert j["quality"]["seeds"] == [100, 101] and j["quality"]["held_out"]
    row = j["quality"]["settings"]["8/opt32/x1"]
    assert set(row["ne_change_interval"]) == {"value", "lo", "hi", "n"}
    assert row["ne_change_interval"]["n"] == 2
    d = j["settings"][j["default"]]
    assert math.isclose(d["ne_change"], row["ne_change"], rel_tol=1e-5)
    assert d["write_reduction"] > 1
    assert "reference_ne" in j and "reference_auc" in j and "reference_ne<=0.95" in j["targets"]
