"""Field checks of the config dataclasses: type, range and finiteness, one line naming the field.

Each config field may carry a ``Rule`` in its ``dataclasses.field`` metadata (``rule(...)``).
``check_fields`` runs first in every section's ``__post_init__``, so a loaded config and one built
in code are checked alike: the value's type from the field's annotation (``bool`` is not an
``int``; an ``int`` given for a ``float`` becomes a float; a list item is checked like a field),
then its rule. Every float must be finite. Errors name the field's full dotted name (``train.
log_every``), the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, get_args, get_origin, get_type_hints

from neorec.errors import ConfigError

__all__ = [
    "Rule",
    "rule",
    "check_fields",
    "check_choice",
    "suggest",
    "show",
    "MAX_TABLES",
    "MAX_ROWS",
    "MAX_DIM",
    "MAX_TOTAL_ELEMS",
    "MAX_WIDTH",
    "MAX_SEED",
    "SHARDING_TYPES",
]

MAX_TABLES = 100_000
"""Most embedding tables in one config (generated or listed)."""
MAX_ROWS = 2**40
"""Most rows of one table (~1.1e12; the largest tables of the paper-scale model have ~1e9)."""
MAX_DIM = 65_536
"""Largest embedding dim."""
MAX_TOTAL_ELEMS = 2**53
"""Most weight elements over all tables (exact in float64, far from int64 overflow)."""
MAX_WIDTH = 65_536
"""Widest MLP layer (and dcn_low_rank, num_dense)."""
MAX_SEED = 2**63 - 1
"""Largest seed (torch generators take 64-bit seeds)."""
SHARDING_TYPES = {
    "data_parallel": "dp",
    "table_wise": "tw",
    "row_wise": "rw",
    "column_wise": "cw",
    "table_row_wise": "twrw",
}
"""Sharding type names and their abbreviations (as ``neorec.sharding.types.ShardingType``)."""


@dataclass(frozen=True)
class Rule:
    """What a field's value may be beyond its type (bounds inclusive unless ``gt``)."""

    lo: float | None = None
    hi: float | None = None
    gt: float | None = None
    choices: tuple[Any, ...] | None = None
    nonempty: bool = False
    item: Rule | None = None


def rule(
    lo: float | None = None,
    hi: float | None = None,
    *,
    gt: float | None = None,
    choices: Sequence[Any] | None = None,
    nonempty: bool = False,
    item: Rule | None = None,
) -> dict[str, Rule]:
    """Field metadata carrying a ``Rule``: ``field(default=1, metadata=rule(1, 100))``."""
    return {
        "rule": Rule(lo, hi, gt, tuple(choices) if choices is not None else None, nonempty, item)
    }


def item_rule(lo: float | None = None, hi: float | None = None, *, gt: float | None = None) -> Rule:
    """A bound on each item of a list field."""
    return Rule(lo, hi, gt)


