"""What the step benchmarks share (``step``, ``step_breakdown``, ``step_dist_breakdown``): the
batches, the phase timer and how it attaches to the trainer's step from outside, the phase
model's view of a config, and the breakdown's table and JSON fields.

The timer (``PhaseTimer``, a ``neorec.phases.Marks``) attaches with torch hooks and the step's
own seams, so ``train.steps.train_step`` runs unchanged: the model's forward hook ends
``dense_forward``; the NaN guard's record ends ``loss`` (``MarkedGuard``); the dense optimizer's
``zero_grad`` ends ``dense_optimizer``, its step's pre-hook ends the backward (``tbe_backward_update``
in one process: ``backward()`` returns after the TBE update) and its post-hook ``dense_optimizer``
again; the embedding collection's forward hook ends ``tbe_forward`` and a hook on its output's
backward node ends ``dense_backward`` (``hook_collection``); a sharded collection marks its own
phases (``ebc.marks``, ``watch_backward``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from neorec.bench.floors import Floors
from neorec.bench.step_phases import PHASES, StepShape, gemm_sites
from neorec.data.batch import Batch
from neorec.data.synthetic import zipf_batches
from neorec.machine import cpu_model_and_flags
from neorec.phases import Marks
from neorec.train.steps import LossGuard

__all__ = [
    "PhaseTimer",
    "MarkedGuard",
    "attach_timer",
    "hook_collection",
    "make_batches",
    "fresh_batches",
    "print_table",
    "result_fields",
    "row_state_bytes",
    "step_shape",
]

EMB_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
DENSE_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}


def make_batches(cfg: Any, n: int, alpha: float, seed: int = 0) -> list[Batch]:
    """``n`` random batches of the config's shape; fixed pooling, Zipf(alpha) ids (0 = uniform)."""
    return zipf_batches(
        cfg.embedding.tables, cfg.data.batch_size, cfg.model.num_dense, n, alpha, seed
    )


