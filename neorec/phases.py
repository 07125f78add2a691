"""Progress of the long phases outside the training loop: building the tables (their random
initialization), eval, predict, export. The ``Marks`` protocol through which a benchmark times the
phases of a training step from outside (its null object marks nothing). Also the switch that builds tables without initializing
them (a saved model's rows overwrite every one of them).

A ``Phase`` says nothing for its first ``QUIET_S`` seconds (short phases stay quiet). Then, on a
terminal, one line redrawn in place at most every ``REDRAW_S`` seconds; elsewhere (a pipe, a
file, CI) a plain line at most every ``EVERY_S`` seconds; and one closing line with the phase's
time. With a known total the line has the fraction done and an ETA. Lines go to stderr: stdout
keeps what a command prints as its result.

The tables' initializer (``neorec.modules.collection_parts.init_rows``) reports the rows it
generates to the observers ``watch_init`` installs, whatever collection calls it (in memory,
cached, sharded).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = [
    "Phase",
    "fmt_duration",
    "eta",
    "watch_init",
    "rows_initialized",
    "no_table_init",
    "table_init_skipped",
    "Marks",
    "NO_MARKS",
    "QUIET_S",
    "EVERY_S",
    "REDRAW_S",
]

QUIET_S = 2.0
"""Seconds a phase runs before its first line (0: from its first update)."""
EVERY_S = 5.0
"""At most one line per this many seconds when the output is not a terminal."""
REDRAW_S = 0.5
"""At most one redraw per this many seconds on a terminal."""


def fmt_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h04m``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(spent: float, done: float, total: float | None) -> str | None:
    """The time left (as ``fmt_duration``) after ``done`` of ``total`` units took ``spent``
    seconds, at the same rate; None when unknown or finished."""
    if not total or done <= 0 or spent <= 0 or done >= total:
        return None
    return fmt_duration(spent / done * (total - done))


def _count(n: float) -> str:
    if n >= 10_000_000:
        return f"{n / 1e6:,.0f}M"
    return f"{int(n):,}"


class Phase:
    """Progress of one phase of ``total`` ``unit`` (None: unknown), shown as described above.

    ``with Phase("eval", total, "batches") as p: ... p.advance(1)``; ``clock`` is for tests."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "rows",
        out: TextIO | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.out = out if out is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock
        self.start = clock()
        self.done = 0
        self.shown = 0
        """Lines (or redraws) shown so far."""
        self._last = self.start
        isatty = getattr(self.out, "isatty", None)
        self.tty = bool(isatty and isatty())

    def line(self, now: float) -> str:
        """The progress line at time ``now``."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        text = f"{self.what}: {_count(self.done)}"
        if self.total:
            text += f"/{_count(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f"  {_count(rate)} {self.unit}/s  {fmt_duration(elapsed)}"
        left = eta(elapsed, self.done, self.total)
        if left is not None:
            text += f"  eta {left}"
        return text

    def announce(self) -> None:
        """Say now that the phase started (for a phase whose progress is not counted as it goes,
        known to take a while)."""
        if self.enabled:
            self._show(f"{self.what} ...", final=True)
            self._last = self.clock()

    def advance(self, n: int = 1) -> None:
        """``n`` more units done; shows a line when one is due."""
        self.done += n
        if not self.enabled:
            return
        now = self.clock()
        if now - self.start < QUIET_S:
            return
        if self.shown and now - self._last < (REDRAW_S if self.tty else EVERY_S):
            return
        self._show(self.line(now), final=False)
        self._last = now

    def _show(self, text: str, final: bool) -> None:
        if self.tty:
            self.out.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.out.write(text + "\n")
        self.out.flush()
        self.shown += 1

    def close(self, ok: bool = True) -> None:
        """The closing line (only when a line was shown: a quick phase stays quiet)."""
        if not self.enabled or not self.shown:
            return
        elapsed = self.clock() - self.start
        if ok:
            self._show(
                f"{self.what}: {_count(self.done)} {self.unit} in {fmt_duration(elapsed)}", True
            )
        elif self.tty:
            self.out.write("\n")
            self.out.flush()
        self.enabled = False

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, typ: Any, *_: Any) -> None:
        self.close(ok=typ is None)


# ---- the tables' initialization -------------------------------------------------------------------
_observers: list[Callable[[int], None]] = []
_skip = [0]


def rows_initialized(n: int) -> None:
    """Called by the initializer for every ``n`` rows it generated."""
    for f in _observers:
        f(n)


@contextmanager
def watch_init(observer: Callable[[int], None]) -> Iterator[None]:
    """Call ``observer(n)`` for the rows initialized inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


@contextmanager
def no_table_init() -> Iterator[None]:
    """Collections built inside the block leave their weights uninitialized (their optimizer
    state and step are zeroed as ever): for a caller that overwrites every row, as loading a saved
    model does."""
    _skip[0] += 1
    try:
        yield
    finally:
        _skip[0] -= 1


def table_init_skipped() -> bool:
    """Inside ``no_table_init``."""
    return _skip[0] > 0


class Marks:
    """Receives the end of each phase of a training step. A benchmark's timer (``neorec bench
    step --breakdown``) attaches a subclass from outside; this class is the null object that
    production code holds: it marks nothing and costs one call per phase."""

    def mark(self, phase: str) -> None:
        """The phase named ``phase`` ends now (the null object: nothing)."""

    def watch_backward(self, pooled: Any, out: Any) -> None:
        """Mark the phases of this step's backward from autograd hooks on the pooled lookup
        ``pooled`` and the collection's output ``out`` (the null object: nothing, no hook)."""


NO_MARKS = Marks()
"""The null ``Marks``: what every collection and step holds unless a benchmark attaches one."""