def show(v: Any, limit: int = 80) -> str:
    """A value as it appears in a message: repr, one line, at most ``limit`` characters."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(word: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or an empty string."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_choice(name: str, v: str, choices: Sequence[str]) -> None:
    """Refuse ``v`` unless it is one of ``choices`` (names the closest one)."""
    if v not in choices:
        shown = ", ".join(f"'{c}'" if isinstance(c, str) else str(c) for c in choices)
        hint = suggest(v, [str(c) for c in choices]) if isinstance(v, str) else ""
        raise ConfigError(f"{name} must be one of {shown}, got {show(v)}{hint}")


def _fmt(x: float) -> str:
    """A bound or value as printed: integers with thousands separators from 10,000 on."""
    if isinstance(x, float) and abs(x) >= 1e16:
        return f"{x:.3g}"
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x:,}" if isinstance(x, int) and abs(x) >= 10_000 else str(x)


def _describe(r: Rule, v: float) -> str:
    """The violated bound first (``>= 1``), then the whole allowed range when there are two."""
    if r.gt is not None and not v > r.gt:
        side = f"> {_fmt(r.gt)}"
    elif r.lo is not None and not v >= r.lo:
        side = f">= {_fmt(r.lo)}"
    else:
        side = f"<= {_fmt(r.hi)}" if r.hi is not None else ""
    if r.hi is None or (r.lo is None and r.gt is None):
        return side
    low = f"({_fmt(r.gt)}" if r.gt is not None else f"[{_fmt(r.lo or 0)}"
    return f"{side} (allowed: {low}, {_fmt(r.hi)}])"


def _in_bounds(v: float, r: Rule) -> bool:
    if r.gt is not None and not v > r.gt:
        return False
    if r.lo is not None and not v >= r.lo:
        return False
    return r.hi is None or v <= r.hi


def _type_name(typ: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        typ, getattr(typ, "__name__", str(typ))
    )


def check_value(typ: Any, v: Any, name: str) -> Any:
    """``v`` checked against the annotation ``typ`` (ints become floats for float fields)."""
    if type(v) is typ and typ in (int, str, bool):  # the common case, fast
        return v
    origin = get_origin(typ)
    if typ is bool:
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {show(v)}")
        return v
    if typ is int:
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise ConfigError(f"{name} must be an integer, got {show(v)}")
        return int(v)
    if typ is float:
        if isinstance(v, bool) or not isinstance(v, Real):
            raise ConfigError(f"{name} must be a number, got {show(v)}")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise ConfigError(f"{name} must be a finite number, got {show(v)}")
        return f
    if typ is str:
        if not isinstance(v, str):
            raise ConfigError(f"{name} must be a string, got {show(v)}")
        return v
    if origin is list:
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{name} must be a list, got {show(v)}")
        (inner,) = get_args(typ)
        if dataclasses.is_dataclass(inner):
            return list(v)  # the section checks its own items
        return [check_value(inner, x, f"{name}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{name} must be a table ({{key = value}}), got {show(v)}")
        ktyp, vtyp = get_args(typ)
        for k in v:
            if not isinstance(k, str):
                raise ConfigError(f"{name} keys must be strings, got {show(k)}")
        if vtyp is Any:
            return dict(v)
        return {k: check_value(vtyp, x, f"{name}.{k}") for k, x in v.items()}
    return v


def _check_rule(r: Rule, v: Any, name: str) -> None:
    if r.choices is not None:
        check_choice(name, v, r.choices)
    if r.nonempty and not v:
        what = "list" if isinstance(v, list) else "string"
        raise ConfigError(f"{name} must be a non-empty {what}, got {show(v)}")
    if isinstance(v, list) and r.item is not None:
        for i, x in enumerate(v):
            _check_rule(r.item, x, f"{name}[{i}]")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if (r.lo, r.hi, r.gt) != (None, None, None) and not _in_bounds(v, r):
            raise ConfigError(f"{name} must be {_describe(r, v)}, got {_fmt(v)}")


_SCHEMAS: dict[type, tuple[tuple[dataclasses.Field[Any], Any], ...]] = {}


def _schema(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any], ...]:
    """The fields of a dataclass with their resolved annotations (computed once per class)."""
    if cls not in _SCHEMAS:
        hints = get_type_hints(cls)
        _SCHEMAS[cls] = tuple((f, hints[f.name]) for f in dataclasses.fields(cls))
    return _SCHEMAS[cls]


def check_fields(obj: Any, section: str) -> None:
    """Check (and normalize) every field of the dataclass ``obj``; ``section`` prefixes names."""
    for f, typ in _schema(type(obj)):
        name = f"{section}.{f.name}" if section else f.name
        v = check_value(typ, getattr(obj, f.name), name)
        object.__setattr__(obj, f.name, v)
        r = f.metadata.get("rule")
        if r is not None:
            _check_rule(r, v, name)
