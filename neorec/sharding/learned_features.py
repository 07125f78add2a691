"""The learned cost model's features of a plan and its regressors (numpy only, JSON params).

``plan_features`` describes a plan by its ranks (sums, maxes and counts of shards, ids, columns
and row bytes), the analytical model's phase shares, imbalance and step, the tables' pooling,
skew, optimizers and sharding types, and the analytical time split by sharding type: each type's
shards on the critical rank (the rank with the longest own time), each type's sample-side time
(ids out, outputs in, the row-range split of row-split tables) and the collectives' fixed latency.
That split is what the row-wise and column-wise plans were mispredicted by: one factor per kind
of work, not one for the step.

Regressors predict ``log(measured / analytical)`` per target: ``analytical`` (none),
``constant``, ``affine`` (the analytical phases re-weighted plus fixed costs), ``typed`` (the
analytical time per sharding type and per kind of work re-weighted, ridged toward the analytical
weights, plus fixed costs per step, shard, table and collective kind; least squares on relative
error), ``typed_stumps`` / ``typed_trees`` (``typed`` with boosted stumps / depth-2 trees on its
log residual), ``ridge`` and ``stumps`` (gradient-boosted depth-1 trees). Split out of
``neorec.sharding.learned_cost``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.cost_types import PHASES, PlanCost
from neorec.sharding.tables import OPTIMIZERS
from neorec.sharding.types import ShardingPlan, ShardingType

__all__ = ["FEATURES", "plan_features", "CANDIDATES", "predict", "check_params", "EPS_MS"]

EPS_MS = 0.05  # keeps log ratios finite for near-zero comm waits
_TYPES = tuple(ShardingType)
_ROW_SPLIT = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)
_TYPE_GROUPS = (
    (ShardingType.TABLE_WISE,),
    _ROW_SPLIT,
    (ShardingType.COLUMN_WISE,),
    (ShardingType.DATA_PARALLEL,),
)
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
    # The analytical step split by sharding type (shares of the step): the critical rank's own
    # shards, the sample side per type, the collectives' fixed latency, the phase imbalance.
    *(f"crit_{t.value}" for t in _TYPES),
    *(f"side_{t.value}" for t in _TYPES),
    "share_fixed",
    "share_excess",
    "share_mean_local",
    "rowsplit_alpha",
    "rowsplit_ids",
)
_F = {n: i for i, n in enumerate(FEATURES)}


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
    side = dict.fromkeys(_TYPES, 0.0)
    type_of: dict[str, ShardingType] = {}
    n_unf = 0
    rs_alpha, rs_n, rs_ids = 0.0, 0, 0.0
    for tp in plan.tables:
        t = by[tp.name]
        st = tp.sharding_type
        type_of[tp.name] = st
        types[st] += 1
        opts[cm.optimizer_of(t)] += 1
        side[st] += cm.sample_side_s(t, st, len(tp.shards))
        unf = cm.cw_unfused(t, st)
        n_unf += unf
        out_rows = cm.batch / w if st is ShardingType.DATA_PARALLEL else cm.batch
        if st in _ROW_SPLIT:
            rs_alpha += t.zipf_alpha
            rs_n += 1
            rs_ids += cm.batch * t.pooling_factor
        for s in tp.shards:
            r = s.rank
            per["shards"][r] += 1
            per["ids"][r] += out_rows * t.pooling_factor * s.rows / t.rows
            per["cols"][r] += s.cols
            per["row_mb"][r] += s.rows * cm.row_bytes(t, s.cols) / 1e6
            per["unfused"][r] += unf
    crit_rank = max(c.ranks, key=lambda rc: (rc.local_s, -rc.rank))
    crit = dict.fromkeys(_TYPES, 0.0)
    for name, _, secs in crit_rank.shards:
        crit[type_of[name]] += secs
    fixed = c.sample_side_s - sum(side.values())
    excess = c.max_time_s - crit_rank.local_s - c.sample_side_s
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
        "share_fixed": fixed / total,
        "share_excess": max(0.0, excess) / total,
        "share_mean_local": sum(rc.local_s for rc in c.ranks) / w / total,
        "rowsplit_alpha": rs_alpha / rs_n if rs_n else 0.0,
        "rowsplit_ids": math.log1p(rs_ids / 1e4),
    }
    for p, name in enumerate(PHASES):
        f[f"share_{name}"] = pm[p] / total
    for st, k in types.items():
        f[f"frac_{st.value}"] = k / n
        f[f"crit_{st.value}"] = crit[st] / total
        f[f"side_{st.value}"] = side[st] / total
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
def _col(x: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(x[:, _F[name]])


def _affine_design(x: np.ndarray) -> np.ndarray:
    """Columns of the ``affine`` model: the analytical step's phase and sample-side ms, then a
    constant (ms per step), the slowest rank's shards, the tables, and the slowest rank's ids
    (1e5s): fixed costs the analytical model under- or over-counts on this machine."""
    step = np.exp(_col(x, "log_pred_ms"))
    cols = [_col(x, f"share_{p}") * step for p in PHASES]
    cols.append(_col(x, "share_sample_side") * step)
    cols += [
        np.ones(len(x)),
        np.expm1(_col(x, "max_shards")),
        np.exp(_col(x, "log_tables")),
        np.expm1(_col(x, "max_ids")) / 1e5,
    ]
    return np.stack(cols, axis=1)


_AFFINE_COLS = 9


def _typed_design(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns of the ``typed`` model and their prior weights (the analytical model's): per
    kind of sharding (table-wise, row-split: row-wise and table-row-wise run the same code,
    column-wise, data-parallel), its shards' ms on the critical rank and its sample-side ms
    (prior 1); the collectives' fixed latency and the phases' imbalance (prior 1); then fixed
    costs (prior 0): per step, per shard of the slowest rank, per table, per kind of collective
    present (row-split, column-wise, column-wise on the unfused path: row-wise Adagrad's slices
    all-gather their row sums, which Adam's and SGD's do not; data-parallel), per id on the
    busiest rank (1e5s: index work that the analytical bytes do not count), the row-split
    tables' ms times their skew, the critical rank's shard ms times the log of the busiest
    rank's row megabytes (bytes
    move slower once a rank's rows outgrow the caches), and the mean rank's shard ms (ranks on
    one CPU share its memory bandwidth: a rank working alone moves bytes faster than the
    calibrated concurrent bandwidth, so imbalance costs less than the critical rank says)."""
    step = np.exp(_col(x, "log_pred_ms"))
    cols = []
    for part in ("crit", "side"):
        for group in _TYPE_GROUPS:
            cols.append(sum((_col(x, f"{part}_{t.value}") for t in group), np.zeros(len(x))) * step)
    cols += [_col(x, "share_fixed") * step, _col(x, "share_excess") * step]
    prior = [1.0] * len(cols)
    rs = _col(x, "frac_row_wise") + _col(x, "frac_table_row_wise")
    rs_ms = step * sum(_col(x, f"crit_{t.value}") + _col(x, f"side_{t.value}") for t in _ROW_SPLIT)
    cols += [
        np.ones(len(x)),
        np.expm1(_col(x, "max_shards")),
        np.exp(_col(x, "log_tables")),
        (rs > 0).astype(float),
        (_col(x, "frac_column_wise") > 0).astype(float),
        (_col(x, "frac_cw_unfused") > 0).astype(float),
        (_col(x, "frac_data_parallel") > 0).astype(float),
        np.expm1(_col(x, "max_ids")) / 1e5,
        rs_ms * _col(x, "rowsplit_alpha"),
        sum(cols[: len(_TYPE_GROUPS)], np.zeros(len(x))) * (_col(x, "max_row_mb") - 3.0),
        _col(x, "share_mean_local") * step,
    ]
    prior += [0.0] * 11
    return np.stack(cols, axis=1), np.asarray(prior)


