"""The cost model prices table-row-wise's two stages (``neorec.distributed.twrw``): the in-host
reduction at intra-host bandwidth, one sum per sample across hosts at inter-host bandwidth."""

from __future__ import annotations

import pytest

from neorec.sharding.cost_model import CostModel
from neorec.sharding.tables import TableSpec
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import ShardingPlan, ShardingType, row_wise, table_row_wise

RW, TWRW = ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE
W, K, BATCH = 4, 2, 4096


def _cm(**kw: float) -> CostModel:
    return CostModel(Topology(world_size=W, ranks_per_host=K, device_memory_gb=100.0, **kw), BATCH)


def test_twrw_shard_sends_its_share_of_one_sum_across_hosts() -> None:
    cm = _cm()
    t = TableSpec(name="t", rows=1_000_000, dim=32, pooling_factor=20)
    half = t.rows // K
    rw, tw = cm.shard_cost(t, RW, half, t.dim), cm.shard_cost(t, TWRW, half, t.dim)
    out = BATCH * t.dim * 4.0  # a shard's partial sums: every sample, float32
    intra, inter = cm.topo.intra_host_bw_gbs * GB, cm.topo.inter_host_bw_gbs * GB
    # Row-wise: the whole partial sum to the samples' ranks; table-row-wise: (k - 1) / k of it
    # inside the host, then the shard's half of the reduced sums to the other host.
    pooled_rw = out * (K - 1) / W / intra + out * (W - K) / W / inter
    pooled_tw = out * (K - 1) / K / intra + out / K * (W - K) / W / inter
    assert rw.fwd_comm_s - tw.fwd_comm_s == pytest.approx(pooled_rw - pooled_tw)
    assert rw.bwd_comm_s - tw.bwd_comm_s == pytest.approx(pooled_rw - pooled_tw)
    assert rw.inter_s - tw.inter_s == pytest.approx(2 * (out - out / K) * (W - K) / W / inter)
    assert tw.compute_s == pytest.approx(rw.compute_s)


def test_twrw_sample_side_receives_one_sum_and_plan_crosses_hosts_less() -> None:
    cm = _cm(intra_host_bw_gbs=1e9)  # the in-host stage free: what crosses hosts shows alone
    t = TableSpec(name="t", rows=1_000_000, dim=32, pooling_factor=20)
    outs = 2 * BATCH / W * t.dim * 4.0  # pooled outputs in + their gradients out, one rank
    cross = outs * (W - K) / W / (cm.topo.inter_host_bw_gbs * GB)
    # Row-wise receives a partial sum from each of the K shards, table-row-wise one sum.
    rw, tw = cm.sample_side_s(t, RW, K), cm.sample_side_s(t, TWRW, K)
    assert rw - tw == pytest.approx((K - 1) * cross, rel=1e-6)
    plans = {
        st: ShardingPlan(W, K, [p])
        for st, p in ((RW, row_wise(t, [0, 1])), (TWRW, table_row_wise(t, 0, K)))
    }
    cost = {st: cm.evaluate(p, [t]) for st, p in plans.items()}
    lat = cm.topo.collective_latency_us * 1e-6
    # Two more collectives each way (the in-host reduction, then the exchange between hosts).
    assert cost[TWRW].sample_side_s - tw == pytest.approx(cost[RW].sample_side_s - rw + 4 * lat)
    assert cm.fixed_s(table_row_wise=True) - cm.fixed_s() == pytest.approx(4 * lat)
