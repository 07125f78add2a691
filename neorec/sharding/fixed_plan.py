"""A plan with a fixed sharding type per table, without the cost model: the config's
``sharding.default_type`` / ``sharding.types`` path (and the benchmarks' and tests' plans of
one kind), validated."""

from __future__ import annotations

from collections.abc import Iterable

from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.types import (
    ShardingPlan,
    ShardingType,
    TableLike,
    column_wise,
    data_parallel,
    parse_sharding_type,
    row_wise,
    table_row_wise,
    table_wise,
)

__all__ = ["plan_by_type"]


def plan_by_type(
    tables: Iterable[TableLike],
    world_size: int,
    ranks_per_host: int | None = None,
    default_type: ShardingType | str = ShardingType.TABLE_WISE,
    types: dict[str, str] | None = None,
) -> ShardingPlan:
    """A plan with a fixed type per table (``types`` overrides ``default_type``), no cost model.

    Table-wise tables go round-robin over ranks, table-row-wise ones round-robin over hosts;
    row-wise and column-wise tables use every rank. This is the ``sharding.default_type`` /
    ``sharding.types`` path of the config, for when the planner is not wanted.
    """
    rph = ranks_per_host or world_size
    hosts = max(1, world_size // rph)
    all_ranks = list(range(world_size))
    default = default_type.value if isinstance(default_type, ShardingType) else default_type
    out = []
    for i, t in enumerate(tables):
        st = parse_sharding_type((types or {}).get(t.name, default))
        if st is ShardingType.DATA_PARALLEL:
            out.append(data_parallel(t, world_size))
        elif st is ShardingType.TABLE_WISE:
            out.append(table_wise(t, i % world_size))
        elif st is ShardingType.ROW_WISE:
            out.append(row_wise(t, all_ranks))
        elif st is ShardingType.COLUMN_WISE:
            out.append(column_wise(t, all_ranks, min(world_size, t.dim)))
        else:
            out.append(table_row_wise(t, i % hosts, rph))
    plan = ShardingPlan(world_size, rph, out, {"source": "plan_by_type"})
    validate_plan(plan)
    return plan
