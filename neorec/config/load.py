"""Reading a config: a TOML file, then ``--set section.key=value`` overrides, then the checks.

Every key is resolved against the ``Config`` schema before any value is used: an unknown section
or key is named with the closest known one, a section given a value (``--set model=3``) or a value
used as a section (``--set train.steps.x=1``) is refused, and a file that is missing, a directory,
not UTF-8 or not TOML is named with the reason (and the line, for TOML errors).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from neorec.config.checks import show, suggest
from neorec.config.core import Config
from neorec.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["load_config", "config_from_data", "apply_overrides", "read_toml"]


def _build(cls: Any, data: dict[str, Any], where: str, source: str) -> Any:
    """``cls(**data)`` with nested sections built; unknown keys named (with the closest one)."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            what = f"key '{k}' in [{where}]" if where else f"section '{k}'"
            raise ConfigError(
                f"{source}: unknown {what}{suggest(str(k), names)}; known: {', '.join(names)}"
            )
    kwargs = {}
    for k, v in data.items():
        name = f"{where}.{k}" if where else k
        typ = hints[k]
        if dataclasses.is_dataclass(typ):
            if not isinstance(v, dict):
                raise ConfigError(f"{source}: {_section_given_value(name, typ, v)}")
            kwargs[k] = _build(typ, v, name, source)
        else:
            kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - every field has a default or is checked
        raise ConfigError(f"{source}: [{where}]: {e}") from None


def _section_given_value(name: str, typ: Any, v: Any) -> str:
    first = dataclasses.fields(typ)[0].name
    return (
        f"{name} is a section, not a value (got {show(v)}); set its keys, e.g. "
        f"--set {name}.{first}=... or [{name}] {first} = ... in the file"
    )


def _check_key(parts: list[str], value: Any, item: str) -> None:
    """Resolve an override's key path against the Config schema (before it is applied)."""
    typ: Any = Config
    for i, p in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if dataclasses.is_dataclass(typ):
            hints = get_type_hints(typ)
            names = [f.name for f in dataclasses.fields(typ)]
            if p not in names:
                parent = ".".join(parts[:i])
                what = f"key '{p}' in [{parent}]" if parent else f"section '{p}'"
                raise ConfigError(
                    f"--set {item}: unknown {what}{suggest(p, names)}; known: {', '.join(names)}"
                )
            typ = hints[p]
        elif get_origin(typ) is dict:
            typ = get_args(typ)[1]
            if typ is Any:
                return  # free-form (planner.topology): checked by its reader
        else:
            parent = ".".join(parts[:i])
            raise ConfigError(
                f"--set {item}: {parent} is a value, not a section ({here} is unknown)"
            )
    if dataclasses.is_dataclass(typ) and not isinstance(value, dict):
        raise ConfigError(f"--set {item}: " + _section_given_value(".".join(parts), typ, value))


def _parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, bools, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a raw config dict (keys checked against Config)."""
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(
                f"--set expects section.key=value (e.g. --set train.steps=100), got {show(item)}"
            )
        key, text = item.split("=", 1)
        parts = [p.strip() for p in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(
                f"--set {item}: the key '{key.strip()}' has an empty part; "
                "expected section.key=value (e.g. --set train.steps=100)"
            )
        value = _parse_value(text.strip())
        _check_key(parts, value, item)
        node = data
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {item}: {'.'.join(parts[: i + 1])} is a value in the config file, "
                    "not a section"
                )
        node[parts[-1]] = value
    return data


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; a missing, unreadable, non-UTF-8 or invalid file is a ConfigError."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory; --config wants a TOML file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"config file {p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); "
            "a config is a TOML text file"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"config file {p}: invalid TOML: {msg}") from None


def _from_file(e: ConfigError, path: str | Path | None, overrides: list[str]) -> ConfigError:
    """``e`` naming the config file too, unless it names an override's key or the file already."""
    msg = str(e)
    keys = [o.split("=", 1)[0].strip() for o in overrides if isinstance(o, str)]
    if path is None or str(path) in msg or any(msg.startswith(k) for k in keys):
        return e
    return ConfigError(f"config file {path}: {msg}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a TOML file (or the defaults) plus ``--set`` overrides, every field checked."""
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    return config_from_data(data, overrides, path)


def config_from_data(
    data: dict[str, Any], overrides: list[str] | None = None, path: str | Path | None = None
) -> Config:
    """Config from a raw dict (as a TOML file reads) plus ``--set`` overrides, every field
    checked; ``path`` names where the dict came from in messages. ``data`` is changed."""
    apply_overrides(data, list(overrides or []))
    source = str(path) if path is not None else "config"
    try:
        cfg: Config = _build(Config, data, "", source)
    except ConfigError as e:
        raise _from_file(e, path, overrides or []) from None
    return cfg
