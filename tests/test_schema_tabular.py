"""Tabular data (issue 42): a declared schema over Parquet and CSV, preprocessed or read directly.

The example data set (``neorec.data.example``: dense, an integer id, a string id with a
vocabulary, a weighted multi-hot list and a second list sharing its table) is written as Parquet
and as CSV; both must give the same model inputs, equal to a plain-Python reading of the columns,
and both train through ``neorec train``, preprocessed and direct.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from neorec.cli import main  # noqa: E402
from neorec.config import load_config  # noqa: E402
from neorec.data.encode import hash_rows, str_keys  # noqa: E402
from neorec.data.example import example_columns, write_example  # noqa: E402
from neorec.data.loader import PreprocessedSource, SampleOrder, ShardedReader  # noqa: E402
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular  # noqa: E402
from neorec.data.tabular_source import TabularSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "parquet_example.toml"
N_TRAIN, N_EVAL = 300, 100


def cfg(path: Path | str = "", **data: object):
    c = load_config(CONFIG)
    c.data = dataclasses.replace(c.data, path=str(path), batch_size=50, workers=0, **data)
    return c


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tab")
    out = {}
    for fmt in ("parquet", "csv"):
        write_example(d / fmt, fmt, N_TRAIN, N_EVAL, seed=3, row_group=64)
        c = cfg()
        opts = TabularOptions(shard_rows=128, workers=1)
        preprocess_tabular([d / fmt], d / f"{fmt}_pre", c.data.schema, c.embedding.tables, opts)
        out[fmt], out[f"{fmt}_pre"] = d / fmt, d / f"{fmt}_pre"
    return out


def read_all(pre: Path) -> list[tuple]:
    """Every sample of a preprocessed directory in stored order: (label, dense, {feature: ids},
    {feature: weights})."""
    r = ShardedReader(pre, 10_000, order=SampleOrder(shuffle=False))
    out = []
    for b in r:
        sp = b.sparse
        for i in range(b.size):
            ids, wts = {}, {}
            for k in sp.keys:
                v, _, w = sp.feature(k)
                lens = sp.lengths[sp.keys.index(k) * b.size : (sp.keys.index(k) + 1) * b.size]
                lo = int(lens[:i].sum())
                ids[k] = v[lo : lo + int(lens[i])].tolist()
                wts[k] = None if w is None else w[lo : lo + int(lens[i])].tolist()
            out.append((float(b.labels[i]), b.dense[i].tolist(), ids, wts))
    return out


def test_parquet_equals_csv_equals_plain_python(files: dict[str, Path]) -> None:
    pq, csv = read_all(files["parquet_pre"]), read_all(files["csv_pre"])
    assert len(pq) == N_TRAIN + N_EVAL
    assert pq == csv  # one code path after parsing: the same inputs from either format
    m = json.loads((files["parquet_pre"] / "manifest.json").read_text())
    assert m["split"]["train"] == N_TRAIN and m["split"]["eval"] == N_EVAL  # the last file
    cols = {
        k: v + w
        for (k, v), w in zip(
            example_columns(N_TRAIN, 6).items(), example_columns(N_EVAL, 7).values()
        )
    }
    c = cfg()
    rows = {t.name: t.rows for t in c.embedding.tables}
    ages = np.array(cols["age"][:N_TRAIN])  # standardized with the train split's statistics
    mean, std = ages.mean(), ages.std()
    vocab = np.load(files["parquet_pre"] / "vocab" / "item.npy")
    for i, (label, dense, ids, wts) in enumerate(pq):
        assert label == cols["click"][i]
        price = cols["price"][i]
        assert dense[0] == pytest.approx(0.0 if price is None else math.log1p(price), rel=1e-6)
        assert dense[1] == pytest.approx((cols["age"][i] - mean) / std, rel=1e-5, abs=1e-6)
        user = hash_rows(np.array([cols["user"][i]]), 0, rows["user"]).tolist()
        assert ids["user"] == user
        key = str_keys([cols["item"][i]])[0]
        want = [int(np.flatnonzero(vocab == key)[0]) + 1] if key in vocab else [0]
        assert ids["item"] == want
        assert ids["tags"] == hash_rows(np.array(cols["tags"][i], np.int64), 0, 128).tolist()
        assert wts["tags"] == pytest.approx(cols["tag_w"][i])  # per-id weights kept
        assert wts["query_tags"] == [1.0] * len(cols["query_tags"][i])
        assert len(ids["query_tags"]) == len(cols["query_tags"][i])
    # the vocabulary: train ids by descending count (ties by key), row 0 = out of vocabulary
    keys, counts = np.unique(str_keys(cols["item"][:N_TRAIN]), return_counts=True)
    assert vocab.tolist() == keys[np.lexsort((keys, -counts))].tolist()


def test_direct_reading_equals_preprocessed(files: dict[str, Path]) -> None:
    for fmt in ("parquet", "csv"):
        direct = TabularSource(cfg(files[fmt]).data, cfg().embedding.tables)
        pre = PreprocessedSource(cfg(files[f"{fmt}_pre"]).data, cfg().embedding.tables, num_dense=2)
        assert direct.num_train_batches() == N_TRAIN // 50
        for a, b in zip(direct.eval_batches(), pre.eval_batches(), strict=True):
            assert a.labels.tolist() == b.labels.tolist()
            assert a.dense.tolist() == b.dense.tolist()
            assert a.sparse.keys == b.sparse.keys
            assert a.sparse.values.tolist() == b.sparse.values.tolist()
            assert a.sparse.lengths.tolist() == b.sparse.lengths.tolist()
            assert a.sparse.weights.tolist() == b.sparse.weights.tolist()
        # resume: batches from 3 on are the tail of the whole pass
        whole = [b.labels.tolist() for b in direct.train_batches()]
        assert [b.labels.tolist() for b in direct.train_batches(3)] == whole[3:]


def test_ranks_read_the_global_batch(files: dict[str, Path]) -> None:
    one = ShardedReader(files["parquet_pre"], 40, order=SampleOrder(seed=1, shuffle_buffer=64))
    two = [
        ShardedReader(
            files["parquet_pre"],
            40,
            order=SampleOrder(seed=1, shuffle_buffer=64),
            rank=r,
            world_size=2,
        )
        for r in (0, 1)
    ]
    for g, p0, p1 in zip(one, *two, strict=True):
        v = g.sparse
        for k in v.keys:
            ids = [p.sparse.feature(k)[0].tolist() for p in (p0, p1)]
            assert v.feature(k)[0].tolist() == ids[0] + ids[1]
        assert g.labels.tolist() == p0.labels.tolist() + p1.labels.tolist()


@pytest.mark.parametrize("fmt,pre", [("parquet", False), ("csv", True)])
def test_train_cli(files: dict[str, Path], tmp_path: Path, fmt: str, pre: bool) -> None:
    path = files[f"{fmt}_pre" if pre else fmt]
    sets = f"data.path={path} data.batch_size=50 train.steps=4 train.run_dir={tmp_path / 'run'} data.workers=0 train.progress=false train.save_model=false"
    argv = ["train", "--config", str(CONFIG)] + [a for kv in sets.split() for a in ("--set", kv)]
    assert main(argv) == 0
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= m["eval"]["auc"] <= 1.0


def test_train_nproc2_preprocessed_parquet(files: dict[str, Path], tmp_path: Path) -> None:
    from faults import run_cli

    sets = f"data.path={files['parquet_pre']} data.batch_size=50 train.steps=3 train.run_dir={tmp_path / 'run'} data.workers=0 train.progress=false train.save_model=false"
    argv = ["train", "--nproc", "2", "--config", str(CONFIG)] + [
        a for kv in sets.split() for a in ("--set", kv)
    ]
    r = run_cli(argv, timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= m["eval"]["auc"] <= 1.0
