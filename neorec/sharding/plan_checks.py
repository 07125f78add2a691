"""Validation of a sharding plan: every table's shards tile it exactly once, as its type requires.

``validate_plan`` (the tiling), ``check_model`` (the plan is for this model and world) and
``check_storage`` (the runtime executes its tiers): each problem names the table, the shard and
the field, and all of a plan's problems are raised together in one ``PlanValidationError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from neorec.sharding.types import (
    RUNTIME_STORAGES,
    STORAGES,
    PlanValidationError,
    ShardingPlan,
    ShardingType,
    TableLike,
    TablePlan,
)

__all__ = ["validate_plan", "check_model", "check_storage"]


def check_storage(
    plan: ShardingPlan, supported: Sequence[str] = RUNTIME_STORAGES, who: str = ""
) -> None:
    """Raise ``PlanValidationError`` naming every table whose storage is not in ``supported``
    (the distributed runtime executes ``RUNTIME_STORAGES`` only; a cached tier it would ignore
    must not pass silently)."""
    by = f" by {who}" if who else ""
    problems = [
        f"table '{t.name}': storage '{t.storage_label}' is not supported{by} "
        f"(supported: {', '.join(supported)}); plan without cached tiers "
        "(planner.allow_cached_tiers = false) or set the table's storage to "
        f"{' or '.join(supported)}"
        for t in plan.tables
        if t.storage not in supported
    ]
    if problems:
        raise PlanValidationError(problems, plan.source)


def validate_plan(plan: ShardingPlan) -> None:
    """Raise ``PlanValidationError`` unless every table's shards tile it exactly once."""
    problems: list[str] = []
    if plan.world_size <= 0:
        problems.append(f"world_size must be > 0, got {plan.world_size}")
    if plan.ranks_per_host <= 0 or (
        plan.world_size > 0 and plan.world_size % plan.ranks_per_host != 0
    ):
        problems.append(
            f"ranks_per_host must be > 0 and divide world_size {plan.world_size}, "
            f"got {plan.ranks_per_host}"
        )
    if problems:
        raise PlanValidationError(problems, plan.source)
    seen: set[str] = set()
    for t in plan.tables:
        if t.name in seen:
            problems.append(f"table '{t.name}' appears more than once")
        seen.add(t.name)
        problems.extend(_table_problems(plan, t))
    if problems:
        raise PlanValidationError(problems, plan.source)


def check_model(
    plan: ShardingPlan,
    tables: Iterable[TableLike] | None = None,
    world_size: int | None = None,
) -> None:
    """Raise ``PlanValidationError`` unless the plan is for exactly these ``tables`` (names,
    rows, dims) and ``world_size`` ranks: a table the model lacks is refused, not ignored."""
    problems: list[str] = []
    if world_size is not None and plan.world_size != world_size:
        running = f"{world_size} rank" + ("s are" if world_size != 1 else " is")
        problems.append(
            f"the plan is for world_size {plan.world_size}, but {running} running "
            f"(neorec train --nproc {plan.world_size} runs that many)"
        )
    if tables is not None:
        model = {t.name: t for t in tables}
        planned = {t.name: t for t in plan.tables}
        extra = [n for n in planned if n not in model]
        if extra:
            problems.append(
                f"table(s) {extra} are in the plan but not in the model "
                f"(model tables: {sorted(model)})"
            )
        missing = [n for n in model if n not in planned]
        if missing:
            problems.append(f"table(s) {missing} of the model have no entry in the plan")
        for name, t in planned.items():
            m = model.get(name)
            if m is not None and (t.rows, t.dim) != (m.rows, m.dim):
                problems.append(
                    f"table '{name}': the plan has {t.rows} rows x {t.dim} dims, "
                    f"the model {m.rows} x {m.dim}"
                )
    if problems:
        raise PlanValidationError(problems, plan.source)


