"""Tower partitioner (DMT): split embedding TABLES into towers, balanced by the cost model.

Pure Python + NumPy, like the planner. A partition is data: ``list[list[str]]`` of table names,
each tower's tables in the given table order, towers ordered by their first table.

Cost of a table: the cost model's predicted step time of the whole table as one table-wise shard
in device memory on a one-rank topology (``table_cost``: lookups, outputs and the fused update; no
communication, which is the same per pooled output for every table of one dim). A tower's cost is
the sum of its tables' costs.

Balance bound, guaranteed by every method: every tower is non-empty and

    max tower cost <= cap = max(balance * total / count, lpt_max)

where ``lpt_max`` is the largest tower cost of the LPT partition (largest table first, onto the
least loaded tower). So the bound is ``balance`` x the mean whenever LPT meets it (always when no
table is large next to the mean); when one table alone is too large, the bound is what LPT reaches.

Methods:
- ``balanced``: LPT on cost only.
- ``random``: seeded random assignment under the cap (the first ``count`` tables of a seeded
  permutation open the towers, each next table goes to a uniformly chosen tower it fits in); up
  to 100 seeded attempts, then LPT (only reachable with very uneven costs).
- ``learned``: maximize the total within-tower affinity (``affinity[i, j]`` between tables i, j,
  e.g. measured interaction strength) under the cap: greedy average-linkage agglomeration (merges
  that fit the cap) and LPT as starting points, each improved by best-improvement moves and swaps
  that keep the cap; the better one wins. Deterministic (the seed is not used).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from neorec.errors import ConfigError
from neorec.sharding.cost_model import CostModel
from neorec.sharding.tables import TableSpec
from neorec.sharding.topology import Topology
from neorec.sharding.types import ShardingType

__all__ = [
    "METHODS",
    "table_cost",
    "partition_tables",
    "balance_cap",
    "lpt",
    "tower_loads",
    "within_affinity",
]

METHODS = ("balanced", "random", "learned")
_RANDOM_ATTEMPTS = 100
_AGGLOMERATE_MAX = 300
"""Tables up to which the agglomerative start is tried (it is cubic in the table count)."""
_SWAP_MAX = 1000
"""Tables up to which swaps are searched (an n x n gain matrix per step); moves always are."""


def table_cost(
    table: TableSpec,
    batch_size: int = 512,
    topology: Topology | None = None,
    optimizer: str = "rowwise_adagrad",
) -> float:
    """Predicted seconds per step of ``table`` as one table-wise shard in device memory (the cost
    model's ``shard_cost``; default topology: one rank)."""
    cm = CostModel(topology or Topology(world_size=1), batch_size, optimizer)
    return cm.shard_cost(table, ShardingType.TABLE_WISE, table.rows, table.dim, "device").time_s


def _names_costs(
    tables: Sequence[TableSpec | tuple[str, float]], batch_size: int
) -> tuple[list[str], np.ndarray]:
    names: list[str] = []
    costs: list[float] = []
    for i, t in enumerate(tables):
        if isinstance(t, TableSpec):
            names.append(t.name)
            costs.append(table_cost(t, batch_size))
        elif isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str):
            c = float(t[1])
            if not (np.isfinite(c) and c >= 0):
                raise ConfigError(f"towers: table '{t[0]}' has cost {t[1]!r}, need a number >= 0")
            names.append(t[0])
            costs.append(c)
        else:
            raise ConfigError(f"towers: tables[{i}] must be a TableSpec or (name, cost), got {t!r}")
    if len(set(names)) != len(names):
        raise ConfigError(
            f"towers: table names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}"
        )
    return names, np.asarray(costs, dtype=np.float64)


