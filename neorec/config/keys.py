"""The reference of config keys, read from the schema itself: every field of every section (lists
of tables and schema features as ``section.list[].key``), its type, default and the docstring
under it in ``neorec/config/`` (``neorec config --keys``)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, get_args, get_origin, get_type_hints

__all__ = ["KeyDoc", "config_keys", "field_docs", "format_keys"]


@dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path, type, default (TOML-ish text) and docstring."""

    key: str
    type: str
    default: str
    doc: str


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotation in ``cls``'s source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            out[a.target.id] = inspect.cleandoc(b.value.value)
    return out


def _type_name(t: Any) -> str:
    origin = get_origin(t)
    if origin is None:
        return getattr(t, "__name__", str(t))
    args = ", ".join(_type_name(a) for a in get_args(t))
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return " | ".join(_type_name(a) for a in get_args(t))
    return f"{getattr(origin, '__name__', str(origin))}[{args}]"


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _REQUIRED


class _Required:
    def __repr__(self) -> str:
        return "(required)"


_REQUIRED = _Required()


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if v is None:
        return "none"
    return repr(v)


def _item_dataclass(t: Any) -> Any:
    """The dataclass of a ``list[SomeDataclass]`` field, else None."""
    if get_origin(t) is list:
        (item,) = get_args(t) or (None,)
        if dataclasses.is_dataclass(item):
            return item
    return None


def _walk(cls: Any, prefix: str) -> list[KeyDoc]:
    hints, docs, out = get_type_hints(cls), field_docs(cls), []
    for f in dataclasses.fields(cls):
        t, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(t):
            out += _walk(t, key + ".")
            continue
        item = _item_dataclass(t)
        if item is not None:
            out.append(KeyDoc(key, "list of sections", _show(_default(f)), docs.get(f.name, "")))
            out += _walk(item, key + "[].")
            continue
        out.append(KeyDoc(key, _type_name(t), _show(_default(f)), docs.get(f.name, "")))
    return out


def config_keys() -> list[KeyDoc]:
    """Every key of ``Config``, in the schema's order."""
    from neorec.config.core import Config

    return _walk(Config, "")


def format_keys(keys: list[KeyDoc], full: bool = False) -> str:
    """The reference as text: one line per key (``full``: the whole docstring under it)."""
    lines = []
    for k in keys:
        first = k.doc.split("\n\n")[0].replace("\n", " ")
        lines.append(f"{k.key}  ({k.type}, default {k.default})")
        text = k.doc if full else first
        lines += ["    " + x for x in textwrap.wrap(text, 96)] if text else []
    return "\n".join(lines)
