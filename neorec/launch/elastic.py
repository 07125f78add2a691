"""The elastic agent under ``--nproc``: workers tied to the launcher from their fork, stopped
workers ended promptly, and ``--max-restarts`` (the group restarted from the run's newest
checkpoint).

PyTorch's ``LocalElasticAgent`` runs as it does under ``torchrun``; three of its seams are
replaced while ``run_agent`` runs:

- **the worker's start** (``get_subprocess_handler``): between the fork and the exec the child
  asks the kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), then checks that its
  parent is still the launcher and exits if not. No moment of a worker's life is unguarded: a
  launcher killed while a worker's interpreter starts up takes the worker with it;
- **the worker's stop**: SIGTERM, then SIGCONT, so that a stopped worker (SIGSTOP, a debugger)
  acts on it at once instead of after the agent's 30 s grace and SIGKILL;
- **the restart** (``_monitor_workers`` / ``_restart_workers``): a failure that would recur (a
  rank's ``NeorecError``: bad input; Ctrl-C of a rank) is not restarted; otherwise the launcher
  prints one line naming the cause, notes it for ``events.jsonl`` and starts the group again
  with ``checkpoint.resume`` set to the newest complete checkpoint this job wrote (the run's own
  lineage; none yet: the run's original start).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed.elastic.multiprocessing.api as mp_api
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)

from neorec.launch import EXIT_INTERRUPTED, Recovery, cause_of, proc_state, reports

__all__ = ["Job", "run_agent"]

_PR_SET_PDEATHSIG = 1


def _tied_to(parent: int) -> Callable[[], None]:
    """The child's first act after the fork: die with ``parent``, or now if it is gone."""
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)

    return preexec


class _Worker(SubprocessHandler):
    """torch's worker process, started tied to the launcher and stopped even when stopped."""

    preexec: Callable[[], None] = staticmethod(lambda: None)
    on_stopped: Callable[[int], None] = staticmethod(lambda rank: None)

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.rank = int((kw.get("env") or {}).get("RANK", self.local_rank_id))

    def _popen(self, args: tuple[Any, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            args=args,
            env=env,
            stdout=self._stdout,
            stderr=self._stderr,
            start_new_session=True,
            preexec_fn=self.preexec,
        )

    def close(self, death_sig: signal.Signals | None = None) -> None:
        if proc_state(self.proc.pid) in ("T", "t"):  # stopped: most likely why its peers failed
            self.on_stopped(self.rank)
        super().close(death_sig)
        with contextlib.suppress(OSError):  # a stopped worker acts on the signal now
            os.killpg(self.proc.pid, signal.SIGCONT)


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


def _agent_class(job: Job) -> type[LocalElasticAgent]:
    class Agent(LocalElasticAgent):
        """torch's agent, with the restart decided and prepared by ``job``."""

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                pids: dict[int, int] = {}
                if self._pcontext is not None:
                    for local, pid in self._pcontext.pids().items():
                        pids[worker_group.workers[local].global_rank] = pid
                job.failed(result.failures, pids)
                if job.no_restart:
                    self._remaining_restarts = 0
            return result

        def _restart_workers(self, worker_group: WorkerGroup) -> None:
            if not job.failures:  # a membership change, not a failure: torch's own restart
                super()._restart_workers(worker_group)
                return
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.STOPPED
            attempt = job.max_restarts - self._remaining_restarts
            job.restart(worker_group.spec, attempt, self._base_args)
            job.failures = {}
            self._initialize_workers(worker_group)

        @property
        def _base_args(self) -> tuple[Any, ...]:
            if not hasattr(self, "_first_args"):
                self._first_args = tuple(self._worker_group.spec.args)
            return self._first_args

        def _initialize_workers(self, worker_group: WorkerGroup) -> None:
            _ = self._base_args  # the first attempt's arguments, kept before any restart
            super()._initialize_workers(worker_group)

    return Agent


@contextlib.contextmanager
def _patched(job: Job) -> Iterator[None]:
    class Worker(_Worker):
        preexec = staticmethod(_tied_to(os.getpid()))
        on_stopped = staticmethod(job.stopped.append)

    def handler(**kw: Any) -> SubprocessHandler:
        return Worker(**kw)

    saved = (mp_api.get_subprocess_handler, launcher_api.LocalElasticAgent)
    mp_api.get_subprocess_handler = handler  # type: ignore[assignment]
    launcher_api.LocalElasticAgent = _agent_class(job)  # type: ignore[misc]
    try:
        yield
    finally:
        mp_api.get_subprocess_handler, launcher_api.LocalElasticAgent = saved  # type: ignore[misc]


def run_agent(config: Any, cmd: Any, args: list[str], job: Job) -> None:
    """``torch.distributed.launcher.api.launch_agent`` with the seams above replaced."""
    with _patched(job):
        try:
            launcher_api.launch_agent(config, cmd, args)
        finally:
            job.write_events()
