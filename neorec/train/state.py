"""Where a run is: its step, its data position, the step it resumed from and its periodic evals.

``TrainState`` is what the trainer, its checkpoints and its summary share instead of the trainer
itself. A checkpoint keeps it (``state_dict``: ``step``, ``epoch``, ``next_batch`` and the number
of periodic evals, ``evals_count``) through the ``CheckpointManager`` it is registered with. The
evals themselves live in the run's ``events.jsonl``, not in memory nor in checkpoints (a long run
would otherwise grow by every eval): the summary reads them back from there at the end
(``evals_from_events``). A checkpoint written before this holds the list (``evals``): its length
is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TrainState", "evals_from_events"]


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
    evals_count: int = 0
    """Periodic evals so far (a resumed run's included); the evals are in ``events.jsonl``."""

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
        """Step, data position and the number of evals (a checkpoint's keys): constant size."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "next_batch": self.next_batch,
            "evals_count": self.evals_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's step, data position and number of evals (an older checkpoint's
        list of evals counts as its length; ``KeyError`` / ``TypeError`` / ``ValueError`` when it
        has neither)."""
        step, epoch, nxt = int(state["step"]), int(state["epoch"]), int(state["next_batch"])
        count = len(state["evals"]) if "evals" in state else int(state["evals_count"])
        self.step, self.epoch, self.next_batch, self.evals_count = step, epoch, nxt, count


def evals_from_events(path: Path, step: int) -> list[dict[str, Any]]:
    """The periodic evals of ``events.jsonl`` up to ``step``, as ``{"step": s, **metrics}`` (the
    trainer's own records; the last line of a step wins). Empty when the file is missing."""
    found: dict[int, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a cut last line (the process was killed while writing)
        if not isinstance(rec, dict) or rec.get("final") or not isinstance(rec.get("step"), int):
            continue
        metrics = {
            k[5:]: v for k, v in rec.items() if k.startswith("eval_") and k != "eval_batches"
        }
        if metrics and rec["step"] <= step:
            found[rec["step"]] = {"step": rec["step"], **metrics}
    return [found[s] for s in sorted(found)]
