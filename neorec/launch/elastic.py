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
  lineage; none yet: the run's original start). What the job knows across restarts is
  ``neorec.launch.agent.Job``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed.elastic.multiprocessing.api as mp_api
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
    SubprocessHandler,
)

from neorec.launch.worker import proc_state

if TYPE_CHECKING:
    from neorec.launch.agent import Job

__all__ = ["run_agent"]

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
