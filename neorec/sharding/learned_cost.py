"""A learned correction of the analytical cost model, fitted on placements measured on one machine.

The analytical ``CostModel`` is the backbone: for a plan it predicts each rank's phase times. The
learned model predicts, per target, ``log(measured / analytical)`` from features of the plan's
ranks (per-rank sums, maxes and counts of shards, ids, columns and row bytes; the analytical
model's own phase shares, imbalance and step time; the tables' pooling, skew, optimizer and
sharding types), so a prediction is ``analytical x exp(correction)``. Targets (ms per step, as
``neorec bench dist --embedding-only`` measures them, the slowest rank): ``step`` (what the
planner ranks plans by), ``fwd``, ``bwd`` and ``comm`` (time waiting on collectives).

Candidates (numpy only, seconds to fit): ``analytical`` (no correction), ``constant`` (one
factor), ``affine`` (the analytical phases re-weighted plus fixed costs per step, per shard of
the slowest rank, per table and per id, least squares on relative error), ``ridge`` (linear in
standardized features, a few penalties) and ``stumps`` (gradient-boosted depth-1 trees). Each is scored by grouped cross-validation: a fold holds out
whole table mixes (other tables and shard geometries than those fitted); the one with the
lowest held-out mean |relative error| is kept per target, refitted on all samples, and its
held-out mean / max error travel with it as its validation error.

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
from neorec.sharding.cost_model import PHASES, CostModel, PlanCost, TableSpec
from neorec.sharding.tables import OPTIMIZERS
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan, ShardingType

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

FORMAT = "neorec.learned_cost/1"
TARGETS = ("step", "fwd", "bwd", "comm")
COST_MODEL_MODES = ("auto", "learned", "analytical")
"""``auto``: the topology's learned model when it was fitted on this machine and world size, else
the analytical one (saying why); ``learned``: the learned model even when fitted elsewhere (with
a warning), an error when there is none; ``analytical``: ignore any learned model."""
_TYPES = tuple(ShardingType)
_EPS_MS = 0.05  # keeps log ratios finite for near-zero comm waits
FEATURES = (
    "log_pred_ms",
    *(f"share_{p}" for p in PHASES),
    "share_sample_side",
    "imbalance",
    "log_tables",
    "log_batch",
    "world_size",
    *(f"frac_{t.value}" for t in _TYPES),
    *(f"frac_{o}" for o in OPTIMIZERS),
    "mean_log_pooling",
    "mean_alpha",
    "mean_log_rows",
    "mean_log_dim",
    "frac_cw_unfused",
    *(
        f"{agg}_{q}"
        for q in ("shards", "ids", "cols", "row_mb", "unfused")
        for agg in ("max", "mean")
    ),
)


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


# ---- features ---------------------------------------------------------------------------------
def plan_features(
    cm: CostModel, plan: ShardingPlan, specs: Sequence[TableSpec], cost: PlanCost | None = None
) -> tuple[list[float], dict[str, float]]:
    """(feature vector in ``FEATURES`` order, analytical ms per target) of ``plan`` (``cost``:
    its ``cm.evaluate``, when the caller has it)."""
    by = {t.name: t for t in specs}
    c = cost if cost is not None else cm.evaluate(plan, specs)
    total = max(c.max_time_s, 1e-12)
    pm = c.phase_max()
    w = plan.world_size
    per = {q: [0.0] * w for q in ("shards", "ids", "cols", "row_mb", "unfused")}
    types = dict.fromkeys(_TYPES, 0)
    opts = dict.fromkeys(OPTIMIZERS, 0)
    n_unf = 0
    for tp in plan.tables:
        t = by[tp.name]
        st = tp.sharding_type
        types[st] += 1
        opts[cm.optimizer_of(t)] += 1
        unf = cm.cw_unfused(t, st)
        n_unf += unf
        out_rows = cm.batch / w if st is ShardingType.DATA_PARALLEL else cm.batch
        for s in tp.shards:
            r = s.rank
            per["shards"][r] += 1
            per["ids"][r] += out_rows * t.pooling_factor * s.rows / t.rows
            per["cols"][r] += s.cols
            per["row_mb"][r] += s.rows * cm.row_bytes(t, s.cols) / 1e6
            per["unfused"][r] += unf
    n = max(1, len(plan.tables))
    tabs = [by[tp.name] for tp in plan.tables]
    f: dict[str, float] = {
        "log_pred_ms": math.log(1000 * total),
        "share_sample_side": c.sample_side_s / total,
        "imbalance": c.imbalance - 1.0,
        "log_tables": math.log(n),
        "log_batch": math.log(cm.batch),
        "world_size": float(w),
        "mean_log_pooling": sum(math.log1p(t.pooling_factor) for t in tabs) / n,
        "mean_alpha": sum(t.zipf_alpha for t in tabs) / n,
        "mean_log_rows": sum(math.log(t.rows) for t in tabs) / n,
        "mean_log_dim": sum(math.log(t.dim) for t in tabs) / n,
        "frac_cw_unfused": n_unf / n,
    }
    for p, name in enumerate(PHASES):
        f[f"share_{name}"] = pm[p] / total
    for st, k in types.items():
        f[f"frac_{st.value}"] = k / n
    for o, k in opts.items():
        f[f"frac_{o}"] = k / n
    for q, vals in per.items():
        logs = [math.log1p(v) for v in vals]
        f[f"max_{q}"] = max(logs)
        f[f"mean_{q}"] = sum(logs) / w
    base = {
        "step": 1000 * c.max_time_s,
        "fwd": 1000 * (pm[0] + pm[1] + c.sample_side_s / 2),
        "bwd": 1000 * (pm[2] + pm[3] + c.sample_side_s / 2),
        "comm": 1000 * (pm[0] + pm[2] + c.sample_side_s),
    }
    return [f[k] for k in FEATURES], base


# ---- regressors (params are plain JSON) -------------------------------------------------------
def _affine_design(x: np.ndarray) -> np.ndarray:
    """Columns of the ``affine`` model: the analytical step's phase and sample-side ms, then a
    constant (ms per step), the slowest rank's shards, the tables, and the slowest rank's ids
    (1e5s): fixed costs the analytical model under- or over-counts on this machine."""
    f = {n: i for i, n in enumerate(FEATURES)}
    step = np.exp(x[:, f["log_pred_ms"]])
    cols = [x[:, f[f"share_{p}"]] * step for p in PHASES]
    cols.append(x[:, f["share_sample_side"]] * step)
    cols += [
        np.ones(len(x)),
        np.expm1(x[:, f["max_shards"]]),
        np.exp(x[:, f["log_tables"]]),
        np.expm1(x[:, f["max_ids"]]) / 1e5,
    ]
    return np.stack(cols, axis=1)


_AFFINE_COLS = 9


def _fit_affine(x: np.ndarray, y: np.ndarray, base: np.ndarray, lam: float = 1e-3) -> dict:
    """Least squares of the measured ms on ``_affine_design`` columns, weighted by 1 / measured
    (relative errors), lightly ridged toward 0."""
    meas = (base + _EPS_MS) * np.exp(y) - _EPS_MS
    w = 1.0 / np.maximum(meas, _EPS_MS)
    a = _affine_design(x) * w[:, None]
    coef = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (meas * w))
    return {"kind": "affine", "coef": coef.tolist()}


def _predict(p: dict[str, Any], x: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Log corrections of regressor ``p`` for features ``x`` (``base``: analytical ms)."""
    kind = p["kind"]
    if kind == "affine":
        ms = np.maximum(_affine_design(x) @ np.asarray(p["coef"]), 0.02)
        return np.asarray(np.log((ms + _EPS_MS) / (base + _EPS_MS)))
    if kind == "analytical":
        return np.zeros(len(x))
    if kind == "constant":
        return np.full(len(x), float(p["c"]))
    if kind == "ridge":
        xs = (x - np.asarray(p["mean"])) / np.asarray(p["scale"])
        return np.asarray(xs @ np.asarray(p["coef"]) + float(p["intercept"]))
    if kind == "stumps":
        out = np.full(len(x), float(p["base"]))
        for j, thr, lo, hi in p["stumps"]:
            out += np.where(x[:, int(j)] <= thr, lo, hi)
        return out
    raise LearnedModelError(f"unknown regressor kind {kind!r}")


