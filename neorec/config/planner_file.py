"""A config file as ``neorec plan`` reads it: the ``Config`` and its ``[planner]`` section raw.

``neorec plan`` reads the ``[planner]`` section itself (its keys, the ``[planner.topology]``
fields, paths relative to the file: ``neorec.sharding.plan_inputs``); the rest is the config. A
file without ``[planner]`` is read as ``load_config`` reads it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from neorec.config.core import Config
from neorec.config.load import load_config
from neorec.config.model import EmbeddingConfig, ModelConfig
from neorec.config.run import (
    CheckpointConfig,
    CommConfig,
    DataConfig,
    LowpConfig,
    ShardingConfig,
    StorageConfig,
    TrainConfig,
)
from neorec.config.towers import TowersConfig
from neorec.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["read_plan_config"]

_SECTIONS = {
    "model": ModelConfig,
    "embedding": EmbeddingConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sharding": ShardingConfig,
    # read by training, not by the planner; accepted so one config serves both
    "storage": StorageConfig,
    "checkpoint": CheckpointConfig,
    "comm": CommConfig,
    "lowp": LowpConfig,
    "towers": TowersConfig,
}


def _config_from_dict(data: dict[str, Any], where: str) -> Config:
    """A Config from TOML data without the ``[planner]`` section (same checks as load_config)."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(_SECTIONS)}")
    try:
        sections = {k: cls(**data.get(k, {})) for k, cls in _SECTIONS.items()}
        return Config(**sections)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_plan_config(path: str | Path) -> tuple[Config, dict[str, Any]]:
    """The config at ``path`` and its ``[planner]`` section as read (empty without one)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    planner = data.pop("planner", {})
    cfg = _config_from_dict(data, str(path)) if planner else load_config(path)
    return cfg, planner
