"""``neorec runs``: the run folders under a root, one row each, newest last."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from neorec.errors import DataError
from neorec.train.runlock import locked_by
from neorec.train.runs import LATEST, started
from neorec.train.runstatus import run_status

__all__ = ["describe_run", "list_runs", "format_runs", "run_runs_command"]


# ---- neorec runs ---------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _last_step(events: Path) -> int | None:
    """Step of the last whole line of events.jsonl (read from its end)."""
    try:
        with open(events, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def describe_run(folder: Path) -> dict[str, Any]:
    """One row of ``neorec runs``: what the folder's files say about the run."""
    row: dict[str, Any] = {"name": folder.name, "folder": str(folder)}
    metrics_path = folder / "metrics.json"
    m = _read_json(metrics_path) if metrics_path.exists() else None
    run = m.get("run", {}) if m else {}
    # The first start (a resume keeps it; config.toml's first line says when it resumed last).
    known = started(folder)
    start = known[0] if known else run.get("start_utc") if isinstance(run, dict) else None
    if known and known[1]:
        row["resumed_utc"] = known[1]
    if not start:
        stamp = folder / "config.toml" if (folder / "config.toml").exists() else folder
        start = datetime.fromtimestamp(stamp.stat().st_mtime, timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
    row["start_utc"] = start
    holder = locked_by(folder)
    if m is None or holder is not None:  # a live run holds the folder's lock: still going
        if holder is not None:
            row["status"] = f"running ({holder})"
        elif metrics_path.exists():
            row["status"] = "unreadable metrics.json"
        else:
            row["status"] = run_status(folder) or "stopped"
        row["steps"] = _last_step(folder / "events.jsonl")
        return row
    row["status"] = "finished"
    row["steps"] = m.get("train", {}).get("steps")
    row["world_size"] = run.get("world_size") if isinstance(run, dict) else None
    ev, te = m.get("eval") or {}, m.get("teacher") or {}
    row["ne"], row["auc"] = ev.get("ne"), ev.get("auc")
    row["teacher_ne"] = te.get("ne")
    row["ne_gap_vs_teacher"] = m.get("eval_ne_gap_vs_teacher")
    return row


def list_runs(root: str | Path) -> list[dict[str, Any]]:
    """Every run folder under ``root``, oldest start first (``DataError`` without the root)."""
    r = Path(root)
    if not r.is_dir():
        what = "is not a folder" if r.exists() else "does not exist"
        raise DataError(
            f"runs root '{root}' {what}; runs are written under train.runs_dir (default 'runs') "
            f"by neorec train: pass --root DIR"
        )
    latest = r / LATEST
    target = os.path.realpath(latest) if latest.is_symlink() else None
    rows = []
    for p in sorted(r.iterdir()):
        if p.name.startswith(".") or not p.is_dir() or p.is_symlink():
            continue
        row = describe_run(p)
        row["latest"] = target is not None and os.path.realpath(p) == target
        rows.append(row)
    return sorted(rows, key=lambda x: (x["start_utc"], x["name"]))


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_runs(rows: list[dict[str, Any]]) -> str:
    """The table ``neorec runs`` prints (newest last; ``*`` marks ``latest``; a resumed run's
    start is its first one, and its status says when it was last resumed)."""
    head = f"  {'name':<28}{'started (UTC)':<18}{'steps':>8}{'ranks':>6}{'eval NE':>9}"
    head += f"{'AUC':>8}{'teacher NE':>11}{'gap':>9}  status"
    lines = [head]
    for x in rows:
        gap = x.get("ne_gap_vs_teacher")
        start = str(x["start_utc"]).replace("T", " ").rstrip("Z")[:16]
        last = x.get("resumed_utc")
        resumed = f", resumed {str(last).replace('T', ' ').rstrip('Z')[:16]}" if last else ""
        lines.append(
            f"{'*' if x.get('latest') else ' '} {x['name']:<28}{start:<18}"
            f"{_num(x.get('steps'), ',d'):>8}{_num(x.get('world_size'), 'd'):>6}"
            f"{_num(x.get('ne'), '.4f'):>9}{_num(x.get('auc'), '.4f'):>8}"
            f"{_num(x.get('teacher_ne'), '.4f'):>11}"
            f"{'-' if gap is None else f'{100 * gap:+.2f}%':>9}  {x['status']}{resumed}"
        )
    if len(rows) == 0:
        lines.append("  (no runs)")
    return "\n".join(lines)


def run_runs_command(root: str, as_json: bool = False) -> int:
    """``neorec runs``: print the runs under ``root``."""
    rows = list_runs(root)
    print(json.dumps(rows, indent=1) if as_json else format_runs(rows))
    return 0
