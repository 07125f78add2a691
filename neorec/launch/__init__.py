"""Processes of a run: the ``--nproc`` launcher, its workers, Ctrl-C and signals.

``neorec train --nproc N`` runs PyTorch's elastic agent (what ``torchrun`` runs) in this process;
it starts N workers ``python -m neorec train ...`` with ``LOCAL_RANK`` set. What this module adds:

- **Launcher death**: a worker exits within a second of losing its launcher, even when it is
  blocked in a collective (``PR_SET_PDEATHSIG`` on Linux, and a thread that watches the parent pid
  and ends the process with ``os._exit``). A SIGTERM / SIGINT of the launcher is forwarded to the
  workers by the agent.
- **One line**: a worker's ``NeorecError`` is handed to the launcher (a file in a directory named by
  ``NEOREC_ERROR_DIR``), which prints ``neorec: error: rank R: <msg>`` once; torchrun's own log
  lines and failure report are not printed (set ``LOGLEVEL`` to see them).
- **Ctrl-C**: workers stay quiet; the launcher (or the single process) prints one line, with the
  resume command when a complete checkpoint exists, and exits 130.
- **A lost peer**: gloo's error when a peer rank died or stopped answering (a reset connection, a
  collective's timeout) is one line naming that rank (``PeerLostError``), not a traceback; the
  launcher names a rank it finds stopped (SIGSTOP) and ends it at once.
- **Restarts** (``--max-restarts K``, ``neorec.launch.elastic``): a lost rank restarts the group
  from the run's newest checkpoint; workers are tied to the launcher from their fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from neorec.errors import NeorecError

__all__ = [
    "EXIT_INTERRUPTED",
    "LAUNCHER_PID_ENV",
    "ERROR_DIR_ENV",
    "is_worker",
    "launch",
    "watch_launcher",
    "run_worker",
    "failure_line",
    "interrupted_line",
    "resume_command",
    "step_of",
    "init_rank_group",
    "PeerLostError",
    "Recovery",
    "Nodes",
    "peer_lost",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
LAUNCHER_PID_ENV = "NEOREC_LAUNCHER_PID"
ERROR_DIR_ENV = "NEOREC_ERROR_DIR"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_GRACE_S = 3.0  # a failing rank waits this long for its launcher to stop it (see _consequence)


def is_worker() -> bool:
    """True in a process started by torchrun (or ``--nproc``) as one rank of a job."""
    return "LOCAL_RANK" in os.environ


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class PeerLostError(NeorecError):
    """A collective failed because another rank died or stopped answering."""


@dataclass(frozen=True)
class Nodes:
    """The machines of a job: how many, this one's place, where their launchers meet."""

    count: int = 1
    rank: int = 0
    endpoint: str = "localhost:0"
    job_id: str = ""


@dataclass(frozen=True)
class Recovery:
    """Where a restarted group finds the run's checkpoints and its events.jsonl."""

    checkpoint_root: str
    run_dir: str | None = None


# ---- the worker side -----------------------------------------------------------------------
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


def _peer_failed(rank: int) -> bool:
    d = os.environ.get(ERROR_DIR_ENV, "")
    if not d or not os.path.isdir(d):
        return False
    return any(n.endswith(".json") and n != f"rank-{rank}.json" for n in os.listdir(d))


def _report(rank: int, message: str, kind: str = "error") -> bool:
    """Hand a worker's failure to the launcher (which prints it once); False if there is none.

    ``kind``: ``error`` (a ``NeorecError``: bad input, the same again on a restart), ``defect``
    (any other exception) or ``peer`` (a collective broken by another rank: ``PeerLostError``).
    """
    d = os.environ.get(ERROR_DIR_ENV, "")
    if not d or not os.path.isdir(d):
        return False
    try:
        tmp = os.path.join(d, f".rank-{rank}.tmp")
        with open(tmp, "w") as f:
            record = {"rank": rank, "time": time.time(), "message": message, "kind": kind}
            json.dump(record, f)
        os.replace(tmp, os.path.join(d, f"rank-{rank}.json"))
    except OSError:
        return False
    return True


def _consequence(rank: int, grace_s: float = _GRACE_S) -> bool:
    """True if this rank's failure follows another's: Ctrl-C, or a peer that failed first.

    A peer killed by a signal reports nothing, and this rank's collective then breaks
    ("Connection reset by peer"): so a rank of a job waits ``grace_s`` seconds first, in which
    the launcher, having seen the peer's end, stops this rank too (SIGTERM).
    """
    deadline = time.monotonic() + (grace_s if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0)
    while True:
        if _WorkerState.interrupted or _peer_failed(rank):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


