"""``neorec bench step --breakdown``: the step's time split into phases, each next to its floor.

The step is the trainer's own: the sequential pipeline (``train.pipeline.TrainPipeline``: the
batch staged, then ``train.steps.train_step`` with the NaN guard, under LoKA's dispatch hooks
when ``lowp.mode`` is on). Steps alternate between timed by phase (the timer attached from
outside: ``step_timing``) and untimed, whose medians give the whole step the phases must add up
to. The floors are measured in the same run (``floors``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from neorec.bench.floors import measure_floors
from neorec.bench.step_dist_breakdown import run_dist_breakdown
from neorec.bench.step_phases import phase_work, summarize
from neorec.bench.step_timing import (
    PhaseTimer,
    StepMarksHook,
    attach_timer,
    fresh_batches,
    hook_collection,
    print_table,
    result_fields,
    step_shape,
)
from neorec.builder import build_dlrm, dense_optimizer
from neorec.data.batch import Batch
from neorec.train.lowp import TrainerLowp
from neorec.train.pipeline import StepHook, TrainPipeline
from neorec.train.steps import Step

__all__ = ["run_breakdown", "main_args"]


def run_breakdown(cfg: Any, a: argparse.Namespace, batches: list[Batch]) -> int:
    """Time the phases and the whole step, measure the floors, print a table and a JSON line
    (``--nproc N``: N gloo ranks on this machine, ``step_dist_breakdown``)."""
    if a.nproc != 1:
        return run_dist_breakdown(cfg, a)
    torch.manual_seed(cfg.train.seed)
    model = build_dlrm(cfg, torch.device("cpu"))
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    timer = PhaseTimer()
    hook_collection(model, timer)
    guard = attach_timer(model, opt, timer)
    bf16 = bool(a.bf16 or cfg.train.bf16_dense)
    # Around the step, as nested wrappers: the batch taken, copied and staged (the pipeline's
    # work) ends batch_prep; LoKA's hooks, as the trainer runs them, are lowp_dispatch.
    hooks: list[StepHook] = [StepMarksHook(timer, "batch_prep", "lowp_dispatch", timer.end)]
    lowp = None
    if cfg.lowp.mode != "off":
        lowp = TrainerLowp(cfg, model, sys.stdout)
        hooks.append(lowp)
    hooks.append(StepMarksHook(timer, "lowp_dispatch"))  # (before_step's time; none without LoKA)
    pipe = TrainPipeline(
        model, opt, fresh_batches(batches, timer), Step(guard=guard), bf16=bf16, device="cpu",
        hooks=hooks,
    )  # fmt: skip
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
