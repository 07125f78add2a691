"""Fault and fuzz campaigns: every case a user can cause or suffer, classified by its outcome.

A campaign runs many bad inputs (or crashes) and records what happened to each:

- ``clear error``: refused with a ``NeorecError`` (the CLI: a non-zero exit and one line on stderr,
  no traceback) whose message names what was wrong;
- ``handled``: a case with a specified non-error outcome that was met (a skipped line counted
  exactly, a resume equal to the uninterrupted run);
- ``crash``: any other exception or a traceback;
- ``silently accepted``: no error where one was due;
- ``data lost``: something that was there before is gone or changed (weights after a rejected
  batch, another run's checkpoints).

The last three must stay at 0. Each campaign test ends with ``campaign.check()``, which fails
listing every offending case; the session summary prints the counts per campaign (and
``NEOREC_FAULTS_JSON=path`` writes them as JSON).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neorec.errors import NeorecError

OUTCOMES = ("clear error", "handled", "crash", "silently accepted", "data lost")
BAD = ("crash", "silently accepted", "data lost")

REGISTRY: dict[str, Campaign] = {}


@dataclass
class Case:
    """One tried input and what came of it."""

    name: str
    outcome: str
    detail: str = ""


@dataclass
class Campaign:
    """The cases of one campaign (created once per name, shared by its tests)."""

    name: str
    cases: list[Case] = field(default_factory=list)

    def record(self, name: str, outcome: str, detail: str = "") -> str:
        """Note a case's outcome; returns it."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.cases.append(Case(name, outcome, detail[:500]))
        return outcome

    def expect_error(
        self, name: str, fn: Callable[[], Any], match: str | tuple[str, ...] = ""
    ) -> str:
        """Run ``fn``, which must raise a one-line ``NeorecError`` (containing ``match``)."""
        try:
            fn()
        except NeorecError as e:
            return self.record(name, *_judge_message(str(e), match))
        except Exception as e:  # noqa: BLE001 - a crash is what we are counting
            return self.record(name, "crash", f"{type(e).__name__}: {e}")
        return self.record(name, "silently accepted", "no error raised")

    def expect_cli_error(
        self,
        name: str,
        argv: list[str],
        match: str | tuple[str, ...] = "",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 120,
    ) -> str:
        """Run ``neorec ARGV`` in a subprocess: it must exit non-zero with one error line."""
        r = run_cli(argv, env=env, cwd=cwd, timeout=timeout)
        return self.record(name, *judge_cli(r, match))

    def counts(self) -> dict[str, int]:
        """Cases per outcome, plus ``tried``."""
        out = {"tried": len(self.cases)}
        out.update({o: sum(c.outcome == o for c in self.cases) for o in OUTCOMES})
        return out

    def check(self) -> None:
        """Fail listing every case whose outcome is a crash, a silent acceptance or a loss."""
        bad = [c for c in self.cases if c.outcome in BAD]
        assert not bad, f"{self.name}: " + "; ".join(
            f"[{c.outcome}] {c.name}: {c.detail}" for c in bad
        )


def campaign(name: str) -> Campaign:
    """The campaign called ``name`` (one per name for the whole session)."""
    if name not in REGISTRY:
        REGISTRY[name] = Campaign(name)
    return REGISTRY[name]


def _judge_message(msg: str, match: str | tuple[str, ...]) -> tuple[str, str]:
    wanted = (match,) if isinstance(match, str) else match
    if "\n" in msg.strip():
        return "crash", f"multi-line message: {msg!r}"
    missing = [m for m in wanted if m and m not in msg]
    if missing:
        return "crash", f"message lacks {missing}: {msg!r}"
    return "clear error", msg


def run_cli(
    argv: list[str],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``python -m neorec ARGV`` with one thread and the given extra environment."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "neorec", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        cwd=cwd,
    )


def judge_cli(
    r: subprocess.CompletedProcess[str], match: str | tuple[str, ...] = ""
) -> tuple[str, str]:
    """Outcome of a CLI run that had to fail: one line on stderr naming it, no traceback."""
    err = r.stderr.strip()
    if r.returncode == 0:
        return "silently accepted", f"exit 0; stdout tail: {r.stdout[-300:]!r}"
    if "Traceback" in err:
        return "crash", f"exit {r.returncode}; {err[-600:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    if not errors:
        return "crash", f"exit {r.returncode}, no error line; stderr {err[-300:]!r}"
    return _judge_message(errors[-1], match)
