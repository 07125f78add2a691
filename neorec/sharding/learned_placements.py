"""The designed set of placements the learned cost model is fitted and validated on, the
calibration samples (files) and the fit itself.

Random table mixes (2-8 tables: rows, dims, pooling, one Zipf skew, batch, optimizer) and random
valid placements of them (a sharding type per table, random ranks and shard geometry), as jobs
``neorec.bench.dist.run_jobs`` measures; a seed picks the mixes, so other seeds are held out
(``neorec bench costcheck --random-plans``). ``fit`` scores every candidate regressor of
``neorec.sharding.learned_cost`` by grouped cross-validation (folds hold out whole table mixes)
and keeps the best per target. Split out of ``neorec.sharding.learned_cost``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.learned_cost import (
    _CANDIDATES,
    _EPS_MS,
    TARGETS,
    LearnedCostModel,
    LearnedModelError,
    _predict,
    machine_description,
    plan_features,
    specs_dicts,
)
from neorec.sharding.tables import OPTIMIZERS
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingPlan

__all__ = [
    "random_mix",
    "random_placement",
    "random_jobs",
    "sample_from_job",
    "predict_job",
    "fit",
    "samples_path",
    "save_samples",
    "refit_topology",
]


# ---- the designed set of placements -----------------------------------------------------------
def random_mix(rng: Any, mix: str) -> tuple[list[TableSpec], int, str]:
    """A random table mix (2-8 tables: rows 1e3..1e5 log-uniform, dims 8..64, pooling 1..30,
    one Zipf skew), a global batch and a fused optimizer, from ``rng`` (``random.Random``)."""
    n = rng.randint(2, 8)
    alpha = rng.choice((0.0, 0.8, 1.05, 1.2))
    tables = [
        TableSpec(
            name=f"{mix}_t{i}",
            rows=int(10 ** rng.uniform(3.0, 5.0)),
            dim=rng.choice((8, 16, 32, 64)),
            pooling_factor=float(max(1, round(math.exp(rng.uniform(0.0, math.log(30.0)))))),
            zipf_alpha=alpha,
        )
        for i in range(n)
    ]
    batch = rng.choice((512, 1024, 1024, 2048))
    opt = rng.choices(OPTIMIZERS, (0.1, 0.8, 0.1))[0]
    return tables, batch, opt


def random_placement(rng: Any, tables: Sequence[TableSpec], world: int, rph: int) -> ShardingPlan:
    """A random valid placement of ``tables``: a sharding type per table and random ranks."""
    from neorec.sharding.types import (
        column_wise,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )

    ranks = list(range(world))
    out = []
    for t in tables:
        kinds = ["tw", "tw", "dp"] + (["rw", "cw"] if world > 1 else []) + (["twrw"] * (rph > 1))
        k = rng.choice(kinds)
        if k == "dp":
            out.append(data_parallel(t, world))
        elif k == "tw":
            out.append(table_wise(t, rng.randrange(world)))
        elif k == "rw":
            m = rng.randint(2, world)
            out.append(row_wise(t, sorted(rng.sample(ranks, m))))
        elif k == "cw":
            n = rng.choice([s for s in (2, 4) if s <= t.dim // 4] or [2])
            start = rng.randrange(world)
            out.append(column_wise(t, [ranks[(start + i) % world] for i in range(world)], n))
        else:
            out.append(table_row_wise(t, rng.randrange(world // rph), rph))
    plan = ShardingPlan(world, rph, out, {"source": "neorec.sharding.learned_cost random"})
    plan.validate()
    return plan


def random_jobs(
    n_mixes: int, world: int, rph: int, seed: int = 0, per_mix: int = 2
) -> list[dict[str, Any]]:
    """``n_mixes`` random table mixes x ``per_mix`` random placements each, as measurable jobs
    (``neorec.bench.dist.run_jobs``): tables, batch, optimizer, alpha, plan and the mix label.
    Different seeds give other mixes (``neorec bench costcheck --random-plans`` holds them out)."""
    import random

    rng = random.Random(seed)
    jobs = []
    for m in range(n_mixes):
        mix = f"s{seed}m{m}"
        tables, batch, opt = random_mix(rng, mix)
        for _ in range(per_mix):
            plan = random_placement(rng, tables, world, rph)
            jobs.append(
                {
                    "mix": mix,
                    "tables": specs_dicts(tables),
                    "batch": batch,
                    "optimizer": opt,
                    "alpha": tables[0].zipf_alpha,
                    "plan": plan.to_dict(),
                }
            )
    return jobs


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
    topo: Topology, job: dict[str, Any], model: LearnedCostModel | None
) -> dict[str, float]:
    """Predicted ms per target of a job (learned when ``model``, else analytical)."""
    specs = [TableSpec(**t) for t in job["tables"]]
    plan = ShardingPlan.from_dict(job["plan"])
    cm = CostModel(
        topo.with_world(plan.world_size, plan.ranks_per_host), int(job["batch"]), job["optimizer"]
    )
    if model is not None:
        return model.predict_ms(cm, plan, specs)
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
            plan = ShardingPlan.from_dict(s["plan"])
            cm = CostModel(
                topo.with_world(plan.world_size, plan.ranks_per_host), int(s["batch"]),
                str(s["optimizer"]),
            )  # fmt: skip
            x, b = plan_features(cm, plan, specs)
            m = {t: float(s["measured"][t]) for t in TARGETS}
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
    """Fit the learned model on measured ``samples`` (see ``neorec.bench.calibrate``).

    Each sample: ``tables`` (TableSpec fields), ``batch``, ``optimizer``, ``plan`` (plan dict),
    ``measured`` (ms per target) and ``mix`` (its table mix: the cross-validation group).
    """
    if not samples:
        raise LearnedModelError("no calibration samples to fit; raise --budget-s")
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
                "max_abs_error": round(float(errs.max()), 4),
            }
        # Lowest held-out mean |error|, a quarter of the max added (ties: the simpler model).
        order = [n for n, _ in _CANDIDATES]
        best = min(
            scores,
            key=lambda n: (
                scores[n]["mean_abs_error"] + 0.25 * scores[n]["max_abs_error"],
                order.index(n),
            ),
        )
        targets[t] = dict(_CANDIDATES)[best](x, y, base[t])
        validation[t] = {**scores[best], "kept": best, "folds": k, "candidates": scores}
    return LearnedCostModel(
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