_TYPED_COLS = 2 * len(_TYPE_GROUPS) + 2 + 11


def _measured(y: np.ndarray, base: np.ndarray) -> np.ndarray:
    return (base + EPS_MS) * np.exp(y) - EPS_MS


def _fit_affine(x: np.ndarray, y: np.ndarray, base: np.ndarray, lam: float = 1e-3) -> dict:
    """Least squares of the measured ms on ``_affine_design`` columns, weighted by 1 / measured
    (relative errors), lightly ridged toward 0."""
    meas = _measured(y, base)
    w = 1.0 / np.maximum(meas, EPS_MS)
    a = _affine_design(x) * w[:, None]
    coef = np.linalg.solve(a.T @ a + lam * np.eye(a.shape[1]), a.T @ (meas * w))
    return {"kind": "affine", "coef": coef.tolist()}


def _fit_typed(
    x: np.ndarray, y: np.ndarray, base: np.ndarray, lam: float = 0.01, huber: float = 0.1
) -> dict:
    """Least squares of the measured ms on ``_typed_design`` columns in relative error, ridged
    toward the analytical weights in proportion to each column's own scale (a kind of work the
    samples rarely show keeps its analytical weight); robust (Huber weights at ``huber``
    relative error, a few reweighting rounds: a measurement disturbed by load counts less),
    then scaled so the median measured / predicted ratio is 1 (relative least squares alone
    predicts low)."""
    meas = _measured(y, base)
    w = 1.0 / np.maximum(meas, EPS_MS)
    d, prior = _typed_design(x)
    rob = np.ones(len(y))
    coef = prior
    for _ in range(4):
        a = d * (w * np.sqrt(rob))[:, None]
        gram = a.T @ a
        pen = lam * np.diag(np.maximum(np.diag(gram), 1e-6 * len(y)))
        coef = np.linalg.solve(gram + pen, a.T @ (meas * w * np.sqrt(rob)) + pen @ prior)
        rel = np.abs(d @ coef - meas) * w
        rob = np.minimum(1.0, huber / np.maximum(rel, 1e-12))
    pred = np.maximum(d @ coef, 0.02)
    coef = coef * float(np.median(meas / pred))
    return {"kind": "typed", "coef": coef.tolist()}


