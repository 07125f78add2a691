"""Collectives the sharded runtime uses: awaitable all-to-all, autograd all-to-all of pooled
vectors, deterministic all-reduce and reduce-scatter built from collectives every backend has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.distributed.shm import HostTransport
from neorec.sparse import SparseFeatureError

if TYPE_CHECKING:
    from neorec.distributed.codecs import Codec

__all__ = [
    "Awaitable",
    "Done",
    "Chain",
    "CommStats",
    "all_to_all",
    "all_gather",
    "coded_all_to_all",
    "coded_all_reduce",
    "AllToAllPooled",
    "ordered_all_reduce",
    "reduce_scatter",
    "ScaleGrad",
    "tree_sum",
    "source_major_to_unit_major",
    "unit_major_order",
    "process_group_backend",
    "rank_device",
    "TRANSPORTS",
    "init_host_transport",
    "close_host_transports",
    "host_transport",
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


class Chain(Awaitable[T]):
    """Two dependent phases (e.g. lengths, then ids): ``advance()`` ends one and starts two."""

    def __init__(self, first: Callable[[], Awaitable[T]]) -> None:
        super().__init__(lambda: self._second_phase().wait())
        self._first: Callable[[], Awaitable[T]] | None = first
        self._second: Awaitable[T] | None = None

    def _second_phase(self) -> Awaitable[T]:
        if self._second is None:
            assert self._first is not None
            self._second, self._first = self._first(), None
        return self._second

    def advance(self) -> None:
        """Wait for phase one and start phase two (a pipeline calls it while other work runs)."""
        if self._fn is not None:
            self._second_phase()


@dataclass
class CommStats:
    """Bytes this rank sent per collective name (for ``bench dist`` and metrics.json)."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)
    """Seconds blocked waiting for each collective to finish (communication not hidden)."""
    codec_s: float = 0.0
    """Seconds spent encoding and decoding reduced-precision messages."""
    ranks_per_host: int = 0
    """When > 0, all-to-alls also count the bytes sent to ranks of other hosts (global rank //
    ranks_per_host) in ``inter_host``."""
    inter_host: dict[str, int] = field(default_factory=dict)
    """Bytes this rank's all-to-alls sent to other hosts, per collective name."""

    def add(self, name: str, nbytes: int) -> None:
        """Record one collective."""
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + int(nbytes)
        self.calls[name] = self.calls.get(name, 0) + 1

    def waited(self, name: str, seconds: float) -> None:
        """Record time blocked on a collective."""
        self.wait_s[name] = self.wait_s.get(name, 0.0) + seconds

    def add_inter_host(self, name: str, nbytes: int) -> None:
        """Record bytes one collective sent across hosts."""
        self.inter_host[name] = self.inter_host.get(name, 0) + int(nbytes)

    def reset(self) -> None:
        """Forget everything recorded."""
        self.inter_host.clear()
        self.bytes_sent.clear()
        self.calls.clear()
        self.wait_s.clear()
        self.codec_s = 0.0


def tree_sum(parts: Sequence[Tensor]) -> Tensor:
    """Sum in a fixed pairwise tree: ``tree_sum(parts[:h]) + tree_sum(parts[h:])``, ``h = n // 2``.

    A power-of-two number of contiguous groups of ``parts`` are whole subtrees, so summing each
    group (on its own rank) and then the group sums in this tree gives bitwise the same result.
    """
    if not parts:
        raise ValueError("tree_sum of nothing")
    if len(parts) == 1:
        return parts[0]
    h = len(parts) // 2
    return tree_sum(parts[:h]) + tree_sum(parts[h:])


