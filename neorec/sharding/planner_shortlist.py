"""The plans ``neorec plan --tune`` measures: a planner's shortlist (pure Python, no torch).

A cost model ranks a task's plans only as well as its error allows. On 2 ranks of the 2-core VM
the table-wise plans of a 6-12-table task differ by a few percent, and neither the calibrated
learned model nor the analytical one orders them better than chance (``docs/autoshard.md``).
Measuring a few of them settles what the models cannot: ``neorec.measure.plan_tune`` runs the
shortlist on this machine and keeps the fastest.

The shortlist, in order: the plan the planner returned (``planner``); the greedy baselines' plans
(by their names: the plans the planner claims to beat, so a tuned plan is measured against
them); then, by the scoring model's predicted step, the search's other candidates (``search{i}``)
and the returned plan's one-table moves (``move {table} -> {rank}``: a table-wise table onto
another rank it may use). Every plan fits memory; with a learned model, an alternative must stay
within the planner's trust region (its analytical step within 1 + the model's held-out mean
|error| of the best candidate's, as ``Planner._learned_pick``); plans equal up to which rank is
which appear once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from neorec.sharding.cost_model import TableSpec
from neorec.sharding.cost_types import PlanCost
from neorec.sharding.planner import Planner, PlanResult
from neorec.sharding.planner_baselines import baseline_candidates, plan_key
from neorec.sharding.types import ShardingPlan

__all__ = [
    "TUNE_MAX_RANKS",
    "TUNE_ROUNDS",
    "Shortlisted",
    "check_tune",
    "shortlist",
    "with_plan",
]

TUNE_ROUNDS = 4
"""``--tune``'s rounds by default (``neorec plan --tune-rounds``, ``bench planner
--planner-tune-rounds``, ``neorec.measure.plan_tune.tune``)."""

TUNE_MAX_RANKS = 8
"""``--tune`` runs every plan on ``world_size`` gloo ranks of this one machine: at most this many."""
TUNE_MEMORY_SHARE = 0.5
"""``--tune`` builds a round's plans together: their tables (weights twice over, for the optimizer
state and gradients) may take at most this share of the memory available here."""


def check_tune(tables: Sequence[TableSpec], world: int, k: int, rounds: int) -> None:
    """``neorec plan --tune k --tune-rounds rounds`` on ``world`` ranks is runnable here: one
    ``ValueError`` line naming what is not (checked before any planning or measuring)."""
    from neorec.machine import available_memory_bytes

    if k < 2:
        raise ValueError(f"--tune measures K >= 2 plans to pick the fastest, not {k}")
    if rounds < 1:
        raise ValueError(f"--tune-rounds must be >= 1, not {rounds}")
    if not 2 <= world <= TUNE_MAX_RANKS:
        raise ValueError(
            f"--tune runs each plan on {world} gloo rank(s) of this machine: the world size "
            f"must be 2..{TUNE_MAX_RANKS} (plan for a larger cluster without --tune)"
        )
    alphas = sorted({t.zipf_alpha for t in tables})
    if len(alphas) > 1:
        raise ValueError(
            f"--tune draws every table's ids from one Zipf alpha; the tables have {alphas}"
        )
    need = k * sum(2 * 4 * t.rows * t.dim for t in tables)
    have = available_memory_bytes()
    if have and need > TUNE_MEMORY_SHARE * have:
        raise ValueError(
            f"--tune builds {k} plans of these tables at once here: ~{need / 1e9:.2f} GB, more "
            f"than {TUNE_MEMORY_SHARE:.0%} of the {have / 1e9:.2f} GB available; lower --tune "
            "or plan without it"
        )


@dataclasses.dataclass
class Shortlisted:
    """One plan of a shortlist: its label, the plan and the scoring model's predicted ms/step."""

    label: str
    plan: ShardingPlan
    predicted_ms: float


def _score_ms(planner: Planner, plan: ShardingPlan, tables: Sequence[TableSpec], cost: PlanCost):
    """The planner's scoring model's ms per step of ``plan`` (learned, else analytical)."""
    model = planner.scoring.model
    if model is None:
        return 1000 * cost.max_time_s
    return 1000 * model.step_s(planner.cm, plan, tables, cost)


def shortlist(planner: Planner, result: PlanResult, k: int) -> list[Shortlisted]:
    """At most ``k`` (>= 1) distinct plans of ``result``'s tables to measure, in the module
    docstring's order: the returned plan first, the greedy baselines' next, then the best
    alternatives by ``planner``'s scoring model (ties in the order generated)."""
    if k < 1:
        raise ValueError(f"a shortlist needs k >= 1 plans, not {k}")
    tables = result.tables
    out: list[Shortlisted] = []
    seen: set[str] = set()

    def add(label: str, plan: ShardingPlan, cost: PlanCost | None = None) -> None:
        key = plan_key(plan.to_dict())
        if key in seen or len(out) >= k:
            return
        cost = cost or planner.cm.evaluate(plan, tables)
        if not cost.fits:
            return
        seen.add(key)
        out.append(Shortlisted(label, plan, _score_ms(planner, plan, tables, cost)))

    add("planner", result.plan, result.cost)
    for name, plan in baseline_candidates(planner, tables):
        add(name, plan)
    if len(out) >= k:
        return out
    alts: list[tuple[str, ShardingPlan, PlanCost]] = []
    for i, plan in enumerate(result.candidates):
        alts.append((f"search{i}", plan, planner.cm.evaluate(plan, tables)))
    for label, plan in planner.table_moves(result.plan, tables):
        alts.append((label, plan, planner.cm.evaluate(plan, tables)))
    alts = [a for a in alts if a[2].fits]
    model = planner.scoring.model
    if model is not None and alts:
        tau = float(model.validation["step"]["mean_abs_error"])
        limit = min(c.max_time_s for _, _, c in alts) * (1 + tau)
        limit = max(limit, result.cost.max_time_s)
        alts = [a for a in alts if a[2].max_time_s <= limit * (1 + 1e-9)]
    scored = [
        (_score_ms(planner, p, tables, c), n, label, p, c) for n, (label, p, c) in enumerate(alts)
    ]
    for _, _, label, plan, cost in sorted(scored, key=lambda x: (x[0], x[1])):
        add(label, plan, cost)
    return out


def with_plan(planner: Planner, result: PlanResult, plan: ShardingPlan) -> PlanResult:
    """``result`` with ``plan`` in place of its plan: its cost, learned prediction and
    ``plan.meta`` (the planner's, predictions of ``plan``) made again."""
    cost = planner.cm.evaluate(plan, result.tables)
    if not cost.fits:
        raise ValueError("the picked plan does not fit the topology's memory")
    model = planner.scoring.model
    learned = model.predict_ms(planner.cm, plan, result.tables) if model else None
    meta = dict(result.plan.meta)
    meta["predicted_step_embedding_s"] = learned["step"] / 1000 if learned else cost.max_time_s
    meta["imbalance"] = cost.imbalance
    if learned:
        meta["analytical_step_embedding_s"] = cost.max_time_s
    picked = dataclasses.replace(plan, meta=meta)
    return dataclasses.replace(result, plan=picked, cost=cost, learned_ms=learned)
