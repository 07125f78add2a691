"""What a failed or interrupted run says: the failure reports workers hand to their launcher, and
the one lines printed from them.

A worker's failure is a JSON file in the folder ``NEOREC_ERROR_DIR`` names (``write_report``);
the launcher reads them (``reports``) and prints one line naming the cause (``failure_line``).
gloo's error of a collective whose peer died is one line naming the peer (``peer_lost``); Ctrl-C
prints one line with the resume command (``interrupted_line``, ``resume_command``).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from neorec.errors import NeorecError

__all__ = [
    "EXIT_INTERRUPTED",
    "ERROR_DIR_ENV",
    "PeerLostError",
    "peer_lost",
    "write_report",
    "peer_reported",
    "reports",
    "cause_of",
    "failure_line",
    "resume_command",
    "interrupted_line",
    "step_of",
]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
ERROR_DIR_ENV = "NEOREC_ERROR_DIR"


class PeerLostError(NeorecError):
    """A collective failed because another rank died or stopped answering."""


# gloo's messages (tcp transport) when a peer stopped answering / went away mid-collective
_TIMED_OUT = ("Timed out waiting", "timeout caused pair closure", "timed out connecting")
_CUT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_lost(exc: BaseException, rank: int, world: int) -> PeerLostError | None:
    """gloo's error of a collective whose peer died or stopped answering, as one line naming the
    peer (the other rank of two; "another rank" of more); None for any other exception."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    timed_out = any(t in text for t in _TIMED_OUT)
    cut = any(t in text for t in _CUT)
    if not (timed_out or cut):
        return None
    peer = f"rank {1 - rank}" if world == 2 and rank in (0, 1) else "another rank"
    gloo = first.split("] ", 1)[-1][:200]
    if timed_out:
        what = f"{peer} did not answer a collective within train.collective_timeout_s (stopped?)"
    else:
        what = f"{peer} exited or lost its connection during a collective"
    return PeerLostError(f"{what} (gloo: {gloo})")


# ---- the error folder ----------------------------------------------------------------------
def write_report(rank: int, message: str, kind: str = "error") -> bool:
    """Hand a worker's failure to the launcher (which prints it once); False if there is none.

    ``kind``: ``error`` (a ``NeorecError``: bad input, the same again on a restart), ``defect``
    (any other exception) or ``peer`` (a collective broken by another rank: ``PeerLostError``).
    """
    d = os.environ.get(ERROR_DIR_ENV, "")
    if not d or not os.path.isdir(d):
        return False
    try:
        tmp = os.path.join(d, f".rank-{rank}.tmp")
        with open(tmp, "w") as f:
            record = {"rank": rank, "time": time.time(), "message": message, "kind": kind}
            json.dump(record, f)
        os.replace(tmp, os.path.join(d, f"rank-{rank}.json"))
    except OSError:
        return False
    return True


def peer_reported(rank: int) -> bool:
    """True if a rank other than ``rank`` has reported a failure."""
    d = os.environ.get(ERROR_DIR_ENV, "")
    if not d or not os.path.isdir(d):
        return False
    return any(n.endswith(".json") and n != f"rank-{rank}.json" for n in os.listdir(d))


def reports(errdir: str) -> list[dict[str, Any]]:
    """The failures the workers reported (rank, message, kind, time), earliest first."""
    found = []
    for p in Path(errdir).glob("rank-*.json"):
        try:
            d = json.loads(p.read_text())
            kind = str(d.get("kind", "defect" if d.get("defect") else "error"))
            found.append(
                {"time": float(d["time"]), "rank": int(d["rank"]), "message": str(d["message"])}
                | {"kind": kind}
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda r: (r["time"], r["rank"]))


def _exit_code(failures: dict[int, Any], rank: int) -> int:
    code = int(getattr(failures.get(rank), "exitcode", 1))
    return code if 0 < code < 256 else 1


