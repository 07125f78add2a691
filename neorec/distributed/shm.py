"""All-to-all through shared memory between the ranks of one host.

Gloo moves every collective through sockets and its own threads. On one host that costs a copy
through the kernel and a thread hand-off per message, and on a busy 2-core VM one collective in
ten or so waits 3-5 ms more than its median (``docs/distributed.md``). ``HostTransport``
does an all-to-all as two copies through memory the ranks share, synchronized by sequence
counters (``neorec/ops/csrc/shm_sync.c``):

- **Write** (when the collective is started): rank r copies its whole send buffer, with a header
  of where each destination's chunk starts and how long it is, into one of its two slots, then
  publishes the collective's sequence number s. Slot ``s % 2``: a slot is written again only
  after every rank has read it (its "consumed" counter), so two collectives may be in flight.
- **Read** (when the result is awaited): once every rank has published s, rank r copies its chunk
  out of each peer's slot, checks its length against the split it expected, and publishes that it
  consumed s.

A slot that is too small is replaced by a larger file (a new generation); the files live in
``/dev/shm`` only until every peer has mapped them, so a crash leaves nothing behind after the
first collectives. Ranks must start the same collectives in the same order, as with any process
group. Results are the same bytes as gloo's (``tests/test_shm_transport.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["HostTransport", "ShmTransportError", "native_sync"]

_STRIDE = 32
"""int64s per rank in the control block (256 bytes): published at 0, the generation of each slot's
write at 1-2, consumed at 16 (its own cache lines, written by the reader), the process id at 24
(a waiter checks every second that the rank it waits for is still alive)."""
_PUB, _GEN0, _CONS, _PID = 0, 1, 16, 24
_MIN_CAP = 1 << 20
_SHM_DIR = "/dev/shm"


class ShmTransportError(RuntimeError):
    """A shared-memory collective failed: a peer did not arrive, or sizes disagree."""


def native_sync() -> Any:
    """The compiled library with the sequence-counter functions declared, or None."""
    from neorec.ops.cpu import declared_kernel

    return declared_kernel("shm_sync", _declare)


def _declare(lib: Any) -> None:
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.shm_store.argtypes = [vp, i64]
    lib.shm_store.restype = None
    lib.shm_load.argtypes = [vp]
    lib.shm_load.restype = i64
    lib.shm_wait_all_ge.argtypes = [vp, i64, i64, i64, i64, ctypes.c_double]
    lib.shm_wait_all_ge.restype = i64


class _Mapping:
    """One shared file mapped: its mmap, a uint8 tensor over it, and its address."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))


