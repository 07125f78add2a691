"""How a run ended, as ``neorec runs`` tells it: finished, failed (with the error line) or
interrupted.

Two records: ``status.json``, which a command without metrics.json writes when it ends (``neorec
exfm``: ``mark_run``), and the trainer's last ``train.log`` line when a run stops on an error or
Ctrl-C (``stopped at step N: <Type>: <message>``). A run folder with neither (killed, or still
starting) is none of these: ``run_status`` returns None and ``neorec runs`` says ``stopped``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["STATUS_FILE", "mark_run", "mark_ended", "run_status"]

STATUS_FILE = "status.json"
_STOPPED = "stopped at step "
_TAIL = 65536
_WENT_ON = ("run      ", "step ", "eval at step ", "resum")
"""How lines a run writes while it trains begin (a resumed run's after an earlier stop)."""


def mark_run(folder: str | Path, status: str, error: str = "") -> None:
    """Record in ``folder`` that its run ended: ``status`` finished / failed / interrupted, and
    for a failure the error's first line."""
    if status not in ("finished", "failed", "interrupted"):
        raise ValueError(f"status must be finished, failed or interrupted, got {status!r}")
    f = Path(folder) / STATUS_FILE
    record = {
        "status": status,
        "error": error.strip().splitlines()[0] if error.strip() else "",
        "ended_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    tmp = f.with_name(f".{f.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, f)


def mark_ended(folder: str | Path, error: BaseException | None) -> None:
    """``mark_run`` from how a command ended: None (finished), Ctrl-C (interrupted), else
    failed with ``error``'s line."""
    if error is None:
        mark_run(folder, "finished")
    elif isinstance(error, KeyboardInterrupt):
        mark_run(folder, "interrupted")
    else:
        mark_run(folder, "failed", str(error) or type(error).__name__)


def _from_file(folder: Path) -> str | None:
    try:
        d = json.loads((folder / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("status") not in ("finished", "failed", "interrupted"):
        return None
    if d["status"] == "failed":
        return f"failed: {d.get('error') or 'unknown error'}"
    return str(d["status"])


def _from_log(folder: Path) -> str | None:
    """The trainer's ``stopped at step N: Type: message`` when it is train.log's last line (a
    resumed run writes on after it)."""
    try:
        with open(folder / "train.log", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - _TAIL))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(_STOPPED)]
    if not starts:
        return None
    last = lines[starts[-1]]
    if any(line.startswith(_WENT_ON) for line in lines[starts[-1] + 1 :]):
        return None  # the run went on after it (resumed)
    step, _, rest = last[len(_STOPPED) :].partition(": ")
    kind, _, message = rest.partition(": ")
    if kind in ("KeyboardInterrupt", "Terminated"):  # Ctrl-C, SIGTERM (train.sigterm)
        return f"interrupted at step {step}"
    return f"failed at step {step}: {message.strip() or kind}"


def run_status(folder: str | Path) -> str | None:
    """How the run of ``folder`` ended (``finished``, ``failed: <error>``, ``failed at step N:
    <error>``, ``interrupted ...``), or None when no record says."""
    p = Path(folder)
    return _from_file(p) or _from_log(p)
