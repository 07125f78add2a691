"""How ``neorec bench report``'s rows write figures: an interval, a relative change, a seed list
(shared by ``report_rows`` and ``report_render``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["Json", "iv", "pct", "seeds_text"]

Json = Mapping[str, Any]


def iv(d: Json, fmt: str = ".2f", unit: str = "") -> str:
    """An interval object {value, lo, hi, n} as ``v [lo, hi]``."""
    lo, hi = d["lo"], d["hi"]
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{d['value']:{fmt}}{unit} (n = {d['n']}, no interval)"
    return f"{d['value']:{fmt}}{unit} [{lo:{fmt}}, {hi:{fmt}}]"


def pct(d: Json) -> str:
    """A relative interval object as signed percents."""
    scaled = {**d, "value": 100 * d["value"], "lo": 100 * d["lo"], "hi": 100 * d["hi"]}
    return iv(scaled, "+.2f", "%")


def seeds_text(seeds: list[int]) -> str:
    """Seeds as ``a-b`` when consecutive, else ``a,b,c``."""
    s = sorted(seeds)
    if s and s == list(range(s[0], s[0] + len(s))):
        return f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0])
    return ",".join(map(str, s))
