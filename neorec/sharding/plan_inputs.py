"""What ``neorec plan`` plans: tables, topology, batch, optimizer and planner options, from a
config's sections, its ``[planner]`` section and the command's flags.

The ``[planner]`` section (read raw: ``neorec.config.planner_file``) adds what the planner needs
beyond the model: ``tables_file`` (relative to the config; replaces its tables), ``batch_size``,
``optimizer``, ``topology_file``, ``[planner.topology]`` fields and the planner's options
(``weight_bytes``, ``allow_host``, ``max_cw_slices``, ``allow_cached_tiers``,
``cache_fractions``). The flags given win over the section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neorec.config import DataConfig, EmbeddingConfig, ShardingConfig, TableConfig
from neorec.errors import ConfigError
from neorec.sharding.gpu_topology import preset_topology
from neorec.sharding.tables import TableSpec, load_tables, tables_from_config
from neorec.sharding.topology import Topology
from neorec.sharding.types import CACHED_STORAGES

__all__ = ["PlanFlags", "PlanInputs", "plan_inputs"]

_OPTIONS = {"weight_bytes", "allow_host", "max_cw_slices", "allow_cached_tiers", "cache_fractions"}


class PlanInputs:
    """Everything ``neorec plan`` needs: tables, topology, batch, optimizer and planner options."""

    def __init__(
        self,
        tables: list[TableSpec],
        topology: Topology,
        batch_size: int,
        optimizer: str,
        options: dict[str, Any],
    ) -> None:
        self.tables = tables
        self.topology = topology
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.options = options


@dataclass(frozen=True)
class PlanFlags:
    """The flags of ``neorec plan`` that ``plan_inputs`` reads; 0 / empty: not given."""

    world_size: int
    ranks_per_host: int = 0
    batch_size: int = 0
    tables: str = ""
    """A tables file (replaces the config's tables)."""
    topology: str = ""
    """A topology JSON."""
    preset: str | None = None
    """A GPU host preset (not together with ``topology``)."""
    cached_tiers: bool = True
    """False: ``--no-cached-tiers``."""


def plan_inputs(
    embedding: EmbeddingConfig,
    data: DataConfig,
    sharding: ShardingConfig,
    planner: dict[str, Any],
    flags: PlanFlags,
    *,
    base: Path = Path("."),
    source: str | None = None,
) -> PlanInputs:
    """The inputs from the config's sections, its ``[planner]`` section (``planner``, emptied of
    the keys read; paths in it relative to ``base``; ``source`` names the config in messages)
    and the ``flags`` (they win over the section)."""
    world_size, ranks_per_host = flags.world_size, flags.ranks_per_host
    tables, topology, preset = flags.tables, flags.topology, flags.preset
    topo_over = dict(planner.pop("topology", {}))
    tables_file = tables or (
        str(base / planner.pop("tables_file")) if "tables_file" in planner else ""
    )
    planner.pop("tables_file", None)
    cached = bool(planner.get("allow_cached_tiers", True)) and flags.cached_tiers
    planner["allow_cached_tiers"] = cached
    if tables_file:
        specs = load_tables(tables_file)
    else:
        # Synthetic Zipf ids: skew lowers the rows a batch touches (other distributions: uniform).
        synthetic = data.source in ("synthetic", "stream")
        alpha = data.zipf_alpha if synthetic and data.id_distribution == "zipf" else 0.0
        dist = data.id_distribution if synthetic else ""
        specs = tables_from_config(
            embedding.tables, sharding.types, sharding.default_type, alpha, dist
        )
        if cached:
            _config_storage(specs, embedding.tables)
    batch = flags.batch_size or int(planner.pop("batch_size", data.batch_size))
    planner.pop("batch_size", None)
    optimizer = str(planner.pop("optimizer", embedding.optimizer))
    topo_file = str(planner.pop("topology_file", "") or "")
    if topo_file and not topology:
        tpath = base / topo_file
        if not tpath.exists():
            raise ConfigError(
                f"{source}: planner.topology_file {str(tpath)!r} does not exist; write one "
                "with neorec plan --calibrate --topology PATH, or drop the key"
            )
        topo = Topology.load(tpath).with_world(world_size, ranks_per_host or None)
    elif topology:  # written just now by --calibrate, or given: missing is an error
        topo = Topology.load(topology)
        topo = topo.with_world(world_size, ranks_per_host or None)
    else:
        fields = {"world_size": world_size, **topo_over}
        fields["world_size"] = world_size
        if ranks_per_host:
            fields["ranks_per_host"] = ranks_per_host
        if topo_over:
            topo = Topology.from_dict(fields)
        else:
            topo = Topology.local_cpu(world_size).with_world(
                world_size, ranks_per_host or world_size
            )
    if preset:  # a GPU host preset instead
        topo = preset_topology(preset, world_size, ranks_per_host)
    if "cache_fractions" in planner:
        planner["cache_fractions"] = tuple(float(f) for f in planner["cache_fractions"])
    bad = sorted(set(planner) - _OPTIONS)
    if bad:
        raise ConfigError(f"unknown [planner] key(s) {bad}; known: {sorted(_OPTIONS)}")
    return PlanInputs(specs, topo, batch, optimizer, planner)


def _config_storage(specs: list[TableSpec], tables: list[TableConfig]) -> None:
    """Config tables with ``storage = "dram" | "ssd"`` keep that tier and cache size."""
    by_name = {t.name: t for t in tables}
    for spec in specs:
        t = by_name[spec.name]
        if t.storage not in CACHED_STORAGES:
            continue
        spec.storage = t.storage
        spec.cache_policy = t.cache_policy
        # cache_rows / cache_fraction as the runtime sizes the cache (default 10%; of a dynamic
        # table's slots, spec.rows)
        rows = t.cache_rows or math.ceil((t.cache_fraction or 0.1) * spec.rows)
        spec.cache_fraction = min(1.0, max(1, rows) / spec.rows)
