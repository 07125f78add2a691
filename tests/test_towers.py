"""DMT towers, unsharded: config, tower modules, ``TowerDLRM`` vs the flat model, the partitioner,
the grouped teacher and the learned partition (campaign "towers config" for bad inputs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from faults import campaign

from neorec.bench.towers_quality import adjusted_rand, captured, grouped_config, grouped_data
from neorec.builder import build_dlrm, build_flat_dlrm, tower_groups
from neorec.config import Config, ConfigError, TowersConfig, load_config
from neorec.data.synthetic import SyntheticClickData
from neorec.modules.dlrm import DLRM
from neorec.modules.towers import TowerDLRM, TowerModule, feature_affinity, table_affinity
from neorec.sharding.tables import TableSpec
from neorec.sharding.towers import balance_cap, lpt, partition_tables, tower_loads
from neorec.train.towers_warmup import learned_groups

C = campaign("towers config")


def _cfg(*over: str) -> Config:
    return load_config(None, ["embedding.rows=300", "data.batch_size=64", *over])


# ---- TowerDLRM with identity towers = the flat DLRM in tower order ------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_identity_towers_equal_flat_model_in_tower_order(precision):
    torch.set_num_threads(1)
    groups = [["t3", "t0"], ["t5", "t1", "t4"], ["t2"]]
    over = ["embedding.num_tables=6", f"embedding.precision='{precision}'"]
    cfg = _cfg(*over, f"towers.groups={groups}")
    towered = build_dlrm(cfg)
    assert isinstance(towered, TowerDLRM)
    assert towered.tower_tables == [["t0", "t3"], ["t1", "t4", "t5"], ["t2"]]
    assert towered.tower_features == [[0, 3], [1, 4, 5], [2]]
    flat_cfg = _cfg(*over)
    by_name = {t.name: t for t in flat_cfg.embedding.tables}
    flat_cfg.embedding.tables = [by_name[n] for g in towered.tower_tables for n in g]
    flat = build_flat_dlrm(flat_cfg)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    models = (towered, flat)
    opts = [torch.optim.Adagrad(list(m.dense_parameters()), lr=0.05) for m in models]
    for step in range(4):  # forward and three updates: same logits, bitwise
        b = data.batch("train", step, 64)
        outs = []
        for m, opt in zip(models, opts):
            y = m(b.dense, b.sparse)
            outs.append(y.detach())
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(y, b.labels).backward()
            opt.step()
        assert torch.equal(outs[0], outs[1]), (step, (outs[0] - outs[1]).abs().max())
    for name in by_name:
        assert torch.equal(towered.ebc.table_weight(name), flat.ebc.table_weight(name))
    # the dense part is the flat model's (same seed, same init, same training)
    for p, q in zip(towered.dense_arch.parameters(), flat.dense_arch.parameters()):
        assert torch.equal(p, q)


def test_tower_module_kinds_shapes():
    x = torch.randn(5, 3 * 4)
    ident = TowerModule("identity", 3, 4, out_vectors=7)
    assert ident.out_vectors == 3 and ident(x) is x and not list(ident.parameters())
    for kind in ("mlp", "dot", "dcn"):
        m = TowerModule(kind, 3, 4, out_vectors=2)
        y = m(x)
        assert m.out_vectors == 2 and y.shape == (5, 8), kind
        y.sum().backward()
        assert all(p.grad is not None for p in m.parameters()), kind
    # the dot module sees the pairwise dots: a change of one feature's direction that keeps the
    # flattened sum moves its output differently from the mlp's
    one = TowerModule("dot", 1, 4, 1)
    assert one(torch.randn(2, 4)).shape == (2, 4)  # a single feature: no pairs


def _train_loss_curve(cfg: Config, data: SyntheticClickData, groups, steps: int):
    model = build_dlrm(cfg, groups=groups)
    assert isinstance(model, TowerDLRM)
    before = [p.detach().clone() for p in model.towers.parameters()]
    opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=0.05)
    losses = []
    for i in range(steps):
        b = data.batch("train", i % 8, cfg.data.batch_size)  # a few batches, revisited
        loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    moved = all(not torch.equal(a, p) for a, p in zip(before, model.towers.parameters()))
    return losses, moved


@pytest.mark.parametrize("kind", ["identity", "mlp", "dot", "dcn"])
def test_each_tower_module_trains(kind):
    torch.set_num_threads(1)
    cfg = grouped_config(0, tables=6, towers=2, module=kind, out_vectors=2, batch=128)
    data = grouped_data(cfg, 2)
    losses, moved = _train_loss_curve(cfg, data, data.group_tables(), 40)
    first, last = np.mean(losses[:8]), np.mean(losses[-8:])
    assert last < 0.9 * first, (kind, first, last)
    assert moved or kind == "identity", "tower module parameters were not trained"


def test_build_dlrm_towers_from_config():
    cfg = _cfg("towers.count=3")
    model = build_dlrm(cfg)
    assert isinstance(model, TowerDLRM) and len(model.towers) == 3
    assert sorted(n for g in model.tower_tables for n in g) == [f"t{i}" for i in range(8)]
    assert isinstance(build_dlrm(_cfg()), DLRM)
    rnd = tower_groups(_cfg("towers.count=3", "towers.partitioner='random'", "towers.seed=5"))
    assert rnd == tower_groups(
        _cfg("towers.count=3", "towers.partitioner='random'", "towers.seed=5")
    )
    learned = _cfg("towers.count=2", "towers.partitioner='learned'")
    assert tower_groups(learned) is None
    C.expect_error("build: learned without groups", lambda: build_dlrm(learned), "learned_groups")
    m = build_dlrm(learned, groups=[["t0", "t1", "t2", "t3"], ["t4", "t5", "t6", "t7"]])
    assert isinstance(m, TowerDLRM)
    mlp = build_dlrm(_cfg("towers.count=2", "towers.module='mlp'", "towers.out_vectors=3"))
    assert isinstance(mlp, TowerDLRM) and mlp.dense_arch.num_features == 6
    names = {n for n, _ in mlp.named_parameters()}
    assert {n for n, _ in mlp.named_parameters() if n.startswith("towers.")} <= names
    dense = {id(p) for p in mlp.dense_parameters()}
    assert all(id(p) in dense for p in mlp.towers.parameters())
    C.check()


# ---- the partitioner ------------------------------------------------------------------------
def test_partition_deterministic_and_within_bound():
    rng = random.Random(0)
    for case in range(30):
        n = rng.randint(3, 40)
        costs = [rng.uniform(0.1, 3.0) ** 2 for _ in range(n)]
        if case % 5 == 0:
            costs[0] = sum(costs)  # one table larger than the mean tower: LPT's bound rules
        tables = [(f"x{i}", c) for i, c in enumerate(costs)]
        count = rng.randint(1, min(n, 6))
        aff = np.random.default_rng(case).random((n, n))
        balance = rng.choice([1.0, 1.1, 1.25, 2.0])
        cap = balance_cap(np.array(costs), count, balance)
        assert cap >= balance * sum(costs) / count - 1e-9
        by_name = dict(tables)
        for method in ("balanced", "random", "learned"):
            kw = {"affinity": aff} if method == "learned" else {}
            a = partition_tables(tables, count, method, seed=case, balance=balance, **kw)
            b = partition_tables(tables, count, method, seed=case, balance=balance, **kw)
            assert a == b, (case, method)
            assert len(a) == count and all(a), (case, method, a)
            assert sorted(x for g in a for x in g) == sorted(by_name)
            worst = max(sum(by_name[x] for x in g) for g in a)
            assert worst <= cap * (1 + 1e-9), (case, method, worst, cap)
    # equal costs: the bound is balance x mean, and LPT is perfectly even
    eq = [(f"t{i}", 1.0) for i in range(12)]
    assert balance_cap(np.ones(12), 4, 1.25) == pytest.approx(3.75)
    assert all(len(g) == 3 for g in partition_tables(eq, 4, "balanced"))
    seeds = {str(partition_tables(eq, 4, "random", seed=s)) for s in range(5)}
    assert len(seeds) > 1, "the random partition ignores its seed"
    # the cost model's per-table cost: a table with 10x the rows and pooling costs more
    small = TableSpec(name="s", rows=1000, dim=16, pooling_factor=1)
    big = TableSpec(name="b", rows=100_000, dim=16, pooling_factor=10)
    g = partition_tables([small, big, TableSpec(name="m", rows=1000, dim=16, pooling_factor=1)], 2)
    assert ["b"] in g


def test_learned_partitioner_maximizes_within_affinity():
    rng = np.random.default_rng(3)
    n, k = 16, 4
    planted = rng.permutation(n) % k
    aff = (planted[:, None] == planted[None, :]) + 0.3 * rng.random((n, n))
    tables = [(f"t{i}", 1.0) for i in range(n)]
    got = partition_tables(tables, k, "learned", affinity=aff)
    want = [[f"t{i}" for i in range(n) if planted[i] == g] for g in range(k)]
    assert adjusted_rand(got, want) == 1.0
    assert lpt(np.ones(5), 5).tolist() == [0, 1, 2, 3, 4]
    assert tower_loads(np.array([0, 1, 1]), np.array([1.0, 2.0, 3.0]), 2).tolist() == [1.0, 5.0]


def test_partitioner_bad_inputs():
    t = [("a", 1.0), ("b", 2.0)]
    C.expect_error("partition: count 0", lambda: partition_tables(t, 0), "count")
    C.expect_error("partition: count > tables", lambda: partition_tables(t, 3), "count")
    C.expect_error("partition: method", lambda: partition_tables(t, 1, "lerned"), "partitioner")
    C.expect_error("partition: no affinity", lambda: partition_tables(t, 1, "learned"), "affinity")
    C.expect_error(
        "partition: affinity shape",
        lambda: partition_tables(t, 1, "learned", affinity=np.ones((3, 3))),
        "affinity",
    )
    C.expect_error("partition: nan cost", lambda: partition_tables([("a", float("nan"))], 1), "a")
    C.expect_error("partition: balance", lambda: partition_tables(t, 1, balance=0.5), "balance")
    C.expect_error("partition: duplicate", lambda: partition_tables([("a", 1), ("a", 1)], 1), "a")
    C.check()


# ---- the grouped teacher and the learned partition --------------------------------------------
def test_grouped_teacher_default_unchanged_and_groups_random():
    cfg = grouped_config(0)
    flat = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    zero = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, teacher_groups=0)
    grouped = grouped_data(cfg, 3)
    (b0, p0), (b1, p1) = (
        flat.batch_with_probs("train", 2, 64),
        zero.batch_with_probs("train", 2, 64),
    )
    assert torch.equal(p0, p1) and torch.equal(b0.labels, b1.labels)
    b2, p2 = grouped.batch_with_probs("train", 2, 64)
    assert torch.equal(b0.dense, b2.dense) and torch.equal(b0.sparse.values, b2.sparse.values)
    assert not torch.allclose(p0, p2)  # the within-group term changes the labels' probabilities
    sizes = sorted(len(g) for g in grouped.group_tables())
    assert sizes == [4, 4, 4]
    contiguous = [[f"t{i}" for i in range(j * 4, j * 4 + 4)] for j in range(3)]
    assert adjusted_rand(grouped.group_tables(), contiguous) < 1.0  # not table order
    inter = grouped.table_interaction()
    g = np.array(grouped.table_group)
    assert float(inter[torch.from_numpy(g[:, None] != g[None, :])].abs().sum()) == 0.0
    C.expect_error(
        "data: teacher_groups > tables",
        lambda: grouped_data(cfg, 13),
        "data.teacher_groups",
    )
    C.check()


def test_learned_recovers_planted_groups():
    """Warm-up 600 steps of the flat model on the grouped teacher (12 tables, 3 planted groups of
    4), then the normalized H-statistic clustered under the balance bound: the planted groups are
    recovered (measured: adjusted Rand 1.0 for seeds 0, 1, 2; |correlation| of the pooled
    embeddings is at chance, ~0.1, since ids are drawn independently per table)."""
    torch.set_num_threads(1)
    cfg = grouped_config(0)
    data = grouped_data(cfg, 3)
    bs = cfg.data.batch_size
    groups = learned_groups(cfg, (data.batch("train", i, bs) for i in range(600)))
    planted = data.group_tables()
    assert adjusted_rand(groups, planted) >= 0.7, (groups, planted)
    assert captured(groups, data) >= 0.9
    rnd = tower_groups(grouped_config(0, extra=["towers.partitioner='random'"]))
    assert rnd is not None and captured(groups, data) > captured(rnd, data)
    C.expect_error(
        "learned: too few warm-up batches",
        lambda: learned_groups(cfg, (data.batch("train", i, bs) for i in range(3))),
        "towers.warmup_steps",
    )
    C.check()


def test_affinity_helpers():
    cfg = _cfg("embedding.num_tables=3")
    model = build_flat_dlrm(cfg)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    for method in ("hstat", "corr"):
        a = feature_affinity(model, [data.batch("train", 0, 64)], method)
        assert a.shape == (3, 3) and torch.equal(a, a.T) and torch.all(a.diagonal() == 0)
    fa = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 3.0], [2.0, 3.0, 0.0]])
    tables = load_config(
        None,
        [
            "embedding.tables=[{name='a', rows=3, dim=16, features=['f', 'g']}, "
            "{name='b', rows=3, dim=16}]"
        ],  # fmt: skip
    ).embedding.tables
    assert table_affinity(fa, tables).tolist() == [[0.0, 5.0], [5.0, 0.0]]


# ---- config ----------------------------------------------------------------------------------
BAD = [
    (["towers.count=-1"], "towers.count"),
    (["towers.count=9"], "towers.count 9 is more than the 8 tables"),
    (["towers.module='mpl'"], "did you mean 'mlp'"),
    (["towers.partitioner='learnt'"], "towers.partitioner"),
    (["towers.partitioner='manual'"], "needs towers.groups"),
    (["towers.out_vectors=0"], "towers.out_vectors"),
    (["towers.warmup_steps=0"], "towers.warmup_steps"),
    (["towers.balance=0.9"], "towers.balance"),
    (["towers.balance=nan"], "towers.balance"),
    (["towers.seed=-2"], "towers.seed"),
    (["towers.groups=[['t0']]"], "leaves out table(s)"),
    (["towers.groups=[['t0','t1','t2','t3'],['t3','t4','t5','t6','t7']]"], "'t3' is in tower 0"),
    (["towers.groups=[['t0','t1','t2','t3'],['t4','t5','t6','t8']]"], "unknown table 't8'"),
    (["towers.groups=[[],['t0']]"], "towers.groups[0] must be a non-empty list"),
    (["towers.groups=['t0']"], "towers.groups[0] must be a list"),
    (["towers.groups=[[1]]"], "towers.groups[0][0]"),
    (["towers.groups=[['t0','t1','t2','t3'],['t4','t5','t6','t7']]", "towers.count=3"], "count 3"),
    (
        [
            "towers.groups=[['t0','t1','t2','t3'],['t4','t5','t6','t7']]",
            "towers.partitioner='random'",
        ],
        "must be 'manual'",
    ),
    (
        [
            "embedding.tables=[{name='a', rows=3, dim=16, features=['fa', 'fb']}, "
            "{name='b', rows=3, dim=16}]",
            "towers.groups=[['fa'], ['b']]",
        ],
        "names feature 'fa', which reads table 'a'",
    ),
]


def test_config_campaign():
    for over, match in BAD:
        C.expect_error(f"config: {over}", lambda o=over: load_config(None, o), match)
    for over in (
        ["towers.count=8", "towers.partitioner='random'"],
        ["towers.groups=[['t0','t1','t2','t3'],['t4','t5','t6','t7']]", "towers.count=2"],
        ["towers.count=2", "towers.module='dcn'", "towers.out_vectors=4", "towers.balance=1"],
    ):
        try:
            cfg = load_config(None, over)
            assert cfg.towers.enabled and cfg.towers.method in ("random", "manual", "balanced")
            C.record(f"config ok: {over}", "handled", "loads")
        except Exception as e:  # noqa: BLE001 - a valid config refused
            C.record(f"config ok: {over}", "crash", f"{type(e).__name__}: {e}")
    tw = TowersConfig(groups=[["a"], ["b", "c"]])
    assert tw.num_towers == 2 and tw.method == "manual" and tw.count == 0
    assert TowersConfig().method == "balanced" and not TowersConfig().enabled
    C.expect_error(
        "code: TowersConfig(count=True)", lambda: TowersConfig(count=True), "towers.count"
    )
    C.check()


def test_config_towers_cli_one_line(tmp_path):
    C.expect_cli_error(
        "cli: towers.count too large",
        ["train", "--set", "towers.count=99", "--set", f"train.run_dir='{tmp_path / 'r'}'"],
        "towers.count 99",
        cwd=str(tmp_path),
    )
    C.check()


def test_config_error_type():
    with pytest.raises(ConfigError):
        load_config(None, ["towers.count=100"])