class PhaseTimer(Marks):
    """Wall time of each phase of the steps it is active in (marks outside are ignored)."""

    def __init__(self) -> None:
        self.active = False
        self.last = 0.0
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def begin(self) -> None:
        """A step starts now (its batch is taken)."""
        self.cur, self.last = {}, time.perf_counter()

    def mark(self, phase: str) -> None:
        """``phase`` ends now (a phase marked twice in a step adds up)."""
        if self.active:
            now = time.perf_counter()
            self.cur[phase] = self.cur.get(phase, 0.0) + now - self.last
            self.last = now

    def watch_backward(self, pooled: Any, out: Any) -> None:
        """Mark, in this step's backward, the dense backward's end (the collection's output's
        gradient is whole: the output was made before any dense op, so autograd reaches it after
        all of them), the pooled gradients' return to their owners (the lookup's node starts)
        and the TBE backward with its fused update (the lookup's node ends). The hooks return
        None: no gradient changes."""
        if not self.active:
            return
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda _g: self.mark("dense_backward"))
        if pooled.grad_fn is not None:
            pooled.grad_fn.register_prehook(lambda _g: self.mark("grad_dist"))
            pooled.grad_fn.register_hook(lambda _gi, _go: self.mark("tbe_backward_update"))

    def end(self) -> None:
        """The step ended: keep its phases."""
        if self.active:
            self.steps.append(self.cur)

    def medians_ms(self) -> dict[str, float]:
        """Median ms of each phase over the steps kept."""
        names = dict.fromkeys(n for s in self.steps for n in s)
        return {n: 1000 * statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


class MarkedGuard(LossGuard):
    """The NaN guard of a timed step: its record (the loss computed) ends ``loss``."""

    def __init__(self, marks: Marks) -> None:
        super().__init__()
        self.marks = marks

    def record(self, loss: Tensor, step: int) -> None:
        """Note ``loss`` of ``step`` (device ops only); the loss phase ends."""
        super().record(loss, step)
        self.marks.mark("loss")


def attach_timer(
    model: Any, opt: torch.optim.Optimizer, timer: Marks, backward_end: str = "tbe_backward_update"
) -> LossGuard:
    """Attach ``timer`` to ``train_step``'s phases on ``model`` and ``opt`` (the module
    docstring); ``backward_end``: the phase ``backward()`` ends. Returns the guard to step with
    (``MarkedGuard``)."""
    model.register_forward_hook(lambda *_: timer.mark("dense_forward"))
    zero_grad = opt.zero_grad

    def marked_zero_grad(set_to_none: bool = True) -> None:
        zero_grad(set_to_none)
        timer.mark("dense_optimizer")

    opt.zero_grad = marked_zero_grad  # type: ignore[method-assign]
    opt.register_step_pre_hook(lambda *_: timer.mark(backward_end))
    opt.register_step_post_hook(lambda *_: timer.mark("dense_optimizer"))
    return MarkedGuard(timer)


def hook_collection(model: Any, timer: PhaseTimer) -> None:
    """Mark the embedding forward's end and, in backward, the start of its node (the dense
    backward's end: the node was made first, so autograd runs it after every dense node)."""

    def forward_end(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
        timer.mark("tbe_forward")
        if timer.active and out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda _g: timer.mark("dense_backward"))

    model.ebc.register_forward_hook(forward_end)


class StepMarksHook:
    """A pipeline step hook that marks ``before`` before the step and ``after`` after it, then
    calls ``then`` (None: nothing)."""

    def __init__(
        self,
        timer: Marks,
        before: str | None = None,
        after: str | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.timer, self.before, self.after, self.then = timer, before, after, then

    def before_step(self, step: int) -> None:
        """Mark ``before``."""
        if self.before is not None:
            self.timer.mark(self.before)

    def after_step(self, step: int, loss: Tensor) -> None:
        """Mark ``after``, then ``then()``."""
        if self.after is not None:
            self.timer.mark(self.after)
        if self.then is not None:
            self.then()


def unique_rows(batches: list[Batch], tables: list[Any]) -> int:
    """Distinct rows a batch touches over all tables (mean over ``batches``)."""
    counts = []
    for b in batches:
        n = 0
        for t in tables:
            ids = [b.sparse.feature(f)[0] for f in t.features]
            n += int(torch.unique(torch.cat(ids)).numel())
        counts.append(n)
    return round(statistics.fmean(counts))


def step_shape(cfg: Any, model: Any, batches: list[Batch], plan: dict[str, str]) -> StepShape:
    """The phase model's view of a config's step (``plan``: each GEMM site's format)."""
    emb = cfg.embedding
    tables = list(emb.tables)
    dim = tables[0].dim
    b = cfg.data.batch_size
    ids = round(statistics.fmean(int(x.sparse.values.numel()) for x in batches))
    precs = {t.precision for t in tables}
    state = row_state_bytes(emb.optimizer, dim)
    return StepShape(
        batch=b,
        features=sum(len(t.features) for t in tables),
        dim=dim,
        ids=ids,
        unique_rows=unique_rows(batches, tables),
        num_dense=cfg.model.num_dense,
        gemms=tuple(gemm_sites(model.dense_arch, b, plan)),
        dense_params=sum(p.numel() for p in model.dense_parameters()),
        emb_bytes=max(EMB_BYTES.get(p, 4) for p in precs),
        row_state_bytes=state,
        dense_states=DENSE_STATES.get(cfg.train.dense_optimizer, 0),
    )


def fresh_batches(batches: list[Batch], timer: PhaseTimer | None = None) -> Iterator[Batch]:
    """The batches in turn, each as a fresh object (the same tensors): a batch seen before
    carries the pipeline's "checked" mark, and its checks would be skipped on every later step.
    ``timer``: its step begins as each batch is taken (the pipeline's step starts there)."""
    i = 0
    while True:
        if timer is not None:
            timer.begin()
        b = batches[i % len(batches)]
        yield dataclasses.replace(b, sparse=dataclasses.replace(b.sparse))
        i += 1


def row_state_bytes(optimizer: str, dim: int) -> int:
    """Bytes of row optimizer state per row of dimension ``dim``."""
    return {"sgd": 0, "rowwise_adagrad": 4, "adam": 8 * dim}[optimizer]


def result_fields(
    cfg: Any, a: Any, out: dict, floors: Floors, plan: dict, shape: StepShape
) -> dict:
    """The JSON line's fields: the config's shape, the summary (``summarize``), the floors."""
    t = cfg.embedding.tables
    return {
        "bench": "step_breakdown",
        "cpu": cpu_model_and_flags()[0],
        "threads": torch.get_num_threads(),
        "tables": len(t),
        "rows": t[0].rows,
        "dim": t[0].dim,
        "batch": cfg.data.batch_size,
        "pooling": t[0].pooling_factor,
        "interaction": cfg.model.interaction,
        "lowp_mode": cfg.lowp.mode,
        "bf16_dense": bool(a.bf16 or cfg.train.bf16_dense),
        "lowp_sites": sum(p != "fp32" for p in plan.values()) if not a.bf16 else None,
        "unique_rows": shape.unique_rows,
        "ids": shape.ids,
        "iters": a.iters,
        **out,
        "floors": floors.to_dict(),
    }


def print_table(r: dict, phases: tuple[str, ...] = PHASES) -> None:
    """The table: each phase (in ``phases`` order) next to its floor, then the whole step."""
    fl = r["floors"]
    gemm = ", ".join(f"{k} {v:.0f}" for k, v in fl["gemm_gflops"].items())
    print(
        f"{r['cpu']}, {r['threads']} threads; floors: triad {fl['triad_gbs']:.1f} GB/s, copy "
        f"{fl['copy_gbs']:.1f} GB/s, GEMM GFLOP/s {gemm}"
    )
    ranks = "ms_max_over_ranks" in r["phases"][0]  # (distributed: the max over ranks too)
    head = f"{'phase':<22}{'MB':>10}{'GFLOP':>9}{'ms':>10}{'floor ms':>10}{'x floor':>9}  bound"
    print(head + (f"{'max rank ms':>14}" if ranks else ""))
    order = {n: i for i, n in enumerate(phases)}
    for p in sorted(r["phases"], key=lambda p: order.get(p["name"], len(order))):
        x = f"{p['over_floor']:.1f}" if p["over_floor"] is not None else "-"
        print(
            f"{p['name']:<22}{p['mb']:>10.1f}{p['gflop']:>9.2f}{p['ms']:>10.2f}"
            f"{p['floor_ms']:>10.2f}{x:>9}  {p['bound']:<5}"
            + (f"{p['ms_max_over_ranks']:>14.2f}" if ranks else "")
        )
    print(
        f"{'step (untimed phases)':<22}{'':>19}{r['step_ms']:>10.2f}{r['floor_ms']:>10.2f}"
        f"{r['step_over_floor']:>9.1f}"
    )
    print(
        f"phases sum {r['phase_sum_ms']:.2f} ms = {r['phase_sum_over_step']:.3f} x the step; "
        f"furthest from its floor: {r['furthest']}"
    )