def lpt(costs: np.ndarray, count: int) -> np.ndarray:
    """Tower of each table by LPT: largest cost first (ties: table order) onto the least loaded
    tower (ties: lowest index). With ``count <= len(costs)`` every tower gets a table."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = np.zeros(count)
    sizes = np.zeros(count, dtype=np.int64)
    out = np.zeros(len(costs), dtype=np.int64)
    for i in order:
        # an empty tower first, so every tower is opened even when costs are 0
        t = int(np.argmin(sizes)) if sizes.min() == 0 else int(np.argmin(loads))
        out[i] = t
        loads[t] += costs[i]
        sizes[t] += 1
    return out


def tower_loads(assign: np.ndarray, costs: np.ndarray, count: int) -> np.ndarray:
    """Cost of each tower."""
    return np.bincount(assign, weights=costs, minlength=count)


def balance_cap(costs: np.ndarray, count: int, balance: float) -> float:
    """The guaranteed bound on a tower's cost: max(balance * mean tower cost, LPT's max)."""
    lpt_max = float(tower_loads(lpt(costs, count), costs, count).max())
    return max(balance * float(costs.sum()) / count, lpt_max)


def within_affinity(groups: Sequence[Sequence[str]], names: Sequence[str], affinity: Any) -> float:
    """Sum of ``affinity[i, j]`` over unordered pairs of tables in the same tower."""
    a = np.asarray(affinity, dtype=np.float64)
    idx = {n: i for i, n in enumerate(names)}
    total = 0.0
    for g in groups:
        ii = [idx[n] for n in g]
        sub = a[np.ix_(ii, ii)]
        total += (float(sub.sum()) - float(np.trace(sub))) / 2
    return total


def partition_tables(
    tables: Sequence[TableSpec | tuple[str, float]],
    count: int,
    method: str = "balanced",
    seed: int = 0,
    affinity: Any = None,
    balance: float = 1.25,
    batch_size: int = 512,
) -> list[list[str]]:
    """Split ``tables`` (``TableSpec``, costed by ``table_cost``, or ``(name, cost)``) into
    ``count`` non-empty towers by ``method`` (``balanced`` / ``random`` / ``learned``, the latter
    with ``affinity``: a symmetric [n, n] array over ``tables`` in order, larger = more
    interaction).
    Every tower's cost is at most ``balance_cap``. Deterministic for a seed."""
    names, costs = _names_costs(tables, batch_size)
    n = len(names)
    if method not in METHODS:
        raise ConfigError(f"towers: partitioner must be one of {METHODS}, got {method!r}")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= max(n, 1):
        raise ConfigError(
            f"towers: count must be an integer in [1, {n}] (the number of tables), got {count!r}"
        )
    if not (isinstance(balance, (int, float)) and np.isfinite(balance) and balance >= 1):
        raise ConfigError(f"towers: balance must be a number >= 1, got {balance!r}")
    cap = balance_cap(costs, count, float(balance))
    if method == "balanced":
        assign = lpt(costs, count)
    elif method == "random":
        assign = _random(costs, count, cap, seed)
    else:
        aff = _check_affinity(affinity, n)
        assign = _learned(costs, count, cap, aff)
    return _groups(assign, names, count)


def _groups(assign: np.ndarray, names: Sequence[str], count: int) -> list[list[str]]:
    groups: list[list[str]] = [[] for _ in range(count)]
    for i, t in enumerate(assign):
        groups[int(t)].append(names[i])
    return sorted(groups, key=lambda g: names.index(g[0]))


def _check_affinity(affinity: Any, n: int) -> np.ndarray:
    if affinity is None:
        raise ConfigError("towers: the learned partitioner needs an affinity matrix (measured)")
    a = np.asarray(affinity, dtype=np.float64)
    if a.shape != (n, n) or not np.isfinite(a).all():
        raise ConfigError(
            f"towers: affinity must be a finite [{n}, {n}] matrix over the tables, got shape "
            f"{list(a.shape)}"
        )
    a = (a + a.T) / 2
    np.fill_diagonal(a, 0.0)
    return a


