"""A learned correction of the analytical cost model, fitted on placements measured on one machine.

The analytical ``CostModel`` is the backbone: for a plan it predicts each rank's phase times. The
learned model predicts, per target, ``log(measured / analytical)`` from features of the plan
(``neorec.sharding.learned_features``: per-rank sums, maxes and counts of shards, ids, columns and
row bytes; the analytical phase shares, imbalance and step, and the analytical time split by
sharding type and kind of work; the tables' pooling, skew, optimizer and sharding types), so a
prediction is ``analytical x exp(correction)``. Targets (ms per step, as
``neorec bench dist --embedding-only`` measures them, the slowest rank): ``step`` (what the
planner ranks plans by), ``fwd``, ``bwd`` and ``comm`` (time waiting on collectives).

Candidates (numpy only, seconds to fit; ``learned_features.CANDIDATES``): ``analytical`` (no
correction), ``constant`` (one factor), ``affine`` (the analytical phases re-weighted plus fixed
costs), ``typed`` (the analytical time per sharding type and kind of work re-weighted, plus fixed
costs), ``typed_stumps`` / ``typed_trees`` (``typed`` plus boosted stumps / depth-2 trees on
its residual), ``ridge`` (linear in standardized features, a few penalties) and ``stumps``
(gradient-boosted depth-1 trees). Each is scored by grouped cross-validation: a fold holds out
whole table mixes (other tables and shard geometries than those fitted); the one with the lowest
held-out mean |relative error| plus half its 95th percentile is kept per target, refitted on all
samples, and its held-out mean / 95th percentile / max error travel with it as its validation
error (``neorec.sharding.learned_fit``; the placements measured: ``learned_placements``).

The fitted model lives in the topology file (``Topology.learned_cost``) with the machine it was
fitted on (CPU model, vector flags, logical CPUs) and the world size of its samples;
``resolve`` decides whether a planner may use it (see there).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neorec.errors import NeorecError
from neorec.machine import cpu_model_and_flags
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.cost_types import PlanCost
from neorec.sharding.learned_features import FEATURES, check_params, plan_features
from neorec.sharding.learned_features import predict as _predict
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan

__all__ = [
    "FORMAT",
    "TARGETS",
    "COST_MODEL_MODES",
    "FEATURES",
    "LearnedModelError",
    "LearnedCostModel",
    "Scoring",
    "machine_description",
    "machine_label",
    "machine_differences",
    "model_summary",
    "plan_features",
    "resolve",
]

FORMAT = "neorec.learned_cost/2"
TARGETS = ("step", "fwd", "bwd", "comm")
COST_MODEL_MODES = ("auto", "learned", "analytical")
"""``auto``: the topology's learned model when it was fitted on this machine and world size, else
the analytical one (saying why); ``learned``: the learned model even when fitted elsewhere (with
a warning), an error when there is none; ``analytical``: ignore any learned model."""


class LearnedModelError(NeorecError, ValueError):
    """A learned cost model that cannot be used: corrupt, missing where required, or unfit."""


# ---- the machine ------------------------------------------------------------------------------
def machine_description() -> dict[str, Any]:
    """This machine as a learned model records it: CPU model, vector flags, logical CPUs."""
    model, flags = cpu_model_and_flags()
    return {
        "cpu_model": model or "unknown",
        "flags": flags,
        "logical_cpus": os.cpu_count() or 0,
    }


def machine_label(m: dict[str, Any]) -> str:
    """``<cpu model> [flags] N cpus`` in one line."""
    flags = ",".join(m.get("flags", [])) or "no listed flags"
    return f"'{m.get('cpu_model', 'unknown')}' [{flags}] {m.get('logical_cpus', '?')} cpus"


def machine_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Fields of two machine descriptions that differ (CPU model, flags, logical CPUs)."""
    out = []
    for k in ("cpu_model", "flags", "logical_cpus"):
        va, vb = a.get(k), b.get(k)
        if k == "flags":
            va, vb = sorted(va or []), sorted(vb or [])
        if va != vb:
            out.append(k)
    return out


