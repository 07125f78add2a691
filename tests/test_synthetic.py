"""Synthetic click data: determinism, random access, layout, pooling, teacher."""

from __future__ import annotations

import math

import pytest
import torch

from neorec.config import DataConfig, EmbeddingConfig, TableConfig
from neorec.data.synthetic import SyntheticClickData
from neorec.metrics import binary_metrics


def _tables() -> list[TableConfig]:
    return [
        TableConfig(name="a", rows=1000, dim=16, pooling_factor=3.0),
        TableConfig(name="b", rows=50, dim=16, pooling_factor=1.0, features=["b1", "b2"]),
        TableConfig(name="c", rows=10**9, dim=16, pooling_factor=6.0),
    ]


def _data(**kw) -> SyntheticClickData:
    return SyntheticClickData(
        DataConfig(train_samples=4096, eval_samples=2048, **kw), _tables(), 13
    )


def _same(x, y) -> bool:
    return (
        torch.equal(x.dense, y.dense)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse.values, y.sparse.values)
        and torch.equal(x.sparse.lengths, y.sparse.lengths)
    )


@pytest.mark.parametrize("dist", ["locality", "zipf", "uniform"])
def test_deterministic_and_random_access(dist: str) -> None:
    d1, d2 = _data(id_distribution=dist), _data(id_distribution=dist)
    first = d1.batch("train", 3, 256)
    for i in range(3):  # generating other batches first changes nothing
        d2.batch("train", i, 256)
    assert _same(first, d2.batch("train", 3, 256))
    assert _same(first, d1.batch("train", 3, 256))
    assert not _same(first, d1.batch("train", 4, 256))
    assert not _same(first, d1.batch("eval", 3, 256))
    other_seed = SyntheticClickData(DataConfig(seed=99, id_distribution=dist), _tables(), 13)
    assert not _same(first, other_seed.batch("train", 3, 256))


def test_layout_and_valid_ids() -> None:
    d = _data()
    b = d.batch("train", 0, 512)
    assert b.sparse.keys == ["a", "b1", "b2", "c"]
    assert b.dense.shape == (512, 13) and b.dense.dtype == torch.float32
    assert b.labels.shape == (512,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.sparse.weights is None
    rows = {"a": 1000, "b1": 50, "b2": 50, "c": 10**9}
    b.sparse.validate(rows)
    assert int(b.sparse.lengths.sum()) == b.sparse.values.numel()
    assert bool((b.dense >= 0).all())  # log1p of positive values


def test_fixed_vs_variable_pooling() -> None:
    fixed = _data(fixed_pooling=True).batch("train", 0, 1024)
    lens = fixed.sparse.lengths.view(4, 1024)
    assert lens[0].eq(3).all() and lens[1].eq(1).all() and lens[3].eq(6).all()
    var = _data(fixed_pooling=False).batch("train", 0, 4096).sparse.lengths.view(4, 4096).float()
    assert var[0].mean().item() == pytest.approx(3.0, rel=0.05)
    assert var[3].mean().item() == pytest.approx(6.0, rel=0.05)
    assert float(var[0].std()) > 1.0 and bool((var == 0).any())  # empty bags happen


def test_sizes_and_iteration() -> None:
    d = _data()
    assert d.num_samples("train") == 4096 and d.num_samples("eval") == 2048
    assert d.num_batches("train", 1000) == 4  # remainder dropped
    got = list(d.batches("train", 1000, start=2))
    assert len(got) == 2 and _same(got[0], d.batch("train", 2, 1000))
    with pytest.raises(ValueError, match="split"):
        d.batch("test", 0, 10)


def test_teacher_metrics_sane() -> None:
    d = SyntheticClickData(DataConfig(eval_samples=16_384), EmbeddingConfig().tables, 13)
    t = d.teacher_metrics("eval", 1024)
    c = d.constant_metrics("eval", 1024)
    assert 0.15 < t["ctr"] < 0.35
    assert c["ne"] == pytest.approx(1.0, abs=1e-9) and c["auc"] == pytest.approx(0.5)
    assert 0.6 < t["ne"] < 0.95 and t["auc"] > 0.65
    # log loss is the mean over samples of the labels' loss under the teacher's probabilities
    ll, n = 0.0, 0
    for i in range(d.num_batches("eval", 1024)):
        b, p = d.batch_with_probs("eval", i, 1024)
        p = p.double()
        ll += float(-(b.labels * p.log() + (1 - b.labels) * (1 - p).log()).sum())
        n += b.size
    assert ll / n == pytest.approx(t["logloss"], rel=1e-6)
    # a stronger teacher gives a lower Bayes NE
    strong = SyntheticClickData(
        DataConfig(eval_samples=16_384, teacher_scale=2.0), EmbeddingConfig().tables, 13
    )
    assert strong.teacher_metrics("eval", 1024)["ne"] < t["ne"]


def test_binary_metrics_by_hand() -> None:
    p = torch.tensor([0.1, 0.4, 0.35, 0.8])
    y = torch.tensor([0.0, 0.0, 1.0, 1.0])
    m = binary_metrics(p, y)
    assert m["auc"] == pytest.approx(0.75)
    ll = -(math.log(0.9) + math.log(0.6) + math.log(0.35) + math.log(0.8)) / 4
    assert m["logloss"] == pytest.approx(ll)
    assert m["ne"] == pytest.approx(ll / math.log(2))
    ties = binary_metrics(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0]))
    assert ties["auc"] == pytest.approx(0.5)
