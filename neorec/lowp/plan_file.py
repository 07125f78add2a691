"""A pinned LoKA plan on disk (``lowp.plan``): read, checked against a model's sites, written.

A plan is ``{site: precision}`` for every GEMM site (``linear`` / ``interaction``), optionally
``pooled.forward`` / ``pooled.backward`` (the wire codecs). The file is either that object or one
holding it under ``plan`` (a run's ``lowp.json``, or what ``neorec bench lowp --save-plan``
writes), so a plan chosen once can be run again, by the speed run and the quality run alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neorec.errors import ConfigError
from neorec.lowp.formats import candidate

__all__ = ["load_plan", "check_plan", "save_plan", "low_sites"]

WIRE_KEYS = ("pooled.forward", "pooled.backward")


def load_plan(path: str | Path) -> dict[str, str]:
    """The plan in ``path`` (``ConfigError`` naming the file and what is wrong)."""
    p = Path(path)
    try:
        data: Any = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"lowp.plan = '{p}': cannot read a JSON plan ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("plan"), dict):
        data = data["plan"]
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"lowp.plan = '{p}': expected an object {{site: precision}}")
    plan: dict[str, str] = {}
    for site, prec in data.items():
        if not isinstance(prec, str):
            raise ConfigError(f"lowp.plan = '{p}': site {site!r} has {prec!r}, not a precision")
        try:
            candidate(prec)
        except ValueError as e:
            raise ConfigError(f"lowp.plan = '{p}': site {site!r}: {e}") from None
        plan[str(site)] = prec
    return plan


def check_plan(plan: dict[str, str], gemm_sites: list[str], where: str) -> None:
    """``plan`` names exactly the model's GEMM sites (and at most the wire keys besides)."""
    names = set(plan) - set(WIRE_KEYS)
    missing = [s for s in gemm_sites if s not in names]
    extra = sorted(names - set(gemm_sites))
    if missing or extra:
        raise ConfigError(
            f"lowp.plan = '{where}' does not fit this model: "
            + "; ".join(
                x
                for x in (
                    f"sites it does not name: {', '.join(missing)}" if missing else "",
                    f"sites the model lacks: {', '.join(extra)}" if extra else "",
                )
                if x
            )
            + f" (the model's GEMM sites: {', '.join(gemm_sites)})"
        )


def low_sites(plan: dict[str, str]) -> list[str]:
    """The GEMM sites of ``plan`` that run below fp32, in plan order."""
    return [s for s, p in plan.items() if p != "fp32" and s not in WIRE_KEYS]


def save_plan(path: str | Path, plan: dict[str, str], **meta: Any) -> None:
    """Write ``plan`` (with ``meta``: where it was chosen) as ``lowp.plan`` reads it."""
    Path(path).write_text(json.dumps({"plan": plan, **meta}, indent=1) + "\n")
