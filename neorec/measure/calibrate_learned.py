"""The learned cost model's calibration (``neorec plan --calibrate --budget-s S``): the designed
set of placements (``neorec.sharding.learned_placements.designed_jobs``: whole-plan kinds and
the greedy baselines' and planner's plans of bench-like mixes, planner-task-like mixes, random
mixes and placements) measured on this machine's gloo ranks with the real sharded runtime, each
placement ``REPEATS`` times (median), until the budget is spent; then the fit. Split from
``neorec.measure.calibrate`` (the analytical constants)."""

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
"""Interleaved passes over each block (a placement's sample is the median of its passes). One
10-step window varies by +-20% here; 5 passes instead of 3 gave as many fewer samples and no
lower held-out error (12.1% vs 11.9-12.3%), so the budget goes to more placements."""
PASS_ITERS = 10
"""Steps measured per pass (after 3 of warm-up at the first, 1 at the later ones), as a pass of
``bench costcheck``'s rounds, so both measure alike."""
_JOBS_PER_S = 12.0  # more passes than the budget can take
SPAWN_BLOCKS = 4
"""Blocks measured by one pair of rank processes (one of each kind of ``DESIGN_CYCLE``, ~15 s)
before fresh ones take over."""


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
    from neorec.measure.jobs import run_jobs
    from neorec.sharding.learned_fit import fit, samples_from_rows, save_samples
    from neorec.sharding.learned_placements import designed_jobs

    world = max(2, min(topo.ranks_per_host, os.cpu_count() or 1))
    left = deadline - _FIT_RESERVE_S - time.time()
    n_jobs = int(left * _JOBS_PER_S) if left > 0 else 0
    jobs = designed_jobs(topo, world, world, n_jobs, seed, repeats) if n_jobs else []
    if progress:
        print(
            f"measuring the designed placements on {world} gloo ranks for up to "
            f"{max(0, left):.0f} s, {repeats} interleaved passes per block with the speed "
            "references (blocks in turn: random mixes, bench-like whole-plan kinds + baselines + "
            "planner, random mixes, planner tasks)"
        )
    # As costcheck measures (passes of 10 steps, 3 of warm-up at a placement's first):
    # with one 20-step window instead of 30, some placements measured up to 20% slower (first
    # touches of zero-initialised optimizer state still in the median).
    # Fresh rank processes every SPAWN_BLOCKS blocks, as every check round has: one pair of
    # processes running the whole calibration slowed down by ~30% over 7 minutes (the speed
    # references' times rose from the first fifth of the blocks to the last), and not alike for
    # every kind of placement, so the references could not divide all of it out.
    rows: list[dict] = []
    for lo, hi in _spawn_parts(jobs, SPAWN_BLOCKS):
        if time.time() >= deadline - _FIT_RESERVE_S:
            break
        got = run_jobs(
            jobs[lo:hi],
            world,
            deadline - _FIT_RESERVE_S,
            iters=PASS_ITERS,
            warmup=3,
            progress=progress,
            progress_at=(lo, len(jobs)),
        )
        rows.extend({**r, "job": lo + r["job"]} for r in got)
    samples = samples_from_rows(jobs, rows)
    if samples_out:  # before the fit: kept even when too few to fit
        save_samples(samples_out, samples)
        print(f"{len(samples)} placement samples ({len(rows)} measurements) -> {samples_out}")
    return fit(topo.with_world(world, world), samples), samples


def _spawn_parts(jobs: list[dict], blocks: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of ``jobs`` holding ``blocks`` whole blocks each (``block`` keys)."""
    parts: list[tuple[int, int]] = []
    lo, seen, last = 0, 0, object()
    for i, j in enumerate(jobs):
        b = j.get("block")
        if b != last:
            if seen == blocks:
                parts.append((lo, i))
                lo, seen = i, 0
            seen += 1
            last = b
    if lo < len(jobs):
        parts.append((lo, len(jobs)))
    return parts


def _refit(topology_path: str, samples_file: str) -> int:
    """``--refit``: fit the learned model of a topology file again on stored samples."""
    from neorec.sharding.learned_cost import LearnedModelError
    from neorec.sharding.learned_fit import refit_topology

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
            f"{k} {100 * c['mean_abs_error']:.1f}%/"
            + (f"{100 * c['p95_abs_error']:.1f}%/" if "p95_abs_error" in c else "")
            + f"{100 * c['max_abs_error']:.1f}%"
            for k, c in v["candidates"].items()
        )
        print(f"  {t}: kept {v['kept']}; held-out mean/p95/max |error|: {cands}")
