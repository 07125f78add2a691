"""Config section ``[towers]``: DMT (disaggregated multi-tower) training.

Towers partition the embedding TABLES (a table and every feature reading it stay in one tower, so a
tower's tables can be sharded on one host). Each tower has a tower module (``module``) that turns
its features' pooled embeddings into ``out_vectors`` vectors of the embedding dim; the dense part
interacts the towers' outputs. The checks that need the tables (``groups`` covering every table
once, ``count`` at most the number of tables) are in ``neorec.config.core.Config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.config.checks import MAX_SEED, MAX_TABLES, MAX_WIDTH, check_fields, rule, show
from neorec.errors import ConfigError

__all__ = ["TowersConfig", "TOWER_MODULES", "TOWER_PARTITIONERS"]

TOWER_MODULES = ("identity", "mlp", "dot", "dcn")
"""Tower module kinds (``neorec.modules.towers.TowerModule``)."""
TOWER_PARTITIONERS = ("learned", "balanced", "random", "manual")
"""How tables are split into towers (``neorec.sharding.towers.partition_tables``)."""


@dataclass(kw_only=True)
class TowersConfig:
    """DMT towers: how many, which tables each holds, and the module each runs."""

    count: int = field(default=0, metadata=rule(0, MAX_TABLES))
    """Number of towers; 0 = no towers (the flat model). With ``groups``: 0 or len(groups)."""
    groups: list[list[str]] = field(default_factory=list)
    """Explicit towers: a list of lists of TABLE names covering every table once (implies
    ``partitioner = "manual"``)."""
    partitioner: str = field(default="", metadata=rule(choices=("",) + TOWER_PARTITIONERS))
    """``learned`` (cluster tables by measured interaction after a warm-up), ``balanced`` (cost
    only, LPT), ``random`` (seeded), ``manual`` (``groups``); empty = ``manual`` when ``groups``
    is given, else ``balanced``."""
    module: str = field(default="identity", metadata=rule(choices=TOWER_MODULES))
    """Tower module: ``identity`` (the flat model's function), ``mlp`` (linear compression to
    ``out_vectors`` vectors), ``dot`` (local pairwise dots + features, compressed), ``dcn`` (a
    local cross layer, compressed)."""
    out_vectors: int = field(default=1, metadata=rule(1, MAX_WIDTH))
    """k: vectors of the embedding dim each tower outputs (ignored by ``identity``)."""
    warmup_steps: int = field(default=200, metadata=rule(1, 2**40))
    """Learned partitioner: steps of the flat model trained before measuring interactions."""
    balance: float = field(default=1.25, metadata=rule(1.0, 1000.0))
    """Largest allowed max-tower-cost / mean-tower-cost (per-table cost from the cost model);
    when no partition meets it, the bound is the LPT partition's own ratio."""
    seed: int = field(default=0, metadata=rule(0, MAX_SEED))
    """Seed of the random and learned partitioners."""

    def __post_init__(self) -> None:
        check_fields(self, "towers")
        for i, g in enumerate(self.groups):
            if not isinstance(g, (list, tuple)) or not g:
                raise ConfigError(
                    f"towers.groups[{i}] must be a non-empty list of table names, got {show(g)}"
                )
            for j, name in enumerate(g):
                if not isinstance(name, str) or not name:
                    raise ConfigError(
                        f"towers.groups[{i}][{j}] must be a table name, got {show(name)}"
                    )
        self.groups = [list(g) for g in self.groups]
        if self.groups:
            if self.partitioner not in ("", "manual"):
                raise ConfigError(
                    f"towers.groups is given, so towers.partitioner must be 'manual' (or unset), "
                    f"got '{self.partitioner}'; drop towers.groups to use '{self.partitioner}'"
                )
            if self.count not in (0, len(self.groups)):
                raise ConfigError(
                    f"towers.count {self.count} differs from the {len(self.groups)} towers of "
                    f"towers.groups; set towers.count = {len(self.groups)} or 0"
                )
        elif self.partitioner == "manual":
            raise ConfigError(
                "towers.partitioner 'manual' needs towers.groups (lists of table names); or use "
                "'balanced', 'random' or 'learned'"
            )

    @property
    def num_towers(self) -> int:
        """Towers of the model: ``len(groups)`` when given, else ``count`` (0 = flat). The fields
        are kept as written (not normalized), so ``--set`` on a saved config stays consistent."""
        return len(self.groups) if self.groups else self.count

    @property
    def enabled(self) -> bool:
        """Whether the model is towered."""
        return self.num_towers > 0

    @property
    def method(self) -> str:
        """The partitioner in effect: ``manual`` with ``groups``, else ``partitioner`` (empty =
        ``balanced``)."""
        if self.groups:
            return "manual"
        return self.partitioner or "balanced"
