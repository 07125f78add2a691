"""The learned cost model's calibration (``neorec plan --calibrate --budget-s S``): the designed
set of placements (``neorec.sharding.learned_placements.designed_jobs``: whole-plan kinds and
the greedy baselines' and planner's plans of bench-like mixes, planner-task-like mixes, random
mixes and placements) measured on this machine's gloo ranks with the real sharded runtime, each
placement ``REPEATS`` times (median), until the budget is spent; then the fit. Split from
``neorec.bench.calibrate`` (the analytical constants)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from neorec.sharding.topology import Topology

__all__ = ["DEFAULT_BUDGET_S", "calibrate_learned"]

DEFAULT_BUDGET_S = 300.0
"""Wall-clock budget of ``neorec plan --calibrate`` (micro-benchmarks and placements)."""
_FIT_RESERVE_S = 5.0  # left for the fit after the last placement
REPEATS = 3
"""Measurements per placement (their median is the sample): one measurement's noise is of the
order of the model's error."""
CHECK_ITERS = 30
"""Steps measured per placement: costcheck's (``--iters`` default), so both measure alike."""
_JOBS_PER_S = 6.0  # more measurements than the budget can take (2-3 a second here)


def calibrate_learned(
    topo: Topology,
    deadline: float,
    seed: int = 0,
    progress: bool = True,
    samples_out: str = "",
    repeats: int = REPEATS,
) -> tuple[Any, list[dict]]:
    """Measure the designed set of placements (``designed_jobs``, each ``repeats`` times in a
    row) on this machine's gloo ranks with the real sharded runtime (``bench dist
    --embedding-only``'s measurement) until ``deadline`` (``time.time()``; no placement starts
    after it), then fit the learned model on ``topo``'s analytical predictions:
    (``LearnedCostModel``, samples; written first to ``samples_out`` when given).
    ``LearnedModelError`` when too few were measured to validate a fit."""
    from neorec.bench.dist import run_jobs
    from neorec.sharding.learned_placements import (
        designed_jobs,
        fit,
        samples_from_rows,
        save_samples,
    )

    world = max(2, min(topo.ranks_per_host, os.cpu_count() or 1))
    left = deadline - _FIT_RESERVE_S - time.time()
    n_jobs = int(left * _JOBS_PER_S) if left > 0 else 0
    jobs = designed_jobs(topo, world, world, n_jobs, seed, repeats) if n_jobs else []
    if progress:
        print(
            f"measuring the designed placements on {world} gloo ranks for up to "
            f"{max(0, left):.0f} s, each {repeats} times (blocks in turn: random mixes, bench-like "
            "whole-plan kinds + baselines + planner, random mixes, planner tasks)"
        )
    # As costcheck measures (30 steps after 3 of warm-up): with 20, some placements measured up
    # to 20% slower (first touches of zero-initialised optimizer state still in the median).
    rows = run_jobs(
        jobs, world, deadline - _FIT_RESERVE_S, iters=CHECK_ITERS, warmup=3, progress=progress
    )
    samples = samples_from_rows(jobs, rows)
    if samples_out:  # before the fit: kept even when too few to fit
        save_samples(samples_out, samples)
        print(f"{len(samples)} placement samples ({len(rows)} measurements) -> {samples_out}")
    return fit(topo.with_world(world, world), samples), samples


def _refit(topology_path: str, samples_file: str) -> int:
    """``--refit``: fit the learned model of a topology file again on stored samples."""
    from neorec.sharding.learned_cost import LearnedModelError
    from neorec.sharding.learned_placements import refit_topology

    try:
        model = refit_topology(topology_path, samples_file)
    except LearnedModelError as e:
        print(f"neorec: error: {e}", file=sys.stderr)
        return 2
    _print_model(model)
    print(f"written to {topology_path}")
    return 0


def _print_model(model: Any) -> None:
    """The kept regressor and every candidate's held-out error, per target."""
    print(f"learned cost model: {model.describe()}")
    for t, v in model.validation.items():
        cands = ", ".join(
            f"{k} {100 * c['mean_abs_error']:.1f}%/{100 * c['max_abs_error']:.1f}%"
            for k, c in v["candidates"].items()
        )
        print(f"  {t}: kept {v['kept']}; held-out mean/max |error|: {cands}")
