"""The training loop end to end on tiny synthetic data."""

import json
import math

import pytest
import torch

from neorec.config import ConfigError, load_config
from neorec.distributed.dense_blocks import blocks_of
from neorec.train.trainer import Trainer, TrainingDiverged, train_step


def tiny_cfg(tmp_path, *extra):
    return load_config(
        overrides=[
            "embedding.num_tables=3",
            "embedding.rows=200",
            "embedding.dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=64",
            "data.train_samples=1280",
            "data.eval_samples=640",
            f"train.run_dir='{tmp_path}'",
            "train.progress=false",
            *extra,
        ]
    )


def test_train_writes_metrics(tmp_path):
    result = Trainer(tiny_cfg(tmp_path, "train.eval_every=10")).fit()
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["train"]["steps"] == 20 and m["train"]["samples"] == 1280
    assert [e["step"] for e in m["evals"]] == [10, 20]
    for key in ("auc", "logloss", "ne", "calibration"):
        assert math.isfinite(m["eval"][key])
    assert m["teacher"]["ne"] < 1.0
    assert m["train"]["peak_rss_mb"] > 0
    assert result["eval_ne_gap_vs_teacher"] == pytest.approx(
        m["eval"]["ne"] / m["teacher"]["ne"] - 1
    )


@pytest.mark.bitwise
def test_same_seed_bitwise_identical(tmp_path):
    a = Trainer(tiny_cfg(tmp_path / "a", "train.steps=5"))
    b = Trainer(tiny_cfg(tmp_path / "b", "train.steps=5"))
    a.fit()
    b.fit()
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_nan_loss_stops_with_message(tmp_path):
    t = Trainer(tiny_cfg(tmp_path))
    batch = next(iter(t.source.train_batches()))
    batch.dense[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged, match="loss became nan at step 1"):
        train_step(t.model, t.opt, batch, 1)


def test_dense_blocks_default_and_plain(tmp_path):
    # The one-process model runs its dense part in train.dense_blocks blocks (what 2 ranks run).
    blocked = Trainer(tiny_cfg(tmp_path / "b", "train.steps=3"))
    plain = Trainer(tiny_cfg(tmp_path / "p", "train.steps=3", "train.dense_blocks=1"))
    assert (blocks_of(blocked.model), blocks_of(plain.model)) == (2, 1)
    assert list(blocked.model.state_dict()) == list(plain.model.state_dict())
    a, b = blocked.fit()["eval"], plain.fit()["eval"]
    assert a["ne"] == pytest.approx(b["ne"], rel=1e-4)  # the same sums, in another order
    with pytest.raises(ConfigError, match="train.dense_blocks must be >= 1"):
        tiny_cfg(tmp_path, "train.dense_blocks=0")


def test_a_train_split_without_batches_names_its_data(tmp_path, monkeypatch):
    """A source whose train split yields nothing (past the size checks) is one line naming it."""
    import neorec.train.trainer as trainer_mod

    real = trainer_mod.data_source

    def empty(cfg):
        src = real(cfg)
        src.train_batches = lambda start=0: iter(())
        return src

    monkeypatch.setattr(trainer_mod, "data_source", empty)
    with pytest.raises(ConfigError, match="the synthetic train split produced no batches .*64"):
        Trainer(tiny_cfg(tmp_path, "train.steps=5")).fit()
