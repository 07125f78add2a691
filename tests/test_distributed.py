"""Sharded training equals single-process training (spawned gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from neorec.builder import build_dlrm, dense_optimizer, distributed_model
from neorec.config import Config, DataConfig, EmbeddingConfig, ModelConfig, TableConfig, TrainConfig
from neorec.data.batch import Batch
from neorec.distributed.model_parallel import DistributedModel
from neorec.modules.dlrm import DLRM
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.types import ShardingPlan
from neorec.sparse import SparseFeatures
from neorec.train.trainer import train_step

# Uneven row splits (37, 50 rows), a table with fewer rows than ranks (3), a shared table.
TABLES = [
    TableConfig(name="a", rows=37, dim=8),
    TableConfig(name="b", rows=3, dim=8, features=["b", "b2"]),
    TableConfig(name="c", rows=50, dim=8),
    TableConfig(name="d", rows=10, dim=8),
]
B = 16


def make_cfg(opt: str, pooling: str = "sum") -> Config:
    return Config(
        model=ModelConfig(num_dense=5, bottom_mlp=[8, 8], top_mlp=[8, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in TABLES],
            optimizer=opt,
            lr=0.1,
            pooling=pooling,
        ),
        data=DataConfig(batch_size=B),
        train=TrainConfig(dense_optimizer="sgd", dense_lr=0.1, seed=7),
    )


def global_batch(seed: int, weighted: bool) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for t in TABLES:
        for _ in t.features:
            lens = torch.randint(0, 5, (B,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.rows, (int(lens.sum()),), generator=g))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=g) if weighted else None
    feats = [f for t in TABLES for f in t.features]
    sparse = SparseFeatures(feats, v, torch.cat(lengths), w)
    return Batch(torch.randn(B, 5, generator=g), sparse, (torch.rand(B, generator=g) < 0.4).float())


def plans(world: int) -> dict[str, ShardingPlan]:
    rph = 2 if world >= 4 else world
    out = {
        name: plan_by_type(TABLES, world, rph, name)
        for name in ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise")
    }
    mixed = {"a": "row_wise", "b": "data_parallel", "c": "column_wise", "d": "table_row_wise"}
    out["mixed"] = plan_by_type(TABLES, world, rph, "table_wise", mixed)
    return out


def train_both(
    rank: int,
    world: int,
    plan: ShardingPlan,
    cfg: Config,
    weighted: bool,
    steps: int,
    ref: DLRM | None = None,
) -> tuple[DLRM, DistributedModel, int, int]:
    """The one-process model (``ref``, else built from ``cfg``) and the distributed one, trained
    on the same global batches (this rank on its slice [lo, hi)): (ref, dm, lo, hi)."""
    ref = build_dlrm(cfg) if ref is None else ref
    dm = distributed_model(cfg, plan)
    opt_ref = dense_optimizer(cfg.train, ref.dense_parameters())
    opt_dm = dense_optimizer(cfg.train, dm.dense_parameters())
    b = B // world
    lo, hi = rank * b, (rank + 1) * b
    for step in range(1, steps + 1):
        batch = global_batch(100 + step, weighted)
        train_step(ref, opt_ref, batch, step)
        train_step(dm, opt_dm, batch.slice(lo, hi), step)
    return ref, dm, lo, hi


def check_equal(rank: int, world: int, plan: ShardingPlan, cfg: Config, weighted: bool) -> None:
    ref, dm, lo, hi = train_both(rank, world, plan, cfg, weighted, steps=3)
    test = global_batch(999, weighted)
    with torch.no_grad():
        expected = ref(test.dense, test.sparse)[lo:hi]
        got = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
    where = f"plan {plan.meta} opt {cfg.embedding.optimizer} rank {rank}/{world}"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    for t in TABLES:
        full = dm.ebc.gather_table(t.name)
        torch.testing.assert_close(
            full,
            ref.ebc.table_weight(t.name),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, n=t.name: f"{where} table {n}: {m}",
        )


def all_plans(rank: int, world: int) -> None:
    for name, plan in plans(world).items():
        plan.meta = {"name": name}
        for opt in ("sgd", "rowwise_adagrad"):
            check_equal(rank, world, plan, make_cfg(opt), weighted=False)
    plan = plans(world)["mixed"]
    plan.meta = {"name": "mixed-mean-weighted-adam"}
    check_equal(rank, world, plan, make_cfg("adam", pooling="mean"), weighted=True)


@pytest.mark.parametrize("world", [2, 4])
def test_every_sharding_type_equals_single_process(world):
    run_ranks(all_plans, world)


def _dp_hooks_see_every_rank(rank: int, world: int) -> None:
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection
    from neorec.modules.collection import CollectionSpec

    table = TableConfig(name="a", rows=10, dim=4)
    plan = plan_by_type([table], world, world, "data_parallel")
    ebc = ShardedEmbeddingBagCollection([table], CollectionSpec(), plan=plan)
    seen: list[int] = []
    ebc.add_update_hook(lambda lay, idx, off: seen.extend(idx.tolist()))
    before = ebc.gather_table("a").clone()
    # Rank r looks up only row 3*r: the update (and the dirty-row hooks) must cover all ranks' rows.
    sparse = SparseFeatures(["a"], torch.tensor([3 * rank]), torch.tensor([1]))
    ebc(sparse).sum().backward()
    changed = (ebc.gather_table("a") != before).any(1).nonzero().flatten().tolist()
    assert sorted(set(seen)) == changed == [3 * r for r in range(world)], (seen, changed)


def test_data_parallel_update_hooks_report_rows_of_every_rank():
    run_ranks(_dp_hooks_see_every_rank, 2)


def _reduce_scatter_check(rank: int, world: int) -> None:
    from neorec.distributed.comm import CommStats, ordered_all_reduce, reduce_scatter

    t = torch.arange(world * 6, dtype=torch.float32).view(world * 2, 3) * (rank + 1)
    stats = CommStats()
    got = reduce_scatter(t, stats=stats)
    full = sum(
        torch.arange(world * 6, dtype=torch.float32).view(world * 2, 3) * (r + 1)
        for r in range(world)
    )
    assert torch.equal(got, full[2 * rank : 2 * rank + 2])
    assert torch.equal(ordered_all_reduce(t), full)
    assert stats.bytes_sent["reduce_scatter"] == 4 * 6 * (world - 1)


def test_reduce_scatter_built_from_all_to_all():
    run_ranks(_reduce_scatter_check, 3)


# ---- dense blocks: N ranks compute bitwise the gradients of one process ------------------------


def _dense_grads(
    blocks: int, parts: int, batch: int = 32, dim: int = 8
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradients of a blocked dense arch, the batch fed as ``parts`` slices (as ``parts`` ranks
    would: each slice's loss is its mean / parts, and .grad adds the slices' sums). The loss is
    taken per block, as the trainer takes it: an elementwise kernel over 2 blocks' samples may
    round its vectorized body and its tail otherwise than over one block's (AVX-512: a 16-sample
    block is all tail), so the loss over the whole batch is not what each rank computes."""
    from neorec.distributed.dense_blocks import block_dense, per_block
    from neorec.modules.dlrm import DenseArch

    torch.manual_seed(0)
    arch = DenseArch(ModelConfig(bottom_mlp=[16, dim], top_mlp=[16, 1]), 3, dim)
    model = block_dense(arch, blocks)
    g = torch.Generator().manual_seed(1)
    dense, pooled = torch.randn(batch, 13, generator=g), torch.randn(batch, 3 * dim, generator=g)
    labels = (torch.rand(batch, generator=g) < 0.3).float()
    outs = []
    for d, p, y in zip(dense.chunk(parts), pooled.chunk(parts), labels.chunk(parts)):
        out = model(d, p)
        losses = per_block(torch.nn.functional.binary_cross_entropy_with_logits, blocks, out, y)
        (torch.stack(losses).mean() / parts).backward()
        outs.append(out.detach())
    return [q.grad for q in model.parameters()], torch.cat(outs)


