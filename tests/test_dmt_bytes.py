"""Every inter-host byte of DMT counted: the hierarchical all-reduce (a DDP comm hook) against a
plain all-reduce and its byte formula; SPTT with parametrised tower modules, their gradients
synchronised world-wide or inside the host, against the unsharded TowerDLRM (4 gloo ranks as
2 hosts x 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from neorec.distributed.comm import CommStats
from neorec.distributed.grad_sync import (
    HostLayout,
    hier_bytes,
    hierarchical_all_reduce,
    hierarchical_hook,
)


def _total(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _allreduce_rank(rank: int, world: int, rph: int) -> None:
    layout = HostLayout(rph)
    for n in (1, 37, 64):
        t = torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + n))
        stats = CommStats()
        got = hierarchical_all_reduce(t, layout, stats)
        want = t.clone()
        dist.all_reduce(want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        # the same bits everywhere
        parts = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(parts, got)
        assert all(torch.equal(p, parts[0]) for p in parts)
        inter = stats.inter_host.get("allreduce_dense", 0)
        assert inter == 0 or rank % rph == 0  # only the leaders send across hosts
        assert _total(inter) == hier_bytes(n, 4, world // rph)
    # hier_bytes by hand: 2 hosts, 37 floats -> 2 * 2 * 1 * 19 * 4
    assert hier_bytes(37, 4, 2) == 304 and hier_bytes(37, 4, 1) == 0


@pytest.mark.parametrize("rph", [2, 1])
def test_hierarchical_all_reduce_equals_all_reduce_and_its_byte_formula(rph):
    run_ranks(_allreduce_rank, 4, rph)


def _ddp_hook_rank(rank: int, world: int) -> None:
    layout = HostLayout(2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 1))
    ref = DistributedDataParallel(_clone(net))
    hooked = DistributedDataParallel(_clone(net))
    stats = CommStats()
    hooked.register_comm_hook(None, hierarchical_hook(layout, stats))
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(rank))
    for m in (ref, hooked):
        m(x).square().mean().backward()
    for p, q in zip(ref.parameters(), hooked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)
    numel = sum(p.numel() for p in net.parameters())  # one bucket: every parameter
    assert _total(stats.inter_host.get("allreduce_dense", 0)) == hier_bytes(numel, 4, 2)


def _clone(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net)


def test_hierarchical_ddp_hook_equals_ddp_all_reduce():
    run_ranks(_ddp_hook_rank, 4)


# ---- SPTT with parametrised tower modules = TowerDLRM, both tower syncs ------------------------
GROUPS = [["t3", "t0"], ["t1", "t4", "t2"]]
B = 16


def _cfg(kind: str):
    from neorec.config import load_config

    return load_config(
        None,
        [
            "embedding.num_tables=5",
            "embedding.rows=40",
            "embedding.dim=8",
            "embedding.pooling_factor=2",
            "model.bottom_mlp=[8, 8]",
            "model.top_mlp=[8, 1]",
            f"data.batch_size={B}",
            "sharding.default_type='table_wise'",
            "train.dense_optimizer='adam'",
            "train.dense_lr=0.05",
            "towers.count=2",
            f"towers.module='{kind}'",
        ],
    )


def _sptt_rank(rank: int, world: int, kind: str, sync: str) -> None:
    from neorec.builder import build_dlrm, dense_optimizer, towered_model
    from neorec.data.synthetic import SyntheticClickData
    from neorec.train.trainer import train_step

    cfg = _cfg(kind)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    dm = towered_model(cfg, GROUPS, tower_sync=sync)
    layout = HostLayout(2)
    dm.world_ddp.register_comm_hook(None, hierarchical_hook(layout, dm.comm_stats))
    ref = build_dlrm(cfg, groups=GROUPS)
    opt_ref = dense_optimizer(cfg.train, ref.dense_parameters())
    opt_dm = dense_optimizer(cfg.train, dm.dense_parameters())
    b = B // world
    lo, hi = rank * b, (rank + 1) * b
    steps = 3
    for step in range(1, steps + 1):
        batch = data.batch("train", step, B)
        train_step(ref, opt_ref, batch, step)
        train_step(dm, opt_dm, batch.slice(lo, hi), step)
    test = data.batch("eval", 0, B)
    with torch.no_grad():
        want = ref(test.dense, test.sparse)[lo:hi]
        got = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for t in dm.ebc.tables:
        torch.testing.assert_close(
            dm.ebc.gather_table(t.name), ref.ebc.table_weight(t.name), rtol=1e-5, atol=1e-6
        )
    spec = ref.dense_part.state_dict()
    mine = dm.dense_part.state_dict()
    host = rank // 2
    other = f"towers.{1 - host}."
    for k, v in spec.items():  # under "host", the other host's tower is stale until synced
        if sync == "world" or not k.startswith(other):
            torch.testing.assert_close(mine[k], v, rtol=1e-5, atol=1e-6, msg=k)
    dm.sync_replicas(opt_dm)
    for k, v in spec.items():
        torch.testing.assert_close(dm.dense_part.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # the dense optimizer's state of every tower module is the spec's after sync_replicas
    spec_state = {n: opt_ref.state[p] for n, p in ref.dense_part.named_parameters()}
    for n, p in dm.dense_part.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                opt_dm.state[p][key], spec_state[n][key], rtol=1e-4, atol=1e-7, msg=n
            )
    # bytes: the world-wide DDP's all-reduce crosses hosts (counted); the tower sync never does
    inter = dm.comm_stats.inter_host
    arch = sum(p.numel() for p in ref.dense_arch.parameters())
    towers = sum(p.numel() for p in ref.towers.parameters())
    synced = arch + (towers if sync == "world" else 0)
    assert _total(inter.get("allreduce_dense", 0)) == steps * hier_bytes(synced, 4, 2)
    assert "allreduce_tower" not in inter
    assert (dm.comm_stats.bytes_sent.get("allreduce_tower", 0) > 0) == (sync == "host")


@pytest.mark.parametrize("sync", ["world", "host"])
def test_sptt_dot_towers_equal_tower_dlrm(sync):
    run_ranks(_sptt_rank, 4, "dot", sync)


def test_sptt_host_sync_mlp_towers_equal_tower_dlrm():
    run_ranks(_sptt_rank, 4, "mlp", "host")


def test_tower_sync_must_be_world_or_host():
    from neorec.config import ConfigError
    from neorec.distributed.towers import DistributedTowerModel

    with pytest.raises(ConfigError, match="tower_sync"):
        DistributedTowerModel([], [["a"]], None, None, tower_sync="pod")  # type: ignore[arg-type]
