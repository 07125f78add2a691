"""Serving raw Criteo rows: the export carries the feature transforms, the standalone loader
applies them (issue 41)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_trainer import tiny_cfg

from neorec.cli import main
from neorec.data.criteo import CriteoTSVDataset
from neorec.data.shards import multi_hot_extra
from neorec.serve import save_model, standalone
from neorec.serve.export import feature_transforms
from neorec.train.trainer import Trainer

ROWS = [50 + i for i in range(1, 27)]
DYNAMIC = 2  # C3 is a dynamic table: raw ids


def _lines(n: int, seed: int) -> list[str]:
    """Criteo lines with empty and negative dense fields, empty categories and other hex widths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        dense = [str(int(x)) if x >= -1 else "" for x in rng.integers(-3, 50, 13)]
        if i % 7 == 0:
            dense[4] = str(2**40 + i)  # a large count
        cats = [f"{int(x):08x}" for x in rng.integers(0, 2**32, 26)]
        cats[5] = "" if i % 3 == 0 else cats[5]
        cats[DYNAMIC] = f"{int(rng.integers(0, 12)):x}"  # few raw ids, 1 digit: seen in training
        cats[9] = f"{int(rng.integers(0, 2**40)):x}"  # 10 hex digits: the slow path
        out.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]) + "\n")
    return out


def _tables() -> str:
    t = [f"{{name='C{i}', rows={r}, dim=4}}" for i, r in enumerate(ROWS, 1)]
    t[DYNAMIC] = f"{{name='C{DYNAMIC + 1}', rows=1000, dim=4, kind='dynamic', capacity=64}}"
    return f"embedding.tables=[{', '.join(t)}]"


