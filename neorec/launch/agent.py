"""The ``--nproc`` launcher: PyTorch's elastic agent (what ``torchrun`` runs) in this process, and
what it knows of its job across restarts.

``neorec train --nproc N`` starts N workers ``python -m neorec train ...`` with ``LOCAL_RANK``
set (``neorec.launch.worker`` is their side). A SIGTERM / SIGINT of the launcher is forwarded to
the workers by the agent; a failed group prints one line (``messages.failure_line``); torchrun's
own log lines and failure report are not printed (set ``LOGLEVEL`` to see them). The launcher
names a rank it finds stopped (SIGSTOP) and ends it at once. ``--max-restarts K``: a lost rank
restarts the group from the run's newest checkpoint (``Job``; the agent's seams:
``neorec.launch.elastic``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neorec.launch.messages import (
    ERROR_DIR_ENV,
    EXIT_INTERRUPTED,
    cause_of,
    failure_line,
    reports,
)
from neorec.launch.worker import LAUNCHER_PID_ENV, proc_state
from neorec.machine import THREADS_WHY_ENV, default_threads

__all__ = ["Nodes", "Recovery", "Job", "launch"]


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


class Job:
    """What the launcher knows of its job across restarts (a failure's cause, the restarts)."""

    def __init__(self, errdir: str, max_restarts: int, recovery: Recovery | None) -> None:
        self.errdir = errdir
        self.max_restarts = max_restarts
        self.recovery = recovery
        self.restarts: list[dict[str, Any]] = []  # the events.jsonl records, written at the end
        self.stopped: list[int] = []  # ranks found stopped (state T) when the group failed
        self.failures: dict[int, Any] = {}
        self.no_restart = ""  # why a failure is not restarted ("" = it may be)
        self.before = self._checkpoints() if recovery is not None else set()

    def _storage(self) -> Any:
        from neorec.checkpoint import open_storage

        assert self.recovery is not None
        return open_storage(self.recovery.checkpoint_root, fsync=False)

    def _checkpoints(self) -> set[str]:
        from neorec.checkpoint.catalog import scan

        try:
            return {e.name for e in scan(self._storage())}
        except (OSError, ValueError):
            return set()

    def failed(self, failures: dict[int, Any], pids: dict[int, int]) -> None:
        """The group failed (``failures``: global rank -> failure; ``pids``: its ranks' pids)."""
        self.failures = dict(failures)
        found = self.stopped + [r for r, p in pids.items() if proc_state(p) in ("T", "t")]
        self.stopped[:] = sorted(set(found))  # (in place: the workers' close() appends to it)
        errors = [r for r in reports(self.errdir) if r["kind"] == "error"]
        if errors and not self.stopped:
            self.no_restart = "not restarted: the same error would recur"
        elif any(int(getattr(f, "exitcode", 0)) == EXIT_INTERRUPTED for f in failures.values()):
            self.no_restart = "not restarted: a rank was interrupted"
        else:
            self.no_restart = ""

    def newest(self) -> dict[str, Any] | None:
        """The newest complete, restorable checkpoint this job wrote, if any."""
        from neorec.checkpoint.catalog import chain_problem, order_key, scan

        try:
            entries = scan(self._storage())
        except (OSError, ValueError):
            return None
        by_name = {e.name: e for e in entries}
        done = [
            e.manifest
            for e in entries
            if e.manifest is not None and e.name not in self.before
            if not chain_problem(by_name, e.manifest)
        ]
        return max(done, key=order_key, default=None)

    def restart(self, spec: Any, attempt: int, base_args: tuple[Any, ...]) -> None:
        """Before restart ``attempt``: one line, a record for events.jsonl, the resume target."""
        cause = cause_of(self.failures, self.errdir, self.stopped)[0]
        target = self.newest() if self.recovery is not None else None
        args = base_args
        if target is not None:
            path = self._storage().path(str(target["name"]))
            args = (*base_args, "--set", f"checkpoint.resume={json.dumps(path)}")
            where = f"from the checkpoint of step {target['step']}"
        else:
            where = "from its start (no checkpoint of this run yet)"
        print(
            f"neorec: {cause}; restarting the group ({attempt} of {self.max_restarts}) {where}",
            file=sys.stderr,
            flush=True,
        )
        self.restarts.append(
            {
                "step": int(target["step"]) if target is not None else 0,
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "restart": attempt,
                "max_restarts": self.max_restarts,
                "cause": cause,
                "resumed_from": None if target is None else str(target["name"]),
            }
        )
        for p in Path(self.errdir).glob("rank-*.json"):  # this attempt's reports are dealt with
            p.unlink(missing_ok=True)
        self.stopped.clear()
        spec.args = args

    def write_events(self) -> None:
        """Insert the restart records into the run's events.jsonl, each after its step."""
        if not self.restarts or self.recovery is None or self.recovery.run_dir is None:
            return
        path = Path(self.recovery.run_dir) / "events.jsonl"
        try:
            lines = path.read_text().splitlines() if path.exists() else []
            for rec in self.restarts:
                at = 0
                for i, line in enumerate(lines):
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        if int(json.loads(line)["step"]) <= rec["step"]:
                            at = i + 1
                lines.insert(at, json.dumps(rec))
            tmp = path.with_name(path.name + ".restarts.tmp")
            tmp.write_text("".join(ln + "\n" for ln in lines))
            os.replace(tmp, path)
        except OSError as e:
            print(f"neorec: events.jsonl: the restarts not recorded: {e}", file=sys.stderr)


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


def worker_threads_env(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``nproc`` workers on this host when the user set none: this
    process's usable CPUs split among them (``neorec.machine.default_threads``), and why."""
    if env.get("OMP_NUM_THREADS", "").strip():
        return {}
    n, why = default_threads(nproc, env)
    return {"OMP_NUM_THREADS": str(n), THREADS_WHY_ENV: why}


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

    from neorec.launch.elastic import run_agent

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
    ours = {LAUNCHER_PID_ENV: str(os.getpid()), ERROR_DIR_ENV: errdir}
    ours.update(worker_threads_env(nproc, {**os.environ, **(env or {})}))
    try:
        # (torchrun reads OMP_NUM_THREADS as it is configured: 1 per worker when unset)
        with _quiet_torchrun(), _env(**ours, **(env or {})):
            targs = torchrun.parse_args(argv)
            if targs.master_port is None:
                targs.master_port = 29500  # as torchrun's run(); unused by c10d rendezvous
            config, cmd, cmd_args = torchrun.config_from_args(targs)
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
