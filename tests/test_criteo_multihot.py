"""Multi-hot Criteo as in MLPerf DLRMv2: ``--multi-hot mlperf`` on a generated Criteo file gives
bags of the published sizes whose first id is the one-hot row, and configs/criteo_multihot.toml
(the DLRMv2 model, rows shrunk to fit here) trains on it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from test_preprocess import make_lines, write

from neorec.cli import main
from neorec.cli.data import preprocess_main
from neorec.config import load_config
from neorec.data.loader import SampleOrder, ShardedReader
from neorec.data.shards import MLPERF_MULTI_HOT

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "criteo_multihot.toml"


def test_mlperf_multi_hot_preprocess_and_train(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert [t.pooling_factor for t in cfg.embedding.tables] == list(MLPERF_MULTI_HOT)
    assert cfg.model.interaction == "dcn" and {t.dim for t in cfg.embedding.tables} == {128}
    small = tmp_path / "small.toml"  # the same model, tables of at most 1000 rows
    small.write_text(
        re.sub(r"rows = (\d+)", lambda m: f"rows = {min(int(m[1]), 1000)}", CONFIG.read_text())
    )
    write(tmp_path / "day.txt", make_lines(70, 3))
    args = ["--input", str(tmp_path / "day.txt"), "--config", str(small), "--workers", "1"]
    assert preprocess_main([*args, "--output", str(tmp_path / "mh"), "--multi-hot", "mlperf"]) == 0
    assert preprocess_main([*args, "--output", str(tmp_path / "one")]) == 0
    m = json.loads((tmp_path / "mh" / "manifest.json").read_text())
    assert m["multi_hot"] == list(MLPERF_MULTI_HOT)
    mh, one = (
        ShardedReader(tmp_path / d, 70, order=SampleOrder(shuffle=False)) for d in ("mh", "one")
    )
    for a, b in zip(mh, one, strict=True):
        sa, sb = a.sparse, b.sparse
        for j, k in enumerate(sa.keys):
            ids, lengths = sa.feature(k)[:2]
            assert lengths.tolist() == [MLPERF_MULTI_HOT[j]] * a.size
            bags = ids.reshape(a.size, MLPERF_MULTI_HOT[j])
            assert bags[:, 0].tolist() == sb.feature(k)[0].tolist()  # the one-hot row first
    sets = f"data.path={tmp_path / 'mh'} data.batch_size=16 train.steps=1 data.workers=0 train.progress=false train.save_model=false train.run_dir={tmp_path / 'run'}"
    assert (
        main(["train", "--config", str(small)] + [a for kv in sets.split() for a in ("--set", kv)])
        == 0
    )
    assert "auc" in json.loads((tmp_path / "run" / "metrics.json").read_text())["eval"]
