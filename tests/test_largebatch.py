"""``neorec bench largebatch`` without training: each arm's config (batch, scaling, schedule),
the same samples at both batch sizes, the summary's paired figures and ``ne_gap``, and its flags
refused in one line."""

from __future__ import annotations

import pytest
import torch

from neorec.bench.largebatch import ARMS, SameSamples, _cfg, _summary, arm_overrides, main, parse
from neorec.builder import lr_schedule
from neorec.builder.run import data_source
from neorec.config import ConfigError, load_config


def test_arms_configs(tmp_path):
    a = parse(["--batch", "64", "--factor", "8", "--samples", "51200"])  # 100 steps at 8B
    cfgs = {
        arm: _cfg(a, arm_overrides(arm, a, 0.1, "cosine", "sqrt/none"), 3, tmp_path) for arm in ARMS
    }
    assert cfgs["B"].data.batch_size == 64 and cfgs["kB plain"].data.batch_size == 512
    assert all(c.train.seed == 3 and c.data.seed == 3 for c in cfgs.values())
    dense, rows = cfgs["B"].train.dense_lr, cfgs["B"].embedding.lr
    lrs = {arm: lr_schedule(c, 100).lrs(100 // 2) for arm, c in cfgs.items()}
    assert lrs["B"] == pytest.approx((dense, rows)) and lrs["kB plain"] == lrs["B"]
    assert lrs["kB linear"] == pytest.approx((dense * 8, rows * 8))
    scaled = [lr_schedule(cfgs[arm], 100) for arm in ("kB recipe", "kB no warmup")]
    assert all((s.dense_lr, s.rows_lr) == pytest.approx((dense * 8**0.5, rows)) for s in scaled)
    rec, nowarm = (cfgs[arm].train.schedule for arm in ("kB recipe", "kB no warmup"))
    assert (rec.warmup_steps, rec.decay, nowarm.warmup_steps, nowarm.decay) == (
        10,
        "cosine",
        0,
        "cosine",
    )
    assert not cfgs["kB linear"].train.schedule.active and not cfgs["B"].train.schedule.active
    one = _cfg(a, arm_overrides("kB recipe", a, 0.0, "constant", "sqrt"), 3, tmp_path).train
    assert (one.lr_scaling, one.reference_batch, one.schedule.active) == ("sqrt", 64, False)
    none = _cfg(a, arm_overrides("kB recipe", a, 0.1, "cosine", "none"), 3, tmp_path)
    assert lr_schedule(none, 100).lrs(10) == pytest.approx(lrs["kB plain"])  # warmup ends at 1


def test_same_samples_concatenates_small_batches():
    cfg = load_config("configs/default.toml", [
        "embedding.num_tables=2", "embedding.rows=50", "data.batch_size=32",
        "data.train_samples=200", "data.eval_samples=40"])  # fmt: skip
    src = data_source(cfg)
    same = SameSamples(src, 8)  # 4 small batches a large one; 25 small -> 6 large
    assert same.num_train_batches() == 6
    big = list(same.train_batches(start=5))
    assert len(big) == 1 and big[0].size == 32
    for j in range(4):
        small, part = src.data.batch("train", 20 + j, 8), big[0].slice(8 * j, 8 * j + 8)
        assert torch.equal(part.dense, small.dense) and torch.equal(part.labels, small.labels)
        assert torch.equal(part.sparse.values, small.sparse.values)
        assert torch.equal(part.sparse.lengths, small.sparse.lengths)
    evals = list(same.eval_batches())
    assert [b.size for b in evals] == [8] * 5
    assert torch.equal(evals[1].labels, src.data.batch("eval", 1, 8).labels)


def test_summary_pairs_by_seed():
    a = parse([])
    ne = {"B": [1.0, 0.9, 0.8], "kB recipe": [1.001, 0.9, 0.8008], "kB plain": [1.1, 1.0, 0.9],
          "kB no warmup": [1.0, 1.0, 1.0], "kB linear": [2.0, 1.8, 1.6]}  # fmt: skip
    r = _summary(a, ne, {k: 1 for k in ARMS}, [1, 2, 3], {}, {}, 0.0, "cpu")
    gaps = [(x - y) / y for x, y in zip(ne["kB recipe"], ne["B"])]
    assert r["ne_gap"] == pytest.approx(sum(gaps) / 3)
    assert r["arms"]["kB linear"]["ne_vs_B_pct"]["value"] == pytest.approx(100.0)
    assert r["arms"]["B"]["ne_vs_B_pct"] is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seeds", "a-b"], "--seeds 'a-b'"),
        (["--warmups", "1.5"], "warmup shares must be in"),
        (["--factor", "1"], "--factor >= 2"),
        (["--scalings", "sqrt/cube"], "--scalings 'sqrt/cube': expected RULE or DENSE/ROWS"),
        (["--set", "train.schedule.decay='x'"], "train.schedule.decay must be one of"),
    ],
)
def test_bad_flags_refused_before_training(argv, match):
    with pytest.raises(ConfigError, match=match):
        main(argv)
