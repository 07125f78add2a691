"""SPTT (DMT's tower transform) on gloo: 4 ranks as 2 hosts x 2 against the unsharded model."""

from __future__ import annotations

import torch
from dist_util import run_ranks
from torch import nn

from neorec.builder import build_dlrm, dense_optimizer
from neorec.config import Config, DataConfig, EmbeddingConfig, ModelConfig, TableConfig, TrainConfig
from neorec.data.batch import Batch
from neorec.modules.dlrm import DenseArch
from neorec.sparse import SparseFeatures
from neorec.train.trainer import train_step

TABLES = [
    TableConfig(name="a", rows=37, dim=8),
    TableConfig(name="b", rows=5, dim=8, features=["b", "b2"]),
    TableConfig(name="c", rows=50, dim=8),
    TableConfig(name="d", rows=10, dim=8),
    TableConfig(name="e", rows=21, dim=8),
]
GROUPS = [["c", "a"], ["b", "d", "e"]]  # tower 0 on host 0, tower 1 on host 1
B = 16


class _Identity(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.out_vectors = n

    def forward(self, x):
        return x


def _cfg(opt: str = "rowwise_adagrad", tables=TABLES) -> Config:
    return Config(
        model=ModelConfig(num_dense=5, bottom_mlp=[8, 8], top_mlp=[8, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in tables], optimizer=opt, lr=0.1
        ),
        data=DataConfig(batch_size=B),
        train=TrainConfig(dense_optimizer="sgd", dense_lr=0.1, seed=7),
    )


def _batch(seed: int, weighted: bool) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for t in TABLES:
        for _ in t.features:
            lens = torch.randint(0, 4, (B,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.rows, (int(lens.sum()),), generator=g))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=g) if weighted else None
    feats = [f for t in TABLES for f in t.features]
    return Batch(
        torch.randn(B, 5, generator=g),
        SparseFeatures(feats, v, torch.cat(lengths), w),
        (torch.rand(B, generator=g) < 0.4).float(),
    )


def _tower_order() -> list[TableConfig]:
    by = {t.name: t for t in TABLES}
    return [by[n] for g in GROUPS for n in sorted(g, key=[t.name for t in TABLES].index)]


def _identity_rank(rank: int, world: int, opt: str, weighted: bool, root: str = "") -> None:
    """Train the towered model and the flat one; compare. With ``root``, also save a checkpoint
    every step and the final predictions (``_restore_rank`` restores them on another world)."""
    from neorec.builder import towered_model
    from neorec.checkpoint import CheckpointManager
    from neorec.config import CheckpointConfig
    from neorec.distributed.towers import tower_features

    cfg = _cfg(opt)
    feats = tower_features(cfg.embedding.tables, GROUPS)

    def build_dense():
        towers = nn.ModuleList(_Identity(len(f)) for f in feats)
        return towers, DenseArch(cfg.model, sum(len(f) for f in feats), 8)

    dm = towered_model(cfg, GROUPS, build_dense)
    ref = build_dlrm(_cfg(opt, _tower_order()))  # the flat model, features in tower order
    opt_ref = dense_optimizer(cfg.train, ref.dense_parameters())
    opt_dm = dense_optimizer(cfg.train, dm.dense_parameters())
    b = B // world
    lo, hi = rank * b, (rank + 1) * b
    ck = CheckpointConfig(
        policy="consecutive", bits=32, opt_bits=32, async_write=False, fsync=False
    )
    mgr = CheckpointManager(ck, dm, opt_dm, f"{root}/ck") if root else None
    for step in range(1, 4):
        batch = _batch(100 + step, weighted)
        train_step(ref, opt_ref, batch, step)
        train_step(dm, opt_dm, batch.slice(lo, hi), step)
        if mgr is not None:
            mgr.save(step)
    if mgr is not None:
        mgr.close()
        preds = _all_preds(dm, rank, world)
        if rank == 0:
            torch.save(preds, f"{root}/preds.pt")
    test = _batch(999, weighted)
    with torch.no_grad():
        want = ref(test.dense, test.sparse)[lo:hi]
        got = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for t in dm.ebc.tables:
        torch.testing.assert_close(
            dm.ebc.gather_table(t.name), ref.ebc.table_weight(t.name), rtol=1e-5, atol=1e-6
        )
    # only the tower's own tables live on this host
    assert {t.name for t in dm.ebc.tables} == set(GROUPS[rank // 2])
    inter = dm.comm_stats.inter_host
    assert inter.get("tower_fwd", 0) > 0 and inter.get("fwd_pooled", 0) == 0, inter
    assert inter.get("lengths", 0) == 0 and inter.get("ids", 0) == 0, inter


def test_sptt_identity_equals_flat_on_2_hosts_x_2():
    run_ranks(_identity_rank, 4, "rowwise_adagrad", False)


def test_sptt_adam_weighted_equals_flat_and_restores_under_another_world_size(tmp_path):
    """Adam with weighted bags on 2 hosts x 2 == flat; its checkpoints (saved every step by the
    4 ranks) restore under 2 hosts x 1 rank to the same predictions."""
    run_ranks(_identity_rank, 4, "adam", True, str(tmp_path))
    run_ranks(_restore_rank, 2, str(tmp_path))


def _identity_model(cfg):
    from neorec.builder import towered_model
    from neorec.distributed.towers import tower_features

    feats = tower_features(cfg.embedding.tables, GROUPS)

    def build_dense():
        towers = nn.ModuleList(_Identity(len(f)) for f in feats)
        return towers, DenseArch(cfg.model, sum(len(f) for f in feats), 8)

    return towered_model(cfg, GROUPS, build_dense)


def _all_preds(model, rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist

    test = _batch(999, False)
    b = B // world
    with torch.no_grad():
        mine = model(test.dense[rank * b : (rank + 1) * b], test.sparse.select_samples(
            rank * b, (rank + 1) * b))  # fmt: skip
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)


def _restore_rank(rank: int, world: int, root: str) -> None:
    from neorec.checkpoint import CheckpointManager
    from neorec.config import CheckpointConfig

    cfg = _cfg("adam")
    dm = _identity_model(cfg)
    opt = dense_optimizer(cfg.train, dm.dense_parameters())
    ck = CheckpointConfig(
        policy="consecutive", bits=32, opt_bits=32, async_write=False, fsync=False
    )
    CheckpointManager(ck, dm, opt, f"{root}/ck").restore("latest")
    preds = _all_preds(dm, rank, world)
    torch.testing.assert_close(preds, torch.load(f"{root}/preds.pt"), rtol=1e-5, atol=1e-6)