def _random(costs: np.ndarray, count: int, cap: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = len(costs)
    for _ in range(_RANDOM_ATTEMPTS):
        perm = rng.permutation(n)
        assign = np.zeros(n, dtype=np.int64)
        loads = np.zeros(count)
        ok = True
        for k, i in enumerate(perm):
            if k < count:
                t = k
            else:
                fits = np.flatnonzero(loads + costs[i] <= cap * (1 + 1e-12))
                if len(fits) == 0:
                    ok = False
                    break
                t = int(fits[rng.integers(len(fits))])
            assign[i] = t
            loads[t] += costs[i]
        if ok:
            return assign
    return lpt(costs, count)


def _agglomerate(costs: np.ndarray, count: int, cap: float, aff: np.ndarray) -> np.ndarray | None:
    """Average-linkage merges that fit the cap, down to ``count`` clusters (None when stuck).
    Ties go to the lowest (x, y) pair: deterministic."""
    n = len(costs)
    label = np.arange(n)
    load = costs.astype(np.float64).copy()
    size = np.ones(n)
    link = aff.copy()  # summed affinity between clusters
    alive = np.ones(n, dtype=bool)
    tol = cap * (1 + 1e-12)
    for _ in range(n - count):
        both = alive[:, None] & alive[None, :]
        fits = load[:, None] + load[None, :] <= tol
        score = np.where(
            both & fits & np.triu(np.ones((n, n), dtype=bool), 1),
            link / (size[:, None] * size[None, :]),
            -np.inf,
        )
        x, y = np.unravel_index(int(np.argmax(score)), score.shape)
        if score[x, y] == -np.inf:
            return None
        label[label == y] = x
        load[x] += load[y]
        size[x] += size[y]
        link[x, :] += link[y, :]
        link[:, x] += link[:, y]
        link[x, x] = 0.0
        alive[y] = False
    roots = np.flatnonzero(alive)
    return np.searchsorted(roots, label).astype(np.int64)


def _improve(
    assign: np.ndarray, costs: np.ndarray, count: int, cap: float, aff: np.ndarray
) -> np.ndarray:
    """Best-improvement moves and swaps under the cap (no tower emptied) until none improves."""
    n = len(costs)
    assign = assign.copy()
    tol = cap * (1 + 1e-12)
    eps = 1e-12 * max(1.0, float(np.abs(aff).sum()))
    for _ in range(50 * n + 100):
        onehot = np.zeros((n, count))
        onehot[np.arange(n), assign] = 1.0
        a_t = aff @ onehot  # [n, count] affinity of each table to each tower
        loads = onehot.T @ costs
        sizes = onehot.sum(0)
        own = a_t[np.arange(n), assign]
        gain = a_t - own[:, None]  # move i to tower t
        ok = (loads[None, :] + costs[:, None] <= tol) & (sizes[assign] > 1)[:, None]
        ok[np.arange(n), assign] = False
        move = np.where(ok, gain, -np.inf)
        i, t = np.unravel_index(int(np.argmax(move)), move.shape)
        if move[i, t] > eps:  # moves first (cheap); swaps only when no move improves
            assign[i] = t
            continue
        if n > _SWAP_MAX:
            break
        ga = gain[:, assign]  # [i, j]: gain of moving i to j's tower
        sw = ga + ga.T - 2 * aff
        li = loads[assign]
        fit = (li[:, None] - costs[:, None] + costs[None, :] <= tol) & (
            li[None, :] - costs[None, :] + costs[:, None] <= tol
        )
        sw = np.where(fit & (assign[:, None] != assign[None, :]), sw, -np.inf)
        si, sj = np.unravel_index(int(np.argmax(sw)), sw.shape)
        if sw[si, sj] <= eps:
            break
        assign[si], assign[sj] = assign[sj], assign[si]
    return assign


def _objective(assign: np.ndarray, aff: np.ndarray) -> float:
    same = assign[:, None] == assign[None, :]
    return float((aff * same).sum()) / 2


def _learned(costs: np.ndarray, count: int, cap: float, aff: np.ndarray) -> np.ndarray:
    starts = []
    if len(costs) <= _AGGLOMERATE_MAX:
        agg = _agglomerate(costs, count, cap, aff)
        if agg is not None:
            starts.append(agg)
    starts.append(lpt(costs, count))
    results = [_improve(s, costs, count, cap, aff) for s in starts]
    objs = [_objective(a, aff) for a in results]
    tol = 1e-12 * max(1.0, max(abs(o) for o in objs))
    best = 0
    for k in range(1, len(objs)):
        if objs[k] > objs[best] + tol:
            best = k
    return results[best]
