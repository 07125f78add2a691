"""The shared-memory all-to-all (``neorec.distributed.shm``) gives gloo's bytes, for any dtype,
uneven and empty splits, growing messages and several collectives in flight; bad splits and a
missing peer are clear errors; the sharded collection over it equals the unsharded one."""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks

from neorec.distributed import comm
from neorec.distributed.shm import ShmTransportError


def _splits(g: torch.Generator, world: int, hi: int) -> torch.Tensor:
    """[world, world] element counts: row i = what rank i sends to each rank (some empty)."""
    m = torch.randint(0, hi, (world, world), generator=g)
    m[torch.rand(world, world, generator=g) < 0.2] = 0
    return m


def _messages(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    assert comm.init_host_transport("shm") == "shm"
    host = comm.host_transport()
    assert host is not None
    g = torch.Generator().manual_seed(7)  # every rank draws the same splits
    dtypes = [torch.float32, torch.int64, torch.uint8, torch.float16, torch.int32]
    for step in range(24):
        hi = 3 if step < 4 else (300_000 if step in (9, 17) else 2_000)  # 9, 17: grow the slot
        m = _splits(g, world, hi)
        dt = dtypes[step % len(dtypes)]
        send_splits, recv_splits = m[rank].tolist(), m[:, rank].tolist()
        src = torch.Generator().manual_seed(100 * step + rank)
        send = (torch.randint(0, 100, (sum(send_splits),), generator=src)).to(dt)
        # Three in flight before the first is awaited, awaited out of order.
        shm = [comm.all_to_all(send + k, send_splits, recv_splits) for k in range(3)]
        got = [shm[2].wait(), shm[0].wait(), shm[1].wait()]
        entry = comm._HOST.pop(comm._group_key(None))  # the same exchange through gloo
        ref = [comm.all_to_all(send + k, send_splits, recv_splits).wait() for k in range(3)]
        comm._HOST[comm._group_key(None)] = entry
        for k, out in zip((2, 0, 1), got):
            assert out.dtype == dt
            assert torch.equal(out, ref[k]), (step, k)
    # Never a file in /dev/shm; each rank lets go of its memory's descriptor once every peer has
    # mapped it, so the memory lives only in the ranks' mappings (and goes with them): the
    # control block, this rank's slots and one per peer (each mmap keeps a duplicate descriptor).
    dist.barrier()
    comm.all_to_all(torch.zeros(world), [1] * world, [1] * world).wait()
    comm.all_to_all(torch.zeros(world), [1] * world, [1] * world).wait()
    dist.barrier()
    assert not glob.glob(f"/dev/shm/neorec-{os.getpid()}-*")
    assert not host._held
    assert len(_own_memfds()) == world + 1, _own_memfds()
    comm.close_host_transports()


def _own_memfds() -> list[str]:
    """This process's open descriptors of the transport's memory (its mappings' included)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the descriptor listdir itself used)
            continue
        if target.startswith("/memfd:neorec-"):
            fds.append(target)
    return fds


@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_to_all_equals_gloo(world: int) -> None:
    run_ranks(_messages, world)


def _bad_splits(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    comm.init_host_transport("shm")
    # Rank 0 sends 3 elements to rank 1, which expects 2.
    send_splits = [1, 3] if rank == 0 else [2, 1]
    recv_splits = [1, 2] if rank == 0 else [2, 1]
    send = torch.zeros(sum(send_splits))
    pending = comm.all_to_all(send, send_splits, recv_splits)
    if rank == 1:
        with pytest.raises(
            ShmTransportError,
            match="all-to-all 1: rank 0 sent 12 bytes to rank 1, which expected 8",
        ):
            pending.wait()
    with pytest.raises(ShmTransportError, match="send splits add up to 5"):
        comm.all_to_all(torch.zeros(4), [2, 3], [1, 1])
    with pytest.raises(
        ShmTransportError, match=f"rank {rank} sends itself 1 elements but expects 2"
    ):
        comm.all_to_all(torch.zeros(2), [1, 1], [2, 2] if rank == 0 else [1, 2])
    comm.close_host_transports()


def test_shm_all_to_all_refuses_disagreeing_splits() -> None:
    run_ranks(_bad_splits, 2)


def _late_peer(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    comm.init_host_transport("shm", timeout_s=0.5)
    if rank == 0:  # rank 1 never starts the collective
        pending = comm.all_to_all(torch.zeros(2), [1, 1], [1, 1])
        with pytest.raises(ShmTransportError, match="rank 1 did not write collective 1 within"):
            pending.wait()
    comm.close_host_transports()


def test_shm_missing_peer_times_out_with_a_clear_error() -> None:
    run_ranks(_late_peer, 2)


def _transport_modes(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    with pytest.raises(ValueError, match="transport must be one of auto, shm, gloo"):
        comm.init_host_transport("tcp")
    assert comm.init_host_transport("gloo") == "gloo"
    assert comm.host_transport() is None
    assert comm.init_host_transport() == "shm"  # auto, the default
    assert comm.init_host_transport("shm") == "shm"  # already set up: the same one
    comm.close_host_transports()


def test_transport_modes() -> None:
    run_ranks(_transport_modes, 2)


def _sharded(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    from neorec.config import TableConfig
    from neorec.distributed.sharded import ShardedEmbeddingBagCollection
    from neorec.modules.collection import CollectionSpec
    from neorec.ops.row_optim import RowOptimizer
    from neorec.sharding.fixed_plan import plan_by_type
    from neorec.sparse import SparseFeatures

    tables = [
        TableConfig(name="a", rows=50, dim=8),
        TableConfig(name="b", rows=70, dim=16),
        TableConfig(name="c", rows=40, dim=4),
    ]
    b = 5

    def steps(kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        plan = plan_by_type(tables, world, world, kind)
        spec = CollectionSpec(RowOptimizer(kind="rowwise_adagrad", lr=0.1), seed=3)
        ebc = ShardedEmbeddingBagCollection(tables, spec, plan=plan)
        outs = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            lens = torch.randint(0, 4, (3 * b * world,), generator=g)
            vals = torch.cat(
                [
                    torch.randint(0, t.rows, (int(n),), generator=g)
                    for t, n in zip(tables, lens.view(3, -1).sum(1))
                ]
            )
            sparse = SparseFeatures(["a", "b", "c"], vals, lens)
            grad = torch.randn(b * world, 28, generator=g)
            out = ebc(sparse.select_samples(rank * b, (rank + 1) * b))
            (out * grad[rank * b : (rank + 1) * b]).sum().backward()
            outs.append(out.detach())
        return outs, [ebc.gather_table(t.name) for t in tables]

    for kind in ("table_wise", "row_wise", "column_wise", "data_parallel"):
        comm.close_host_transports()
        ref_out, ref_tab = steps(kind)  # gloo
        assert comm.init_host_transport("shm") == "shm"
        host = comm.host_transport()
        assert host is not None
        before = host.seq
        out, tab = steps(kind)
        assert host.seq > before, "the sharded step did not use the shared-memory transport"
        for x, y in zip(out + tab, ref_out + ref_tab):
            assert torch.equal(x, y), kind
    comm.close_host_transports()


def test_sharded_collection_over_shm_is_bitwise_gloos() -> None:
    run_ranks(_sharded, 2)


def _peer_exits(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    comm.init_host_transport("shm", timeout_s=60)
    if rank == 1:
        os._exit(0)  # gone without starting the collective
    t0 = time.monotonic()
    pending = comm.all_to_all(torch.zeros(2), [1, 1], [1, 1])
    with pytest.raises(ShmTransportError, match=r"rank 1 \(pid \d+\) exited before it could write"):
        pending.wait()
    assert time.monotonic() - t0 < 10, "a dead peer is noticed within seconds, not the timeout"
    os._exit(0)


def test_shm_dead_peer_is_reported_not_waited_for() -> None:
    run_ranks(_peer_exits, 2)


def _train(rank: int, world: int, out: str) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    from pathlib import Path

    from test_checkpoint_dist import PLAN_A, cfg_for

    from neorec.train.trainer import Trainer

    got = {}
    for transport in ("gloo", "auto"):
        # Every sharding type: DP, CW (row-wise Adagrad across slices), RW, TW.
        cfg = cfg_for(Path(out) / transport, PLAN_A, f"comm.transport='{transport}'")
        trainer = Trainer(cfg)
        result = trainer.fit()
        ebc = trainer.model.ebc
        host = comm.host_transport(ebc.group)
        if transport == "gloo":
            assert host is None
        else:  # auto, every rank on this host: the embedding group's all-to-alls over shm
            assert host is not None and host.seq > 0
        tables = {t.name: ebc.gather_table(t.name) for t in ebc.tables}
        got[transport] = (tables, result["train"]["final_loss"], result["eval"])
    for name, t in got["gloo"][0].items():
        assert torch.equal(t, got["auto"][0][name]), name
    assert got["gloo"][1:] == got["auto"][1:]


def test_training_over_shm_is_bitwise_gloos(tmp_path) -> None:
    run_ranks(_train, 2, str(tmp_path))