def _serving(artifact: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        f"serving_{id(artifact)}", artifact / "serving.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def criteo(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny model trained on Criteo TSV (one dynamic table), saved and exported."""
    tmp = tmp_path_factory.mktemp("criteo")
    train, held = tmp / "train.tsv", tmp / "held.tsv"
    train.write_text("".join(_lines(96, 0)))
    held_lines = _lines(40, 1)
    held.write_text("".join(held_lines))
    cfg = tiny_cfg(
        tmp, _tables(), "model.bottom_mlp=[8, 4]", "data.batch_size=16", "data.source='criteo'",
        f"data.path='{train}'", f"data.eval_path='{held}'",
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    if not (tmp / "model" / "model.json").exists():
        save_model(trainer.model, trainer.cfg, tmp / "model")
    art = tmp / "art"
    assert main(["export", "--model", str(tmp), "--out", str(art)]) == 0
    return SimpleNamespace(tmp=tmp, cfg=cfg, held=held, lines=held_lines, art=art)


def test_manifest_carries_the_transforms(criteo: SimpleNamespace) -> None:
    tf = json.loads((criteo.art / "manifest.json").read_text())["transforms"]
    assert tf["kind"] == "criteo" and tf["dense"]["function"] == "log1p(max(x, 0))"
    cats = tf["categorical"]
    assert [c["field"] for c in cats] == [f"C{j}" for j in range(1, 27)]
    assert [c["map"] for c in cats] == ["raw" if j == DYNAMIC else "modulo" for j in range(26)]
    assert [c["rows"] for j, c in enumerate(cats) if j != DYNAMIC] == [
        r for j, r in enumerate(ROWS) if j != DYNAMIC
    ]


def test_raw_rows_match_neorec_predict(criteo: SimpleNamespace) -> None:
    out = criteo.tmp / "p.npy"
    argv = ["predict", "--model", str(criteo.tmp), "--data", str(criteo.held), "--out", str(out)]
    assert main(argv) == 0
    want = np.load(out)
    predictor = _serving(criteo.art).load(str(criteo.art))
    got_text = predictor.predict_raw(criteo.lines, labels=True)  # log lines, label first
    got_fields = predictor.predict_raw([ln.rstrip("\n").split("\t")[1:] for ln in criteo.lines])
    assert got_text.shape == want.shape == (40,)
    assert np.abs(got_text - want).max() <= 1e-6
    assert np.array_equal(got_text, got_fields)


def test_transforms_equal_the_training_reader(criteo: SimpleNamespace) -> None:
    """The loader's dense values and ids are bitwise the Criteo reader's (what training saw)."""
    predictor = _serving(criteo.art).load(str(criteo.art))
    dense, sparse = predictor.inputs_from_raw(criteo.lines, labels=True)
    ds = CriteoTSVDataset(criteo.held, criteo.cfg.embedding.tables, batch_size=len(criteo.lines))
    (batch,) = list(ds)
    assert dense.dtype == np.float32 and np.array_equal(dense, batch.dense.numpy())
    for t in criteo.cfg.embedding.tables:
        values, lengths, _ = batch.sparse.feature(t.features[0])
        assert np.array_equal(sparse[t.features[0]][0], lengths.numpy())
        assert np.array_equal(sparse[t.features[0]][1], values.numpy()), t.name


def test_multi_hot_rows_equal_preprocessing() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10**6, 500)
    for feature, size, rows, seed in ((0, 1, 10**6, 0), (4, 3, 977, 0), (25, 20, 10**7, 12345)):
        want = multi_hot_extra(ids, feature, size, rows, seed)
        assert np.array_equal(standalone.multi_hot_rows(ids, feature, size, rows, seed), want)


def _inputs(
    transforms: dict[str, Any], rows: Any, labels: bool = False
) -> tuple[np.ndarray, dict[str, Any]]:
    fake = SimpleNamespace(manifest={"transforms": transforms})
    return standalone.Predictor.inputs_from_raw(fake, rows, labels)  # type: ignore[arg-type]


def test_preprocessed_multi_hot_transforms_equal_the_reader(tmp_path: Path) -> None:
    from neorec.cli.data import preprocess_main
    from neorec.data.loader import SampleOrder, ShardedReader, ShardSet

    lines = _lines(30, 2)
    raw = tmp_path / "raw.tsv"
    raw.write_text("".join(lines))
    pre = tmp_path / "pre"
    rows = ",".join(map(str, ROWS))
    hot = ",".join("3" if j in (1, 7) else "1" for j in range(26))
    argv = ["--input", str(raw), "--output", str(pre), "--rows", rows, "--multi-hot", hot]
    argv += ["--multi-hot-seed", "7", "--eval-fraction", "0", "--workers", "1"]
    assert preprocess_main(argv, out=open(os.devnull, "w")) == 0  # noqa: SIM115
    tables = ", ".join(f"{{name='C{i}', rows={r}, dim=4}}" for i, r in enumerate(ROWS, 1))
    cfg = tiny_cfg(
        tmp_path, f"embedding.tables=[{tables}]", "model.bottom_mlp=[8, 4]",
        "data.source='criteo'", f"data.path='{pre}'",
    )  # fmt: skip
    tf = feature_transforms(cfg)
    assert tf["multi_hot"]["seed"] == 7 and tf["categorical"][1]["multi_hot"] == 3
    dense, sparse = _inputs(tf, lines, labels=True)
    keys = [t.features[0] for t in cfg.embedding.tables]
    (batch,) = list(
        ShardedReader(ShardSet(pre), 30, keys=keys, order=SampleOrder(shuffle=False), workers=0)
    )
    assert np.array_equal(dense, batch.dense.numpy())
    for k in keys:
        values, lengths, _ = batch.sparse.feature(k)
        assert np.array_equal(sparse[k][0], lengths.numpy())
        assert np.array_equal(sparse[k][1], values.numpy()), k


def test_bad_rows_and_models_without_transforms(tmp_path: Path) -> None:
    tables = ", ".join(f"{{name='C{i}', rows={r}, dim=8}}" for i, r in enumerate(ROWS, 1))
    tsv = tmp_path / "x.tsv"
    tsv.write_text("")
    tf = feature_transforms(tiny_cfg(tmp_path))
    assert tf["kind"] is None and "synthetic" in tf["why"]
    with pytest.raises(ValueError, match="cannot read raw rows .*synthetic"):
        _inputs(tf, [])
    cfg = tiny_cfg(
        tmp_path, f"embedding.tables=[{tables}]", "data.source='criteo'", f"data.path='{tsv}'",
        "data.hash_categories=false",
    )  # fmt: skip
    tf = feature_transforms(cfg)
    assert {c["map"] for c in tf["categorical"]} == {"index"}
    good = _lines(2, 5)[0].rstrip("\n").split("\t")[1:]
    good[13:] = ["1"] * 26
    _inputs(tf, [good])
    for j, v, msg in (
        (2, "x1", r"row 1: field I3: 'x1' is not a 64-bit integer"),
        (3, "1" * 21, r"row 1: field I4: .* is not a 64-bit integer"),
        (13, "0x1f", r"row 1: field C1: '0x1f' is not hex"),
        (14, "ff", r"row 1: field C2: id 255 >= table rows 52"),
    ):
        bad = list(good)
        bad[j] = v
        with pytest.raises(ValueError, match=msg):
            _inputs(tf, [good, bad])
    with pytest.raises(ValueError, match="row 0: 38 fields, want 39"):
        _inputs(tf, [good[1:]])
    # a labelled row that lost a field, or a label-less row with a trailing tab, would be read
    # with every field shifted: refused unless the caller says the rows carry labels
    trailing_tab = "\t".join(good) + "\t"
    with pytest.raises(ValueError, match="row 0: 40 fields, want 39 .*labels=True"):
        _inputs(tf, [trailing_tab])
    with pytest.raises(ValueError, match="row 0: 39 fields, want 40"):
        _inputs(tf, [good], labels=True)
    dense, _ = _inputs(tf, ["1\t" + "\t".join(good)], labels=True)
    assert np.array_equal(dense, _inputs(tf, [good])[0])
    gone = tiny_cfg(tmp_path, "data.source='criteo'", "data.path='/nonexistent/criteo'")
    assert "not found" in feature_transforms(gone)["why"]