def _inter_host_bytes(
    t: Tensor, splits: Sequence[int], group: dist.ProcessGroup | None, stats: CommStats
) -> int:
    """Bytes of an all-to-all sent to ranks of another host (``stats.ranks_per_host``)."""
    if not dist.is_initialized():
        return 0
    rph = stats.ranks_per_host
    me = dist.get_rank() // rph
    glob = [dist.get_global_rank(group, i) if group is not None else i for i in range(len(splits))]
    return t.element_size() * sum(n for n, g in zip(splits, glob) if g // rph != me)


def _off_rank_bytes(t: Tensor, splits: Sequence[int], rank: int) -> int:
    """Bytes that leave this rank (the part sent to itself stays local)."""
    return t.element_size() * (sum(splits) - splits[rank])


def all_to_all(
    send: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> Awaitable[Tensor]:
    """Start an all-to-all of a 1-D tensor with per-rank element counts; returns an awaitable.
    (One process without a process group is a world of one.)"""
    on = dist.is_initialized()
    world = dist.get_world_size(group) if on else 1
    rank = dist.get_rank(group) if on else 0
    recv = torch.empty(int(sum(recv_splits)), dtype=send.dtype, device=send.device)
    if stats is not None:
        stats.add(name, _off_rank_bytes(send, list(send_splits), rank))
        if stats.ranks_per_host:
            stats.add_inter_host(name, _inter_host_bytes(send, send_splits, group, stats))
    if world == 1:
        recv.copy_(send)
        return Done(recv)
    host = host_transport(group)
    if host is not None:
        wait = host.all_to_all(send, send_splits, recv_splits, recv)
    else:
        work = dist.all_to_all_single(
            recv, send.contiguous(), list(recv_splits), list(send_splits), group=group,
            async_op=True,
        )  # fmt: skip

        def wait() -> Tensor:
            assert work is not None
            work.wait()
            return recv

    def finish() -> Tensor:
        t0 = time.perf_counter()
        got = wait()
        if stats is not None:
            stats.waited(name, time.perf_counter() - t0)
        return got

    return Awaitable(finish)


def coded_all_to_all(
    send: Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    rows: int,
    codec: Codec | None,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    name: str = "all_to_all",
) -> Awaitable[Tensor]:
    """``all_to_all`` of float32 chunks of ``rows`` rows each, through ``codec`` on the wire.

    Chunk q of ``send`` is [rows, send_splits[q] / rows]; every chunk (the one this rank keeps
    too, so results do not depend on placement) is encoded alone and carries its own scales.
    """
    if codec is None:
        return all_to_all(send, send_splits, recv_splits, group, stats, name)
    t0 = time.perf_counter()
    shapes_out = [(rows, n // rows if rows else 0) for n in send_splits]
    shapes_in = [(rows, n // rows if rows else 0) for n in recv_splits]
    chunks = torch.split(send.detach().float(), list(send_splits))
    enc = [codec.encode(c.view(s), name) for c, s in zip(chunks, shapes_out)]
    out_bytes = [codec.nbytes(*s) for s in shapes_out]
    in_bytes = [codec.nbytes(*s) for s in shapes_in]
    buf = torch.cat(enc) if enc else torch.empty(0, dtype=torch.uint8, device=send.device)
    if stats is not None:
        stats.codec_s += time.perf_counter() - t0
    pending = all_to_all(buf, out_bytes, in_bytes, group, stats, name)

    def finish() -> Tensor:
        got = pending.wait()
        t1 = time.perf_counter()
        parts = torch.split(got, in_bytes)
        out = torch.cat([codec.decode(p, *s).reshape(-1) for p, s in zip(parts, shapes_in)])
        if stats is not None:
            stats.codec_s += time.perf_counter() - t1
        return out

    return Awaitable(finish)


def coded_all_reduce(
    t: Tensor,
    codec: Codec | None,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    name: str = "allreduce_dense",
    row: int = 64,
) -> Tensor:
    """Sum of ``t`` over ranks with ``codec`` on the wire: reduce-scatter, then all-gather.

    Each rank receives chunk r of every rank (encoded), sums them in a fixed pairwise tree over
    ranks (``tree_sum``) in float32, encodes the sum once and all-gathers it; every rank decodes
    the same bytes, so the result is bitwise identical everywhere. ``codec`` None sends float32
    as is: then the sum is bitwise the one-process tree of ``neorec.distributed.dense_blocks``.
    Bytes per rank: 2 (W-1)/W of the encoded tensor, as a ring.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return t.clone()
    n = t.numel()
    per = -(-n // (world * row)) * row  # elements per rank's chunk, whole rows
    flat = torch.zeros(world * per, device=t.device)
    flat[:n] = t.reshape(-1)
    got = coded_all_to_all(
        flat, [per] * world, [per] * world, per // row, codec, group, stats, name
    )
    parts = got.wait().view(world, per // row, row)
    total = tree_sum(list(parts))
    t0 = time.perf_counter()
    mine = codec.encode(total, name) if codec is not None else total.reshape(-1)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    if stats is not None:
        stats.add(name, mine.numel() * mine.element_size() * (world - 1))
    dist.all_gather(gathered, mine, group=group)
    if codec is None:
        out = torch.cat(gathered)
    else:
        out = torch.cat([codec.decode(g, per // row, row).reshape(-1) for g in gathered])
    if stats is not None:
        stats.codec_s += time.perf_counter() - t0
    return out[:n].view_as(t)


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
        codecs: tuple[Codec | None, Codec | None] = (None, None),
        rows: int = 0,
    ) -> Tensor:
        ctx.meta = (send.shape, send_splits, recv_splits, group, stats, codecs[1], rows)
        return coded_all_to_all(
            send.reshape(-1), send_splits, recv_splits, rows, codecs[0], group, stats, "fwd_pooled"
        ).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        shape, send_splits, recv_splits, group, stats, codec, rows = ctx.meta
        back = coded_all_to_all(
            grad.contiguous(), recv_splits, send_splits, rows, codec, group, stats, "bwd_grads"
        )
        return back.wait().view(shape), None, None, None, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (global-batch semantics)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def all_gather(
    t: Tensor, group: dist.ProcessGroup | None = None, sizes: Sequence[int] | None = None
) -> list[Tensor]:
    """Every rank's 1-D ``t`` in rank order; rank q's has ``sizes[q]`` elements (None: all as
    many as ``t``). Through shared memory when ``group`` has a host transport, else gloo's
    all-gather (of ``t`` padded to the largest size when the sizes differ)."""
    world = dist.get_world_size(group)
    t = t.reshape(-1)
    sizes = [t.numel()] * world if sizes is None else [int(n) for n in sizes]
    host = host_transport(group)
    if host is not None:
        return host.all_gather(t, sizes)()
    n = max(sizes) if sizes else 0
    if all(k == n for k in sizes):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts
    padded = torch.zeros(n, dtype=t.dtype, device=t.device)
    padded[: t.numel()] = t
    parts = [torch.empty(n, dtype=t.dtype, device=t.device) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [p[:k] for p, k in zip(parts, sizes)]


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
    got = all_to_all(
        t.reshape(-1), [chunk] * world, [chunk] * world, group, stats, "reduce_scatter"
    )
    parts = got.wait().view(world, t.shape[0] // world, *t.shape[1:])
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


TRANSPORTS = ("auto", "shm", "gloo")
"""``comm.transport``: ``auto`` = shared memory when every rank is on this
host, else the process group; ``shm`` = shared memory or an error; ``gloo`` = the process group."""

_HOST: dict[int, tuple[Any, HostTransport]] = {}
"""id(group) -> (the group, kept alive so that its id stays its own; its transport)."""


def _group_key(group: dist.ProcessGroup | None) -> int:
    return id(group if group is not None else dist.group.WORLD)


def init_host_transport(
    mode: str = "auto", group: dist.ProcessGroup | None = None, timeout_s: float = 300.0
) -> str:
    """Route ``group``'s all-to-alls through shared memory (``neorec.distributed.shm``) when
    ``mode`` allows and every rank is on this host. A collective over ``group``: every rank must
    call it with the same mode. Returns the transport the all-to-alls use: ``"shm"`` or the
    process group's backend."""
    if mode not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {mode!r}")
    backend = str(dist.get_backend(group))
    key = _group_key(group)
    if key in _HOST:
        return "shm"
    if mode == "gloo" or backend != "gloo" or dist.get_world_size(group) == 1:
        if mode == "shm" and backend != "gloo":
            raise ValueError(f"transport 'shm' needs the gloo backend, not {backend}")
        return backend
    host = HostTransport.create(group, timeout_s, required=mode == "shm")
    if host is None:
        if mode == "shm":
            raise ValueError(
                "transport 'shm' needs every rank on this host, /dev/shm and a C compiler"
            )
        return backend
    _HOST[key] = (group if group is not None else dist.group.WORLD, host)
    return "shm"


def close_host_transports() -> None:
    """Forget every shared-memory transport (before the process group is destroyed)."""
    for _, host in _HOST.values():
        host.close()
    _HOST.clear()


def host_transport(group: dist.ProcessGroup | None = None) -> HostTransport | None:
    """The shared-memory transport of ``group``, if ``init_host_transport`` set one up."""
    got = _HOST.get(_group_key(group))
    return got[1] if got is not None else None


def process_group_backend(device: str) -> str:
    """The torch.distributed backend for ``train.device``: NCCL on cuda, gloo on cpu."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str) -> torch.device:
    """This process's device for ``train.device``: ``cuda:LOCAL_RANK`` on cuda (torchrun's local
    rank; without one, the current CUDA device), else the CPU."""
    if torch.device(device).type != "cuda":
        return torch.device("cpu")

    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def unit_major_order(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Bags received as [source rank][unit][sample] (``blocks``: their lengths [W, U, b], on the
    host): the gather index that puts their ids in [unit][source rank][sample] order, and the
    offsets of the bags in that order (a feature-major batch with W*b samples per unit)."""
    world, units, b = blocks.shape
    sizes = blocks.sum(2)  # [W, U] ids per (source, unit) block
    src_start = torch.zeros(world * units, dtype=torch.int64)
    src_start[1:] = torch.cumsum(sizes.flatten(), 0)[:-1]
    src_start = src_start.view(world, units).t().flatten()  # in target (unit, source) order
    tgt_sizes = sizes.t().flatten()
    tgt_start = torch.zeros_like(tgt_sizes)
    tgt_start[1:] = torch.cumsum(tgt_sizes, 0)[:-1]
    n = int(tgt_sizes.sum())
    gather = torch.repeat_interleave(src_start - tgt_start, tgt_sizes) + torch.arange(n)
    lengths = blocks.permute(1, 0, 2).reshape(-1)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return gather, offsets


def source_major_to_unit_major(
    blocks: Tensor, values: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Reorder received bags from [source rank][unit][sample] to [unit][source rank][sample].

    Returns (indices, offsets, weights) of a feature-major batch with W*b samples per unit.
    """
    gather, offsets = unit_major_order(blocks)
    n = gather.numel()
    if values.numel() != n:
        raise SparseFeatureError(f"received {values.numel()} ids, lengths say {n}")
    w = weights[gather] if weights is not None else None
    return values[gather], offsets, w
