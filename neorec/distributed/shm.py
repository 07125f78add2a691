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

The shared memory is anonymous (``memfd_create``): never a file in ``/dev/shm`` or anywhere else,
so a rank killed at any moment leaves nothing behind; the kernel frees the memory when the last
process mapping it is gone. A peer maps a rank's memory through ``/proc/<pid>/fd/<fd>`` while the
rank still holds that descriptor; the rank closes it once every peer has mapped it (so open
descriptors do not pile up as slots grow). A slot that is
too small is replaced by a larger one (a new generation). At set-up every rank maps every peer's
memory and checks a random token in it: ranks on one host that cannot (separate containers, PID
namespaces) get gloo and one line saying why, or one clear error under ``transport = "shm"``.

A peer that exits (or is a zombie, exited but not yet reaped) is reported within about a second;
one that is stopped (SIGSTOP, a debugger) is named when the wait reaches ``timeout_s``. Every error
is a ``ShmTransportError`` (a ``NeorecError``). Ranks must start the same collectives in the same
order, as with any process group. Results are the same bytes as gloo's
(``tests/test_shm_transport.py``; the faults: ``tests/test_shm_faults.py``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.errors import NeorecError

__all__ = ["HostTransport", "ShmTransportError", "native_sync"]

_STRIDE = 32
"""int64s per rank in the control block (256 bytes): published at 0, the generation of each slot's
write at 1-2 and the descriptor that holds it at 3-4 (both written with it), consumed at 16 (its
own cache lines, written by the reader). Rank 0's block holds the control block's token at 8-9."""
_PUB, _GEN0, _FD0, _TOKEN, _CONS = 0, 1, 3, 8, 16
_MIN_CAP = 1 << 20
_PROC = "/proc"


class ShmTransportError(NeorecError, RuntimeError):
    """A shared-memory collective failed or cannot be set up: a peer did not arrive, exited or
    is stopped, sizes disagree, or the ranks cannot map each other's memory."""


class _Unreachable(Exception):
    """A peer's memory could not be mapped (the message says which and why)."""


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
    """One piece of shared memory mapped: its mmap, a uint8 tensor over it, and its address.
    ``fd`` is the descriptor the owner publishes until every peer has mapped it (-1 once closed,
    and always in a peer's mapping). The mmap keeps a duplicate descriptor of its own, closed
    with it: the memory goes when the last process mapping it does."""

    def __init__(self, fd: int, size: int, keep_fd: bool) -> None:
        try:
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
        self.fd = fd if keep_fd else -1
        self.size = size
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    @classmethod
    def new(cls, name: str, size: int) -> _Mapping:
        """Anonymous shared memory of ``size`` bytes (no file anywhere), its descriptor kept."""
        fd = os.memfd_create(name)  # close-on-exec
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, keep_fd=True)

    @classmethod
    def of_peer(cls, pid: int, fd: int, token: bytes = b"", at: int = 0) -> _Mapping:
        """Map the memory process ``pid`` holds as descriptor ``fd``; with ``token``, check it
        is at offset ``at`` (that it is the peer's memory, not another process's)."""
        path = f"{_PROC}/{pid}/fd/{fd}"
        try:
            peer_fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise _Unreachable(f"{path}: {e.strerror or e}") from e
        try:
            size = os.fstat(peer_fd).st_size
        except BaseException:
            os.close(peer_fd)
            raise
        try:
            m = cls(peer_fd, size, keep_fd=False)
        except (OSError, ValueError) as e:
            raise _Unreachable(f"{path}: {e}") from e
        if token and bytes(m.mm[at : at + len(token)]) != token:
            raise _Unreachable(f"{path} is another process's memory")
        return m

    def release(self) -> None:
        """Close the published descriptor (the mapping stays): every peer has mapped it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostTransport:
    """Shared-memory all-to-all for the ranks of ``group``, all on this host. Build it with
    ``create`` (a collective over the group); ``None`` when the ranks are not all on one host,
    cannot map each other's memory, or the counters cannot be compiled."""

    def __init__(
        self,
        lib: Any,
        control: _Mapping,
        rank: int,
        world: int,
        timeout_s: float,
        pids: list[int],
        own: _Mapping,
        peers: dict[int, _Mapping],
    ) -> None:
        self.lib = lib
        self.control = control
        self.rank = rank
        self.world = world
        self.timeout_s = timeout_s
        self.pids = pids
        self.seq = 0
        self.read_seq = 0
        self.header = 64 * (-(-16 * world // 64))
        self._own: _Mapping | None = own
        self._gen = 1
        self._held: list[tuple[_Mapping, int]] = []  # (own memory, first seq written with it)
        self._peers: dict[int, tuple[int, _Mapping]] = {j: (1, m) for j, m in peers.items()}
        self._pending: dict[int, Callable[[], None]] = {}
        self._lock = threading.RLock()
        self.closed = False

    # -- setup -----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 300.0,
        required: bool = False,
    ) -> HostTransport | None:
        """Collective over ``group``: every rank gets a transport, or every rank gets None (with
        ``required``: every rank raises a ``ShmTransportError`` saying why instead). Ranks on one
        host that cannot map each other's memory get None and rank 0 prints one line why."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        lib = native_sync()
        why = ""
        own = control = None
        token = os.urandom(16)
        if lib is None:
            why = "the shared-memory counters could not be compiled (no C compiler?)"
        elif not hasattr(os, "memfd_create") or not os.path.isdir(f"{_PROC}/self/fd"):
            why = "this system has no memfd_create or /proc"
        else:  # every rank's first slot (rank 0's also the control block), with a token to check
            try:
                if rank == 0:
                    control = _Mapping.new("neorec-ctl", _STRIDE * 8 * world)
                    control.mm[8 * _TOKEN : 8 * _TOKEN + 16] = token
                own = _Mapping.new(f"neorec-r{rank}-g1", 2 * _MIN_CAP)
                own.mm[:16] = token
            except OSError as e:
                why = f"cannot create shared memory ({e})"
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (socket.gethostname(), _boot_id(), why), group=group)
        reason = next((f"rank {j}: {e[2]}" for j, e in enumerate(every) if e[2]), "")
        if not reason and len({(e[0], e[1]) for e in every}) != 1:
            hosts = sorted({e[0] for e in every})
            reason = f"the ranks are not all on one host (hosts {', '.join(hosts)}, or boot ids)"
        if reason or own is None:
            for mem in (own, control):
                if mem is not None:
                    mem.release()
            if required:
                raise ShmTransportError(f"transport 'shm' cannot be used: {reason}")
            return None
        dist.all_gather_object(
            every, (os.getpid(), own.fd, control.fd if control else -1, token), group=group
        )
        pids = [int(e[0]) for e in every]
        peers: dict[int, _Mapping] = {}
        err, j = "", 0
        try:
            if control is None:
                control = _Mapping.of_peer(pids[0], every[0][2], every[0][3], 8 * _TOKEN)
            for j in range(world):
                if j != rank:
                    peers[j] = _Mapping.of_peer(pids[j], every[j][1], every[j][3])
        except _Unreachable as e:
            err = (
                f"rank {rank} cannot map rank {j}'s shared memory ({e}; separate containers or "
                f"PID namespaces on one host?)"
            )
        errs: list[Any] = [None] * world
        dist.all_gather_object(errs, err, group=group)  # also: every rank has mapped every peer
        own.release()  # from here on the memory lives only in the processes' mappings
        if control is not None:
            control.release()
        bad = next((str(e) for e in errs if e), "")
        if bad:
            if required:
                raise ShmTransportError(f"transport 'shm' cannot be used: {bad}")
            if rank == 0:
                print(
                    f"neorec: shared-memory transport off: {bad}; using gloo",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        assert control is not None
        return cls(lib, control, rank, world, timeout_s, pids, own, peers)

    def close(self, grace_s: float = 5.0) -> None:
        """Close this rank's descriptors still held (not collective): each once every peer has
        mapped its memory, or after ``grace_s`` seconds (a peer that never reads)."""
        with self._lock:
            for mem, first in self._held:
                self.lib.shm_wait_all_ge(
                    self._ctl_addr(0, _CONS), self.world, _STRIDE, self.rank, first, grace_s
                )
                mem.release()
            self._held.clear()
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
            self._put(r, _FD0 + s % 2, own.fd)  # valid until every peer has mapped it
            self.lib.shm_store(self._ctl_addr(r, _PUB), s)

            def read() -> None:
                self._wait(_PUB, s, f"write collective {s}")
                for j in range(w):
                    if j == r:
                        continue
                    peer = self._peer(j, self._get(j, _GEN0 + s % 2), s % 2, f"{what} {s}")
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
        """Until every peer's ``field`` reaches ``value``: checks every second that the rank
        waited for is alive (a zombie is not); at ``timeout_s``, names it (stopped, if it is)."""
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
            pid = self.pids[late]
            state = _state(pid)
            if not _alive(pid, state):
                raise ShmTransportError(
                    f"shm transport: rank {late} (pid {pid}) exited before it could {what}"
                )
            if left <= 1.0:
                if state in ("T", "t"):
                    raise ShmTransportError(
                        f"shm transport: rank {late} (pid {pid}) is stopped (SIGSTOP or a "
                        f"debugger) and did not {what} within {self.timeout_s:g} s"
                    )
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
            self._own = _Mapping.new(f"neorec-r{self.rank}-g{self._gen}", 2 * cap)
            self._held.append((self._own, s))
        return self._own

    def _drop_linked(self) -> None:
        """Close this rank's descriptors of memory every peer has read from (so has mapped)."""
        if not self._held:
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
        for mem, first in self._held:
            if done >= first:
                mem.release()
            else:
                keep.append((mem, first))
        self._held = keep

    def _peer(self, j: int, gen: int, slot: int, what: str) -> _Mapping:
        got = self._peers.get(j)
        if got is None or got[0] != gen:
            pid = self.pids[j]
            try:
                m = _Mapping.of_peer(pid, self._get(j, _FD0 + slot))
            except _Unreachable as e:
                if not _alive(pid, _state(pid)):
                    raise ShmTransportError(
                        f"shm transport: rank {j} (pid {pid}) exited during {what}"
                    ) from e
                raise ShmTransportError(
                    f"shm transport: rank {j}'s memory of {what} cannot be mapped ({e})"
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


def _state(pid: int) -> str | None:
    """Process ``pid``'s state letter from ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped,
    ``Z`` zombie, ...); None when there is no such process."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields[0].decode() if fields else None


def _alive(pid: int, state: str | None = "") -> bool:
    """Whether ``pid`` runs (or may run again): not gone, not a zombie (``os.kill(pid, 0)``
    succeeds on a zombie, exited but not yet reaped by its parent)."""
    if state == "":
        state = _state(pid)
    return state is not None and state not in ("Z", "X", "x")
