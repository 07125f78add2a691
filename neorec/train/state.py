"""Where a run is: its step, its data position, the step it resumed from and its periodic evals.

``TrainState`` is what the trainer, its checkpoints and its summary share instead of the trainer
itself. A checkpoint keeps it (``state_dict``: ``step``, ``epoch``, ``next_batch``, ``evals``, the
keys checkpoints have always had) through the ``CheckpointManager`` it is registered with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Step, data position and eval history of a run (the trainer moves it; checkpoints keep it).

    The data position is the next train batch to read: batch ``next_batch`` of epoch ``epoch``
    (synthetic batches are random access, so the position is all a reader needs)."""

    step: int = 0
    """Train steps done (the last finished step)."""
    epoch: int = 0
    next_batch: int = 0
    resumed_step: int | None = None
    """The step of the checkpoint this run resumed from (None: a new run)."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The periodic evals so far: ``{"step": s, **metrics}`` each (a resumed run's included)."""

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, next batch)."""
        return self.epoch, self.next_batch

    def advance(self, position: tuple[int, int]) -> None:
        """One more step done; the data position after its batch."""
        self.step += 1
        self.epoch, self.next_batch = position

    def due(self, every: int) -> bool:
        """The step is a multiple of ``every`` (never when ``every`` is 0)."""
        return bool(every) and self.step % every == 0

    def state_dict(self) -> dict[str, Any]:
        """Step, data position and evals (a checkpoint's keys)."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "next_batch": self.next_batch,
            "evals": self.evals,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's step, data position and evals (``KeyError`` / ``TypeError`` /
        ``ValueError`` when it has none)."""
        step, epoch, nxt = int(state["step"]), int(state["epoch"]), int(state["next_batch"])
        evals = [dict(e) for e in state["evals"]]
        self.step, self.epoch, self.next_batch, self.evals = step, epoch, nxt, evals
