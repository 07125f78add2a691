"""Faults of the shared-memory transport (``neorec.distributed.shm``): ranks killed at any point
leave nothing in ``/dev/shm``; a dead, unreaped (zombie) or stopped peer is one ``NeorecError``
line naming the rank; ranks that cannot see each other's shared memory (separate containers on
one host) fall back to gloo with one line, or get one clear error under ``transport = "shm"``.

The kill, zombie and stop cases run each rank as a plain subprocess of the test (this file run as
a script), driven line by line through its stdin: every kill or signal happens at a state a rank
has reported, never after a sleep. The test process does not reap a rank it wants as a zombie.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from neorec.distributed import comm, shm
from neorec.errors import NeorecError

HERE = os.path.dirname(os.path.abspath(__file__))


# -- the rank process (this file run as a script) -----------------------------------------------
def _say(line: str) -> None:
    sys.stdout.write(line.replace("\n", " | ") + "\n")
    sys.stdout.flush()


def _rank_main(rank: int, world: int, port: int, timeout_s: float) -> None:
    """Commands on stdin, one a line: ``a2a N`` starts an all-to-all of N floats per peer
    (not awaited), ``wait`` awaits every started one, ``exit`` ends the process at once."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        got = comm.init_host_transport("shm", timeout_s=timeout_s)
        _say(f"ready {got}")
        pending = []
        for line in sys.stdin:
            cmd, *arg = line.split()
            if cmd == "a2a":
                n = int(arg[0])
                pending.append(comm.all_to_all(torch.ones(n * world), [n] * world, [n] * world))
                _say("started")
            elif cmd == "wait":
                for p in pending:
                    p.wait()
                pending.clear()
                _say("done")
            elif cmd == "exit":
                os._exit(0)
    except NeorecError as e:
        _say(f"error {type(e).__name__}: {e}")
        os._exit(3)
    except BaseException as e:  # noqa: BLE001 - a crash: say so, the test fails on it
        _say(f"crash {type(e).__name__}: {e}")
        os._exit(4)
    os._exit(0)


