"""``neorec bench planner --measure --seed-base S --seeds N``: the planner's plan against the best
greedy baseline's on the tasks of seeds S .. S+N-1 (each seed its own pool and tasks,
``planner_measure.measure_result``), with the 95% interval of the paired ratio
(``bench.stats.paired_ratio``) per seed and pooled over the seeds.

Per task the best baseline is picked on the even rounds and compared with the planner on the odd
ones, paired by round (both plans ran in that round's processes and block). Two intervals:

- ``paired_ratio``: over every held-out task-round (planner ms / that baseline's ms in the same
  round): the noise of the measurement, tasks taken as they are;
- ``paired_ratio_by_task``: over the tasks (each task's geometric mean over its held-out rounds):
  the planner against greedy on another task of this kind, the figure that generalizes (task-rounds
  of one task are not independent).

Seeds 0-2 are the ones the planner and its cost model were developed on; report others.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from neorec.bench.stats import Interval, paired_ratio
from neorec.machine import cpu_model_and_flags

if TYPE_CHECKING:
    from neorec.bench.planner_measure import MeasureOptions

__all__ = ["DEV_SEEDS", "measure_seeds", "seed_ratios", "summarize_seeds"]

DEV_SEEDS = (0, 1, 2)
"""Seeds the planner, its cost model and this benchmark were developed on."""


def seed_ratios(result: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """From one seed's ``measure_result``: the planner's and its held-out baseline's ms per held-out
    task-round, and each task's geometric-mean ratio over its held-out rounds."""
    p_ms: list[float] = []
    b_ms: list[float] = []
    by_task: list[float] = []
    for t in result["tasks"]:
        h = t.get("held_out")
        if not h:
            continue
        p, b = h["planner_rounds_ms"], h["baseline_rounds_ms"]
        p_ms += p
        b_ms += b
        by_task.append(math.exp(sum(math.log(x / y) for x, y in zip(p, b)) / len(p)))
    return p_ms, b_ms, by_task


def _ratio(p: Sequence[float], b: Sequence[float]) -> dict[str, Any] | None:
    """``paired_ratio`` as a JSON object (None with no pairs)."""
    return paired_ratio(p, b).to_dict() if p else None


def summarize_seeds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per seed and pooled: the paired ratio's interval over task-rounds and over tasks, and
    whether each excludes 1."""
    per_seed = []
    all_p: list[float] = []
    all_b: list[float] = []
    all_tasks: list[float] = []
    for r in results:
        p, b, by_task = seed_ratios(r)
        all_p += p
        all_b += b
        all_tasks += by_task
        per_seed.append(
            {
                "seed": r["seed"],
                "paired_ratio": _ratio(p, b),
                "paired_ratio_by_task": _ratio(by_task, [1.0] * len(by_task)),
                "held_out_wins": r["held_out_wins"],
                "held_out_ties": r["held_out_ties"],
                "tasks": len(r["tasks"]),
            }
        )
    pooled = _ratio(all_p, all_b)
    pooled_tasks = _ratio(all_tasks, [1.0] * len(all_tasks))
    return {
        "per_seed": per_seed,
        "paired_ratio": pooled,
        "paired_ratio_by_task": pooled_tasks,
        "excludes_1": _excludes_1(pooled),
        "by_task_excludes_1": _excludes_1(pooled_tasks),
    }


def _excludes_1(iv: dict[str, Any] | None) -> bool | None:
    return None if iv is None else Interval(**iv).excludes(1.0)


def _fmt(iv: dict[str, Any] | None) -> str:
    if iv is None:
        return "-"
    mark = " (excludes 1)" if Interval(**iv).excludes(1.0) else ""
    return f"{iv['value']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}] n={iv['n']}{mark}"


def measure_seeds(seeds: Sequence[int], n_tasks: int, options: MeasureOptions) -> int:
    """``measure_result`` of ``n_tasks`` tasks with ``options`` on each seed (its own table), then
    the summary table and one JSON line (the last line of stdout)."""
    from neorec.bench.planner_measure import measure_result

    if not seeds:
        raise ValueError("--seeds must be >= 1")
    results = [measure_result(n_tasks, seed=s, options=options) for s in seeds]
    summary = summarize_seeds(results)
    dev = sorted(set(seeds) & set(DEV_SEEDS))
    print(
        "planner / best greedy baseline (held out: picked on the even rounds, compared on the odd "
        "ones, paired by round); 95% intervals"
        + (f"; seeds {dev} were used in development" if dev else "; no development seed")
    )
    print(f"{'seed':>6}  {'over task-rounds':<44}{'over tasks':<44}")
    for s in summary["per_seed"]:
        print(f"{s['seed']:>6}  {_fmt(s['paired_ratio']):<44}{_fmt(s['paired_ratio_by_task']):<44}")
    print(
        f"{'pooled':>6}  {_fmt(summary['paired_ratio']):<44}"
        f"{_fmt(summary['paired_ratio_by_task']):<44}"
    )
    first = results[0]
    print(
        json.dumps(
            {
                "bench": "planner_measure_seeds",
                "seeds": list(seeds),
                "development_seeds": list(DEV_SEEDS),
                "cpu": cpu_model_and_flags()[0],
                "kind": first["kind"],
                "repeats": first["repeats"],
                "tasks_per_seed": len(first["tasks"]),
                "batch": first["tasks"][0]["batch"] if first["tasks"] else None,
                **summary,
                "results": results,
            }
        )
    )
    return 0
