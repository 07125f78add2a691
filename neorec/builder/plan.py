"""The sharding plan a config asks for: a plan file, per-table types, or the planner's."""

from __future__ import annotations

from neorec.config import Config, ConfigError
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sharding.plan_checks import check_storage
from neorec.sharding.plan_json import load_plan
from neorec.sharding.types import ShardingPlan

__all__ = ["resolve_plan"]


def resolve_plan(cfg: Config, world_size: int, ranks_per_host: int | None = None) -> ShardingPlan:
    """The plan a config asks for: a JSON file, per-table types, or the planner."""
    rph = ranks_per_host or world_size
    sh = cfg.sharding
    if sh.plan:
        # Checked against the model's tables and the ranks running: a table the model lacks,
        # or one it has that the plan misses, is an error naming it.
        plan = load_plan(sh.plan, tables=cfg.embedding.tables, world_size=world_size)
        check_storage(plan, who="the distributed runtime")  # no cached tier it would ignore
        return plan
    unknown = sorted(set(sh.types) - {t.name for t in cfg.embedding.tables})
    if unknown:
        raise ConfigError(f"sharding.types names unknown table(s) {unknown}")
    if sh.default_type or sh.types:
        try:
            return plan_by_type(
                cfg.embedding.tables, world_size, rph, sh.default_type or "table_wise", sh.types
            )
        except ValueError as e:
            raise ConfigError(f"sharding: {e}") from None
    return _planned(cfg, world_size, rph)


def _planned(cfg: Config, world_size: int, rph: int) -> ShardingPlan:
    """The cost-model planner's plan for this machine (or the configured topology)."""
    from neorec.sharding.planner import PlanningError, plan_tables
    from neorec.sharding.tables import tables_from_config
    from neorec.sharding.topology import Topology

    pc = cfg.planner
    if pc.topology_file:
        topo = Topology.load(pc.topology_file).with_world(world_size, rph)
    elif pc.topology:
        topo = Topology.from_dict({**pc.topology, "world_size": world_size, "ranks_per_host": rph})
    else:
        topo = Topology.local_cpu(world_size).with_world(world_size, rph)
    tables = tables_from_config(cfg.embedding.tables, cfg.sharding.types, cfg.sharding.default_type)
    options = {"weight_bytes": pc.weight_bytes, "allow_host": pc.allow_host}
    if pc.max_cw_slices:
        options["max_cw_slices"] = pc.max_cw_slices
    try:
        result = plan_tables(
            tables,
            topo,
            pc.batch_size or cfg.data.batch_size,
            pc.optimizer or cfg.embedding.optimizer,
            **options,
        )
    except PlanningError as e:
        raise ConfigError(f"the planner found no plan: {e}") from None
    return result.plan