def _typed_log(p: dict[str, Any], x: np.ndarray, base: np.ndarray) -> np.ndarray:
    ms = np.maximum(_typed_design(x)[0] @ np.asarray(p["coef"]), 0.02)
    return np.asarray(np.log((ms + EPS_MS) / (base + EPS_MS)))


def _fit_typed_stumps(x: np.ndarray, y: np.ndarray, base: np.ndarray) -> dict:
    typed = _fit_typed(x, y, base)
    resid = y - _typed_log(typed, x, base)
    st = _fit_stumps(x, resid, rounds=60)
    return {"kind": "typed_stumps", "coef": typed["coef"], **{k: st[k] for k in ("base", "stumps")}}


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


def _split_candidates(x: np.ndarray) -> tuple[list[tuple[int, float]], np.ndarray]:
    """(feature, threshold) splits at each feature's deciles and their ``x <= thr`` masks."""
    cands: list[tuple[int, float]] = []
    for j in range(x.shape[1]):
        qs = np.unique(np.quantile(x[:, j], np.linspace(0.1, 0.9, 9)))
        cands.extend((j, float(q)) for q in qs)
    masks = np.stack([x[:, j] <= q for j, q in cands]).astype(float)
    return cands, masks


def _fit_stumps(x: np.ndarray, y: np.ndarray, rounds: int = 120, lr: float = 0.1) -> dict[str, Any]:
    base = float(y.mean())
    r = y - base
    cands, masks = _split_candidates(x)
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
        r = r - np.where(masks[b] > 0, lo, hi)
        j, q = cands[b]
        stumps.append([j, q, float(lo), float(hi)])
    return {"kind": "stumps", "base": base, "lr": lr, "stumps": stumps}


def _stumps_log(p: dict[str, Any], x: np.ndarray) -> np.ndarray:
    out = np.full(len(x), float(p["base"]))
    for j, thr, lo, hi in p["stumps"]:
        out += np.where(x[:, int(j)] <= thr, lo, hi)
    return out


def _best_split(
    masks: np.ndarray, r: np.ndarray, rows: np.ndarray, minleaf: int
) -> tuple[float, int, float, float] | None:
    """The split of ``rows`` (bool) that lowers the squared residual ``r`` most: (gain, index,
    left mean, right mean); None when no split leaves ``minleaf`` rows on each side."""
    rr = r * rows
    nl = masks @ rows.astype(float)
    n = float(rows.sum())
    nr = n - nl
    sl = masks @ rr
    sr = rr.sum() - sl
    ok = (nl >= minleaf) & (nr >= minleaf)
    if not ok.any():
        return None
    gain = np.where(ok, sl**2 / np.maximum(nl, 1) + sr**2 / np.maximum(nr, 1), -np.inf)
    b = int(np.argmax(gain))
    return float(gain[b] - rr.sum() ** 2 / max(n, 1.0)), b, sl[b] / nl[b], sr[b] / nr[b]


