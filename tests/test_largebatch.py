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
    a = parse(["--batch", "64", "--factor", "8", "--samples", "204800", "--clip-rule", "cowclip"])
    clip = (0.1, 1e-4, 2.0, "constant")
    cfgs = {
        arm: _cfg(a, arm_overrides(arm, a, 0.1, "cosine", "sqrt/none", clip), 3, tmp_path)
        for arm in ARMS
    }
    assert [cfgs[arm].data.batch_size for arm in ARMS] == [64, 512, 512, 2048]
    assert all(c.train.seed == 3 and c.data.seed == 3 for c in cfgs.values())
    rows_of = {(cfgs[k].embedding.optimizer, cfgs[k].embedding.lr) for k in ("B", "kB recipe")}
    assert rows_of == {(a.emb_optimizer, a.emb_lr)}  # every arm's row optimizer and lr
    dense, rows = cfgs["B"].train.dense_lr, cfgs["B"].embedding.lr
    rec = lr_schedule(cfgs["kB recipe"], 400)
    assert (rec.dense_lr, rec.rows_lr) == pytest.approx((dense * 8**0.5, rows))
    assert (rec.warmup_steps, rec.decay, rec.rows) == (40, "cosine", True)
    cc = cfgs["kB cowclip"]
    assert (cc.embedding.cowclip_ratio, cc.embedding.cowclip_bound) == (0.1, 1e-4)
    s = lr_schedule(cc, 400)
    assert (s.dense_lr, s.rows_lr) == pytest.approx((dense * 8**0.5, rows * 2))
    assert (s.warmup_steps, s.decay, s.rows) == (40, "constant", False)  # the dense lr only
    both = lr_schedule(cfgs["k2B both"], 100)
    assert (both.dense_lr, both.rows_lr) == pytest.approx((dense * 32**0.5, rows * 2))
    assert (both.warmup_steps, both.decay, both.rows) == (10, "cosine", True)
    assert not cfgs["B"].train.schedule.active
    a.clip_rule = "recipe"  # the recipe's lrs and schedule with the clip (and the row L2 x k)
    a.set = ["embedding.weight_decay=1e-6"]
    cc = _cfg(a, arm_overrides("kB cowclip", a, 0.1, "cosine", "none", clip), 3, tmp_path)
    s = lr_schedule(cc, 400)
    assert (s.dense_lr, s.rows_lr) == pytest.approx((dense, rows * 2))
    assert (s.warmup_steps, s.decay, s.rows) == (40, "constant", True)
    assert cc.embedding.cowclip_ratio == 0.1 and cc.embedding.weight_decay == pytest.approx(8e-6)


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


def test_summary_pairs_by_seed_and_refuses_a_verdict_on_a_reference_that_does_not_learn():
    a = parse([])
    ne = {"B": [0.9, 0.8, 0.85], "kB recipe": [0.92, 0.82, 0.86], "kB cowclip": [0.9, 0.8, 0.85],
          "k2B both": [1.8, 1.6, 1.7]}  # fmt: skip
    auc = {k: [0.7] * 3 for k in ne}
    r = _summary(a, ne, {k: 1 for k in ARMS}, [1, 2, 3], {}, {}, 0.0, "cpu", auc)
    assert r["ne_gap"] == pytest.approx(0.0) and r["verdict"] == "met"
    assert r["arms"]["k2B both"]["ne_vs_B_pct"]["value"] == pytest.approx(100.0)
    assert r["arms"]["B"]["ne_vs_B_pct"] is None and r["reference_auc"] == pytest.approx(0.7)
    ne["kB cowclip"] = [0.91, 0.81, 0.86]
    assert _summary(a, ne, {}, [1, 2, 3], {}, {}, 0.0, "cpu", auc)["verdict"] == "not met"
    flat = {k: [1.01, 1.0, 1.02] for k in ne}  # the reference learned nothing
    r = _summary(a, flat, {}, [1, 2, 3], {}, {}, 0.0, "cpu", auc)
    assert r["verdict"].startswith("no claim")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--seeds", "a-b"], "--seeds 'a-b'"),
        (["--warmups", "1.5"], "warmup shares must be in"),
        (["--clip-ratios", "x"], "--clip-ratios 'x'"),
        (["--factor", "1"], "--factor >= 2"),
        (["--scalings", "sqrt/cube"], "--scalings 'sqrt/cube': expected RULE or DENSE/ROWS"),
        (["--set", "train.schedule.decay='x'"], "train.schedule.decay must be one of"),
        (["--emb-optimizer", "lamb"], "embedding.optimizer must be one of"),
        (["--jobs", "0"], "--jobs must be >= 1"),
    ],
)
def test_bad_flags_refused_before_training(argv, match):
    with pytest.raises(ConfigError, match=match):
        main(argv)
