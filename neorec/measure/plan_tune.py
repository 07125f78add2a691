"""``neorec plan --tune K``: measure a planner's shortlist here and keep the fastest plan.

The shortlist (``neorec.sharding.planner_shortlist``: the planner's plan, the greedy baselines'
plans, the best alternatives by the cost model) runs for real on ``world_size`` gloo ranks of
this machine, with the sharded runtime of ``bench dist --embedding-only`` and synthetic Zipf ids:
``rounds`` rounds, each in fresh rank processes that build every plan once and step them in
``passes`` interleaved passes of ``iters`` steps (the first round in shortlist order, each later
one in another seeded order), as ``bench costcheck`` and ``bench planner --measure`` measure.
A plan's figure is the median of its rounds. The fastest plan replaces the planner's own only
when its lead is clear of the measurement's noise (more than ``NOISE_SIGMAS`` standard errors of
the difference, estimated from the rounds' spread; with fewer than ``MIN_ROUNDS_FOR_NOISE``
rounds the fastest is kept); ties go to the earlier plan. A lead within the noise keeps the
planner's plan: the measurement could not tell the two apart, and the planner's is deterministic.

``python -m neorec.measure.plan_tune --request IN.json --out OUT.json`` is what ``neorec plan``
runs (in a subprocess: the planner itself never imports torch); ``tune`` is the library call.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from neorec.sharding.cost_model import TableSpec
from neorec.sharding.learned_placements import plan_job
from neorec.sharding.plan_checks import check_storage
from neorec.sharding.plan_json import parse_plan_dict
from neorec.sharding.planner_shortlist import TUNE_ROUNDS, Shortlisted

__all__ = ["PASSES", "ITERS", "tune", "main"]

PASSES = 5
"""Interleaved passes per round (``bench planner --measure``'s)."""
ITERS = 10
"""Steps per pass."""

MIN_ROUNDS_FOR_NOISE = 3
"""With fewer rounds the round-to-round spread is not estimated: the fastest median is kept."""
NOISE_SIGMAS = 2.0
"""The fastest plan replaces the planner's own only when its median is lower by more than this
many standard errors of the difference of the two medians (each ``1.2533 x sd / sqrt(rounds)``
of its rounds): one plan's copies in one round differ by ~5% here (``docs/autoshard.md``), so
a lead smaller than that is as likely the measurement's as the plan's."""

Measure = Callable[[list[dict], int, int, int, int], list[dict[str, float]]]
"""``(jobs, world, passes, iters, round) -> per job {"ms_per_step": ...}``: one round in fresh
ranks (``neorec.measure.jobs.run_passes``; tests pass a fake)."""


def _median_se(xs: Sequence[float]) -> float:
    """The standard error of the median of ``xs`` (normal approximation)."""
    return 1.2533 * statistics.stdev(xs) / math.sqrt(len(xs))


def _run_passes(jobs: list[dict], world: int, passes: int, iters: int, rnd: int):
    from neorec.measure.jobs import run_passes

    return run_passes(jobs, world, passes, iters, 3, rnd)


def tune(
    cands: Sequence[Shortlisted],
    tables: Sequence[TableSpec],
    batch: int,
    optimizer: str,
    rounds: int = TUNE_ROUNDS,
    passes: int = PASSES,
    iters: int = ITERS,
    measure: Measure | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure ``cands`` (see the module docstring; the planner's own plan first) and return
    the tuning record: ``picked`` (the plan kept), ``fastest`` (the lowest median), ``lead_ms``
    (the planner's plan's median minus the fastest's), ``noise_ms`` (the lead it must beat;
    None: not estimated), ``clear``, ``measured`` (per plan: label, median ``ms_per_step`` over the
    rounds, each round's figure, ``predicted_ms``), ``world``, ``batch``, ``rounds``,
    ``passes``, ``iters``."""
    if len(cands) < 1 or rounds < 1 or passes < 1 or iters < 1:
        raise ValueError(
            f"tune needs plans, rounds, passes and steps (got {len(cands)}, {rounds}, {passes}, "
            f"{iters})"
        )
    world = cands[0].plan.world_size
    if any(c.plan.world_size != world for c in cands):
        raise ValueError("tune: the shortlist's plans have different world sizes")
    if batch < world or batch % world:
        raise ValueError(f"tune: the batch ({batch}) must be a multiple of the {world} ranks")
    alphas = sorted({t.zipf_alpha for t in tables})
    if len(alphas) > 1:
        raise ValueError(f"tune draws every table's ids from one Zipf alpha, not {alphas}")
    for c in cands:
        check_storage(c.plan, who="--tune (the distributed runtime)")
    run = measure or _run_passes
    jobs = [plan_job(tables, batch, optimizer, c.plan) for c in cands]
    figures: list[list[float]] = [[] for _ in cands]
    for rnd in range(rounds):
        order = list(range(len(jobs)))
        if rnd:
            random.Random(rnd).shuffle(order)
        got = run([jobs[i] for i in order], world, passes, iters, rnd)
        for i, g in zip(order, got):
            figures[i].append(float(g["ms_per_step"]))
        if progress is not None:
            progress(f"  --tune: round {rnd + 1}/{rounds} of {len(jobs)} plans measured")
    med = [statistics.median(f) for f in figures]
    best = min(range(len(cands)), key=lambda i: (med[i], i))
    lead, noise = med[0] - med[best], None
    if rounds >= MIN_ROUNDS_FOR_NOISE:
        noise = NOISE_SIGMAS * math.hypot(_median_se(figures[0]), _median_se(figures[best]))
    clear = best == 0 or noise is None or lead > noise
    return {
        "picked": cands[best if clear else 0].label,
        "fastest": cands[best].label,
        "lead_ms": lead,
        "noise_ms": noise,
        "noise_sigmas": NOISE_SIGMAS,
        "clear": clear,
        "world": world,
        "batch": batch,
        "rounds": rounds,
        "passes": passes,
        "iters": iters,
        "measured": [
            {
                "label": c.label,
                "ms_per_step": med[i],
                "rounds_ms": figures[i],
                "predicted_ms": c.predicted_ms,
            }
            for i, c in enumerate(cands)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """The subprocess ``neorec plan --tune`` runs: a request JSON in, the tuning record out."""
    ap = argparse.ArgumentParser(prog="python -m neorec.measure.plan_tune", description=__doc__)
    ap.add_argument(
        "--request",
        required=True,
        help="JSON: tables, batch, optimizer, rounds, plans (label, plan, predicted_ms)",
    )
    ap.add_argument("--out", required=True, help="write the tuning record (JSON) here")
    args = ap.parse_args(argv)
    try:
        with open(args.request) as f:
            req = json.load(f)
        tables = [TableSpec(**t) for t in req["tables"]]
        cands = [
            Shortlisted(c["label"], parse_plan_dict(c["plan"]), float(c["predicted_ms"]))
            for c in req["plans"]
        ]
        rec = tune(
            cands,
            tables,
            int(req["batch"]),
            str(req["optimizer"]),
            int(req["rounds"]),
            progress=lambda m: print(m, flush=True),  # neorec plan shows it on stderr
        )
    except (OSError, KeyError, TypeError, ValueError) as e:
        print(f"neorec: error: --tune: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(rec, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