def _fit_trees(
    x: np.ndarray, y: np.ndarray, rounds: int = 60, lr: float = 0.1, minleaf: int = 8
) -> dict[str, Any]:
    """Gradient-boosted depth-2 trees (greedy: the best split, then the best split of each
    side, ``minleaf`` rows per leaf at least; leaves scaled by ``lr``): unlike stumps they
    model two features together (two small tables *and* column-wise, say)."""
    base = float(y.mean())
    r = y - base
    cands, masks = _split_candidates(x)
    every = np.ones(len(y), bool)
    trees: list[list[Any]] = []
    for _ in range(rounds):
        top = _best_split(masks, r, every, minleaf)
        if top is None:
            break
        left = masks[top[1]] > 0
        sides = []
        for rows in (left, ~left):
            sub = _best_split(masks, r, rows, minleaf)
            if sub is None or sub[0] <= 0:
                v = lr * float(r[rows].mean())
                sides.append([-1, 0.0, v, v])
            else:
                j2, q2 = cands[sub[1]]
                sides.append([j2, q2, lr * sub[2], lr * sub[3]])
        tree = [cands[top[1]][0], cands[top[1]][1], sides]
        r = r - _tree_log(tree, x)
        trees.append(tree)
    return {"kind": "trees", "base": base, "trees": trees}


def _tree_log(t: list[Any], x: np.ndarray) -> np.ndarray:
    j, thr, sides = t
    left = x[:, int(j)] <= float(thr)
    out = np.zeros(len(x))
    for rows, (j2, q2, lo, hi) in zip((left, ~left), sides):
        v = np.full(len(x), float(lo)) if int(j2) < 0 else np.where(x[:, int(j2)] <= q2, lo, hi)
        out = np.where(rows, v, out)
    return out


def _trees_log(p: dict[str, Any], x: np.ndarray) -> np.ndarray:
    out = np.full(len(x), float(p["base"]))
    for t in p["trees"]:
        out += _tree_log(t, x)
    return out


def _fit_typed_trees(x: np.ndarray, y: np.ndarray, base: np.ndarray) -> dict:
    typed = _fit_typed(x, y, base)
    tr = _fit_trees(x, y - _typed_log(typed, x, base))
    return {"kind": "typed_trees", "coef": typed["coef"], "base": tr["base"], "trees": tr["trees"]}


ENSEMBLE = ("typed_stumps", "ridge_10", "stumps")
"""Members of the ``ensemble`` candidate (names in ``CANDIDATES``)."""


def _fit_ensemble(x: np.ndarray, y: np.ndarray, base: np.ndarray) -> dict:
    """The mean log correction of three unlike regressors (``ENSEMBLE``: the analytical time
    re-weighted per type plus stumps, a linear model of the features, boosted stumps): their
    errors on table mixes they have not seen are partly independent, so the mean varies less."""
    fits = dict(CANDIDATES)
    return {"kind": "ensemble", "members": [fits[n](x, y, base) for n in ENSEMBLE]}


