"""``neorec config --keys``: the reference of config keys is read from the schema, so it lists
every key a config has (and nothing else), each with its docstring; ``neorec config`` prints a
resolved config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neorec.cli import main
from neorec.config import Config, load_config
from neorec.config.keys import config_keys, field_docs
from neorec.config.model import TableConfig

MAPS = {"sharding.types", "planner.topology"}
"""Keys whose value is a free-form table (table -> sharding type; topology fields)."""


def _leaves(d: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in MAPS:
            out |= _leaves(v, f"{prefix}{k}.")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            out.add(f"{prefix}{k}")
            for item in v:
                out |= _leaves(item, f"{prefix}{k}[].")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_every_key_of_a_config_is_listed_and_nothing_else() -> None:
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "parquet_example.toml")  # tables and schema features
    listed = {k.key for k in config_keys()}
    have = _leaves(Config().to_dict()) | _leaves(cfg.to_dict())
    assert have == listed, (sorted(have - listed), sorted(listed - have))
    assert "embedding.tables[].rows" in listed and "data.schema.features[].column" in listed
    assert len(listed) == len(config_keys())  # no key twice


def test_every_key_has_a_docstring() -> None:
    missing = [k.key for k in config_keys() if not k.doc.strip()]
    assert missing == []  # a new key is documented where it is declared
    assert field_docs(TableConfig)["rows"].startswith("Number of rows")


def test_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--keys", "train.threads"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.threads  (int, default 0)\n") and "cgroup" in out
    assert main(["config", "--keys", "embedding.tables[].name"]) == 0
    assert "(required)" in capsys.readouterr().out
    assert main(["config", "--keys", "nosuch."]) == 2
    assert "no config key starts with 'nosuch.'" in capsys.readouterr().err
    assert main(["config", "--set", "train.steps=3"]) == 0
    text = capsys.readouterr().out
    assert "[train]" in text and "\nsteps = 3\n" in text
    assert main(["config", "--set", "train.stepz=3"]) == 2
    assert "did you mean" in capsys.readouterr().err
