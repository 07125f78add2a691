"""The trainer's checkpoint hooks: periodic save, resume, and the trainer state that goes along.

Trainer state = step, data position (epoch, next batch index: synthetic batches are random access,
so the position is all a reader needs), RNG states, and the metric state (samples seen, recent
losses, periodic evals), so that a resumed run prints and writes the same metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from neorec.checkpoint.format import CheckpointError
from neorec.checkpoint.manager import CheckpointManager, rng_state, set_rng_state

__all__ = ["TrainerCheckpoints", "checkpoint_root"]


def checkpoint_root(cfg: Any) -> str:
    """checkpoint.dir, or <train.run_dir>/checkpoints."""
    return cfg.checkpoint.dir or str(Path(cfg.train.run_dir) / "checkpoints")


def _say(trainer: Any, msg: str) -> None:
    if trainer.rank == 0:
        print(msg, file=trainer.out, flush=True)


def _gather(values: list[float], world: int) -> list[list[float]]:
    """``values`` of every rank, in rank order (a collective when world > 1)."""
    if world == 1:
        return [values]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, values)
    return out


class TrainerCheckpoints:
    """Owns the CheckpointManager of a Trainer (duck-typed: cfg, model, opt, step, _epoch, ...)."""

    def __init__(self, trainer: Any) -> None:
        self.cfg = trainer.cfg
        self.manager = CheckpointManager(
            self.cfg.checkpoint, trainer.model, trainer.opt, checkpoint_root(self.cfg)
        )
        self.pauses_ms: list[float] = []

    @classmethod
    def create(cls, trainer: Any) -> TrainerCheckpoints | None:
        """Hooks when the config checkpoints or resumes, else None."""
        c = trainer.cfg.checkpoint
        return cls(trainer) if c.every_steps or c.resume else None

    def resume(self, trainer: Any, progress: Any) -> list[dict[str, Any]]:
        """Restore model + trainer state if checkpoint.resume is set; returns the evals so far."""
        which = self.cfg.checkpoint.resume
        if not which:
            return []
        try:
            extra = self.manager.restore(which)
        except CheckpointError as e:
            if which == "latest" and str(e).startswith("no complete checkpoint"):
                _say(trainer, f"resume latest: {e}; starting fresh")
                return []
            raise
        trainer.step = int(extra["step"])
        trainer._epoch, trainer._next_batch = int(extra["epoch"]), int(extra["next_batch"])
        progress.samples = int(extra["samples"])
        # losses are of each rank's own samples: take this rank's (rank 0's under another world)
        per_rank = extra["losses"]
        mine = per_rank[trainer.rank] if len(per_rank) == trainer.world else per_rank[0]
        progress.losses = [float(x) for x in mine]
        set_rng_state(extra["rng"])
        _say(trainer, f"resumed from step {trainer.step} ({which})")
        return [dict(e) for e in extra["evals"]]

    def after_step(self, trainer: Any, progress: Any, evals: list[dict[str, Any]]) -> None:
        """Checkpoint when the step is a multiple of checkpoint.every_steps."""
        every = self.cfg.checkpoint.every_steps
        if not every or trainer.step % every:
            return
        keep = max(50, progress.every)  # what the summary and the progress line read
        extra = {
            "step": trainer.step,
            "epoch": trainer._epoch,
            "next_batch": trainer._next_batch,
            "samples": progress.samples,
            "losses": _gather(progress.losses[-keep:], trainer.world),
            "evals": evals,
            "rng": rng_state(),
        }
        self.pauses_ms.append(self.manager.save(trainer.step, extra))

    def close(self) -> None:
        """Wait for the last background write."""
        self.manager.close()
