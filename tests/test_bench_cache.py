"""``neorec bench cache`` end to end on tiny shapes (the figures themselves are benchmarks)."""

from __future__ import annotations

import json

import pytest

from neorec.bench.cache import main


@pytest.mark.parametrize("model", ["tbe", "dlrm"])
def test_throughput_part_reports_both_setups(
    model: str, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--skip-hit", "--model", model, "--tables", "2", "--rows", "5000", "--dim", "8",
        "--batch", "64", "--pooling", "4", "--warmup", "3", "--iters", "2", "--repeats", "1",
        "--bottom-mlp", "16,8", "--top-mlp", "16,1", "--dir", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    assert f"{model.upper()} train step" in out
    assert line["model"] == model
    assert line["dram_ms_per_step"] > 0 and line["ssd_ms_per_step"] > 0
    # the JSON rounds the ratio to 3 decimals (and each time to 0.1 ms): a tiny ratio such as
    # 0.0415 prints as 0.042, 1.2% off
    assert line["ssd_vs_dram"] == pytest.approx(
        line["dram_ms_per_step"] / line["ssd_ms_per_step"], rel=1e-2, abs=1e-3
    )
    assert 0 < line["ssd_hit_rate"] <= 1
