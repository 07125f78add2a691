"""Table-row-wise with its in-host reduction (``neorec.distributed.twrw``) on 4 gloo ranks taken
as 2 hosts x 2 ranks: bitwise row-wise over the same shards, equal to one process, and the
pooled bytes that cross hosts counted: ranks-per-host times fewer than row-wise's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import TRANSPORT, run_ranks

from neorec.builder import build_dlrm, dense_optimizer, distributed_model
from neorec.config import (
    CommConfig,
    Config,
    DataConfig,
    EmbeddingConfig,
    ModelConfig,
    TableConfig,
    TrainConfig,
)
from neorec.data.batch import Batch
from neorec.distributed.codecs import make_codec
from neorec.distributed.comm import host_transport
from neorec.sharding.types import (
    ShardingPlan,
    ShardingType,
    data_parallel,
    row_wise,
    table_row_wise,
)
from neorec.sparse import SparseFeatures
from neorec.train.trainer import train_step

# Uneven rows (37 on 2 ranks), a table shared by two features, a data-parallel table beside them.
TABLES = [
    TableConfig(name="a", rows=37, dim=8),
    TableConfig(name="b", rows=5, dim=8, features=["b", "b2"]),
    TableConfig(name="c", rows=10, dim=8),
]
B, WORLD, RPH, STEPS = 16, 4, 2, 2
POOLED = ("fwd_pooled", "bwd_grads", "fwd_host_reduce", "bwd_host_reduce")


def _cfg() -> Config:
    return Config(
        model=ModelConfig(num_dense=5, bottom_mlp=[8, 8], top_mlp=[8, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in TABLES], optimizer="rowwise_adagrad", lr=0.1
        ),
        data=DataConfig(batch_size=B),
        train=TrainConfig(dense_optimizer="sgd", dense_lr=0.1, seed=3),
        # The embedding group's all-to-alls over gloo; over shared memory under `make test-shm`.
        comm=CommConfig(transport="shm" if TRANSPORT == "shm" else "gloo"),
    )


def _batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for t in TABLES:
        for _ in t.features:
            lens = torch.randint(0, 5, (B,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.rows, (int(lens.sum()),), generator=g))
    v = torch.cat(values)
    feats = [f for t in TABLES for f in t.features]
    sparse = SparseFeatures(feats, v, torch.cat(lengths), torch.rand(v.numel(), generator=g))
    return Batch(torch.randn(B, 5, generator=g), sparse, (torch.rand(B, generator=g) < 0.4).float())


def _plans() -> dict[str, ShardingPlan]:
    a, b, c = TABLES
    dp = data_parallel(c, WORLD)
    everywhere = list(range(WORLD))
    return {
        "twrw": ShardingPlan(
            WORLD, RPH, [table_row_wise(a, 0, RPH), table_row_wise(b, 1, RPH), dp]
        ),
        # Row-wise over the very shards of the table-row-wise plan: the bitwise reference.
        "rw_same": ShardingPlan(WORLD, RPH, [row_wise(a, [0, 1]), row_wise(b, [2, 3]), dp]),
        "rw": ShardingPlan(WORLD, RPH, [row_wise(a, everywhere), row_wise(b, everywhere), dp]),
    }


def _run(rank: int, plan: ShardingPlan) -> tuple[torch.Tensor, dict, dict[str, int]]:
    """Train ``STEPS`` steps; (logits of a test batch, every table, pooled bytes over ranks)."""
    cfg = _cfg()
    dm = distributed_model(cfg, plan)
    assert host_transport(dm.ebc.group) is not None or TRANSPORT != "shm"
    dm.comm_stats.ranks_per_host = RPH
    opt = dense_optimizer(cfg.train, dm.dense_parameters())
    lo, hi = rank * (B // WORLD), (rank + 1) * (B // WORLD)
    for step in range(1, STEPS + 1):
        train_step(dm, opt, _batch(100 + step).slice(lo, hi), step)
    st = dm.comm_stats
    counts = [st.inter_host.get(n, 0) for n in POOLED] + [st.bytes_sent.get(n, 0) for n in POOLED]
    total = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(total)
    names = [f"inter:{n}" for n in POOLED] + [f"all:{n}" for n in POOLED]
    test = _batch(999)
    with torch.no_grad():
        out = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
        if plan.tables[0].sharding_type is ShardingType.TABLE_ROW_WISE:
            # Wire codecs apply once, to the sums that leave the host stage.
            dm.ebc.codecs = (make_codec("bf16"), make_codec("bf16"))
            coded = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
            torch.testing.assert_close(coded, out, rtol=0.05, atol=0.02)
    tables = {t.name: dm.ebc.gather_table(t.name) for t in TABLES}
    return out, tables, dict(zip(names, total.tolist(), strict=True))


def _check(rank: int, world: int) -> None:
    got = {name: _run(rank, plan) for name, plan in _plans().items()}
    (twrw, twrw_tables, twrw_bytes), (rw, rw_tables, _) = got["twrw"], got["rw_same"]
    where = f"rank {rank}"
    assert torch.equal(twrw, rw), f"{where}: TWRW logits are not row-wise's"
    for name, t in twrw_tables.items():
        assert torch.equal(t, rw_tables[name]), f"{where}: table {name} differs from row-wise's"
    # The specification: one process on the global batches.
    cfg = _cfg()
    ref = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, ref.dense_parameters())
    for step in range(1, STEPS + 1):
        train_step(ref, opt, _batch(100 + step), step)
    test = _batch(999)
    lo, hi = rank * (B // world), (rank + 1) * (B // world)
    with torch.no_grad():
        expected = ref(test.dense, test.sparse)[lo:hi]
    torch.testing.assert_close(twrw, expected, rtol=1e-5, atol=1e-6)
    for name, t in twrw_tables.items():
        torch.testing.assert_close(t, ref.ebc.table_weight(name), rtol=1e-5, atol=1e-6)
    # Bytes: one [b, dim] block per (TWRW feature, sample rank on another host), each way.
    b = B // world
    feats = [t for t in TABLES[:2] for _ in t.features]
    cross = 2 * STEPS * sum((world - RPH) * b * t.dim * 4 for t in feats)
    inter = {
        k: sum(v for n, v in by.items() if n.startswith("inter:")) for k, (_, _, by) in got.items()
    }
    assert twrw_bytes["inter:fwd_host_reduce"] == twrw_bytes["inter:bwd_host_reduce"] == 0
    assert twrw_bytes["all:fwd_host_reduce"] > 0 and twrw_bytes["all:bwd_host_reduce"] > 0
    assert inter["twrw"] == cross, inter
    assert inter["rw_same"] == RPH * cross, inter
    assert inter["rw"] >= RPH * inter["twrw"], inter


@pytest.mark.bitwise
def test_twrw_reduces_in_host_bitwise_row_wise_and_equals_one_process() -> None:
    run_ranks(_check, WORLD)