def _fit_ridge(x: np.ndarray, y: np.ndarray, lam: float) -> dict[str, Any]:
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-9, scale, 1.0)
    xs = (x - mean) / scale
    yc = y - y.mean()
    a = xs.T @ xs + lam * np.eye(x.shape[1])
    coef = np.linalg.solve(a, xs.T @ yc)
    return {
        "kind": "ridge",
        "lambda": lam,
        "mean": mean.tolist(),
        "scale": scale.tolist(),
        "coef": coef.tolist(),
        "intercept": float(y.mean()),
    }


def _fit_stumps(x: np.ndarray, y: np.ndarray, rounds: int = 120, lr: float = 0.1) -> dict[str, Any]:
    base = float(y.mean())
    r = y - base
    cands: list[tuple[int, float]] = []
    for j in range(x.shape[1]):
        qs = np.unique(np.quantile(x[:, j], np.linspace(0.1, 0.9, 9)))
        cands.extend((j, float(q)) for q in qs)
    masks = np.stack([x[:, j] <= q for j, q in cands]) if cands else np.zeros((0, len(y)), bool)
    stumps = []
    for _ in range(rounds):
        nl = masks.sum(axis=1)
        nr = len(y) - nl
        ok = (nl >= 2) & (nr >= 2)
        if not ok.any():
            break
        sl = masks @ r
        sr = r.sum() - sl
        gain = np.where(ok, sl**2 / np.maximum(nl, 1) + sr**2 / np.maximum(nr, 1), -1.0)
        b = int(np.argmax(gain))
        lo, hi = lr * sl[b] / nl[b], lr * sr[b] / nr[b]
        r = r - np.where(masks[b], lo, hi)
        j, q = cands[b]
        stumps.append([j, q, float(lo), float(hi)])
    return {"kind": "stumps", "base": base, "lr": lr, "stumps": stumps}


