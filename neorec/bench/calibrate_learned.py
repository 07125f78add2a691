"""The learned cost model's calibration (``neorec plan --calibrate --budget-s S``): random
placements of random table mixes measured on this machine's gloo ranks with the real sharded
runtime, then the fit (``neorec.sharding.learned_placements``). Split from
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


def calibrate_learned(
    topo: Topology, deadline: float, seed: int = 0, progress: bool = True, samples_out: str = ""
) -> tuple[Any, list[dict]]:
    """Measure random placements of random table mixes (``random_jobs``) on this machine's gloo
    ranks with the real sharded runtime (``bench dist --embedding-only``'s measurement) until
    ``deadline`` (``time.time()``), then fit the learned model on ``topo``'s analytical
    predictions: (``LearnedCostModel``, samples; written first to ``samples_out`` when given).
    ``LearnedModelError`` when too few were measured to validate a fit."""
    from neorec.bench.dist import run_jobs
    from neorec.sharding.learned_placements import (
        fit,
        random_jobs,
        sample_from_job,
        save_samples,
    )

    world = max(2, min(topo.ranks_per_host, os.cpu_count() or 1))
    jobs = random_jobs(600, world, world, seed)
    left = deadline - _FIT_RESERVE_S - time.time()
    if progress:
        print(f"measuring random placements on {world} gloo ranks for up to {max(0, left):.0f} s")
    rows = run_jobs(jobs, world, deadline - _FIT_RESERVE_S, iters=20, warmup=3, progress=progress)
    samples = [sample_from_job(jobs[r["job"]], r) for r in rows]
    if samples_out:  # before the fit: kept even when too few to fit
        save_samples(samples_out, samples)
        print(f"{len(samples)} placement samples written to {samples_out}")
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
