"""Dynamic batching for ``neorec serve``: a bounded queue of validated requests and one inference
thread that runs them together.

The thread takes the oldest request, then every request already queued, and waits for more until
the batch holds ``max_batch`` rows or the oldest request has waited ``max_wait_s``; whole requests
only (a request of more rows than ``max_batch`` runs alone). ``max_batch = 1`` turns batching off:
one request per model call. The queue holds at most ``capacity`` requests; ``submit`` refuses the
next one (``QueueFull``: the server answers 503) instead of growing. The model runs under
``torch.inference_mode`` with the thread's own intra-op budget (``threads``).

Every request was checked before it joined (``serve.http_inputs``), so a batch does not fail; if
one does anyway, each of its requests runs again alone and only the failing one gets the error.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Bag", "Job", "BatchInfo", "Batcher", "QueueFull", "Draining"]

Bag = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]
"""One feature's bags of a request: lengths int64 [n], ids int64 [sum], weights float32 or None."""


class QueueFull(Exception):
    """The queue holds ``capacity`` requests: answer 503 and let the client retry."""


class Draining(Exception):
    """The batcher is stopping (SIGTERM): it takes no new requests."""


@dataclass(frozen=True)
class BatchInfo:
    """Where a request's rows sat: batch number, first row, rows and requests of the batch."""

    batch: int
    offset: int
    rows: int
    requests: int


@dataclass
class Job:
    """A validated request: dense float32 [rows, D] and a ``Bag`` per feature."""

    dense: np.ndarray
    sparse: dict[str, Bag]
    rows: int
    enqueued: float = field(default_factory=time.monotonic)
    future: concurrent.futures.Future[tuple[np.ndarray, BatchInfo]] = field(
        default_factory=concurrent.futures.Future
    )


def concat(jobs: list[Job], features: list[str]) -> tuple[np.ndarray, dict[str, tuple[Any, ...]]]:
    """The batch of ``jobs`` as ``Predictor`` takes it: rows in job order; per-id weights of 1
    for the requests without weights when another has them (``x * 1.0`` is ``x``: the same
    sums)."""
    dense = np.concatenate([j.dense for j in jobs]) if len(jobs) > 1 else jobs[0].dense
    sparse: dict[str, tuple[Any, ...]] = {}
    for f in features:
        bags = [j.sparse[f] for j in jobs]
        lengths = np.concatenate([b[0] for b in bags])
        ids = np.concatenate([b[1] for b in bags])
        if all(b[2] is None for b in bags):
            sparse[f] = (lengths, ids)
        else:
            w = [b[2] if b[2] is not None else np.ones(len(b[1]), np.float32) for b in bags]
            sparse[f] = (lengths, ids, np.concatenate(w))
    return dense, sparse


class Batcher:
    """The bounded queue and its inference thread (see the module docstring)."""

    def __init__(
        self,
        predict: Callable[[np.ndarray, dict[str, Any]], np.ndarray],
        features: list[str],
        *,
        max_batch: int,
        max_wait_s: float,
        capacity: int,
        threads: int,
        on_batch: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.predict, self.features = predict, list(features)
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_s)
        self.capacity, self.threads = int(capacity), int(threads)
        self.on_batch = on_batch
        self._q: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._batches = 0
        self._thread = threading.Thread(target=self._run, name="neorec-serve-infer", daemon=True)

    def start(self) -> None:
        """Start the inference thread."""
        self._thread.start()

    def alive(self) -> bool:
        """The inference thread runs and takes requests."""
        return self._thread.is_alive() and not self._stopping

    def depth(self) -> int:
        """Requests waiting."""
        with self._cond:
            return len(self._q)

    def submit(self, job: Job) -> concurrent.futures.Future[tuple[np.ndarray, BatchInfo]]:
        """Queue ``job``; its future gets (probabilities float32 [rows], BatchInfo)."""
        with self._cond:
            if self._stopping:
                raise Draining()
            if len(self._q) >= self.capacity:
                raise QueueFull()
            job.enqueued = time.monotonic()
            self._q.append(job)
            self._cond.notify()
        return job.future

    def stop(self, timeout: float | None = None) -> bool:
        """Take no new requests, answer the queued ones, end the thread; False if it did not
        end within ``timeout``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> list[Job] | None:
        """The next batch (None: stopped and empty)."""
        with self._cond:
            while not self._q and not self._stopping:
                self._cond.wait()
            if not self._q:
                return None
            batch = [self._q.popleft()]
            rows = batch[0].rows
            deadline = batch[0].enqueued + self.max_wait_s
            while rows < self.max_batch:
                if self._q:
                    if rows + self._q[0].rows > self.max_batch:
                        break
                    batch.append(self._q.popleft())
                    rows += batch[-1].rows
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    break
                self._cond.wait(left)
        # a request whose client went away (its future cancelled) is not computed
        return [j for j in batch if j.future.set_running_or_notify_cancel()]

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # this thread's intra-op budget
        with torch.inference_mode():
            while (batch := self._next()) is not None:
                if batch:
                    self._execute(batch)

    def _execute(self, batch: list[Job]) -> None:
        t0 = time.monotonic()
        try:
            dense, sparse = concat(batch, self.features)
            probs = np.asarray(self.predict(dense, sparse), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - validated requests: run each alone to find it
            if len(batch) > 1:
                for j in batch:
                    self._execute([j])
            else:
                batch[0].future.set_exception(e)
            return
        seconds = time.monotonic() - t0
        rows = sum(j.rows for j in batch)
        self._batches += 1
        if self.on_batch is not None:
            self.on_batch(rows, len(batch), seconds)
        offset = 0
        for j in batch:
            info = BatchInfo(self._batches, offset, rows, len(batch))
            j.future.set_result((probs[offset : offset + j.rows], info))
            offset += j.rows