# ---- the model --------------------------------------------------------------------------------
@dataclass
class LearnedCostModel:
    """Fitted corrections per target, with the machine and samples they came from."""

    targets: dict[str, dict[str, Any]]
    """Per target: the kept regressor's params (``kind`` and its numbers)."""
    validation: dict[str, dict[str, Any]]
    """Per target: held-out mean / max |relative error| of the kept model, and every candidate's."""
    machine: dict[str, Any]
    world_size: int
    ranks_per_host: int
    samples: int
    mixes: int
    fitted_at: str = ""
    features: tuple[str, ...] = FEATURES
    extra: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    """The speed references' median ms/step during the calibration (``ms``, per kind of
    ``learned_placements.REFERENCE_KINDS``): predictions are at that speed; a check that measured
    the references now passes ``speed`` (``learned_placements.speed_of``). Empty: not anchored."""

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (stored as ``Topology.learned_cost``)."""
        return {
            "format": FORMAT,
            "features": list(self.features),
            "targets": self.targets,
            "validation": self.validation,
            "machine": self.machine,
            "world_size": self.world_size,
            "ranks_per_host": self.ranks_per_host,
            "samples": self.samples,
            "mixes": self.mixes,
            "fitted_at": self.fitted_at,
            **({"extra": self.extra} if self.extra else {}),
            **({"reference": self.reference} if self.reference else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "topology") -> LearnedCostModel:
        """Parse and check a stored model; ``LearnedModelError`` names the bad field."""
        at = f"{where}: learned_cost"
        if not isinstance(d, dict):
            raise LearnedModelError(f"{at} must be an object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise LearnedModelError(
                f"{at}.format is {d.get('format')!r}, expected {FORMAT!r}; refit with "
                "neorec plan --calibrate"
            )
        if list(d.get("features") or []) != list(FEATURES):
            raise LearnedModelError(
                f"{at}.features differ from this neorec's ({len(FEATURES)} features); refit with "
                "neorec plan --calibrate"
            )
        try:
            targets = d["targets"]
            for t in TARGETS:
                p = targets[t]
                _check_params(p, f"{at}.targets.{t}")
            m = cls(
                targets={t: targets[t] for t in TARGETS},
                validation=dict(d["validation"]),
                machine=dict(d["machine"]),
                world_size=int(d["world_size"]),
                ranks_per_host=int(d["ranks_per_host"]),
                samples=int(d["samples"]),
                mixes=int(d["mixes"]),
                fitted_at=str(d.get("fitted_at", "")),
                extra=dict(d.get("extra") or {}),
                reference=dict(d.get("reference") or {}),
            )
            if m.reference:
                ms = m.reference.get("ms")
                if not isinstance(ms, dict) or not ms:
                    raise ValueError("'reference.ms' must be a non-empty object")
                for k, v in ms.items():
                    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                        raise ValueError(f"'reference.ms.{k}' must be a positive number, got {v!r}")
            for t in TARGETS:
                v = m.validation[t]
                float(v["mean_abs_error"]), float(v["max_abs_error"])
        except LearnedModelError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise LearnedModelError(
                f"{at}: missing or bad field {e}; refit with neorec plan --calibrate"
            ) from None
        return m

    # ---- use ----------------------------------------------------------------------------------
    def predict_ms(
        self, cm: CostModel, plan: ShardingPlan, specs: Sequence[TableSpec], speed: float = 1.0
    ) -> dict[str, float]:
        """Predicted ms per step of every target (analytical x exp(correction)), at the
        calibration's speed, or x ``speed`` (the machine's now, from the references)."""
        x, base = plan_features(cm, plan, specs)
        xa = np.asarray([x])
        return {
            t: speed
            * base[t]
            * math.exp(float(_predict(self.targets[t], xa, np.asarray([base[t]]))[0]))
            for t in TARGETS
        }

    def step_s(
        self,
        cm: CostModel,
        plan: ShardingPlan,
        specs: Sequence[TableSpec],
        cost: PlanCost | None = None,
    ) -> float:
        """Predicted embedding step of ``plan`` in seconds (what the planner minimizes)."""
        x, base = plan_features(cm, plan, specs, cost)
        b = base["step"]
        corr = float(_predict(self.targets["step"], np.asarray([x]), np.asarray([b]))[0])
        return base["step"] * math.exp(corr) / 1000

    def kind(self, target: str = "step") -> str:
        """Regressor kept for ``target`` (a ``learned_features.KINDS`` name)."""
        return str(self.targets[target]["kind"])

    def describe(self) -> str:
        """One line: regressor, samples, machine and validation error of the step target."""
        v = self.validation["step"]
        return (
            f"learned ({self.kind()} correction of the analytical model, {self.samples} "
            f"placements of {self.mixes} table mixes, {self.world_size} ranks) fitted on "
            f"{machine_label(self.machine)}; held-out mean |error| "
            f"{100 * float(v['mean_abs_error']):.1f}%"
            + (f", p95 {100 * float(v['p95_abs_error']):.1f}%" if "p95_abs_error" in v else "")
            + f", max {100 * float(v['max_abs_error']):.1f}%"
        )


def _check_params(p: Any, at: str) -> None:
    try:
        check_params(p, at)
    except ValueError as e:
        raise LearnedModelError(str(e)) from None


def model_summary(d: dict[str, Any]) -> dict[str, Any]:
    """A stored learned model without its parameters (machine, samples, validation errors), for
    reports that show a topology; empty for none."""
    if not d:
        return {}
    keep = ("format", "machine", "world_size", "ranks_per_host", "samples", "mixes", "fitted_at")
    out = {k: d[k] for k in keep if k in d}
    val = d.get("validation")
    if isinstance(val, dict):
        out["validation"] = {
            t: {k: v.get(k) for k in ("kept", "mean_abs_error", "max_abs_error")}
            for t, v in val.items()
            if isinstance(v, dict)
        }
    return out


# ---- which model scores a plan ----------------------------------------------------------------
@dataclass
class Scoring:
    """The cost model a planner scores plans with, and the lines saying so."""

    model: LearnedCostModel | None
    """The learned model in use, or None (analytical)."""
    note: str
    """One line: which model scores plans (and, for a learned one, its validation error)."""
    warnings: list[str] = field(default_factory=list)
    """Lines to show the user (a model from another machine or world size)."""

    @property
    def kind(self) -> str:
        """``learned`` or ``analytical``."""
        return "learned" if self.model is not None else "analytical"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        out: dict[str, Any] = {"kind": self.kind, "note": self.note, "warnings": self.warnings}
        if self.model is not None:
            v = self.model.validation["step"]
            out.update(
                regressor=self.model.kind(),
                machine=self.model.machine,
                validation_mean_abs_error=v["mean_abs_error"],
                validation_max_abs_error=v["max_abs_error"],
            )
        return out


def resolve(
    topology: Topology, mode: str = "auto", where: str = "topology", here: dict | None = None
) -> Scoring:
    """Decide which model scores plans on ``topology`` (``mode`` in ``COST_MODEL_MODES``).

    A learned model that cannot be parsed is a ``LearnedModelError`` in every mode but
    ``analytical`` (a broken file is not silently ignored). One fitted on another machine (CPU
    model, flags or logical CPUs differ from ``here``, default this machine's) or for another
    world size is reported in ``warnings`` naming both; ``auto`` then plans with the analytical
    model, ``learned`` uses it anyway.
    """
    if mode not in COST_MODEL_MODES:
        raise LearnedModelError(f"--cost-model must be one of {COST_MODEL_MODES}, got {mode!r}")
    raw = getattr(topology, "learned_cost", None) or {}
    if mode == "analytical":
        note = "analytical (asked for with --cost-model analytical)"
        return Scoring(None, note + (" ; the topology's learned model is ignored" if raw else ""))
    if not raw:
        if mode == "learned":
            raise LearnedModelError(
                f"{where}: --cost-model learned, but the topology has no learned model; fit one "
                "with neorec plan --calibrate --topology FILE"
            )
        return Scoring(
            None,
            "analytical (the topology has no learned model; neorec plan --calibrate fits one)",
        )
    model = LearnedCostModel.from_dict(raw, where)
    me = here if here is not None else machine_description()
    warnings = []
    diff = machine_differences(model.machine, me)
    if diff:
        warnings.append(
            f"warning: the learned cost model was fitted on {machine_label(model.machine)}, this "
            f"machine is {machine_label(me)} ({', '.join(diff)} differ)"
        )
    if topology.world_size != model.world_size or topology.ranks_per_host != model.ranks_per_host:
        warnings.append(
            f"warning: the learned cost model was fitted on {model.world_size} ranks "
            f"({model.ranks_per_host} per host), the plan is for {topology.world_size} "
            f"({topology.ranks_per_host} per host)"
        )
    if warnings and mode == "auto":
        warnings[-1] += (
            "; not used: plans are scored by the analytical model (--cost-model learned uses it)"
        )
        return Scoring(
            None, "analytical (the learned model does not match; see the warning)", warnings
        )
    if warnings:
        warnings[-1] += "; used anyway (--cost-model learned)"
    return Scoring(model, model.describe(), warnings)


def specs_dicts(tables: Iterable[TableSpec]) -> list[dict[str, Any]]:
    """The fields of ``tables`` a calibration sample stores (enough to rebuild the specs)."""
    return [
        {
            "name": t.name,
            "rows": t.rows,
            "dim": t.dim,
            "pooling_factor": t.pooling_factor,
            "zipf_alpha": t.zipf_alpha,
            **({"optimizer": t.optimizer} if t.optimizer else {}),
        }
        for t in tables
    ]
