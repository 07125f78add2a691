"""Calibration samples of the learned cost model and its fit: measured placements in, a
``LearnedCostModel`` out (and the sample files beside a topology file).

A sample is a measured placement of the designed set (``neorec.sharding.learned_placements``): its
job and the median of its measurements, divided by the machine's speed at the moment (its block's
speed references against their median). ``fit`` scores every candidate regressor of
``neorec.sharding.learned_features`` by grouped cross-validation (folds hold out whole table
mixes) and keeps the best per target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.learned_cost import (
    TARGETS,
    LearnedCostModel,
    LearnedModelError,
    machine_description,
)
from neorec.sharding.learned_features import CANDIDATES as _CANDIDATES
from neorec.sharding.learned_features import EPS_MS as _EPS_MS
from neorec.sharding.learned_features import plan_features
from neorec.sharding.learned_features import predict as _predict
from neorec.sharding.learned_placements import REFERENCE_KINDS, reference_ms, speed_of
from neorec.sharding.plan_json import parse_plan_dict
from neorec.sharding.topology import Topology

__all__ = [
    "samples_from_rows",
    "sample_from_job",
    "predict_job",
    "fit",
    "samples_path",
    "save_samples",
    "refit_topology",
]


# ---- samples ----------------------------------------------------------------------------------
def samples_from_rows(jobs: Sequence[dict[str, Any]], rows: Sequence[dict]) -> list[dict]:
    """One sample per measured placement (``run_jobs`` rows of ``jobs``): its job and the median
    of its measurements per target, with their count (``repeats``) and spread (``step_range``);
    with reference placements in its block, its ``speed`` (``speed_of`` the block's references
    against their median over all blocks, ``reference_ms``). The references are no samples."""
    import statistics

    by: dict[str, list[dict]] = {}
    order: list[str] = []
    refs = reference_ms(jobs, rows)
    ref_median = {
        k: statistics.median(d[k] for d in refs.values() if k in d)
        for k in REFERENCE_KINDS
        if any(k in d for d in refs.values())
    }
    for r in rows:
        if jobs[r["job"]].get("design") == "reference":
            continue
        pid = str(jobs[r["job"]].get("placement", r["job"]))
        if pid not in by:
            by[pid] = []
            order.append(pid)
        by[pid].append(r)
    out = []
    for pid in order:
        rs = by[pid]
        job = jobs[rs[0]["job"]]
        med = {
            k: statistics.median(float(r[k]) for r in rs)
            for k in ("ms_per_step", "fwd_ms", "bwd_ms", "comm_wait_ms")
        }
        s = sample_from_job(job, med)
        steps = [float(r["ms_per_step"]) for r in rs]
        s.update(repeats=len(rs), step_range=[min(steps), max(steps)])
        block = str(job.get("block", ""))
        if block in refs and ref_median:
            # This block's references against the calibration's median: the sample's speed.
            s.update(speed=speed_of(refs[block], ref_median), reference_ms=ref_median)
        out.append(s)
    return out


def sample_from_job(job: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """A calibration sample: the job and its measured ms per target (``run_jobs`` row)."""
    measured = {
        "step": row["ms_per_step"],
        "fwd": row["fwd_ms"],
        "bwd": row["bwd_ms"],
        "comm": row["comm_wait_ms"],
    }
    return {**job, "measured": measured}


def predict_job(
    topo: Topology, job: dict[str, Any], model: LearnedCostModel | None, speed: float = 1.0
) -> dict[str, float]:
    """Predicted ms per target of a job (learned when ``model``, at the machine's ``speed`` (see
    ``reference_jobs``), else analytical)."""
    specs = [TableSpec(**t) for t in job["tables"]]
    plan = parse_plan_dict(job["plan"])
    cm = CostModel(
        topo.with_world(plan.world_size, plan.ranks_per_host), int(job["batch"]), job["optimizer"]
    )
    if model is not None:
        return model.predict_ms(cm, plan, specs, speed)
    return plan_features(cm, plan, specs)[1]


# ---- fitting ----------------------------------------------------------------------------------
def _sample_arrays(
    topo: Topology, samples: Sequence[dict[str, Any]]
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """Features, analytical ms and measured ms per target, and the group (table mix) of each."""
    xs, groups = [], []
    base: dict[str, list[float]] = {t: [] for t in TARGETS}
    meas: dict[str, list[float]] = {t: [] for t in TARGETS}
    for i, s in enumerate(samples):
        try:
            specs = [TableSpec(**t) for t in s["tables"]]
            plan = parse_plan_dict(s["plan"])
            cm = CostModel(
                topo.with_world(plan.world_size, plan.ranks_per_host), int(s["batch"]),
                str(s["optimizer"]),
            )  # fmt: skip
            x, b = plan_features(cm, plan, specs)
            speed = float(s.get("speed", 1.0))  # times at the calibration's median speed
            m = {t: float(s["measured"][t]) / speed for t in TARGETS}
        except (KeyError, TypeError, ValueError) as e:
            raise LearnedModelError(f"calibration sample {i}: bad or missing field {e}") from None
        xs.append(x)
        groups.append(str(s.get("mix", i)))
        for t in TARGETS:
            base[t].append(b[t])
            meas[t].append(m[t])
    return (
        np.asarray(xs, dtype=float),
        {t: np.asarray(v) for t, v in base.items()},
        {t: np.asarray(v) for t, v in meas.items()},
        groups,
    )


def _log_ratio(meas: np.ndarray, base: np.ndarray) -> np.ndarray:
    return np.log((meas + _EPS_MS) / (base + _EPS_MS))


def _rel_err(corr: np.ndarray, meas: np.ndarray, base: np.ndarray) -> np.ndarray:
    pred = (base + _EPS_MS) * np.exp(corr) - _EPS_MS
    return np.abs(pred - meas) / np.maximum(meas, _EPS_MS)


def fit(
    topo: Topology, samples: Sequence[dict[str, Any]], folds: int = 5, extra: dict | None = None
) -> LearnedCostModel:
    """Fit the learned model on measured ``samples`` (see ``neorec.measure.calibrate``).

    Each sample: ``tables`` (TableSpec fields), ``batch``, ``optimizer``, ``plan`` (plan dict),
    ``measured`` (ms per target) and ``mix`` (its table mix: the cross-validation group);
    optional ``speed`` and ``reference_ms`` (``samples_from_rows``): when samples have them, the
    model is fitted on measured / speed (samples without a speed are left out, counted in
    ``extra``) and keeps the references' ms (``reference``), so a check that measures the
    references predicts at its own speed.
    """
    if not samples:
        raise LearnedModelError("no calibration samples to fit; raise --budget-s")
    anchored = [s for s in samples if "speed" in s]
    dropped = len(samples) - len(anchored) if anchored else 0
    if dropped:  # a block whose references were not measured: its speed is unknown
        samples = anchored
        extra = {**(extra or {}), "dropped_without_speed": dropped}
    x, base, meas, groups = _sample_arrays(topo, samples)
    mixes = sorted(set(groups))
    if len(mixes) < 2:
        raise LearnedModelError(
            f"{len(samples)} calibration sample(s) of {len(mixes)} table mix: held-out validation "
            "needs at least 2 mixes; raise --budget-s"
        )
    k = min(folds, len(mixes))
    fold_of = {g: i % k for i, g in enumerate(mixes)}
    fold = np.asarray([fold_of[g] for g in groups])
    worlds = {int(s["plan"]["world_size"]) for s in samples}
    rphs = {int(s["plan"].get("ranks_per_host") or s["plan"]["world_size"]) for s in samples}
    targets, validation = {}, {}
    for t in TARGETS:
        y = _log_ratio(meas[t], base[t])
        scores = {}
        for name, fn in _CANDIDATES:
            errs = np.zeros(len(y))
            for f in range(k):
                tr, te = fold != f, fold == f
                p = fn(x[tr], y[tr], base[t][tr])
                errs[te] = _rel_err(_predict(p, x[te], base[t][te]), meas[t][te], base[t][te])
            scores[name] = {
                "mean_abs_error": round(float(errs.mean()), 4),
                "p95_abs_error": round(float(np.percentile(errs, 95)), 4),
                "max_abs_error": round(float(errs.max()), 4),
            }
        # Lowest held-out mean |error| + half its 95th percentile: the check's targets (mean 10%,
        # max 20% over ~17 plans, whose max is about a 95th percentile) weighed alike; the max of
        # hundreds of samples is one sample, as much its measurement's noise as the model's
        # (ties: the simpler model).
        order = [n for n, _ in _CANDIDATES]
        best = min(
            scores,
            key=lambda n: (
                scores[n]["mean_abs_error"] + 0.5 * scores[n]["p95_abs_error"],
                order.index(n),
            ),
        )
        targets[t] = dict(_CANDIDATES)[best](x, y, base[t])
        validation[t] = {**scores[best], "kept": best, "folds": k, "candidates": scores}
    reference: dict[str, Any] = {}
    if all("speed" in s for s in samples):  # fitted at the references' median speed
        reference = {"ms": dict(samples[0]["reference_ms"]), "world_size": max(worlds)}
    return LearnedCostModel(
        reference=reference,
        targets=targets,
        validation=validation,
        machine=machine_description(),
        world_size=max(worlds),
        ranks_per_host=max(rphs),
        samples=len(samples),
        mixes=len(mixes),
        fitted_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        extra=dict(extra or {}),
    )


# ---- sample files -----------------------------------------------------------------------------
def samples_path(topology_path: str) -> str:
    """Where the calibration samples of a topology file go: ``<stem>.samples.json`` beside it."""
    p = Path(topology_path)
    return str(p.with_name(p.stem + ".samples.json"))


def save_samples(path: str, samples: list[dict[str, Any]]) -> None:
    """Write calibration samples with this machine's description (JSON)."""
    Path(path).write_text(
        json.dumps({"machine": machine_description(), "samples": samples}, indent=1) + "\n"
    )


def refit_topology(topology_path: str, samples_file: str) -> LearnedCostModel:
    """Fit the learned model of a topology file again on stored samples (no measurement) and
    write it back; ``LearnedModelError`` naming the file when either cannot be used."""
    try:
        topo = Topology.load(topology_path)
        data = json.loads(Path(samples_file).read_text())
        samples = data["samples"] if isinstance(data, dict) else data
        world = int(samples[0]["plan"]["world_size"]) if samples else topo.world_size
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise LearnedModelError(f"--refit {samples_file} / {topology_path}: {e}") from None
    topo.learned_cost = {}
    model = fit(topo.with_world(world, world), samples)
    topo.learned_cost = model.to_dict()
    topo.save(topology_path)
    return model