@pytest.mark.bitwise
@pytest.mark.parametrize("blocks", [2, 4, 8])
@pytest.mark.parametrize("batch,dim", [(32, 8), (40, 5)])  # (40, 5): blocks at unaligned offsets
def test_dense_blocks_one_process_equals_two_halves_bitwise(blocks, batch, dim):
    one, out1 = _dense_grads(blocks, 1, batch, dim)
    two, out2 = _dense_grads(blocks // 2, 2, batch, dim)  # what each of 2 ranks runs, then a + b
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(out1, out2)
    plain, out0 = _dense_grads(1, 1, batch, dim)  # the batch as one GEMM: float tolerance
    for a, b in zip(one, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out1, out0)


def test_dense_blocks_keep_parameters_and_world_rule():
    from neorec.distributed.dense_blocks import block_dense, exact_world, local_blocks
    from neorec.modules.dlrm import DenseArch

    arch = DenseArch(ModelConfig(bottom_mlp=[16, 8], top_mlp=[16, 1]), 3, 8)
    keys = list(arch.state_dict())
    assert list(block_dense(arch, 4).state_dict()) == keys
    assert [local_blocks(8, w) for w in (1, 2, 3, 4, 8, 16)] == [8, 4, 1, 2, 1, 1]
    assert exact_world(8, 8) and not exact_world(8, 3) and not exact_world(6, 4)
    with pytest.raises(ValueError, match="dense blocks must be >= 1"):
        block_dense(arch, 0)


def _bitwise_table_wise(rank: int, world: int, blocks: int) -> None:
    from neorec.distributed.dense_blocks import block_dense

    cfg = make_cfg("rowwise_adagrad")
    cfg.train.dense_optimizer, cfg.train.dense_blocks = "adagrad", blocks
    ref = build_dlrm(cfg)
    block_dense(ref.dense_arch, blocks)  # as the trainer builds the one-process model
    plan = plan_by_type(TABLES, world, world, "table_wise")
    ref, dm, _, _ = train_both(rank, world, plan, cfg, False, steps=5, ref=ref)
    where = f"world {world} blocks {blocks} rank {rank}"
    for (name, a), e in zip(dm.dense_arch.module.named_parameters(), ref.dense_parameters()):
        assert torch.equal(a, e), f"{where}: dense {name} differs"
    for t in TABLES:
        assert torch.equal(dm.ebc.gather_table(t.name), ref.ebc.table_weight(t.name)), where


@pytest.mark.bitwise
@pytest.mark.parametrize("world,blocks", [(2, 2), (2, 8), (4, 4)])
def test_table_wise_training_is_bitwise_one_process(world, blocks):
    # (4, 4): the rank sums go through the tree all-reduce hook instead of DDP's ring.
    run_ranks(_bitwise_table_wise, world, blocks)
