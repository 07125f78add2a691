"""``neorec bench quant``'s parts: its stored rows are the export's (what the serving loader reads
back from ``neorec export --quantize``, bitwise), its bytes the export's files, and its summary
carries the keys the issue's checks read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.bench.quant import table_roundtrip
from neorec.bench.quant_summary import quant_row, summarize
from neorec.config import load_config


def test_roundtrip_is_what_the_export_serves(tmp_path: Path) -> None:
    from neorec.serve import standalone
    from neorec.serve.export import export_model
    from neorec.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "train.steps=3",
            "embedding.num_tables=2",
            "embedding.rows=70",
            "data.batch_size=32",
            "data.eval_samples=64",
            "train.progress=false",
            f"train.run_dir='{tmp_path / 'run'}'",
        ],
    )
    t = Trainer(cfg)
    t.fit()
    for kind in ("int8", "int4"):
        out = export_model(tmp_path / "run", tmp_path / kind, quantize=kind)
        served = standalone.load(str(out))
        for table in t.model.ebc.tables:
            w = t.model.ebc.table_weight(table.name).detach().clone()
            rows, nbytes = table_roundtrip(w, kind)
            got = served.tables[table.name].rows(np.arange(table.rows, dtype=np.int64))
            assert torch.equal(rows, got), (kind, table.name)
            files = [f for f in (out / "tables").iterdir() if f.name.startswith("00")]
            assert nbytes > 0 and files
    rows, nbytes = table_roundtrip(torch.ones(3, 4) / 3, "fp16")
    assert nbytes == 24 and rows.dtype == torch.float32


def _seed(seed: int, ne: float) -> dict:
    arm = {"ne": ne * 1.0001, "auc": 0.7, "bytes_ratio": 0.25, "grid_rms": 0.1}
    return {
        "seed": seed,
        "reference": {"ne": ne, "auc": 0.7},
        "ptq": {"int8": dict(arm, bytes_ratio=0.375), "int4": arm},
        "qat": [
            {
                "setting": {},
                "widths": {"int8": {**arm, "fp32_ne": ne}, "int4": {**arm, "fp32_ne": ne}},
            }
        ],
    }


def test_summary_keys() -> None:
    r = summarize([_seed(10, 0.8), _seed(11, 0.9), _seed(12, 0.85)], ["int8", "int4"])
    for kind in ("int8", "int4"):
        assert {"bytes_ratio", "ptq", "qat"} <= set(r[kind])
        for arm in ("ptq", "qat"):
            assert r[kind][arm]["ne_change"] == pytest.approx(0.01)
            assert r[kind][arm]["ne_change_hi"] == pytest.approx(0.01)
    assert r["reference"]["learns"] and r["targets"]["int4_qat"]["met"]
    assert r["targets"]["int8_ptq"]["met"]  # +0.01%: within 0.02%
    assert not r["targets"]["int4_bytes"]["met"]  # 0.25x the bytes: over 0.2x
    worse = summarize([_seed(10, 0.8), _seed(11, 1.2)], ["int8", "int4"])
    assert not worse["targets"]["int4_qat"]["met"]  # the reference's NE >= 1 on average
    r.update(seeds=[10, 11, 12])
    assert "int4 (0.250× bytes)" in quant_row(r)
