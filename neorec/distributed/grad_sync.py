"""Dense gradient sync with every inter-host byte counted: DDP comm hooks.

A world of ``W`` ranks as ``H = W / rph`` hosts of ``rph`` consecutive global ranks.

``hierarchical_all_reduce`` sums a tensor over the world in three stages:

1. reduce inside each host to its leader (the host's first rank), over the host's group;
2. the ``H`` leaders all-reduce the host sums as a reduce-scatter then an all-gather of ``H``
   equal chunks (``c = ceil(n / H)`` elements, the tensor zero-padded to ``H * c``); the chunk
   sums are added in host order, so every leader holds the same bits;
3. each leader broadcasts the world sum inside its host.

Only stage 2 crosses hosts, and it is written as point-to-point exchanges whose sizes are known:
each leader sends ``(H - 1) * c`` elements in the reduce-scatter and ``(H - 1) * c`` in the
all-gather, so one all-reduce of ``n`` elements of ``e`` bytes sends exactly
``2 * H * (H - 1) * ceil(n / H) * e`` bytes between hosts (summed over ranks; ``hier_bytes``).
Stages 1 and 3 stay inside the host; their bytes are counted as ``(rph - 1) * n * e`` per host
each (every non-leader's tensor once to the leader, the sum once back: a model of gloo's tree,
not a wire measurement).

``hierarchical_hook`` is that all-reduce as a DDP comm hook (the mean over the world, as DDP's
own); ``host_mean_hook`` all-reduces over one host only and divides by the world (the tower
modules' gradients in ``DistributedTowerModel(tower_sync="host")``): no byte crosses a host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.distributed.comm import CommStats

__all__ = [
    "HostLayout",
    "hier_bytes",
    "hierarchical_all_reduce",
    "hierarchical_hook",
    "host_mean_hook",
]


class HostLayout:
    """The host groups and the leaders' group of a world of ``world / rph`` hosts of ``rph``
    consecutive ranks. Collective: every rank builds it, in the same order (it creates groups)."""

    def __init__(self, ranks_per_host: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if ranks_per_host < 1 or world % ranks_per_host:
            raise ValueError(f"{world} ranks do not split into hosts of {ranks_per_host} ranks")
        self.world, self.rph = world, ranks_per_host
        self.hosts = world // ranks_per_host
        self.host, self.local = divmod(rank, ranks_per_host)
        self.leader = self.host * ranks_per_host
        groups = [
            dist.new_group(ranks=list(range(h * ranks_per_host, (h + 1) * ranks_per_host)))
            for h in range(self.hosts)
        ]
        self.host_group = groups[self.host]
        self.leader_group = dist.new_group(ranks=[h * ranks_per_host for h in range(self.hosts)])


def hier_bytes(numel: int, element_size: int, hosts: int) -> int:
    """Bytes one ``hierarchical_all_reduce`` of ``numel`` elements sends between hosts, summed
    over ranks: ``2 * H * (H - 1) * ceil(numel / H) * element_size``."""
    return 2 * hosts * (hosts - 1) * (-(-numel // hosts)) * element_size


def hierarchical_all_reduce(
    t: Tensor, layout: HostLayout, stats: CommStats | None = None, name: str = "allreduce_dense"
) -> Tensor:
    """The sum of ``t`` over the world (a new tensor, the same bits on every rank). Counts this
    rank's bytes in ``stats``: ``add(name)`` all it sends, ``add_inter_host(name)`` those that
    leave its host (nonzero on the leaders only)."""
    buf = t.detach().clone().reshape(-1)
    n, e = buf.numel(), buf.element_size()
    lo = layout
    leader = lo.local == 0
    if lo.rph > 1:
        dist.reduce(buf, dst=lo.leader, group=lo.host_group)
        if stats is not None and not leader:
            stats.add(name, n * e)
    if leader and lo.hosts > 1:
        h = lo.hosts
        c = -(-n // h)
        pad = torch.zeros(h * c, dtype=buf.dtype, device=buf.device)
        pad[:n] = buf
        got = torch.empty_like(pad)
        dist.all_to_all_single(got, pad, group=lo.leader_group)  # chunk i to leader i
        mine = got.view(h, c)[0].clone()
        for j in range(1, h):  # host order: the same additions on every leader
            mine.add_(got.view(h, c)[j])
        parts = [torch.empty_like(mine) for _ in range(h)]
        dist.all_gather(parts, mine, group=lo.leader_group)
        buf = torch.cat(parts)[:n]
        if stats is not None:
            sent = 2 * (h - 1) * c * e
            stats.add(name, sent)
            stats.add_inter_host(name, sent)
    if lo.rph > 1:
        dist.broadcast(buf, src=lo.leader, group=lo.host_group)
        if stats is not None and leader:
            stats.add(name, (lo.rph - 1) * n * e)
    return buf.view(t.shape)


def _done(t: Tensor) -> torch.futures.Future[Tensor]:
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def hierarchical_hook(
    layout: HostLayout, stats: CommStats | None = None, name: str = "allreduce_dense"
) -> Callable[..., Any]:
    """A DDP comm hook (``ddp.register_comm_hook(None, hook)``): each bucket's mean over the
    world by ``hierarchical_all_reduce``, its bytes counted in ``stats``."""

    # Unannotated on purpose: DDP compares the annotations to its own types (strings here).
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer()
        return _done(hierarchical_all_reduce(buf, layout, stats, name).div_(layout.world))

    return hook


def host_mean_hook(
    group: Any, world: int, stats: CommStats | None = None, name: str = "allreduce_tower"
) -> Callable[..., Any]:
    """A DDP comm hook for a DDP over one host's ``group``: the bucket's sum over the host divided
    by the world size (the global-mean gradient of a module only that host computes). Counts a
    ring's ``2 (g - 1) / g`` of the bucket as this rank's bytes (all inside the host)."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer().div_(world)
        g = dist.get_world_size(group)
        if g > 1:
            dist.all_reduce(buf, group=group)
        if stats is not None:
            stats.add(name, 2 * (g - 1) * buf.numel() * buf.element_size() // g)
        return _done(buf)

    return hook
