"""Data-parallel tables summed as dense blocks (small tables: one all-gather) equal the (id, row)
pair exchange bitwise, and both equal the unsharded collection (spawned gloo ranks on CPU)."""

from __future__ import annotations

import pytest
import torch
from dist_util import run_ranks

from neorec.config import TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.types import DENSE_DP_MAX_ELEMS, dense_dp
from neorec.sparse import SparseFeatures

# a, b: dense blocks by default; c: larger than DENSE_DP_MAX_ELEMS, so (id, row) pairs.
TABLES = [
    TableConfig(name="a", rows=37, dim=8),
    TableConfig(name="b", rows=3, dim=4, features=["b", "b2"]),
    TableConfig(name="c", rows=DENSE_DP_MAX_ELEMS // 16 + 1, dim=16),
]
B = 6  # samples per rank


def _batch(step: int, rank: int, world: int) -> tuple[SparseFeatures, torch.Tensor]:
    """The global batch of ``step`` (every rank draws it), and this rank's slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    n = B * world
    feats, values, lengths = [], [], []
    for t in TABLES:
        for f in t.features:
            lens = torch.randint(0, 4, (n,), generator=g)
            # Only rows < 20 of c and row 0 of b: most rows untouched, some by one rank only.
            hi = 20 if t.name == "c" else (1 if f == "b2" else t.rows)
            feats.append(f)
            values.append(torch.randint(0, hi, (int(lens.sum()),), generator=g))
            lengths.append(lens)
    sparse = SparseFeatures(feats, torch.cat(values), torch.cat(lengths))
    grad = torch.randn(n, sum(t.dim * len(t.features) for t in TABLES), generator=g)
    return sparse, grad


def _run(rank: int, world: int, opt: str) -> None:
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection

    plan = plan_by_type(TABLES, world, world, "data_parallel")
    tables: dict[str, list[torch.Tensor]] = {}
    for name, cap in (("default", DENSE_DP_MAX_ELEMS), ("pairs", 0), ("dense", 1 << 30)):
        spec = CollectionSpec(RowOptimizer(kind=opt, lr=0.1), seed=3)
        ebc = ShardedEmbeddingBagCollection(TABLES, spec, plan=plan)
        ebc.dp_dense_max_elems = cap
        for step in range(3):
            sparse, grad = _batch(step, rank, world)
            mine = sparse.select_samples(rank * B, (rank + 1) * B)
            (ebc(mine) * grad[rank * B : (rank + 1) * B]).sum().backward()
        tables[name] = [ebc.gather_table(t.name) for t in TABLES]
        # One exchange a step for each kind in use (pairs: the counts, then ids and rows).
        calls = ebc.comm_stats.calls.get("dp_allgather", 0)
        assert calls == {"default": 6, "pairs": 3, "dense": 3}[name], (name, ebc.comm_stats.calls)
        if name == "dense":  # every table's rows x (dim + 1) floats, to each other rank
            block = sum(t.rows * (t.dim + 1) for t in TABLES)
            assert ebc.comm_stats.bytes_sent["dp_allgather"] == 3 * (world - 1) * 4 * block
    for name in ("pairs", "dense"):
        for t, x, y in zip(TABLES, tables["default"], tables[name]):
            assert torch.equal(x, y), f"{opt} {name}: table {t.name} differs from the default"
    flat = torch.cat([x.flatten() for x in tables["default"]])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone), "replicas differ across ranks"
    # The specification: one process, the whole batch.
    ref = EmbeddingBagCollection(TABLES, CollectionSpec(RowOptimizer(kind=opt, lr=0.1), seed=3))
    for step in range(3):
        sparse, grad = _batch(step, rank, world)
        # Data-parallel gradients are averaged over ranks (each rank's loss is its mean share).
        (ref(sparse) * grad / world).sum().backward()
    for t, got in zip(TABLES, tables["default"]):
        torch.testing.assert_close(got, ref.table_weight(t.name), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
def test_dense_dp_blocks_equal_pairs_and_the_unsharded_collection(world: int, opt: str) -> None:
    run_ranks(_run, world, opt)


def test_cost_model_prices_the_rule_the_runtime_uses() -> None:
    from neorec.sharding.cost_model import CostModel, TableSpec
    from neorec.sharding.topology import Topology
    from neorec.sharding.types import ShardingPlan, ShardingType, data_parallel

    small = TableSpec(name="s", rows=2000, dim=64, pooling_factor=5)
    big = TableSpec(name="g", rows=DENSE_DP_MAX_ELEMS // 64 + 1, dim=64, pooling_factor=5)
    assert dense_dp(small.rows, small.dim) and not dense_dp(big.rows, big.dim)
    cm = CostModel(Topology(world_size=2, ranks_per_host=2), 4096, "rowwise_adagrad")
    c = cm.shard_cost(small, ShardingType.DATA_PARALLEL, small.rows, small.dim)
    ii, ie = cm._a2a_s(2 * small.rows * (small.dim + 1) * 4.0)
    assert c.bwd_comm_s == pytest.approx(ii + ie)  # every rank's dense block, gathered
    one = cm.evaluate(ShardingPlan(2, 2, [data_parallel(small, 2)]), [small]).sample_side_s
    both = cm.evaluate(
        ShardingPlan(2, 2, [data_parallel(small, 2), data_parallel(big, 2)]), [small, big]
    ).sample_side_s
    assert one == pytest.approx(cm.fixed_s(sharded=False, dense_dp=True))
    assert both == pytest.approx(cm.fixed_s(sharded=False, data_parallel=True, dense_dp=True))
    assert both - one == pytest.approx(3 * cm.topo.collective_latency_us * 1e-6)
