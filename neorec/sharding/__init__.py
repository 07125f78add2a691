"""Sharding: the plan as data, the cost model and the planner (pure Python, no process groups)."""

from neorec.sharding.cost_model import CostModel, TableSpec, load_tables
from neorec.sharding.cost_types import PlanCost, ShardCost
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.planner import Planner, PlanningError, PlanResult, format_report, plan_tables
from neorec.sharding.topology import Topology
from neorec.sharding.types import (
    PlanValidationError,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)

__all__ = [
    "CostModel",
    "PlanCost",
    "ShardCost",
    "TableSpec",
    "load_tables",
    "PlanningError",
    "PlanResult",
    "Planner",
    "format_report",
    "plan_tables",
    "Topology",
    "PlanValidationError",
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TablePlan",
    "column_wise",
    "data_parallel",
    "plan_by_type",
    "row_wise",
    "table_row_wise",
    "table_wise",
]
