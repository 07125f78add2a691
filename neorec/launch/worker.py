"""What a worker process of a run does around its work: the launcher watchdog, its rank group,
fault handling.

- **Launcher death**: a worker exits within a second of losing its launcher, even when it is
  blocked in a collective (``PR_SET_PDEATHSIG`` on Linux, and a thread that watches the parent pid
  and ends the process with ``os._exit``).
- **One line**: a worker's ``NeorecError`` is handed to the launcher (``messages.write_report``),
  which prints it once; gloo's error of a collective whose peer is gone is one line too.
- **Ctrl-C**: workers stay quiet (their launcher prints), and so does a failure that follows a
  peer's or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from neorec.errors import NeorecError
from neorec.launch.messages import (
    EXIT_INTERRUPTED,
    PeerLostError,
    peer_lost,
    peer_reported,
    write_report,
)

__all__ = [
    "LAUNCHER_PID_ENV",
    "is_worker",
    "proc_state",
    "watch_launcher",
    "run_worker",
    "init_rank_group",
    "attempt_overrides",
    "train_rank",
]

LAUNCHER_PID_ENV = "NEOREC_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_GRACE_S = 3.0  # a failing rank waits this long for its launcher to stop it (see _consequence)


def is_worker() -> bool:
    """True in a process started by torchrun (or ``--nproc``) as one rank of a job."""
    return "LOCAL_RANK" in os.environ


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (R, S, T, Z, ...); '' if it is gone, '?' if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""
    except (OSError, IndexError):
        return "?"


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    state = proc_state(pid)
    if state != "?":
        return state not in ("", "Z")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _expected_parent() -> int:
    """The launcher's pid: ``NEOREC_LAUNCHER_PID`` (set by ``--nproc``), else the parent now.

    A value that is not our parent but names a live process is a stale variable (a job launched
    from within another), so the parent we have now is the launcher.
    """
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    parent = os.getppid()
    if raw.isdigit() and int(raw) != parent and not _alive(int(raw)):
        return int(raw)  # the launcher is already gone: the check below ends this process
    return parent


def watch_launcher(poll_s: float = _POLL_S) -> None:
    """End this worker (``os._exit``) within ``poll_s`` seconds once its launcher is gone.

    On Linux the kernel also sends SIGTERM when the parent dies (``PR_SET_PDEATHSIG``); the
    watching thread covers the rest (other systems, a SIGTERM handler that cannot run while the
    main thread waits in a collective). A launcher that died before this call ends the worker now.
    """
    expected = _expected_parent()
    # (The kernel ties PDEATHSIG to the parent *thread* that forked us: the elastic agent starts
    # workers from its main thread, so that thread's end is the launcher's end.)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != expected:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != expected:
                os._exit(1)

    threading.Thread(target=watch, name="neorec-launcher-watch", daemon=True).start()


class _WorkerState:
    interrupted = False  # SIGINT received (forwarded by the launcher)
    unwinding = False  # already handling a failure: a SIGINT now must not raise into it


def _on_sigint(signum: int, frame: Any) -> None:
    _WorkerState.interrupted = True
    if not _WorkerState.unwinding:
        raise KeyboardInterrupt


def _consequence(rank: int, grace_s: float = _GRACE_S) -> bool:
    """True if this rank's failure follows another's: Ctrl-C, or a peer that failed first.

    A peer killed by a signal reports nothing, and this rank's collective then breaks
    ("Connection reset by peer"): so a rank of a job waits ``grace_s`` seconds first, in which
    the launcher, having seen the peer's end, stops this rank too (SIGTERM).
    """
    deadline = time.monotonic() + (grace_s if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0)
    while True:
        if _WorkerState.interrupted or peer_reported(rank):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _is_transport(e: BaseException) -> bool:
    """The shared-memory transport's error (a peer gone mid-collective), by its class's name:
    ``distributed.shm`` is a lower layer this one does not reach into."""
    return any(c.__name__ == "ShmTransportError" for c in type(e).__mro__)


def _exit_now(code: int) -> NoReturn:
    """End a failed or interrupted worker at once: no interpreter teardown, whose destructors of
    a process group with a vanished peer can abort (``terminate called ...``) or wait."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_worker(fn: Callable[[], int]) -> int:
    """Run one rank's work: watch the launcher, report errors once, stay quiet on Ctrl-C.

    A ``NeorecError`` is reported (to the launcher, else as ``neorec: error: rank R: ...``) and
    exits 2, as does gloo's error of a collective whose peer is gone (``peer_lost``); Ctrl-C (a SIGINT forwarded by the launcher) exits 130 without a word, as does any
    failure that follows it (a collective broken by a peer that stopped first). A failure that
    follows a peer's (see ``_consequence``) also stays quiet (exit 1). Other exceptions are
    defects: their traceback is printed and the launcher's line names the rank and the exception
    (exit 1). A failed worker ends with ``os._exit``; a finished one returns 0.
    """
    watch_launcher()
    rank = _rank()
    with contextlib.suppress(ValueError):  # not the main thread: keep the default handler
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        return fn()
    except NeorecError as e:
        _WorkerState.unwinding = True
        kind = "peer" if isinstance(e, PeerLostError) or _is_transport(e) else "error"
        if not write_report(rank, str(e), kind):
            print(f"neorec: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        _exit_now(e.exit_code)
    except KeyboardInterrupt:
        _WorkerState.unwinding = True
        _exit_now(EXIT_INTERRUPTED)
    except Exception as e:
        _WorkerState.unwinding = True
        if _consequence(rank):
            _exit_now(EXIT_INTERRUPTED if _WorkerState.interrupted else 1)
        lost = peer_lost(e, rank, int(os.environ.get("WORLD_SIZE", "1")))
        if lost is not None:
            if not write_report(rank, str(lost), kind="peer"):
                print(f"neorec: error: rank {rank}: {lost}", file=sys.stderr, flush=True)
            _exit_now(lost.exit_code)
        write_report(rank, f"{type(e).__name__}: {e}".splitlines()[0], kind="defect")
        traceback.print_exc()
        _exit_now(1)


def init_rank_group(device: str, timeout_s: float, keep_heap: bool = True) -> str:
    """One torchrun worker's default process group for ``train.device``: NCCL on cuda (this rank
    on GPU ``LOCAL_RANK``), gloo on cpu; returns the backend. ``cuda`` without a CUDA device is a
    ``ConfigError`` before any group is made. ``keep_heap``: ``system.keep_heap``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from neorec.config.run import TrainConfig
    from neorec.distributed.comm import process_group_backend, rank_device
    from neorec.ops.memory import keep_freed_heap

    TrainConfig(device=device).check_device()
    if keep_heap:
        keep_freed_heap()  # no page faults on every step's buffers (ops.memory)
    backend = process_group_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(rank_device(device))
    timeout = timedelta(seconds=timeout_s)
    # Every group this rank creates later (dist.new_group without a timeout: the embedding
    # group, the host groups) waits as long as the default one, not torch's 30 minutes.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart.isdigit():
        # The elastic agent's store outlives a restart of the group (torch >= 2.13 no longer
        # prefixes it per attempt): without a prefix of our own, a restarted group's gloo would
        # read the dead group's addresses ("Connection refused").
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=False,
            timeout=timeout,
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"/neorec/attempt_{restart}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
        return backend
    dist.init_process_group(backend, timeout=timeout)
    return backend


def attempt_overrides(resume_given: bool) -> list[str]:
    """The ``--set`` overrides of this attempt of the group: none in the first; in a restarted
    group (``TORCHELASTIC_RESTART_COUNT`` > 0) fault injection is off, and under a bare
    ``torchrun --max-restarts`` (no neorec launcher to name the checkpoint) the run resumes its
    latest checkpoint when it has one, unless ``--resume`` was given."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) <= 0:
        return []
    out = ["system.fail_at=''"]
    if LAUNCHER_PID_ENV not in os.environ and not resume_given:
        out.append('checkpoint.resume="auto"')
    return out


def train_rank(cfg: Any) -> int:
    """Train as one rank of a torchrun-launched job (``WORLD_SIZE`` > 1: gloo on CPU, NCCL on
    GPU), or alone; returns 0.

    The process group is destroyed only after a clean run: after a failure the process exits
    right away, once its error has been handed on (so that a peer whose collective breaks first
    can tell it was not the cause).
    """
    from neorec.train.trainer import train

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        train(cfg)
        return 0
    import torch.distributed as dist

    from neorec.distributed.comm import close_host_transports

    init_rank_group(cfg.train.device, cfg.train.collective_timeout_s, cfg.system.keep_heap)
    train(cfg)
    close_host_transports()
    dist.destroy_process_group()
    return 0