_CANDIDATES: tuple[tuple[str, Any], ...] = (
    ("analytical", lambda x, y, b: {"kind": "analytical"}),
    ("constant", lambda x, y, b: {"kind": "constant", "c": float(y.mean())}),
    ("affine", _fit_affine),
    ("ridge_1", lambda x, y, b: _fit_ridge(x, y, 1.0)),
    ("ridge_10", lambda x, y, b: _fit_ridge(x, y, 10.0)),
    ("ridge_100", lambda x, y, b: _fit_ridge(x, y, 100.0)),
    ("stumps", lambda x, y, b: _fit_stumps(x, y)),
)


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
            )
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
        self, cm: CostModel, plan: ShardingPlan, specs: Sequence[TableSpec]
    ) -> dict[str, float]:
        """Predicted ms per step of every target (analytical x exp(correction))."""
        x, base = plan_features(cm, plan, specs)
        xa = np.asarray([x])
        return {
            t: base[t] * math.exp(float(_predict(self.targets[t], xa, np.asarray([base[t]]))[0]))
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
        """Regressor kept for ``target`` (``ridge``, ``stumps``, ``constant``, ``analytical``)."""
        return str(self.targets[target]["kind"])

    def describe(self) -> str:
        """One line: regressor, samples, machine and validation error of the step target."""
        v = self.validation["step"]
        return (
            f"learned ({self.kind()} correction of the analytical model, {self.samples} "
            f"placements of {self.mixes} table mixes, {self.world_size} ranks) fitted on "
            f"{machine_label(self.machine)}; held-out mean |error| "
            f"{100 * float(v['mean_abs_error']):.1f}%, max {100 * float(v['max_abs_error']):.1f}%"
        )


_KINDS = ("analytical", "constant", "affine", "ridge", "stumps")


def _check_params(p: Any, at: str) -> None:
    if not isinstance(p, dict) or p.get("kind") not in _KINDS:
        raise LearnedModelError(f"{at}: not a regressor (kind {'|'.join(_KINDS)})")
    k = len(FEATURES)
    try:
        if p["kind"] == "affine":
            c = np.asarray(p["coef"], dtype=float)
            if c.shape != (_AFFINE_COLS,) or not np.isfinite(c).all():
                raise ValueError("coef")
        if p["kind"] == "constant" and not math.isfinite(float(p["c"])):
            raise ValueError("c")
        if p["kind"] == "ridge":
            arrs = [np.asarray(p[n], dtype=float) for n in ("mean", "scale", "coef")]
            if any(a.shape != (k,) or not np.isfinite(a).all() for a in arrs):
                raise ValueError("mean/scale/coef")
            if (arrs[1] == 0).any() or not math.isfinite(float(p["intercept"])):
                raise ValueError("scale/intercept")
        if p["kind"] == "stumps":
            float(p["base"])
            for s in p["stumps"]:
                j, thr, lo, hi = s
                if not 0 <= int(j) < k or not all(math.isfinite(float(v)) for v in (thr, lo, hi)):
                    raise ValueError("stump")
    except (KeyError, TypeError, ValueError) as e:
        raise LearnedModelError(
            f"{at}: bad or missing field {e} of a {p['kind']} regressor; refit with "
            "neorec plan --calibrate"
        ) from None


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
