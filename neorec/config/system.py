"""Config section ``[system]``: process-wide settings of this machine's memory and native code.

They change how fast a run goes, never what it computes: every switch has a fallback that takes
bitwise the same decisions (tests compare the two). The builder applies them once per process
(``neorec.builder.run.apply_system``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from neorec.config.checks import check_fields
from neorec.errors import ConfigError

__all__ = ["SystemConfig"]


@dataclass(kw_only=True)
class SystemConfig:
    """Memory and native-code settings of the processes of a run."""

    hugepages: bool = True
    """Table weights and optimizer state on transparent huge pages (Linux), so random row
    accesses do not miss the TLB."""
    keep_heap: bool = True
    """Distributed ranks keep freed heap memory instead of returning it to the OS (no page
    faults on every step's communication buffers; resident size stays at its high-water mark)."""
    native: bool = True
    """The compiled C helpers for the dynamic tables' id map, the row cache's bookkeeping and
    its record I/O (false: the NumPy / torch paths, the same decisions, slower)."""
    fail_at: str = ""
    """Fault injection for tests: ``RANK:STEP`` makes that rank raise at that step, ``RANK:STEP:kill``
    SIGKILL itself there ("": never; a restarted group, ``--max-restarts``, never)."""

    def __post_init__(self) -> None:
        check_fields(self, "system")
        if self.fail_at and not re.fullmatch(r"\d+:\d+(:kill)?", self.fail_at):
            raise ConfigError(
                f"system.fail_at must be RANK:STEP or RANK:STEP:kill (e.g. '1:5') or empty, got "
                f"{self.fail_at!r}"
            )

    @property
    def fail_rank_step(self) -> tuple[int, int] | None:
        """``fail_at`` as (rank, step), or None."""
        if not self.fail_at:
            return None
        r, s = self.fail_at.split(":")[:2]
        return int(r), int(s)