def predict(p: dict[str, Any], x: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Log corrections of regressor ``p`` for features ``x`` (``base``: analytical ms)."""
    kind = p["kind"]
    if kind == "ensemble":
        return np.asarray(np.mean([predict(m, x, base) for m in p["members"]], axis=0))
    if kind == "affine":
        ms = np.maximum(_affine_design(x) @ np.asarray(p["coef"]), 0.02)
        return np.asarray(np.log((ms + EPS_MS) / (base + EPS_MS)))
    if kind == "typed":
        return _typed_log(p, x, base)
    if kind == "typed_stumps":
        return _typed_log(p, x, base) + _stumps_log(p, x)
    if kind == "typed_trees":
        return _typed_log(p, x, base) + _trees_log(p, x)
    if kind == "analytical":
        return np.zeros(len(x))
    if kind == "constant":
        return np.full(len(x), float(p["c"]))
    if kind == "ridge":
        xs = (x - np.asarray(p["mean"])) / np.asarray(p["scale"])
        return np.asarray(xs @ np.asarray(p["coef"]) + float(p["intercept"]))
    if kind == "stumps":
        return _stumps_log(p, x)
    raise ValueError(f"unknown regressor kind {kind!r}")


CANDIDATES: tuple[tuple[str, Any], ...] = (
    ("analytical", lambda x, y, b: {"kind": "analytical"}),
    ("constant", lambda x, y, b: {"kind": "constant", "c": float(y.mean())}),
    ("affine", _fit_affine),
    ("typed", lambda x, y, b: _fit_typed(x, y, b, 0.01)),
    ("typed_0.3", lambda x, y, b: _fit_typed(x, y, b, 0.3)),
    ("typed_stumps", _fit_typed_stumps),
    ("typed_trees", _fit_typed_trees),
    ("ridge_1", lambda x, y, b: _fit_ridge(x, y, 1.0)),
    ("ridge_10", lambda x, y, b: _fit_ridge(x, y, 10.0)),
    ("ridge_100", lambda x, y, b: _fit_ridge(x, y, 100.0)),
    ("stumps", lambda x, y, b: _fit_stumps(x, y)),
)
CANDIDATES += (("ensemble", _fit_ensemble),)
"""(name, fit(features, log ratios, analytical ms) -> params), simplest first (ties)."""
KINDS = (
    "analytical",
    "constant",
    "affine",
    "typed",
    "typed_stumps",
    "typed_trees",
    "ridge",
    "stumps",
    "ensemble",
)


def check_params(p: Any, at: str) -> None:
    """``ValueError`` naming ``at`` and the field when ``p`` is not a usable regressor."""
    if not isinstance(p, dict) or p.get("kind") not in KINDS:
        raise ValueError(f"{at}: not a regressor (kind {'|'.join(KINDS)})")
    k = len(FEATURES)
    kind = p["kind"]
    if kind == "ensemble":
        members = p.get("members")
        if not isinstance(members, list) or not members:
            raise ValueError(f"{at}: an ensemble regressor needs a non-empty 'members' list")
        for i, m in enumerate(members):
            if isinstance(m, dict) and m.get("kind") == "ensemble":
                raise ValueError(f"{at}.members[{i}]: an ensemble inside an ensemble")
            check_params(m, f"{at}.members[{i}]")
        return
    try:
        if kind in ("affine", "typed", "typed_stumps", "typed_trees"):
            c = np.asarray(p["coef"], dtype=float)
            want = _AFFINE_COLS if kind == "affine" else _TYPED_COLS
            if c.shape != (want,) or not np.isfinite(c).all():
                raise ValueError("coef")
        if kind == "constant" and not math.isfinite(float(p["c"])):
            raise ValueError("c")
        if kind == "ridge":
            arrs = [np.asarray(p[n], dtype=float) for n in ("mean", "scale", "coef")]
            if any(a.shape != (k,) or not np.isfinite(a).all() for a in arrs):
                raise ValueError("mean/scale/coef")
            if (arrs[1] == 0).any() or not math.isfinite(float(p["intercept"])):
                raise ValueError("scale/intercept")
        if kind in ("stumps", "typed_stumps"):
            float(p["base"])
            for s in p["stumps"]:
                j, thr, lo, hi = s
                if not 0 <= int(j) < k or not all(math.isfinite(float(v)) for v in (thr, lo, hi)):
                    raise ValueError("stump")
        if kind == "typed_trees":
            if not math.isfinite(float(p["base"])):
                raise ValueError("base")
            for t in p["trees"]:
                j, thr, sides = t
                if not 0 <= int(j) < k or not math.isfinite(float(thr)) or len(sides) != 2:
                    raise ValueError("tree")
                for j2, q2, lo, hi in sides:
                    if not -1 <= int(j2) < k or not all(
                        math.isfinite(float(v)) for v in (q2, lo, hi)
                    ):
                        raise ValueError("tree")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{at}: bad or missing field {e} of a {kind} regressor; refit with "
            "neorec plan --calibrate"
        ) from None
