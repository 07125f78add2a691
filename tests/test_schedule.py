"""The lr schedule and the linear scaling rule: closed forms, both optimizers at the scheduled lr
(a hand-computed step), every collection's row lr set in place (a sharded one too), an exact
resume mid-warmup, and the config's refusals (one line each)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_checkpoint import _same_state, tiny_cfg
from test_collection import KINDS, _batch, _cfg

from neorec.builder import (
    build_collection,
    lr_scale,
    lr_schedule,
    scaling_line,
    sharded_collection,
)
from neorec.config import ConfigError, TableConfig, load_config
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.schedule import LrSchedule
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sparse import SparseFeatures
from neorec.train.trainer import Trainer


# ---- closed forms ----------------------------------------------------------------------------
def _f(total: int, steps: list[int], **kw: Any) -> list[float]:
    s = LrSchedule(1.0, 1.0, total, **kw)
    return [s.factor(i) for i in steps]


def test_warmup_then_constant():
    got = _f(20, [1, 2, 3, 4, 5, 20], warmup_steps=4)
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    got = _f(20, [1, 2, 4], warmup_steps=4, warmup_start=0.2)
    assert got == pytest.approx([0.4, 0.6, 1.0])


def test_step_decay():
    got = _f(20, [2, 3, 5, 6, 8, 9, 20], warmup_steps=2, decay="step", step_size=3, gamma=0.5)
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.5**5])  # (20 - 3) // 3 = 5


def test_polynomial_decay():
    # p = (s - 1) / 10: 0, 0.5, 0.9
    got = _f(10, [1, 6, 10], decay="polynomial", power=2.0)
    assert got == pytest.approx([1.0, 0.25, 0.01])
    got = _f(10, [6], decay="polynomial", power=1.0, end_factor=0.2)
    assert got == pytest.approx([0.2 + 0.8 * 0.5])


def test_cosine_decay_after_warmup():
    # W = 4, T = 14: p = (s - 5) / 10 -> s 5: 0, s 10: 0.5, s 14: 0.9 (cos(0.9 pi) = -0.95106)
    got = _f(14, [4, 5, 10, 14], warmup_steps=4, decay="cosine", end_factor=0.1)
    assert got == pytest.approx([1.0, 1.0, 0.55, 0.1 + 0.9 * 0.5 * (1 - 0.9510565163)])
    f = _f(14, list(range(1, 15)), warmup_steps=4, decay="cosine")
    assert all(a < b for a, b in zip(f[:3], f[1:4])) and all(a > b for a, b in zip(f[4:], f[5:]))
    assert min(f) > 0  # an end factor of 0 is reached after the last step, never trained at


def test_scaling_rule_and_its_line():
    cfg = load_config(None, ["train.lr_scaling='linear'", "train.reference_batch=64"])
    assert lr_scale(cfg) == 8.0  # the default global batch 512
    line = scaling_line(cfg)
    assert line is not None and line.startswith("lr scaled x8 (linear")
    assert "dense 0.05 -> 0.4" in line and "rows 0.05 -> 0.4" in line
    cfg = load_config(None, ["train.lr_scaling='sqrt'", "train.reference_batch=128"])
    assert lr_scale(cfg) == 2.0 and lr_schedule(cfg, 100).dense_lr == pytest.approx(0.1)
    assert scaling_line(load_config()) is None and lr_scale(load_config()) == 1.0


# ---- the lr reaches both optimizers ----------------------------------------------------------
def test_one_step_at_the_scheduled_lr_by_hand():
    """Row SGD and dense SGD at step 2 of a 4-step warmup (factor 0.5): the updates computed
    by hand from the known gradients."""
    ebc = EmbeddingBagCollection(
        [TableConfig(name="t", rows=10, dim=4)],
        CollectionSpec(RowOptimizer(kind="sgd", lr=1.0), backend="reference", seed=1),
    )
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    sched = LrSchedule(dense_lr=0.2, rows_lr=0.4, total_steps=10, warmup_steps=4)
    sparse = SparseFeatures(["t"], torch.tensor([1, 3, 3, 7]), torch.tensor([2, 2]))
    c, x = torch.randn(2, 4), torch.randn(5, 3)
    w0, lw0, lb0 = ebc.table_weight("t").clone(), lin.weight.detach().clone(), lin.bias.detach()
    lb0 = lb0.clone()
    sched.apply(2, opt, ebc)
    loss = (ebc(sparse) * c).sum() + lin(x).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    want = w0.clone()  # bag 0 = rows 1, 3; bag 1 = rows 3, 7; row lr 0.4 * 0.5
    want[1] -= 0.2 * c[0]
    want[3] -= 0.2 * (c[0] + c[1])
    want[7] -= 0.2 * c[1]
    torch.testing.assert_close(ebc.table_weight("t"), want)
    # d sum(xW^T + b) / dW = 1 x sum(x), / db = 5; dense lr 0.2 * 0.5
    torch.testing.assert_close(lin.weight.detach(), lw0 - 0.1 * x.sum(0).expand(2, 3))
    torch.testing.assert_close(lin.bias.detach(), lb0 - 0.1 * 5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and ebc.optimizer.lr == 0.2


def _nested(ebc: EmbeddingCollection) -> list[float]:
    return [m.optimizer.lr for m in ebc.modules() if isinstance(m, EmbeddingCollection)]


@pytest.mark.bitwise
@pytest.mark.parametrize("kind", [*sorted(KINDS), "sharded"])
def test_set_lr_trains_every_collection_as_built_with_that_lr(tmp_path: Any, kind: str):
    """``set_lr(x)`` on a collection built at another lr: every part holds x, and a step equals
    the step of the same collection built at x, bitwise."""
    specs = KINDS[kind][0] if kind != "sharded" else [{}, {}]

    def built(lr: float, where: str) -> EmbeddingCollection:
        cfg = _cfg(tmp_path / where, specs, optimizer="rowwise_adagrad")
        cfg.embedding.lr = lr
        if kind != "sharded":
            return build_collection(cfg)
        return sharded_collection(cfg, plan_by_type(cfg.embedding.tables, 1, 1, "row_wise"))

    moved, made = built(0.01, "a"), built(0.3, "b")
    moved.set_lr(0.3)
    assert set(_nested(moved)) == {0.3} and len(_nested(moved)) == len(_nested(made))
    for ebc in (moved, made):
        batch = _batch(list(ebc.feature_names))
        ebc.prefetch(batch)
        ebc.stage_input_dist(batch, batch)
        ebc(batch).sum().backward()
        ebc.flush()
    for t in made.tables:
        assert torch.equal(moved.table_weight(t.name), made.table_weight(t.name)), t.name
    for ebc in (moved, made):
        ebc.close()


# ---- exact resume ------------------------------------------------------------------------------
@pytest.mark.bitwise
def test_resume_mid_warmup_is_bitwise(tmp_path):
    """8 steps straight == 5 steps failing after the checkpoint at step 3 (warmup of 5), then
    resumed: weights, optimizer state, lrs and evals bitwise."""
    common = [
        "train.steps=8",
        "train.eval_every=4",
        "train.save_model=false",
        "data.eval_samples=128",
        "train.schedule.warmup_steps=5",
        "train.schedule.decay='cosine'",
        "train.lr_scaling='linear'",
        "train.reference_batch=32",
        "checkpoint.bits=32",
        "checkpoint.opt_bits=32",
        "checkpoint.every_steps=3",
    ]
    straight = Trainer(tiny_cfg(tmp_path / "a", *common))
    ra = straight.fit()
    with pytest.raises(RuntimeError, match="injected failure"):
        Trainer(tiny_cfg(tmp_path / "b", *common, "system.fail_at='0:5'")).fit()
    resumed = Trainer(tiny_cfg(tmp_path / "b", *common, "checkpoint.resume=latest"))
    rb = resumed.fit()
    assert _same_state(straight.model, resumed.model)
    sa, sb = straight.opt.state_dict(), resumed.opt.state_dict()
    for k, v in sa["state"].items():
        assert all(torch.equal(t, sb["state"][k][n]) for n, t in v.items())
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]
    assert straight.model.ebc.optimizer.lr == resumed.model.ebc.optimizer.lr
    assert ra["evals"] == rb["evals"] and ra["eval"] == rb["eval"]
    assert ra["train"]["final_loss"] == rb["train"]["final_loss"]


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "over, match",
    [
        (["train.schedule.decay='linear'"], "train.schedule.decay must be one of"),
        (["train.schedule.warmup_steps=-1"], "train.schedule.warmup_steps must be >= 0"),
        (["train.schedule.warmup_start=1.5"], "train.schedule.warmup_start must be <= 1"),
        (["train.schedule.warmup_start=0.5"], "warmup_start 0.5 is set but warmup_steps is 0"),
        (["train.schedule.decay='step'"], "train.schedule.step_size must be > 0"),
        (["train.schedule.gamma=0.5"], "train.schedule.gamma: not read by"),
        (["train.schedule.decay='cosine'", "train.schedule.power=2"], "schedule.power: not read"),
        (["train.schedule.power=nan"], "train.schedule.power must be a finite number"),
        (["train.schedule.end_factor=-0.1"], "train.schedule.end_factor must be >= 0"),
        (["train.schedule=1"], "train.schedule is a section"),
        (["train.schedule.warmup=3"], "did you mean 'warmup_steps'"),
        (["train.lr_scaling='cubic'"], "train.lr_scaling must be one of"),
        (["train.lr_scaling='linear'"], "needs train.reference_batch"),
        (["train.reference_batch=64"], "train.lr_scaling is 'none'"),
    ],
)
def test_bad_config_one_line(over, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, over)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "over, total, match",
    [
        (["train.schedule.decay='cosine'"], None, "needs the run's length"),
        (["train.schedule.warmup_steps=10", "train.schedule.decay='cosine'"], 10, "no step"),
        (["train.schedule.warmup_steps=11"], 10, "leaves no step of the run's 10"),
        (
            [
                "train.schedule.decay='step'",
                "train.schedule.step_size=1",
                "train.schedule.gamma=1e-9",
            ],
            100,
            "0 in float32",
        ),
    ],
)
def test_schedule_the_run_cannot_follow(over, total, match):
    cfg = load_config(None, over)
    with pytest.raises(ConfigError, match=match) as e:
        lr_schedule(cfg, total)
    assert "\n" not in str(e.value)


def test_resume_note_names_what_changes_the_lr():
    """A checkpoint's schedule vs this run's: the run's length counts only under a decay."""
    const = LrSchedule(0.1, 0.1, 8, warmup_steps=2)
    assert const.differences(LrSchedule(0.1, 0.1, 4, warmup_steps=2).state_dict()) == []
    cos = LrSchedule(0.1, 0.1, 8, decay="cosine")
    assert cos.differences(LrSchedule(0.1, 0.1, 4, decay="cosine").state_dict()) == [
        "total_steps 4 -> 8"
    ]
    assert const.differences(LrSchedule(0.2, 0.1, 8, warmup_steps=2).state_dict()) == [
        "dense_lr 0.2 -> 0.1"
    ]