# gloo's messages (tcp transport) when a peer stopped answering / went away mid-collective
_TIMED_OUT = ("Timed out waiting", "timeout caused pair closure", "timed out connecting")
_CUT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_lost(exc: BaseException, rank: int, world: int) -> PeerLostError | None:
    """gloo's error of a collective whose peer died or stopped answering, as one line naming the
    peer (the other rank of two; "another rank" of more); None for any other exception."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    timed_out = any(t in text for t in _TIMED_OUT)
    cut = any(t in text for t in _CUT)
    if not (timed_out or cut):
        return None
    peer = f"rank {1 - rank}" if world == 2 and rank in (0, 1) else "another rank"
    gloo = first.split("] ", 1)[-1][:200]
    if timed_out:
        what = f"{peer} did not answer a collective within train.collective_timeout_s (stopped?)"
    else:
        what = f"{peer} exited or lost its connection during a collective"
    return PeerLostError(f"{what} (gloo: {gloo})")


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
        if not _report(rank, str(e), kind):
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
            if not _report(rank, str(lost), kind="peer"):
                print(f"neorec: error: rank {rank}: {lost}", file=sys.stderr, flush=True)
            _exit_now(lost.exit_code)
        _report(rank, f"{type(e).__name__}: {e}".splitlines()[0], kind="defect")
        traceback.print_exc()
        _exit_now(1)


# ---- the launcher side ---------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_torchrun() -> Iterator[None]:
    """No log lines from the elastic agent (it logs every signal and failure), unless LOGLEVEL."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _restore_signals() -> None:
    """The agent leaves its raising handlers installed; put back Python's defaults."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def reports(errdir: str) -> list[dict[str, Any]]:
    """The failures the workers reported (rank, message, kind, time), earliest first."""
    found = []
    for p in Path(errdir).glob("rank-*.json"):
        try:
            d = json.loads(p.read_text())
            kind = str(d.get("kind", "defect" if d.get("defect") else "error"))
            found.append(
                {"time": float(d["time"]), "rank": int(d["rank"]), "message": str(d["message"])}
                | {"kind": kind}
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda r: (r["time"], r["rank"]))


def _exit_code(failures: dict[int, Any], rank: int) -> int:
    code = int(getattr(failures.get(rank), "exitcode", 1))
    return code if 0 < code < 256 else 1


def cause_of(
    failures: dict[int, Any], errdir: str, stopped: list[int] | tuple[int, ...] = ()
) -> tuple[str, int, bool]:
    """Why a group failed: (the cause, naming the rank; the exit code; whether the line is an
    error of the user's input, which stopped nothing: a ``NeorecError``).

    In this order: the first ``NeorecError`` or defect a rank reported; a rank found stopped
    (its peers' collectives timed out); the first end the agent saw that is not a peer's
    consequence (a signal, an exit code); the first lost peer a rank reported.
    """
    found = reports(errdir)
    first = next((r for r in found if r["kind"] in ("error", "defect")), None)
    if first is not None and first["kind"] == "error":
        return f"rank {first['rank']}: {first['message']}", 2, True
    if first is not None:
        cause = f"rank {first['rank']} failed: {first['message']} (traceback above)"
        return cause, _exit_code(failures, first["rank"]), False
    if stopped:
        cause = f"rank {stopped[0]} was stopped (SIGSTOP?) and its peers' collectives timed out"
        return cause, 1, False
    peers = {r["rank"] for r in found if r["kind"] == "peer"}
    own = {r: f for r, f in failures.items() if r not in peers}
    if not own and found:
        lost = found[0]
        return f"rank {lost['rank']}: {lost['message']}", 2, False
    # (Whole seconds: on a tie the first the agent saw, which it lists first.)
    pool = own or failures
    rank = min(pool, key=lambda r: pool[r].timestamp)
    code = int(pool[rank].exitcode)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}", 1, False
    if code == EXIT_INTERRUPTED:  # a SIGINT sent to that worker alone
        return f"rank {rank} was interrupted", EXIT_INTERRUPTED, False
    return (
        f"rank {rank} exited with code {code} (its output is above)",
        _exit_code(pool, rank),
        False,
    )


def failure_line(
    failures: dict[int, Any],
    errdir: str,
    stopped: list[int] | tuple[int, ...] = (),
    note: str = "",
) -> tuple[str, int]:
    """The one line and the exit code of a failed job (``failures``: global rank -> torch's
    ProcessFailure; ``stopped``: ranks found stopped; ``note``: why it was not restarted)."""
    cause, code, input_error = cause_of(failures, errdir, stopped)
    head = "neorec: " if code == EXIT_INTERRUPTED else "neorec: error: "
    tail = "" if input_error else "; the other ranks were stopped"
    return head + cause + tail + (f" ({note})" if note else ""), code


def launch(
    nproc: int,
    worker_argv: list[str],
    on_signal: Callable[[signal.Signals], str],
    env: dict[str, str] | None = None,
    max_restarts: int = 0,
    recovery: Recovery | None = None,
    nodes: Nodes | None = None,
) -> int:
    """Run ``python -m neorec WORKER_ARGV`` as ``nproc`` local ranks; one line if it fails.

    ``env``: more environment for the workers (e.g. the run folder the launcher chose).
    ``max_restarts``: times a failed group is started again, from the newest checkpoint this
    job wrote under ``recovery.checkpoint_root`` (``neorec.launch.elastic``). ``nodes``: the
    job's machines (default: this one alone).

    Returns the exit code: 0; 2 when a worker reported a ``NeorecError`` (printed once as
    ``neorec: error: rank R: ...``); a failed worker's own code; 128 + n when the launcher got
    signal n (SIGINT: 130, after the workers stopped), printing ``on_signal(sig)``.
    """
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from neorec.launch.elastic import Job, run_agent

    nodes = nodes or Nodes(job_id=str(uuid.uuid4()))
    argv = [
        f"--nnodes={nodes.count}",
        f"--node-rank={nodes.rank}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes.endpoint}",
        f"--rdzv-id={nodes.job_id}",
        "-m",
        "neorec",
        *worker_argv,
    ]
    errdir = tempfile.mkdtemp(prefix="neorec-errors-")
    # torchrun's per-run log folder inside ours, removed with it (its default, a fresh
    # /tmp/torchelastic_* per run, is never removed)
    argv.insert(0, f"--log-dir={os.path.join(errdir, 'agent')}")
    job = Job(errdir, max_restarts, recovery)
    try:
        with _quiet_torchrun():
            targs = torchrun.parse_args(argv)
            if targs.master_port is None:
                targs.master_port = 29500  # as torchrun's run(); unused by c10d rendezvous
            config, cmd, cmd_args = torchrun.config_from_args(targs)
            ours = {LAUNCHER_PID_ENV: str(os.getpid()), ERROR_DIR_ENV: errdir}
            with _env(**ours, **(env or {})):
                try:
                    run_agent(config, cmd, list(cmd_args), job)
                finally:
                    _restore_signals()
        return 0
    except ChildFailedError as e:
        note = job.no_restart if max_restarts else ""
        if max_restarts and not note:
            note = f"restarts exhausted: {len(job.restarts)} of {max_restarts}"
        # (The failures the agent saw before it stopped the group: not its own SIGTERMs.)
        line, code = failure_line(job.failures or e.failures, errdir, job.stopped, note)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        print(on_signal(sig), file=sys.stderr, flush=True)
        return 128 + int(sig)
    finally:
        shutil.rmtree(errdir, ignore_errors=True)


# ---- Ctrl-C and the resume command ---------------------------------------------------------
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


def resume_command(config: str | None, sets: list[str], nproc: int, name: str | None = None) -> str:
    """The ``neorec train`` command that continues a run from its latest checkpoint (``name``:
    the run folder's name, so that the command continues this run even after newer ones)."""
    argv = ["neorec", "train"]
    if config:
        argv += ["--config", config]
    for s in sets:
        key = s.split("=", 1)[0].strip()
        if key != "checkpoint.resume" and not (name and key == "train.name"):
            argv += ["--set", s]
    if name:
        argv += ["--set", f"train.name={name}"]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return shlex.join([*argv, "--resume", "latest"])


def _latest_checkpoint_step(cfg: Any) -> int | None:
    """Step of the checkpoint ``--resume latest`` would restore, None if there is none."""
    from neorec.checkpoint import list_checkpoints, open_storage, resolve_checkpoint
    from neorec.train.checkpoints import checkpoint_root

    try:
        storage = open_storage(checkpoint_root(cfg), fsync=False)
        name = resolve_checkpoint(storage, "latest")
        steps = [int(m["step"]) for m in list_checkpoints(storage) if m["name"] == name]
    except (NeorecError, OSError, KeyError, ValueError):
        return None
    return steps[0] if steps else None


def interrupted_line(cfg: Any, resume: str, step: int | None, what: str = "interrupted") -> str:
    """``neorec: interrupted at step S; resume from the checkpoint of step C with: ...``."""
    head = f"neorec: {what}" + (f" at step {step}" if step is not None else "")
    if cfg is None:
        return head
    ckpt = _latest_checkpoint_step(cfg)
    if ckpt is None:
        return f"{head} (no checkpoint to resume from)"
    return f"{head}; resume from the checkpoint of step {ckpt} with: {resume}"


def step_of(exc: BaseException) -> int | None:
    """The step the trainer had finished when ``exc`` went through it (from its traceback)."""
    tb: TracebackType | None = exc.__traceback__
    step = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        value = getattr(obj, "step", None)
        if type(obj).__name__ == "Trainer" and isinstance(value, int):
            step = value
        tb = tb.tb_next
    return step