# -- the test side ------------------------------------------------------------------------------
class _Ranks:
    """``world`` rank subprocesses of this file; ``send`` writes a command, ``expect`` reads the
    next line of one rank (a line it prints after reaching the state the command asked for)."""

    def __init__(self, world: int, timeout_s: float) -> None:
        from dist_util import free_port

        port = free_port()
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, str(r), str(world), str(port), str(timeout_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]
        # Bounds a hung rank (the test then fails on its empty answer), not a timing window.
        self.watchdog = threading.Timer(600, self._kill_now)
        self.watchdog.daemon = True
        self.watchdog.start()

    def _kill_now(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()

    def send(self, rank: int, cmd: str) -> None:
        stdin = self.procs[rank].stdin
        assert stdin is not None
        stdin.write(cmd + "\n")
        stdin.flush()

    def expect(self, rank: int, prefix: str) -> str:
        stdout = self.procs[rank].stdout
        assert stdout is not None
        line = stdout.readline().strip()
        assert line.startswith(prefix), f"rank {rank}: expected {prefix!r}, got {line!r}"
        return line

    def kill(self) -> None:
        self.watchdog.cancel()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        for p in self.procs:
            p.wait(timeout=60)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


@contextlib.contextmanager
def _ranks(world: int = 2, timeout_s: float = 60.0) -> Iterator[_Ranks]:
    ranks = _Ranks(world, timeout_s)
    try:
        for r in range(world):
            ranks.expect(r, "ready shm")
        yield ranks
    finally:
        ranks.kill()


def _leftovers(pid0: int) -> list[str]:
    """This run's files in /dev/shm (any the transport ever named after rank 0's pid)."""
    return glob.glob(f"/dev/shm/neorec-{pid0}-*")


# Where to SIGKILL every rank: after these commands (rank, command, the line it answers).
_BIG = 3_000_000  # floats per peer: 24 MB a message, more than the first slot holds
KILL_POINTS = {
    "after setup": [],
    "first collective started, unread": [(0, "a2a 4", "started"), (1, "a2a 4", "started")],
    "grown slot started on both, unread": [
        (0, "a2a 4", "started"),
        (1, "a2a 4", "started"),
        (0, "wait", "done"),
        (1, "wait", "done"),
        (0, f"a2a {_BIG}", "started"),
        (1, f"a2a {_BIG}", "started"),
    ],
    "grown slot started on rank 0 only": [
        (0, "a2a 4", "started"),
        (1, "a2a 4", "started"),
        (0, "wait", "done"),
        (1, "wait", "done"),
        (0, f"a2a {_BIG}", "started"),
    ],
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_ranks_killed_at_any_point_leave_nothing_in_dev_shm(point: str) -> None:
    with _ranks() as ranks:
        pid0 = ranks.procs[0].pid
        for rank, cmd, answer in KILL_POINTS[point]:
            ranks.send(rank, cmd)
            ranks.expect(rank, answer)
        assert not _leftovers(pid0), f"{point}: files in /dev/shm while running"
    # Every rank is SIGKILLed (and reaped) by now.
    assert not _leftovers(pid0), f"{point}: left behind {_leftovers(pid0)}"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_zombie_peer_is_reported_as_exited_not_waited_for() -> None:
    with _ranks(timeout_s=30.0) as ranks:
        p1 = ranks.procs[1]
        ranks.send(1, "exit")
        os.waitid(os.P_PID, p1.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        assert _state(p1.pid) == "Z"
        ranks.send(0, "a2a 4")
        ranks.expect(0, "started")
        ranks.send(0, "wait")
        line = ranks.expect(0, "error")
        assert re.search(
            rf"ShmTransportError: .*rank 1 \(pid {p1.pid}\) exited before it could write "
            r"collective 1$",
            line,
        ), line
        assert ranks.procs[0].wait(timeout=60) == 3


def test_stopped_peer_is_named_at_the_timeout() -> None:
    with _ranks(timeout_s=2.0) as ranks:
        p1 = ranks.procs[1]
        p1.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while _state(p1.pid) != "T":  # waits for a state, bounded only against a hang
            assert time.monotonic() < deadline, "rank 1 did not stop"
            time.sleep(0.01)
        ranks.send(0, "a2a 4")
        ranks.expect(0, "started")
        ranks.send(0, "wait")
        line = ranks.expect(0, "error")
        assert re.search(
            rf"ShmTransportError: .*rank 1 \(pid {p1.pid}\) is stopped .*did not write "
            r"collective 1 within 2 s",
            line,
        ), line


def test_every_transport_error_is_a_neorec_error() -> None:
    assert issubclass(shm.ShmTransportError, NeorecError)
    assert issubclass(shm.ShmTransportError, RuntimeError)  # what it was before


def test_a_zombie_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert _state(child.pid) == "Z"
        assert not shm._alive(child.pid)
    finally:
        child.wait()
    assert not shm._alive(child.pid)  # reaped
    assert shm._alive(os.getpid())


# -- ranks that cannot see each other's shared memory (containers) ------------------------------
def _hide_peers_memory() -> None:
    """This process sees no other process's shared memory: no /dev/shm files of the transport and
    no /proc/<pid>/fd of another process (a container with its own /dev/shm and PID namespace on
    the same host, with the same hostname and boot id)."""
    real_open = os.open
    me = str(os.getpid())

    def open_(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        p = os.fsdecode(path)
        other_fd = re.match(r"/proc/(\d+)/fd/", p)
        if p.startswith("/dev/shm/neorec-") or (other_fd and other_fd.group(1) != me):
            raise FileNotFoundError(2, "No such file or directory", p)
        return real_open(path, flags, *a, **k)

    os.open = open_  # type: ignore[assignment]


def _separate_containers(rank: int, world: int) -> None:
    comm.close_host_transports()  # (make test-shm set one up for the world already)
    if rank == 1:
        _hide_peers_memory()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert comm.init_host_transport("auto") == "gloo"
    assert comm.host_transport() is None
    lines = err.getvalue().splitlines()
    if rank == 0:  # one line for the job, naming the rank and the fallback
        assert len(lines) == 1, lines
        assert re.search(r"rank 1 cannot map rank 0's shared memory .*using gloo", lines[0])
    else:
        assert lines == []
    # The all-to-alls work, over gloo.
    got = comm.all_to_all(torch.full((world,), float(rank)), [1] * world, [1] * world).wait()
    assert got.tolist() == [0.0, 1.0]
    with pytest.raises(shm.ShmTransportError, match="rank 1 cannot map rank 0's shared memory"):
        comm.init_host_transport("shm")
    assert comm.host_transport() is None


def test_ranks_that_cannot_see_each_others_shared_memory_fall_back_or_fail_clearly() -> None:
    from dist_util import run_ranks

    run_ranks(_separate_containers, 2)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
