"""Reading a sharding plan from JSON strictly: every structural problem is named, none guessed.

A hand-written plan is user input: a field of the wrong JSON type (``"rows": "0:10"``,
``"rank": 0.5``, ``true`` for a count), a missing or unknown field, a duplicate key or a file that
is not JSON at all each become a ``PlanValidationError`` naming the file, the table, the shard and
the field. Nothing is converted: ``int(0.5)`` would silently put a shard on rank 0.
``load_plan`` reads a plan file and validates it (``plan_checks``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from neorec.sharding.plan_checks import check_model, validate_plan
from neorec.sharding.types import (
    PLAN_FORMAT_VERSION,
    PlanValidationError,
    Shard,
    ShardingPlan,
    ShardingType,
    TableLike,
    TablePlan,
    parse_sharding_type,
)

__all__ = [
    "load_plan",
    "read_plan_file",
    "parse_plan_text",
    "parse_plan_dict",
    "parse_table_dict",
    "parse_shard_dict",
]

_PLAN_KEYS = ("format_version", "world_size", "ranks_per_host", "tables", "meta")
_TABLE_KEYS = ("name", "rows", "dim", "type", "storage", "cache_fraction", "shards")
_SHARD_KEYS = ("rank", "rows", "cols")
_REQUIRED = object()
_INT_MAX = 2**63 - 1


def load_plan(
    path: str | Path,
    validate: bool = True,
    tables: Iterable[TableLike] | None = None,
    world_size: int | None = None,
) -> ShardingPlan:
    """Read a JSON plan: validated unless ``validate=False``, and checked against the model's
    ``tables`` and the running ``world_size`` when given (see ``plan_checks.check_model``)."""
    plan = read_plan_file(path)
    if tables is not None or world_size is not None:
        check_model(plan, tables, world_size)  # first: a plan for another model or world
    if validate:
        validate_plan(plan)
    return plan


def read_plan_file(path: str | Path) -> ShardingPlan:
    """The plan in the JSON file ``path`` (structure checked, not yet validated)."""
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise PlanValidationError([f"cannot read the file: {e.strerror or e}"], source) from None
    try:
        text = raw.decode("utf-8-sig")  # a BOM, as some editors write, is not an error
    except UnicodeDecodeError as e:
        raise PlanValidationError(
            [f"not a JSON text file (byte {e.start} is not UTF-8)"], source
        ) from None
    return parse_plan_text(text, source)


def parse_plan_text(text: str, source: str = "") -> ShardingPlan:
    """The plan in JSON ``text`` (``source`` names it in errors)."""
    if not text.strip():
        raise PlanValidationError(["the file is empty (expected a JSON object)"], source)
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise PlanValidationError(
            [f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"], source
        ) from None
    except _DuplicateKey as e:
        raise PlanValidationError(
            [f"key '{e.args[0]}' appears twice in one object"], source
        ) from None
    except RecursionError:
        raise PlanValidationError(["JSON nested too deeply"], source) from None
    return parse_plan_dict(data, source)


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def parse_plan_dict(d: Any, source: str = "") -> ShardingPlan:
    """``ShardingPlan`` from its JSON form (``ShardingPlan.to_dict``'s), refusing every field of
    the wrong type or range: a missing, unknown or mistyped field is a ``PlanValidationError``
    naming it; ``ranks_per_host`` defaults to ``world_size`` (one host)."""
    p = _Problems()
    if not isinstance(d, dict):
        raise PlanValidationError([f"the plan must be a JSON object, got {_show(d)}"], source)
    p.unknown(d, _PLAN_KEYS, "the plan")
    version = p.integer(d, "format_version", "the plan", PLAN_FORMAT_VERSION, minimum=1)
    if version is not None and version > PLAN_FORMAT_VERSION:
        p.add(f"format_version {version} is newer than supported {PLAN_FORMAT_VERSION}")
    world = p.integer(d, "world_size", "the plan", minimum=1)
    rph = p.integer(d, "ranks_per_host", "the plan", world or 1, minimum=1)
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        p.add(f"the plan: 'meta' must be an object, got {_show(meta)}")
        meta = {}
    tables = p.get(d, "tables", "the plan")
    out: list[TablePlan] = []
    if tables is not None and not isinstance(tables, list):
        p.add(f"the plan: 'tables' must be a list of table objects, got {_show(tables)}")
    elif tables is not None:
        for i, t in enumerate(tables):
            tp = _table(p, t, i)
            if tp is not None:
                out.append(tp)
    if p.problems:
        raise PlanValidationError(p.problems, source)
    assert world is not None and rph is not None
    return ShardingPlan(world, rph, out, dict(meta), source=source)


def parse_table_dict(d: Any, source: str = "") -> TablePlan:
    """One table's plan from its JSON form (strict, as ``parse_plan_dict``)."""
    p = _Problems()
    tp = _table(p, d, 0)
    if tp is None:
        raise PlanValidationError(p.problems, source)
    return tp


def parse_shard_dict(d: Any, source: str = "") -> Shard:
    """One shard from its JSON form (strict, as ``parse_plan_dict``)."""
    p = _Problems()
    sh = _shard(p, d, "shard")
    if sh is None:
        raise PlanValidationError(p.problems, source)
    return sh


def _table(p: _Problems, t: Any, i: int) -> TablePlan | None:
    if not isinstance(t, dict):
        p.add(f"tables[{i}] must be an object, got {_show(t)}")
        return None
    name = t.get("name")
    where = f"table '{name}'" if isinstance(name, str) and name else f"tables[{i}]"
    n0 = len(p.problems)
    p.unknown(t, _TABLE_KEYS, where)
    if not (isinstance(name, str) and name.strip()):
        p.add(f"{where}: 'name' must be a non-empty string, got {_show(name, 'missing')}")
    rows = p.integer(t, "rows", where, minimum=1)
    dim = p.integer(t, "dim", where, minimum=1)
    st = _sharding_type(p, t, where)
    storage = t.get("storage", "device")
    if not isinstance(storage, str):
        p.add(f"{where}: 'storage' must be a string, got {_show(storage)}")
    frac = t.get("cache_fraction", 0.0)
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not math.isfinite(frac):
        p.add(f"{where}: 'cache_fraction' must be a finite number, got {_show(frac)}")
    shards = p.get(t, "shards", where)
    parsed: list[Shard] = []
    if shards is not None and not isinstance(shards, list):
        p.add(f"{where}: 'shards' must be a list of shard objects, got {_show(shards)}")
    elif shards is not None:
        for j, s in enumerate(shards):
            sh = _shard(p, s, f"{where} shard {j}")
            if sh is not None:
                parsed.append(sh)
    if len(p.problems) > n0:
        return None
    assert rows is not None and dim is not None and st is not None
    return TablePlan(str(name), rows, dim, st, parsed, str(storage), float(frac))


def _sharding_type(p: _Problems, t: dict[str, Any], where: str) -> ShardingType | None:
    text = p.get(t, "type", where)
    if text is None:
        return None
    if not isinstance(text, str):
        p.add(f"{where}: 'type' must be a string such as \"row_wise\", got {_show(text)}")
        return None
    try:
        return parse_sharding_type(text)
    except ValueError as e:
        p.add(f"{where}: 'type': {e}")
        return None


def _shard(p: _Problems, s: Any, where: str) -> Shard | None:
    if not isinstance(s, dict):
        p.add(f"{where} must be an object, got {_show(s)}")
        return None
    n0 = len(p.problems)
    p.unknown(s, _SHARD_KEYS, where)
    rank = p.integer(s, "rank", where, minimum=0)
    rows = _pair(p, s, "rows", where)
    cols = _pair(p, s, "cols", where)
    if len(p.problems) > n0:
        return None
    assert rank is not None and rows is not None and cols is not None
    return Shard(rank, rows[0], rows[1], cols[0], cols[1])


def _pair(p: _Problems, s: dict[str, Any], key: str, where: str) -> tuple[int, int] | None:
    v = p.get(s, key, where)
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v)):
        p.add(f"{where}: '{key}' must be [start, end] (two integers), got {_show(v)}")
        return None
    if not all(-_INT_MAX <= x <= _INT_MAX for x in v):
        p.add(f"{where}: '{key}' {v} does not fit int64")
        return None
    return int(v[0]), int(v[1])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Problems:
    """Collects the problems of one plan, each naming where it is."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def add(self, msg: str) -> None:
        self.problems.append(msg)

    def get(self, d: dict[str, Any], key: str, where: str) -> Any:
        """The value of a required field (None, with a problem, when missing or null)."""
        if key not in d:
            self.add(f"{where}: field '{key}' is missing")
            return None
        if d[key] is None:
            self.add(f"{where}: field '{key}' is null")
        return d[key]

    def integer(
        self, d: dict[str, Any], key: str, where: str, default: Any = _REQUIRED, minimum: int = 0
    ) -> int | None:
        """An integer field >= ``minimum`` (``default`` when absent, if it has one)."""
        if key not in d and default is not _REQUIRED:
            return int(default)
        v = self.get(d, key, where)
        if v is None:
            return None
        if not _is_int(v):
            self.add(f"{where}: '{key}' must be an integer, got {_show(v)}")
            return None
        if v < minimum:
            self.add(f"{where}: '{key}' must be >= {minimum}, got {v}")
            return None
        if v > _INT_MAX:
            self.add(f"{where}: '{key}' must be at most 2**63-1, got {v}")
            return None
        return int(v)

    def unknown(self, d: dict[str, Any], known: tuple[str, ...], where: str) -> None:
        extra = [k for k in d if k not in known]
        if extra:
            self.add(f"{where}: unknown field(s) {extra}; known: {list(known)}")


def _show(v: Any, missing: str = "") -> str:
    """A JSON value as the user wrote it, with its JSON type (short)."""
    if v is None:
        return missing or "null"
    kind = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(type(v))
    if kind is None:
        kind = (
            "list" if isinstance(v, list) else "object" if isinstance(v, dict) else type(v).__name__
        )
    try:
        text = json.dumps(v)
    except ValueError:  # pragma: no cover - JSON-decoded values always dump
        text = repr(v)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} {text}"
