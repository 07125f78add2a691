"""Single-process micro-benchmarks of the calibration: memory and copy bandwidth, the fused TBE
step, the unfused row update and the data-parallel table update on one rank's thread share (see
``neorec.measure.calibrate`` for what each constant means to the cost model)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from neorec.sharding.topology import GB, Topology

__all__ = [
    "measure",
    "measure_tbe",
    "measure_unfused",
    "measure_dp_update",
    "_torch_threads",
    "_best_of",
]


def _best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(rows: int = 2_000_000, dim: int = 64, ids: int = 500_000) -> dict[str, float]:
    """Bandwidths in GB/s: row gather, row scatter-add update, memcpy, shared-memory copy."""
    g = torch.Generator().manual_seed(0)
    table = torch.rand(rows, dim, generator=g)
    idx = torch.randint(0, rows, (ids,), generator=g)
    grads = torch.rand(ids, dim, generator=g)
    row_bytes = ids * dim * 4
    gather = _best_of(lambda: torch.index_select(table, 0, idx))
    update = _best_of(lambda: table.index_add_(0, idx, grads, alpha=-1e-9))
    big = torch.empty(64 * 1024 * 1024 // 4)
    dst = torch.empty_like(big)
    memcpy = _best_of(lambda: dst.copy_(big))
    shared = big.clone().share_memory_()
    shm = _best_of(lambda: dst.copy_(shared))
    return {
        "gather_gbs": row_bytes / gather / GB,
        # read + write of each touched row
        "update_gbs": 2 * row_bytes / update / GB,
        "memcpy_gbs": 2 * big.numel() * 4 / memcpy / GB,
        "shm_copy_gbs": 2 * big.numel() * 4 / shm / GB,
    }


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _workload(optimizer: str, rows: int, dim: int, tables: int, batch: int, pooling: int):
    """``tables`` equal tables (random weights, zeroed optimizer state) and one batch of uniform
    ids with fixed pooling and a random output gradient: (layout, weights, state, ids, offsets,
    grad), the same for every seed-0 call."""
    from neorec.ops.memory import table_empty
    from neorec.ops.row_optim import zeros_state
    from neorec.ops.tbe import TBELayout

    g = torch.Generator().manual_seed(0)
    layout = TBELayout(
        rows=(rows,) * tables, dims=(dim,) * tables, feature_table=tuple(range(tables))
    )
    weights = table_empty(layout.total_elems).uniform_(-0.01, 0.01, generator=g)
    state = zeros_state(optimizer, layout.total_rows, layout.total_elems, torch.device("cpu"))
    n = tables * batch * pooling
    ids = torch.randint(0, rows, (n,), generator=g)
    offsets = torch.arange(0, n + 1, pooling)
    grad = torch.randn(batch, tables * dim, generator=g)
    return layout, weights, state, ids, offsets, grad


def measure_tbe(
    threads: int,
    optimizer: str = "rowwise_adagrad",
    rows: int = 100_000,
    dim: int = 32,
    tables: int = 4,
    batch: int = 1024,
    pooling: int = 20,
    repeat: int = 7,
) -> dict[str, float]:
    """Effective bandwidth (GB/s, cost-model bytes) of one fused TBE training step on ``threads``.

    Uniform ids (the cost model's assumption); the median of ``repeat`` steps after a warm-up.
    """
    from neorec.ops.row_optim import RowOptimizer
    from neorec.ops.tbe import Lookup, PoolingMode, get_backend
    from neorec.sharding.cost_model import CostModel, TableSpec
    from neorec.sharding.types import ShardingType

    with _torch_threads(threads):
        layout, weights, state, ids, offsets, grad = _workload(
            optimizer, rows, dim, tables, batch, pooling
        )
        backend = get_backend("auto", "cpu")
        opt = RowOptimizer(kind=optimizer)
        lookup = Lookup(ids, offsets, None, PoolingMode.SUM)
        fwd_t, bwd_t = [], []
        for step in range(repeat + 1):
            t0 = time.perf_counter()
            backend.forward(layout, weights, lookup)
            t1 = time.perf_counter()
            backend.backward_update(layout, weights, state, lookup, grad, opt, step + 1)
            t2 = time.perf_counter()
            if step:
                fwd_t.append(t1 - t0)
                bwd_t.append(t2 - t1)
    fwd, bwd = statistics.median(fwd_t), statistics.median(bwd_t)
    # The same shape through the cost model at 1 GB/s: its predicted seconds = its bytes / 1e9.
    unit = Topology(world_size=1, device_bw_gbs=1.0, shard_overhead_us=0.0)
    spec = TableSpec(name="t", rows=rows, dim=dim, pooling_factor=pooling, optimizer=optimizer)
    c = CostModel(unit, batch, optimizer).shard_cost(spec, ShardingType.TABLE_WISE, rows, dim)
    return {
        "tbe_fwd_ms": 1000 * fwd,
        "tbe_bwd_ms": 1000 * bwd,
        "tbe_gbs": tables * (c.fwd_compute_s + c.bwd_compute_s) / (fwd + bwd),
    }


def measure_unfused(
    threads: int,
    optimizer: str = "rowwise_adagrad",
    rows: int = 100_000,
    dim: int = 32,
    tables: int = 4,
    batch: int = 1024,
    pooling: int = 20,
    repeat: int = 7,
) -> dict[str, float]:
    """Effective bandwidth (GB/s, cost-model bytes) of the runtime's unfused row update.

    The sharded runtime's exact path for column-wise tables under row-wise Adagrad: per-id
    gradients summed per distinct row (``row_grads`` of the default backend: the cpu kernel's,
    without the update), then ``update_table_rows``; on
    ``measure_tbe``'s shape and uniform ids, converted with the cost model's backward bytes
    (``unfused=True`` at 1 GB/s).
    """
    from neorec.ops.row_optim import RowOptimizer
    from neorec.ops.tbe import Lookup, PoolingMode, get_backend, row_grads, update_table_rows
    from neorec.sharding.cost_model import CostModel, TableSpec
    from neorec.sharding.types import ShardingType

    with _torch_threads(threads):
        layout, weights, state, ids, offsets, grad = _workload(
            optimizer, rows, dim, tables, batch, pooling
        )
        be = get_backend("auto")
        opt = RowOptimizer(kind=optimizer)
        lookup = Lookup(ids, offsets, None, PoolingMode.SUM)
        times = []
        for step in range(repeat + 1):
            t0 = time.perf_counter()
            for t, rows_t, g_t in row_grads(be, layout, lookup, grad):
                update_table_rows(layout, weights, state, t, rows_t, g_t, opt, step + 1)
            if step:
                times.append(time.perf_counter() - t0)
    bwd = statistics.median(times)
    unit = Topology(world_size=1, unfused_bw_gbs=1.0, shard_overhead_us=0.0)
    spec = TableSpec(name="t", rows=rows, dim=dim, pooling_factor=pooling, optimizer=optimizer)
    c = CostModel(unit, batch, optimizer).shard_cost(
        spec, ShardingType.TABLE_WISE, rows, dim, unfused=True
    )
    return {"unfused_bwd_ms": 1000 * bwd, "unfused_gbs": tables * c.bwd_compute_s / bwd}


def measure_dp_update(
    threads: int,
    optimizer: str = "rowwise_adagrad",
    rows: int = 100_000,
    dim: int = 32,
    tables: int = 4,
    batch: int = 1024,
    pooling: int = 20,
    ranks: int = 2,
    repeat: int = 7,
) -> dict[str, float]:
    """Effective bandwidth (GB/s, cost-model bytes) of a data-parallel table's backward.

    What ``ShardedEmbeddingBagCollection`` runs on a rank after the forward, less the all-gather
    (priced as communication): the backend's ``row_grads`` of this rank's batch, the (id, row
    sum) pairs of ``ranks`` ranks concatenated per table in rank order (the other ranks' from
    batches of their own, made beforehand), and ``apply_row_grads`` over them. ``measure_tbe``'s
    shape and uniform ids; converted with the cost model's data-parallel backward bytes at
    1 GB/s (global batch ``ranks`` x ``batch``).
    """
    from neorec.ops.row_optim import RowOptimizer
    from neorec.ops.tbe import Lookup, PoolingMode, apply_row_grads, get_backend, row_grads
    from neorec.sharding.cost_model import CostModel, TableSpec
    from neorec.sharding.types import ShardingType

    with _torch_threads(threads):
        layout, weights, state, ids, offsets, grad = _workload(
            optimizer, rows, dim, tables, batch, pooling
        )
        be = get_backend("auto")
        opt = RowOptimizer(kind=optimizer)
        g = torch.Generator().manual_seed(1)
        others = [
            row_grads(
                be,
                layout,
                Lookup(
                    torch.randint(0, rows, ids.shape, generator=g), offsets, None, PoolingMode.SUM
                ),
                torch.randn(grad.shape, generator=g),
            )
            for _ in range(ranks - 1)
        ]
        lookup = Lookup(ids, offsets, None, PoolingMode.SUM)
        times = []
        for step in range(repeat + 1):
            t0 = time.perf_counter()
            mine = row_grads(be, layout, lookup, grad)
            pairs = [
                (t, torch.cat([ids_t, *(o[i][1] for o in others)]),
                 torch.cat([g_t, *(o[i][2] for o in others)]))
                for i, (t, ids_t, g_t) in enumerate(mine)
            ]  # fmt: skip
            apply_row_grads(be, layout, weights, state, pairs, opt, step + 1)
            if step:
                times.append(time.perf_counter() - t0)
    bwd = statistics.median(times)
    unit = Topology(world_size=ranks, dp_update_bw_gbs=1.0, shard_overhead_us=0.0)
    spec = TableSpec(name="t", rows=rows, dim=dim, pooling_factor=pooling, optimizer=optimizer)
    c = CostModel(unit, ranks * batch, optimizer).shard_cost(
        spec, ShardingType.DATA_PARALLEL, rows, dim
    )
    return {"dp_update_ms": 1000 * bwd, "dp_update_gbs": tables * c.bwd_compute_s / bwd}