class HostTransport:
    """Shared-memory all-to-all for the ranks of ``group``, all on this host. Build it with
    ``create`` (a collective over the group); ``None`` when the ranks are not all on one host or
    the counters cannot be compiled."""

    def __init__(
        self, lib: Any, control: _Mapping, prefix: str, rank: int, world: int, timeout_s: float
    ) -> None:
        self.lib = lib
        self.control = control
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.seq = 0
        self.read_seq = 0
        self.header = 64 * (-(-16 * world // 64))
        self._own: _Mapping | None = None
        self._gen = 0
        self._unlink: list[tuple[str, int]] = []  # (path, first seq written with it)
        self._peers: dict[int, tuple[int, _Mapping]] = {}
        self._pending: dict[int, Callable[[], None]] = {}
        self._lock = threading.RLock()
        self.closed = False
        self._put(rank, _PID, os.getpid())

    # -- setup -----------------------------------------------------------------------------
    @classmethod
    def create(
        cls, group: dist.ProcessGroup | None = None, timeout_s: float = 300.0
    ) -> HostTransport | None:
        """Collective over ``group``: every rank gets a transport, or every rank gets None."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        lib = native_sync()
        ok = lib is not None and os.access(_SHM_DIR, os.W_OK)
        mine = (socket.gethostname(), _boot_id(), bool(ok))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine, group=group)
        if not all(e[2] for e in every) or len({(e[0], e[1]) for e in every}) != 1:
            return None
        names: list[Any] = [None]
        control: _Mapping | None = None
        if rank == 0:
            prefix = os.path.join(_SHM_DIR, f"neorec-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            control = _Mapping(prefix + "-ctl", _STRIDE * 8 * world, create=True)
            names = [prefix]
        dist.broadcast_object_list(
            names, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
        prefix = str(names[0])
        if control is None:
            control = _Mapping(prefix + "-ctl", 0, create=False)
        host = cls(lib, control, prefix, rank, world, timeout_s)  # writes its pid
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(prefix + "-ctl")  # every rank has it mapped
        return host

    def close(self, grace_s: float = 5.0) -> None:
        """Remove this rank's files that are still linked (not collective): each once every
        peer has read from it, or after ``grace_s`` seconds (a peer that never reads)."""
        with self._lock:
            for path, first in self._unlink:
                self.lib.shm_wait_all_ge(
                    self._ctl_addr(0, _CONS), self.world, _STRIDE, self.rank, first, grace_s
                )
                _unlink_quiet(path)
            self._unlink.clear()
            self.closed = True

    # -- the collective --------------------------------------------------------------------
    def all_to_all(
        self,
        send: Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        recv: Tensor | None = None,
    ) -> Callable[[], Tensor]:
        """Write ``send`` (1-D, chunk q of ``send_splits[q]`` elements to rank q) and return a
        function that waits for the peers and returns what they sent here (in ``recv`` when
        given: ``sum(recv_splits)`` elements of ``send``'s dtype)."""
        w, r = self.world, self.rank
        if len(send_splits) != w or len(recv_splits) != w:
            raise ShmTransportError(
                f"shm all-to-all: {len(send_splits)} send and {len(recv_splits)} receive splits "
                f"for {w} ranks"
            )
        if int(sum(send_splits)) != send.numel():
            raise ShmTransportError(
                f"shm all-to-all: send splits add up to {int(sum(send_splits))}, "
                f"the tensor has {send.numel()} elements"
            )
        if int(send_splits[r]) != int(recv_splits[r]):
            raise ShmTransportError(
                f"shm all-to-all: rank {r} sends itself {int(send_splits[r])} elements but "
                f"expects {int(recv_splits[r])}"
            )
        esz = send.element_size()
        src = send.detach().contiguous().view(-1).view(torch.uint8)
        nbytes = [int(n) * esz for n in send_splits]
        offs = [sum(nbytes[:q]) for q in range(w)]
        if recv is None:
            recv = torch.empty(int(sum(recv_splits)), dtype=send.dtype, device=send.device)
        if recv.dtype != send.dtype or recv.numel() != int(sum(recv_splits)):
            raise ShmTransportError(
                f"shm all-to-all: the receive buffer holds {recv.numel()} {recv.dtype}, the "
                f"splits want {int(sum(recv_splits))} {send.dtype}"
            )
        out = recv
        rbytes = recv.view(torch.uint8)
        bounds = [0]
        for n in recv_splits:
            bounds.append(bounds[-1] + int(n) * esz)
        dests = [rbytes[bounds[q] : bounds[q + 1]] for q in range(w)]
        dests[r].copy_(src[offs[r] : offs[r] + nbytes[r]])
        read = self._start(src, offs, nbytes, dests, "all-to-all")
        return lambda: (read(), out)[1]

    def all_gather(self, t: Tensor, sizes: Sequence[int]) -> Callable[[], list[Tensor]]:
        """Write ``t`` (1-D, ``sizes[rank]`` elements) once for every peer and return a function
        that waits and returns every rank's tensor (``sizes[q]`` elements from rank q)."""
        w, r = self.world, self.rank
        if len(sizes) != w or int(sizes[r]) != t.numel():
            raise ShmTransportError(
                f"shm all-gather: sizes {list(sizes)} for {w} ranks, rank {r} has {t.numel()}"
            )
        src = t.detach().contiguous().view(-1).view(torch.uint8)
        outs = [torch.empty(int(n), dtype=t.dtype, device=t.device) for n in sizes]
        outs[r].copy_(t.detach().reshape(-1))
        dests = [o.view(torch.uint8) for o in outs]
        read = self._start(src, [0] * w, [src.numel()] * w, dests, "all-gather")
        return lambda: (read(), outs)[1]

    def _start(
        self, src: Tensor, offs: list[int], nbytes: list[int], dests: list[Tensor], what: str
    ) -> Callable[[], None]:
        """Write ``src`` (bytes; rank q's chunk at ``offs[q]``, ``nbytes[q]`` long) to a slot and
        publish it; the returned function waits for the peers and copies rank q's chunk for
        this rank into ``dests[q]`` (checking its length), q != rank."""
        if self.closed:
            raise ShmTransportError("shm transport: used after close()")
        w, r = self.world, self.rank
        with self._lock:
            self.seq += 1
            s = self.seq
            self._complete_through(s - 2)
            self._wait(_CONS, s - 2, f"read collective {s - 2}")
            own = self._slot_for(s, self.header + src.numel())
            base = (s % 2) * (own.size // 2)
            struct.pack_into(f"{2 * w}q", own.mm, base, *[self.header + o for o in offs], *nbytes)
            own.bytes[base + self.header : base + self.header + src.numel()].copy_(src)
            self._put(r, _GEN0 + s % 2, self._gen)
            self.lib.shm_store(self._ctl_addr(r, _PUB), s)

            def read() -> None:
                self._wait(_PUB, s, f"write collective {s}")
                for j in range(w):
                    if j == r:
                        continue
                    peer = self._peer(j, self._get(j, _GEN0 + s % 2))
                    pbase = (s % 2) * (peer.size // 2)
                    off = struct.unpack_from("q", peer.mm, pbase + 8 * r)[0]
                    n = struct.unpack_from("q", peer.mm, pbase + 8 * (w + r))[0]
                    if n != dests[j].numel():
                        raise ShmTransportError(
                            f"shm {what} {s}: rank {j} sent {n} bytes to rank {r}, which "
                            f"expected {dests[j].numel()} (the ranks disagree on the sizes)"
                        )
                    dests[j].copy_(peer.bytes[pbase + off : pbase + off + n])
                self.lib.shm_store(self._ctl_addr(r, _CONS), s)

            self._pending[s] = read

        def finish() -> None:
            with self._lock:
                self._complete_through(s)

        return finish

    # -- internals -------------------------------------------------------------------------
    def _put(self, rank: int, field: int, value: int) -> None:
        """A plain store of this rank's control field (ordered by the release store after it)."""
        struct.pack_into("q", self.control.mm, 8 * (rank * _STRIDE + field), value)

    def _get(self, rank: int, field: int) -> int:
        """A control field as a Python int (read after the acquire load that ordered it)."""
        return int(struct.unpack_from("q", self.control.mm, 8 * (rank * _STRIDE + field))[0])

    def _ctl_addr(self, rank: int, field: int) -> int:
        return int(self.control.addr + 8 * (rank * _STRIDE + field))

    def _wait(self, field: int, value: int, what: str) -> None:
        if value <= 0:
            return
        start = time.monotonic()
        while True:
            left = self.timeout_s - (time.monotonic() - start)
            late = self.lib.shm_wait_all_ge(
                self._ctl_addr(0, field),
                self.world,
                _STRIDE,
                self.rank,
                value,
                max(0.0, min(1.0, left)),
            )
            if late < 0:
                return
            pid = self._get(late, _PID)
            if not _alive(pid):
                raise ShmTransportError(
                    f"shm transport: rank {late} (pid {pid}) exited before it could {what}"
                )
            if left <= 1.0:
                raise ShmTransportError(
                    f"shm transport: rank {late} did not {what} within {self.timeout_s:g} s "
                    f"(did it fail, or start other collectives in another order?)"
                )

    def _complete_through(self, s: int) -> None:
        while self.read_seq < s:
            nxt = self.read_seq + 1
            read = self._pending.pop(nxt, None)
            if read is not None:
                read()
            self.read_seq = nxt
        self._drop_linked()

    def _slot_for(self, s: int, need: int) -> _Mapping:
        if self._own is None or need > self._own.size // 2:
            cap = max(_MIN_CAP, 1 << (need - 1).bit_length())
            self._gen += 1
            path = f"{self.prefix}-r{self.rank}-g{self._gen}"
            self._own = _Mapping(path, 2 * cap, create=True)
            self._unlink.append((path, s))
        return self._own

    def _drop_linked(self) -> None:
        """Unlink this rank's files every peer has read from (so has mapped)."""
        if not self._unlink:
            return
        done = (
            min(
                int(self.lib.shm_load(self._ctl_addr(j, _CONS)))
                for j in range(self.world)
                if j != self.rank
            )
            if self.world > 1
            else self.seq
        )
        keep = []
        for path, first in self._unlink:
            if done >= first:
                _unlink_quiet(path)
            else:
                keep.append((path, first))
        self._unlink = keep

    def _peer(self, j: int, gen: int) -> _Mapping:
        got = self._peers.get(j)
        if got is None or got[0] != gen:
            path = f"{self.prefix}-r{j}-g{gen}"
            try:
                m = _Mapping(path, 0, create=False)
            except FileNotFoundError as e:
                raise ShmTransportError(
                    f"shm transport: rank {j}'s buffer {path} is gone (removed from /dev/shm?)"
                ) from e
            self._peers[j] = (gen, m)
            return m
        return got[1]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, not ours to judge
        return True
    return True


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
