"""``neorec bench step --compare torchrec`` with our model in a low-precision mode: the mode set
in the config (``--set lowp.mode=auto``) is the one timed, and TorchRec's forward runs under bf16
autocast (its own mixed-precision route), so the ratio compares like with like."""

from __future__ import annotations

import importlib.util
import json

import pytest

from neorec.bench import step

TINY = ["--tables", "2", "--rows", "200", "--dim", "8", "--batch", "32", "--pooling", "3"]


@pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="torchrec not installed")
@pytest.mark.parametrize("mode", ["off", "auto"])
def test_compare_torchrec_times_the_configs_lowp_mode(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*TINY, "--compare", "torchrec", "--iters", "2", "--warmup", "2"]
    assert step.main([*argv, "--set", f"lowp.mode={mode!r}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["lowp_mode"] == mode
    assert out["torchrec_bf16_autocast"] is (mode != "off")
    assert out["vs_torchrec"]["n"] == 2 and out["torchrec_ms_per_step"] > 0