def _table_problems(plan: ShardingPlan, t: TablePlan) -> list[str]:
    where = f"table '{t.name}' ({t.sharding_type.value})"
    if t.rows <= 0 or t.dim <= 0:
        return [f"{where}: rows and dim must be > 0, got rows={t.rows}, dim={t.dim}"]
    out: list[str] = []
    if t.storage not in STORAGES:
        out.append(f"{where}: storage must be one of {STORAGES}, got '{t.storage}'")
    elif t.cached:
        if not 0.0 < t.cache_fraction <= 1.0:
            out.append(
                f"{where}: storage '{t.storage}' needs cache_fraction in (0, 1], "
                f"got {t.cache_fraction}"
            )
        if t.sharding_type in (ShardingType.DATA_PARALLEL, ShardingType.COLUMN_WISE):
            out.append(
                f"{where}: cached storage '{t.storage}' is for table-wise and row-split "
                "tables (TW, RW, TWRW)"
            )
    elif t.cache_fraction:
        out.append(
            f"{where}: cache_fraction {t.cache_fraction} is only for storage dram or ssd, "
            f"got storage '{t.storage}'"
        )
    if not t.shards:
        return out + [f"{where}: has no shards"]
    for i, s in enumerate(t.shards):
        sw = f"{where} shard {i} {s}"
        if not 0 <= s.rank < plan.world_size:
            out.append(f"{sw}: rank {s.rank} does not exist (world_size {plan.world_size})")
        if not (0 <= s.row_start < s.row_end <= t.rows):
            out.append(f"{sw}: rows must satisfy 0 <= start < end <= {t.rows}")
        if not (0 <= s.col_start < s.col_end <= t.dim):
            out.append(f"{sw}: cols must satisfy 0 <= start < end <= {t.dim}")
    if out:
        return out
    return out + _type_problems(t, where, plan.world_size, plan.ranks_per_host)


def _full_rows(t: TablePlan, where: str) -> list[str]:
    return [
        f"{where} shard {i} {s}: must hold all rows [0, {t.rows})"
        for i, s in enumerate(t.shards)
        if (s.row_start, s.row_end) != (0, t.rows)
    ]


def _full_cols(t: TablePlan, where: str) -> list[str]:
    return [
        f"{where} shard {i} {s}: must hold all columns [0, {t.dim})"
        for i, s in enumerate(t.shards)
        if (s.col_start, s.col_end) != (0, t.dim)
    ]


def _tiling(ranges: list[tuple[int, int]], total: int, what: str, where: str) -> list[str]:
    """Problems unless half-open ``ranges`` cover ``[0, total)`` exactly once."""
    out = []
    pos = 0
    for a, b in sorted(ranges):
        if a > pos:
            out.append(f"{where}: {what} [{pos}, {a}) are not covered by any shard")
        elif a < pos:
            out.append(f"{where}: {what} [{a}, {min(b, pos)}) are covered more than once")
        pos = max(pos, b)
    if pos < total:
        out.append(f"{where}: {what} [{pos}, {total}) are not covered by any shard")
    return out


def _type_problems(t: TablePlan, where: str, world: int, rph: int) -> list[str]:
    st = t.sharding_type
    if st is ShardingType.DATA_PARALLEL:
        out = _full_rows(t, where) + _full_cols(t, where)
        ranks = sorted(s.rank for s in t.shards)
        if len(ranks) != world or ranks != list(range(world)):
            out.append(f"{where}: needs one full replica on every rank 0..{world - 1}, got {ranks}")
        return out
    if st is ShardingType.TABLE_WISE:
        out = _full_rows(t, where) + _full_cols(t, where)
        if len(t.shards) != 1:
            out.append(f"{where}: needs exactly one shard, got {len(t.shards)}")
        return out
    if st is ShardingType.COLUMN_WISE:
        cols = [(s.col_start, s.col_end) for s in t.shards]
        return _full_rows(t, where) + _tiling(cols, t.dim, "columns", where)
    out = _full_cols(t, where) + _tiling(
        [(s.row_start, s.row_end) for s in t.shards], t.rows, "rows", where
    )
    if st is ShardingType.TABLE_ROW_WISE:
        hosts = sorted({s.rank // rph for s in t.shards})
        if len(hosts) != 1:
            out.append(f"{where}: shards must stay on one host, got hosts {hosts}")
    return out