def cause_of(
    failures: dict[int, Any], errdir: str, stopped: list[int] | tuple[int, ...] = ()
) -> tuple[str, int, bool]:
    """Why a group failed: (the cause, naming the rank; the exit code; whether the line is an
    error of the user's input, which stopped nothing: a ``NeorecError``).

    In this order: the first ``NeorecError`` or defect a rank reported; a rank found stopped
    (its peers' collectives timed out); the first end the agent saw that is not a peer's
    consequence (a signal, an exit code); the first lost peer a rank reported.
    """
    found = reports(errdir)
    first = next((r for r in found if r["kind"] in ("error", "defect")), None)
    if first is not None and first["kind"] == "error":
        return f"rank {first['rank']}: {first['message']}", 2, True
    if first is not None:
        cause = f"rank {first['rank']} failed: {first['message']} (traceback above)"
        return cause, _exit_code(failures, first["rank"]), False
    if stopped:
        cause = f"rank {stopped[0]} was stopped (SIGSTOP?) and its peers' collectives timed out"
        return cause, 1, False
    peers = {r["rank"] for r in found if r["kind"] == "peer"}
    own = {r: f for r, f in failures.items() if r not in peers}
    if not own and found:
        lost = found[0]
        return f"rank {lost['rank']}: {lost['message']}", 2, False
    # (Whole seconds: on a tie the first the agent saw, which it lists first.)
    pool = own or failures
    rank = min(pool, key=lambda r: pool[r].timestamp)
    code = int(pool[rank].exitcode)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}", 1, False
    if code == EXIT_INTERRUPTED:  # a SIGINT sent to that worker alone
        return f"rank {rank} was interrupted", EXIT_INTERRUPTED, False
    return (
        f"rank {rank} exited with code {code} (its output is above)",
        _exit_code(pool, rank),
        False,
    )


def failure_line(
    failures: dict[int, Any],
    errdir: str,
    stopped: list[int] | tuple[int, ...] = (),
    note: str = "",
) -> tuple[str, int]:
    """The one line and the exit code of a failed job (``failures``: global rank -> torch's
    ProcessFailure; ``stopped``: ranks found stopped; ``note``: why it was not restarted)."""
    cause, code, input_error = cause_of(failures, errdir, stopped)
    head = "neorec: " if code == EXIT_INTERRUPTED else "neorec: error: "
    tail = "" if input_error else "; the other ranks were stopped"
    return head + cause + tail + (f" ({note})" if note else ""), code


# ---- Ctrl-C and the resume command ---------------------------------------------------------
def resume_command(config: str | None, sets: list[str], nproc: int, name: str | None = None) -> str:
    """The ``neorec train`` command that continues a run from its latest checkpoint (``name``:
    the run folder's name, so that the command continues this run even after newer ones)."""
    argv = ["neorec", "train"]
    if config:
        argv += ["--config", config]
    for s in sets:
        key = s.split("=", 1)[0].strip()
        if key != "checkpoint.resume" and not (name and key == "train.name"):
            argv += ["--set", s]
    if name:
        argv += ["--set", f"train.name={name}"]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    return shlex.join([*argv, "--resume", "latest"])


def _latest_checkpoint_step(cfg: Any) -> int | None:
    """Step of the checkpoint ``--resume latest`` would restore, None if there is none."""
    from neorec.checkpoint import list_checkpoints, open_storage, resolve_checkpoint
    from neorec.train.checkpoints import checkpoint_root

    try:
        storage = open_storage(checkpoint_root(cfg), fsync=False)
        name = resolve_checkpoint(storage, "latest")
        steps = [int(m["step"]) for m in list_checkpoints(storage) if m["name"] == name]
    except (NeorecError, OSError, KeyError, ValueError):
        return None
    return steps[0] if steps else None


def interrupted_line(cfg: Any, resume: str, step: int | None, what: str = "interrupted") -> str:
    """``neorec: interrupted at step S; resume from the checkpoint of step C with: ...``."""
    head = f"neorec: {what}" + (f" at step {step}" if step is not None else "")
    if cfg is None:
        return head
    ckpt = _latest_checkpoint_step(cfg)
    if ckpt is None:
        return f"{head} (no checkpoint to resume from)"
    return f"{head}; resume from the checkpoint of step {ckpt} with: {resume}"


def step_of(exc: BaseException) -> int | None:
    """The step the trainer had finished when ``exc`` went through it (from its traceback)."""
    tb: TracebackType | None = exc.__traceback__
    step = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        value = getattr(obj, "step", None)
        if type(obj).__name__ == "Trainer" and isinstance(value, int):
            step = value
        tb = tb.tb_next
    return step
