"""``neorec bench step --breakdown``: the step's time split into phases, each next to its floor.

The step is the trainer's own: the sequential pipeline (``train.pipeline.TrainPipeline``: the
batch staged, then ``train.steps.train_step`` with the NaN guard, under LoKA's dispatch hooks
when ``lowp.mode`` is on). Steps alternate between timed by phase (``train_step``'s ``phases``
marks; two torch hooks on the embedding collection: its forward's end and the start of its
backward node, which autograd runs after every dense node) and untimed, whose medians give the
whole step the phases must add up to. The floors are measured in the same run (``floors``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from neorec.bench.floors import Floors, measure_floors
from neorec.bench.step_phases import PHASES, StepShape, gemm_sites, phase_work, summarize
from neorec.build import build_dlrm, dense_optimizer
from neorec.data.batch import Batch
from neorec.machine import cpu_model_and_flags
from neorec.train.pipeline import TrainPipeline
from neorec.train.steps import LossGuard, train_step

__all__ = [
    "PhaseTimer",
    "fresh_batches",
    "print_table",
    "result_fields",
    "row_state_bytes",
    "run_breakdown",
    "step_shape",
]

EMB_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
DENSE_STATES = {"sgd": 0, "adagrad": 1, "adam": 2}


class PhaseTimer:
    """Wall time of each phase of the steps it is active in (``train_step``'s ``phases``)."""

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

    def end(self) -> None:
        """The step ended: keep its phases."""
        if self.active:
            self.steps.append(self.cur)

    def medians_ms(self) -> dict[str, float]:
        """Median ms of each phase over the steps kept."""
        names = dict.fromkeys(n for s in self.steps for n in s)
        return {n: 1000 * statistics.median(s.get(n, 0.0) for s in self.steps) for n in names}


def hook_collection(model: Any, timer: PhaseTimer) -> None:
    """Mark the embedding forward's end and, in backward, the start of its node (the dense
    backward's end: the node was made first, so autograd runs it after every dense node)."""

    def forward_end(_mod: Any, _inp: Any, out: torch.Tensor) -> None:
        timer.mark("tbe_forward")
        if timer.active and out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda _g: timer.mark("dense_backward"))

    model.ebc.register_forward_hook(forward_end)


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


def run_breakdown(cfg: Any, a: argparse.Namespace, batches: list[Batch]) -> int:
    """Time the phases and the whole step, measure the floors, print a table and a JSON line
    (``--nproc N``: N gloo ranks on this machine, ``step_dist_breakdown``)."""
    if a.nproc != 1:
        from neorec.bench.step_dist_breakdown import run_dist_breakdown

        return run_dist_breakdown(cfg, a)
    torch.manual_seed(cfg.train.seed)
    model = build_dlrm(cfg, torch.device("cpu"))
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    timer, guard = PhaseTimer(), LossGuard()
    hook_collection(model, timer)
    bf16 = bool(a.bf16 or cfg.train.bf16_dense)

    def step(model: Any, opt: Any, batch: Batch, i: int, bf16: bool) -> torch.Tensor:
        timer.mark("lowp_dispatch")  # (before_step's time; nothing without LoKA)
        phases = timer if timer.active else None
        return train_step(model, opt, batch, i, bf16, guard=guard, phases=phases)

    lowp = None
    if cfg.lowp.mode != "off":  # the trainer's LoKA hooks around the step, as it runs them
        from neorec.train.lowp import TrainerLowp

        lowp = TrainerLowp(SimpleNamespace(cfg=cfg, model=model, rank=0, world=1, out=sys.stdout))
    inner = lowp.wrap(step) if lowp is not None else step

    def stepped(*args: Any) -> torch.Tensor:
        timer.mark("batch_prep")  # the batch taken, copied and staged (the pipeline's work)
        loss = inner(*args)
        timer.mark("lowp_dispatch")
        timer.end()
        return loss

    pipe = TrainPipeline(
        model, opt, fresh_batches(batches, timer), stepped, bf16=bf16, device="cpu"
    )
    warm = max(a.warmup, cfg.lowp.probe_steps + 2 if lowp is not None else 0)
    whole: list[float] = []
    for i in range(warm + 2 * a.iters):
        timer.active = i >= warm and i % 2 == 0  # phases on every other step, off in between
        pipe.progress(i + 1)
        if i >= warm and not timer.active:
            whole.append(pipe.times.last_s)
    guard.check()
    plan = dict(lowp.disp.plan) if lowp is not None else {}
    if bf16:
        plan = {n: "bf16" for n, _ in model.dense_arch.named_modules()}
    floors = measure_floors(array_mb=a.floor_mb, gemm_n=a.gemm_n)
    ms = timer.medians_ms()
    if lowp is None:
        ms.pop("lowp_dispatch", None)
    shape = step_shape(cfg, model, batches, plan)
    out = summarize(phase_work(shape), ms, floors, 1000 * statistics.median(whole))
    result = result_fields(cfg, a, out, floors, plan, shape)
    print_table(result)
    print(json.dumps(result))
    return 0


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


def main_args(p: argparse.ArgumentParser) -> None:
    """The breakdown's own flags on ``neorec bench step``."""
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="the step's phases next to their floors on this machine (docs/performance.md)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="with --breakdown: the distributed step of N >= 2 gloo ranks on this machine "
        "(all-to-alls by comm.transport: --set comm.transport=shm|gloo)",
    )
    p.add_argument("--gemm-n", type=int, default=2048, help=argparse.SUPPRESS)  # (tests: small)
    p.add_argument("--floor-mb", type=float, default=0.0, help=argparse.SUPPRESS)
