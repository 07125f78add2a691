"""Training pipelines: the sequential reference and the overlapped pipeline (same results, bitwise).

Sequential (``TrainPipeline``), one batch at a time; nothing overlaps::

    step i  : load i ─ copy i ─ input_dist i (lengths ⇄, ids ⇄) ─ lookup ─ output_dist ⇄ ─ dense
              ─ loss ─ backward (grads ⇄, all-reduce ⇄) ─ optimizer
    step i+1:                                                   load i+1 ─ copy i+1 ─ ...

Overlapped (``OverlappedTrainPipeline``), batch i+1 enters while batch i computes::

    loader thread : load i+1 ─────────── load i+2 ──────────────────────── load i+3 ...
    main, step i  : copy i+1 ─ prefetch i+1 ─ start input_dist i+1 ─ lookup i ─ output_dist i ─ dense i
                    ─ loss i ─ backward i ─ optimizer i
    comm (async)  :                lengths i+1 ⇄ ···· ids i+1 ⇄ (started by ``advance`` after lookup i)
    step i+1      : ids i+1 already here ─ copy i+2 ─ ... ─ lookup i+1 ─ ...

Input distribution is a chain (ids need the received lengths). The sharded collection splits it
into two awaitable phases (``Chain``): the lengths all-to-all starts when batch i+1 is staged, and
the lookup of batch i calls ``advance()`` on it, which starts the ids all-to-all; both run on gloo's
worker threads (async work handles) while batch i computes. Data loading runs in a background
thread. Nothing of batch i+1's input distribution depends on weights, so staging it before batch
i's update changes no number: the overlapped pipeline trains bitwise the same model.

Both pipelines prepare a batch's input distribution on the host before its step
(``stage_input_dist(device_sparse, host_sparse)``): the checks of the batch, the split of its ids
by shard, the lengths exchange and every split size are computed from the host copy of the batch,
so the step itself reads nothing back from the device (no host sync; ``train.device``).

On a GPU (``device`` cuda), host-to-device copies (from pinned memory) and the staging of batch
i+1 are issued on a side CUDA stream that the compute stream waits on before batch i+1 runs; on the
CPU tensors stay where they are and the same code runs.
"""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from neorec.data.batch import Batch
from neorec.sparse import SparseFeatures

__all__ = [
    "StepFn",
    "StepHook",
    "StepOutput",
    "TrainPipeline",
    "OverlappedTrainPipeline",
    "make_pipeline",
]

StepFn = Callable[[Any, torch.optim.Optimizer, Batch, int, bool], Tensor]
"""``(model, optimizer, batch, step, bf16) -> loss``: one forward/backward/update (train_step)."""


class StepHook(Protocol):
    """Runs around each step of a pipeline, right before and after ``step_fn`` (the batch is
    staged): the lr schedule, LoKA's dispatch, a benchmark's timer. A pipeline calls the hooks'
    ``before_step`` in order and their ``after_step`` in reverse order, as nested wrappers."""

    def before_step(self, step: int) -> None:
        """Before train step ``step`` (1-based)."""

    def after_step(self, step: int, loss: Tensor) -> None:
        """After train step ``step`` returned ``loss``."""


@dataclass
class StepOutput:
    """What one pipeline step returns: the loss and the (local) batch it trained on."""

    loss: Tensor
    batch: Batch


SAMPLE_STEPS = 8192
"""Step times kept for the median: every step up to this many, then a uniform sample of them."""


@dataclass
class PipelineTimes:
    """Wall time per step and time the step waited for the data loader, in constant memory: the
    count and sum of every step, the last one, and a uniform sample (reservoir) for the median
    (exact up to ``SAMPLE_STEPS`` steps)."""

    steps: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    sample: list[float] = field(default_factory=list)
    load_wait_s: float = 0.0
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def add(self, seconds: float) -> None:
        """One more step of ``seconds``."""
        self.steps += 1
        self.total_s += seconds
        self.last_s = seconds
        if len(self.sample) < SAMPLE_STEPS:
            self.sample.append(seconds)
        else:  # Algorithm R: each step so far is in the sample with the same probability
            j = self._rng.randrange(self.steps)
            if j < SAMPLE_STEPS:
                self.sample[j] = seconds

    def summary(self) -> dict[str, float]:
        """Median and mean ms per step, and ms per step spent waiting for data."""
        n = max(1, self.steps)
        return {
            "steps": self.steps,
            "step_ms_median": 1000 * statistics.median(self.sample) if self.sample else 0.0,
            "step_ms_mean": 1000 * self.total_s / n,
            "load_wait_ms_per_step": 1000 * self.load_wait_s / n,
        }


