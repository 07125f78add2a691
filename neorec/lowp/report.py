"""The probe's table: per site, error per precision (safe or not against the tolerance) and time."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["format_table", "report_json"]

_SHORT = {
    "bf16": "bf16",
    "fp16": "fp16",
    "fp8-e4m3-tensor": "e4m3/t",
    "fp8-e4m3-row": "e4m3/r",
    "fp8-e5m2-tensor": "e5m2/t",
    "fp8-e5m2-row": "e5m2/r",
}


def _err(v: float, tol: float) -> str:
    if not math.isfinite(v):
        return "inf!"
    return f"{v:.1e}" + ("" if v <= tol else "!")


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return "n/a" if not math.isfinite(v) else f"{v:.3f}"


def report_json(
    probe: dict[str, Any],
    plan: dict[str, str],
    times: dict[str, dict[str, float]],
    tolerance: float,
    mode: str,
    machine: str,
) -> dict[str, Any]:
    """What ``lowp.json`` in the run folder holds: the probe, the timings and the choices."""
    return {
        "mode": mode,
        "tolerance": tolerance,
        "machine": machine,
        "plan": plan,
        "times_ms": {
            s: {c: (t if math.isfinite(t) else None) for c, t in r.items()}
            for s, r in times.items()
        },  # fmt: skip
        "probe": probe,
    }


def format_table(
    probe: dict[str, Any],
    plan: dict[str, str],
    times: dict[str, dict[str, float]],
    tolerance: float,
) -> str:
    """A printable table: one line per site; error bounds (``!`` = above tolerance), the fp32
    time, the chosen precision and its time (``n/a``: no kernel for it on this device)."""
    cands = [c for c in _SHORT if any(c in s["errors"] for s in probe["sites"])]
    head = f"{'site':<16}{'kind':<12}{'shape':<12}{'amax':>9}{'outl%':>7}"
    head += "".join(f"{_SHORT[c]:>9}" for c in cands)
    head += f"{'fp32 ms':>9}{'chosen':>16}{'ms':>8}"
    lines = [
        f"LoKA probe: relative error bound (95%) per precision over {probe['steps_probed']} "
        f"probed steps; '!' above lowp.tolerance = {tolerance:g}",
        head,
    ]
    for s in probe["sites"]:
        act = s["stats"].get("act") or s["stats"].get("weight") or {}
        shape = "x".join(map(str, s["shape"]))[:11]
        row = f"{s['name'][:15]:<16}{s['kind']:<12}{shape:<12}"
        row += f"{act.get('amax', 0.0):>9.3g}{100 * act.get('outliers', 0.0):>7.2f}"
        row += "".join(f"{_err(s['errors'][c]['bound'], tolerance):>9}" for c in cands)
        t = times.get(s["name"], {})
        chosen = plan.get(s["name"], "")
        row += (
            f"{_ms(t.get('fp32')):>9}{chosen or '-':>16}{_ms(t.get(chosen)) if chosen else '-':>8}"
        )
        lines.append(row)
    return "\n".join(lines)
