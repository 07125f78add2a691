"""SIGTERM during a run (a scheduler's stop, the launcher stopping its workers): unwound like
Ctrl-C, so the run's files are closed and its row stores flushed, then the process ends by SIGTERM
as it did before (same exit status: the launcher's and a scheduler's view of it are unchanged).

A second SIGTERM, or one that arrives while the main thread is blocked in C code (a collective
waiting for a peer), ends the process at once, as the default action does: the handler runs only
between Python bytecodes of the main thread and puts the default action back first.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "sigterm_unwinds"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread so the run unwinds (an interruption, like
    Ctrl-C: ``train.runstatus`` says "interrupted")."""


def _raise(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated("SIGTERM")


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside the block a SIGTERM raises ``Terminated``; once it has unwound out of the block,
    the process ends by SIGTERM. Outside the main thread: nothing (signals reach only it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends here
        raise
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise:
            signal.signal(signal.SIGTERM, previous)
