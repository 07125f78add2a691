"""``neorec bench step --compare torchrec``: rounds in fresh processes in rotated order, the ratio
paired by round, and both models checked to be the same model (tables, MLP layers, interaction,
parameters in all) before any figure is reported. With our model in a low-precision mode
(``--set lowp.mode=auto``), TorchRec's forward runs under bf16 autocast (its own mixed-precision
route), so the ratio compares like with like. No assertion here depends on a timing."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from neorec.bench import step
from neorec.bench.step_compare import check_same_model, model_shapes, run_rounds
from neorec.errors import ConfigError

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None
needs_torchrec = pytest.mark.skipif(not HAS_TORCHREC, reason="torchrec not installed")

TINY = ["--tables", "2", "--rows", "200", "--dim", "8", "--batch", "32", "--pooling", "3"]
MLPS = ["--set", "model.bottom_mlp=[16, 8]", "--set", "model.top_mlp=[16, 1]"]
TABLES = ["embedding.num_tables=2", "embedding.rows=200", "embedding.dim=8", "embedding.tables=[]"]
DOT = [*TABLES, "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]"]
DCN = [*DOT, "model.interaction='dcn'", "model.dcn_layers=2", "model.dcn_low_rank=4"]
# Counted by hand: tables 2 x 200 x 8; bottom 13->16->8; dot: 8 + 3 pairs -> 16 -> 1; DCN: 24
# wide, two rank-4 layers (V 24x4, U 4x24 + bias 24) -> 16 -> 1.
DOT_PARAMS = 3200 + (13 * 16 + 16 + 16 * 8 + 8) + (11 * 16 + 16 + 16 + 1)
DCN_PARAMS = 3200 + 360 + 2 * (96 + 96 + 24) + (24 * 16 + 16 + 16 + 1)


def _fake_spawn(ms: dict[str, list[float]], calls: list[str], shapes: dict | None = None):
    """A worker stand-in: side -> its next round's figures (no process, no clock)."""
    same = model_shapes([("t0", 10, 4)], *(_linear(),) * 3)

    def spawn(side: str) -> dict:
        calls.append(side)
        k = sum(c == side for c in calls) - 1
        got = (shapes or {}).get(side, same)
        return {"ms": ms[side][k], "shapes": got, "peak_rss_mb": 1.0, "bf16_autocast": False}

    return spawn


def _linear():
    from torch import nn

    return nn.Linear(3, 2)


def test_rounds_rotate_the_order_and_pair_the_ratio_by_round() -> None:
    from neorec.bench.step_compare import summary

    calls: list[str] = []
    ms = {"ours": [10.0, 30.0, 20.0, 12.0], "torchrec": [20.0, 30.0, 10.0, 24.0]}
    runs = run_rounds(4, _fake_spawn(ms, calls))
    assert calls == ["ours", "torchrec", "torchrec", "ours"] * 2
    out = summary(runs)
    assert out["round_orders"] == ["ours,torchrec", "torchrec,ours"] * 2
    geo = math.exp(sum(math.log(o / t) for o, t in zip(ms["ours"], ms["torchrec"])) / 4)
    iv = out["vs_torchrec"]
    assert iv["n"] == 4 and iv["value"] == pytest.approx(geo) and iv["lo"] < geo < iv["hi"]
    assert out["torchrec_ms_per_step"] == 22.0 and out["same_model"]


def test_a_different_model_stops_after_the_first_round_in_one_line() -> None:
    from torch import nn

    calls: list[str] = []
    ours = model_shapes([("t0", 10, 4)], nn.Linear(3, 2), nn.Sequential(), nn.Linear(2, 1))
    theirs = model_shapes([("t0", 10, 4)], nn.Linear(3, 2), nn.Sequential(), nn.Linear(2, 2))
    spawn = _fake_spawn({"ours": [1.0] * 3, "torchrec": [1.0] * 3}, calls, {"ours": ours,
                        "torchrec": theirs})  # fmt: skip
    with pytest.raises(ConfigError, match="differ in top_mlp") as e:
        run_rounds(3, spawn)
    assert calls == ["ours", "torchrec"] and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--rounds", "3"], "only with --compare torchrec"),
        (["--compare", "torchrec", "--rounds", "1"], "at least 2"),
        (["--compare", "torchrec", "--lowp", "off,auto"], "one variant at a time"),
    ],
)
def test_compare_refuses_what_it_cannot_compare_in_one_line(args: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        step.main([*TINY, *args])


def test_a_config_torchrecs_dlrm_cannot_express_is_refused_before_any_process() -> None:
    from neorec.bench.step_torchrec import check_peer_config
    from neorec.config import load_config

    check_peer_config(load_config(None, DCN))
    with pytest.raises(ConfigError, match="bottom MLP's last width"):  # DLRM_DCN requires it
        check_peer_config(load_config(None, [*DCN, "model.bottom_mlp=[16, 4]"]))


@needs_torchrec
@pytest.mark.parametrize(("sets", "params"), [(DOT, DOT_PARAMS), (DCN, DCN_PARAMS)])
def test_torchrecs_dlrm_is_our_model(sets: list[str], params: int) -> None:
    from neorec.bench.step_compare import ours_shapes, torchrec_shapes
    from neorec.bench.step_torchrec import torchrec_dlrm
    from neorec.builder import build_dlrm
    from neorec.config import load_config

    cfg = load_config(None, sets)
    ours, theirs = ours_shapes(build_dlrm(cfg)), torchrec_shapes(torchrec_dlrm(cfg))
    assert ours == theirs and ours["params"] == params
    wider = torchrec_shapes(torchrec_dlrm(load_config(None, [*sets, "model.top_mlp=[17, 1]"])))
    with pytest.raises(ConfigError, match="differ in top_mlp"):
        check_same_model(ours, wider)


@needs_torchrec
def test_compare_torchrec_runs_rounds_in_fresh_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*TINY, *MLPS, "--compare", "torchrec", "--rounds", "2", "--iters", "2", "--warmup", "1"]
    assert step.main([*argv, "--set", "lowp.mode='auto'"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["round_orders"] == ["ours,torchrec", "torchrec,ours"]
    assert out["vs_torchrec"]["n"] == 2 and len(out["torchrec_ms_rounds"]) == 2
    assert out["same_model"] and out["params"] == DOT_PARAMS
    assert out["lowp_mode"] == "auto" and out["torchrec_bf16_autocast"] is True
    assert "plan" in out and isinstance(out["plan_same_every_round"], bool)