class TrainPipeline:
    """The sequential reference: load, copy, then ``step_fn`` on one batch at a time."""

    def __init__(
        self,
        model: Any,
        opt: torch.optim.Optimizer,
        batches: Iterable[Batch],
        step_fn: StepFn,
        *,
        bf16: bool = False,
        device: torch.device | str | None = None,
        hooks: Sequence[StepHook] = (),
    ) -> None:
        self.model, self.opt, self.step_fn, self.bf16 = model, opt, step_fn, bf16
        self.hooks = list(hooks)
        self.batches: Iterator[Batch] = iter(batches)
        self.device = torch.device(device) if device is not None else None
        self.times = PipelineTimes()

    def progress(self, step: int) -> StepOutput | None:
        """Train on the next batch as step ``step``; None when the batches are exhausted."""
        t0 = time.perf_counter()
        batch = next(self.batches, None)
        self.times.load_wait_s += time.perf_counter() - t0
        if batch is None:
            return None
        batch = self._stage_now(batch)
        loss = self._step(batch, step)
        self.times.add(time.perf_counter() - t0)
        return StepOutput(loss, batch)

    def _step(self, batch: Batch, step: int) -> Tensor:
        """``step_fn`` on a staged batch, between the hooks."""
        for hook in self.hooks:
            hook.before_step(step)
        loss = self.step_fn(self.model, self.opt, batch, step, self.bf16)
        for hook in reversed(self.hooks):
            hook.after_step(step, loss)
        return loss

    def _stage_now(self, host: Batch) -> Batch:
        """The batch on the device, its input distribution prepared from the host copy."""
        batch = _to_device(host, self.device)
        self.model.stage_input_dist(batch.sparse, host.sparse)
        return batch

    def close(self) -> None:
        """Release background resources (none here)."""


class OverlappedTrainPipeline(TrainPipeline):
    """Batch i+1 is loaded, copied, prefetched and its input distribution started during step i."""

    def __init__(
        self,
        model: Any,
        opt: torch.optim.Optimizer,
        batches: Iterable[Batch],
        step_fn: StepFn,
        *,
        bf16: bool = False,
        device: torch.device | str | None = None,
        hooks: Sequence[StepHook] = (),
        depth: int = 1,
    ) -> None:
        super().__init__(model, opt, batches, step_fn, bf16=bf16, device=device, hooks=hooks)
        self._loader = _Loader(self.batches, depth)
        self._next: Batch | None = None
        self._started = False
        cuda = self.device is not None and self.device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    def progress(self, step: int) -> StepOutput | None:
        """Stage batch i+1, then train on batch i (staged during the previous step)."""
        t0 = time.perf_counter()
        if not self._started:
            self._next, self._started = self._stage(), True
        batch = self._next
        if batch is None:
            return None
        self._wait_side_stream(batch)
        self._next = self._stage()
        loss = self._step(batch, step)
        self.times.add(time.perf_counter() - t0)
        return StepOutput(loss, batch)

    def _stage(self) -> Batch | None:
        """Take the next loaded batch; copy it, prefetch its rows, start its input distribution."""
        t0 = time.perf_counter()
        batch = self._loader.get()
        self.times.load_wait_s += time.perf_counter() - t0
        if batch is None:
            return None
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            host, batch = batch, _to_device(batch, self.device)
            self.model.prefetch(batch.sparse)  # the memory hierarchy's row cache
            self.model.stage_input_dist(batch.sparse, host.sparse)
        return batch

    def _wait_side_stream(self, batch: Batch) -> None:
        if self._stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self._stream)
        # The tensors were allocated on the side stream: keep them alive for the main one.
        sp = batch.sparse
        for t in (batch.dense, batch.labels, batch.fm_logits, sp.values, sp.lengths, sp.weights):
            if t is not None:
                t.record_stream(main)

    def close(self) -> None:
        """Stop the loader thread."""
        self._loader.close()


def _to_device(batch: Batch, device: torch.device | None) -> Batch:
    """``batch`` on ``device`` (itself when None or the CPU); from pinned memory on a GPU, so
    the copy is asynchronous on the current stream."""
    if device is None or device.type == "cpu":
        return batch

    def pin(t: Tensor) -> Tensor:
        return t.pin_memory() if t.device.type == "cpu" else t

    sp = batch.sparse
    w = None if sp.weights is None else pin(sp.weights)
    pinned = Batch(
        pin(batch.dense),
        SparseFeatures(sp.keys, pin(sp.values), pin(sp.lengths), w),
        pin(batch.labels),
        None if batch.fm_logits is None else pin(batch.fm_logits),
    )
    return pinned.to(device, non_blocking=True)


class _Loader:
    """Reads an iterator in a background thread, ``depth`` items ahead (exceptions re-raised)."""

    _END = object()

    def __init__(self, it: Iterator[Batch], depth: int) -> None:
        self._it = it
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="neorec-loader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._it:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:  # handed to the main thread, which raises it
            self._put(_Failure(e))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Batch | None:
        """The next item; None at the end."""
        if self._done:
            return None
        item = self._q.get()
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        if item is self._END:
            self._done = True
            return None
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop reading ahead."""
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class _Failure:
    error: BaseException


def make_pipeline(
    kind: str,
    model: Any,
    opt: torch.optim.Optimizer,
    batches: Iterable[Batch],
    step_fn: StepFn,
    *,
    bf16: bool = False,
    device: torch.device | str | None = None,
    hooks: Sequence[StepHook] = (),
) -> TrainPipeline:
    """``overlapped`` or ``sequential`` (``train.pipeline``), running ``hooks`` around each step."""
    kw: dict[str, Any] = {"bf16": bf16, "device": device, "hooks": hooks}
    if kind == "sequential":
        return TrainPipeline(model, opt, batches, step_fn, **kw)
    if kind == "overlapped":
        return OverlappedTrainPipeline(model, opt, batches, step_fn, **kw)
    raise ValueError(f"unknown pipeline '{kind}': overlapped or sequential")
