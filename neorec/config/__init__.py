"""Configs: small dataclasses, one per part, loaded from TOML with ``--set a.b=c`` overrides.

Every field is checked on construction (type, range, finiteness; ``neorec.config.checks``), so a
config loaded from a file and one built in code are refused alike, with one line naming the
field's dotted name, the value and what is allowed.
"""

from __future__ import annotations

from neorec.config.checks import SHARDING_TYPES
from neorec.config.core import MAX_DENSE_PARAMS, Config, check_trainable, dense_params
from neorec.config.distill import DistillConfig
from neorec.config.load import _parse_value, apply_overrides, load_config, read_toml
from neorec.config.model import EMBEDDING_OPTIMIZERS, EmbeddingConfig, ModelConfig, TableConfig
from neorec.config.qat import QatConfig
from neorec.config.run import (
    _COMM_CODECS,
    CheckpointConfig,
    CommConfig,
    DataConfig,
    LowpConfig,
    PlannerConfig,
    ShardingConfig,
    StorageConfig,
    TrainConfig,
)
from neorec.config.schedule import ScheduleConfig
from neorec.config.system import SystemConfig
from neorec.config.towers import TOWER_MODULES, TOWER_PARTITIONERS, TowersConfig
from neorec.errors import ConfigError

__all__ = [
    "TableConfig",
    "SystemConfig",
    "ModelConfig",
    "EmbeddingConfig",
    "DataConfig",
    "TrainConfig",
    "ScheduleConfig",
    "QatConfig",
    "ShardingConfig",
    "PlannerConfig",
    "CheckpointConfig",
    "StorageConfig",
    "CommConfig",
    "LowpConfig",
    "TowersConfig",
    "DistillConfig",
    "TOWER_MODULES",
    "TOWER_PARTITIONERS",
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "read_toml",
    "check_trainable",
    "dense_params",
    "MAX_DENSE_PARAMS",
    "EMBEDDING_OPTIMIZERS",
    "SHARDING_TYPES",
    "_COMM_CODECS",
    "_parse_value",
]
