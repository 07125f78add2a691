"""Collectives the sharded runtime uses: awaitable all-to-all, autograd all-to-all of pooled
vectors, deterministic all-reduce and reduce-scatter built from collectives every backend has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "Awaitable",
    "Done",
    "CommStats",
    "all_to_all",
    "AllToAllPooled",
    "ordered_all_reduce",
    "reduce_scatter",
    "ScaleGrad",
]

T = TypeVar("T")


class Awaitable(Generic[T]):
    """A result that may still be in flight; ``wait()`` blocks and returns it (once)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._value: T | None = None

    def wait(self) -> T:
        """Block until the result is ready."""
        if self._fn is not None:
            self._value = self._fn()
            self._fn = None
        return self._value  # type: ignore[return-value]


class Done(Awaitable[T]):
    """An already-available result."""

    def __init__(self, value: T) -> None:
        super().__init__(lambda: value)


@dataclass
class CommStats:
    """Bytes this rank sent per collective name (for ``bench dist`` and metrics.json)."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, nbytes: int) -> None:
        """Record one collective."""
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + int(nbytes)
        self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        """Forget everything recorded."""
        self.bytes_sent.clear()
        self.calls.clear()


def _off_rank_bytes(t: Tensor, splits: Sequence[int] | None, rank: int, world: int) -> int:
    """Bytes that leave this rank (the part sent to itself stays local)."""
    per = t.element_size() * (t.numel() // world if splits is None else 0)
    if splits is None:
        return per * (world - 1)
    return t.element_size() * (sum(splits) - splits[rank])


def all_to_all(
    send: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> Awaitable[Tensor]:
    """Start an all-to-all of a 1-D tensor with per-rank element counts; returns an awaitable."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    recv = torch.empty(int(sum(recv_splits)), dtype=send.dtype, device=send.device)
    if stats is not None:
        stats.add(name, _off_rank_bytes(send, list(send_splits), rank, world))
    if world == 1:
        recv.copy_(send)
        return Done(recv)
    work = dist.all_to_all_single(
        recv, send.contiguous(), list(recv_splits), list(send_splits), group=group, async_op=True
    )

    def finish() -> Tensor:
        assert work is not None
        work.wait()
        return recv

    return Awaitable(finish)


class AllToAllPooled(torch.autograd.Function):
    """Pooled vectors to the ranks that own the samples; backward sends gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        send: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: Any,
        stats: CommStats | None,
    ) -> Tensor:
        ctx.meta = (send.shape, send_splits, recv_splits, group, stats)
        return all_to_all(send.reshape(-1), send_splits, recv_splits, group, stats, "fwd_pooled").wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:  # type: ignore[override]
        shape, send_splits, recv_splits, group, stats = ctx.meta
        back = all_to_all(grad.contiguous(), recv_splits, send_splits, group, stats, "bwd_grads")
        return back.wait().view(shape), None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (global-batch semantics)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def ordered_all_reduce(
    t: Tensor, group: dist.ProcessGroup | None = None, stats: CommStats | None = None
) -> Tensor:
    """Sum over ranks in rank order: bitwise the same on every rank and in every run."""
    world = dist.get_world_size(group)
    if world == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(world)]
    if stats is not None:
        stats.add("all_reduce", t.numel() * t.element_size() * (world - 1))
    dist.all_gather(parts, t.contiguous(), group=group)
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


def reduce_scatter(
    t: Tensor, group: dist.ProcessGroup | None = None, stats: CommStats | None = None
) -> Tensor:
    """Rank r gets the rank-ordered sum of chunk r of ``t`` (first dim split evenly).

    Built from all-to-all so it works on every backend (older gloo has no reduce_scatter).
    """
    world = dist.get_world_size(group)
    if t.shape[0] % world:
        raise ValueError(f"reduce_scatter: dim 0 ({t.shape[0]}) not divisible by {world} ranks")
    chunk = t.numel() // world
    got = all_to_all(t.reshape(-1), [chunk] * world, [chunk] * world, group, stats, "reduce_scatter")
    parts = got.wait().view(world, t.shape[0] // world, *t.shape[1:])
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out
