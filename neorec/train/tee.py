"""The trainer's text stream: the terminal and the run's ``train.log`` together; a terminal side
whose reader goes away (``neorec train ... | head``) stops quietly and the run goes on."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Tee", "silence"]


class Tee:
    """A text stream that writes to the terminal and (once attached) to ``train.log``.

    Before ``attach`` the log's text is kept, so lines printed while the run is being set up
    land in the log too. With a progress bar showing (``bar``), the bar is cleared before a
    line is written and drawn again after it.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.log: TextIO | None = None
        self.pending: list[str] = []
        self.bar: Any = None
        self.terminal_closed = False
        """The terminal side's reader went away (``... | head``): only train.log is written."""
        self.mid_line = False
        """The log's last text did not end a line (``print`` writes its newline separately)."""
        self.on_closed: Callable[[], None] | None = None
        """Called once when the terminal side closes (the trainer notes it in its events)."""

    def write(self, s: str) -> int:
        """Write ``s`` to both."""
        self.log_only(s)
        self._terminal(lambda: self._show(s))
        return len(s)

    def _show(self, s: str) -> None:
        bar = self.bar
        if bar is not None:
            bar.clear()
            self.stream.write(s)
            if s.endswith("\n"):
                bar.refresh()
        else:
            self.stream.write(s)

    def _terminal(self, op: Callable[[], Any]) -> None:
        """``op`` on the terminal side, unless its reader is gone: a pipe whose reader ended
        (``| head``) stops the terminal side, never the run."""
        if self.terminal_closed:
            return
        try:
            op()
        except (BrokenPipeError, ValueError):  # (ValueError: a stream closed under us)
            self.terminal_closed, self.bar = True, None
            silence(self.stream)
            if self.on_closed is not None:
                self.on_closed()

    def log_only(self, s: str) -> None:
        """Write ``s`` to train.log only (the plain progress line behind a bar)."""
        if s:
            self.mid_line = not s.endswith("\n")
        if self.log is None:
            self.pending.append(s)
        else:
            self.log.write(s)

    def log_line(self, line: str) -> None:
        """``line`` on a line of its own in train.log only (a note between a write and its
        newline starts a new line)."""
        self.log_only(("\n" if self.mid_line else "") + line + "\n")

    def flush(self) -> None:
        """Flush both."""
        self._terminal(self.stream.flush)
        if self.log is not None:
            self.log.flush()

    def isatty(self) -> bool:
        """Whether the terminal side is a terminal."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def attach(self, log: TextIO) -> None:
        """Start writing to ``log`` (after what was printed so far)."""
        log.write("".join(self.pending))  # (mid_line already follows the pending text)
        log.flush()
        self.pending, self.log = [], log


def silence(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (its reader has gone): later writes and
    the interpreter's last flush of it go nowhere instead of raising ``BrokenPipeError``."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a StringIO): nothing to point elsewhere
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
