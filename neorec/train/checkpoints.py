"""The trainer's checkpoint hooks: resume checks, periodic save, resume, and the trainer state.

Trainer state = step, data position (epoch, next batch index: synthetic batches are random access,
so the position is all a reader needs), RNG states, the metric state (samples seen, recent
losses, periodic evals), so that a resumed run prints and writes the same metrics, and the lr
schedule's settings (its factor is a function of the step; a resume that changes them says so).

``checkpoint.resume``: ``""`` starts a new run; ``latest`` resumes the most recently written
checkpoint under the root and is an error when there is none or it cannot be restored; ``auto``
is the same but starts a new run when the root holds no checkpoint at all; anything else is a
checkpoint directory (or a root, for its latest). ``preflight_resume`` resolves it and compares
the checkpoint's model with the config before the model is built.

Before that, a run that owns its folder (``neorec.train.runlock``: no other live run can write
it) sweeps ``<run>/checkpoints``: a checkpoint directory without a manifest, of a lineage with no
complete checkpoint there, was left by a run that died during its first checkpoint write; nothing
can resume that lineage, so it is removed, with one line saying what went. Unfinished directories
of a lineage that has complete checkpoints are its resumed run's to remove (the manager does at
its first save; the resume says so). A ``checkpoint.dir`` outside the run folder is not swept
(another run may be writing it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from neorec.checkpoint.catalog import (
    PREFIX,
    load_chain,
    parse_name,
    resolve_checkpoint,
    scan,
    split_path,
)
from neorec.checkpoint.format import MANIFEST, CheckpointError, NoCheckpointError
from neorec.checkpoint.manager import CheckpointManager, rng_state, set_rng_state
from neorec.checkpoint.restore import check_model
from neorec.checkpoint.storage import TMP_MARK, FsspecStorage, open_storage
from neorec.train.runlock import held_for_us

__all__ = [
    "TrainerCheckpoints",
    "ResumeTarget",
    "checkpoint_root",
    "preflight_resume",
    "sweep_unfinished",
]


def checkpoint_root(cfg: Any) -> str:
    """checkpoint.dir, or <run folder>/checkpoints (the Trainer sets train.run_dir to the run folder)."""
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


@dataclass
class ResumeTarget:
    """The checkpoint a run resumes from, resolved and checked once, before the model exists."""

    storage: FsspecStorage
    name: str
    manifest: dict[str, Any]
    which: str

    @property
    def path(self) -> str:
        """Where the checkpoint is (for messages)."""
        return self.storage.path(self.name)


def sweep_unfinished(cfg: Any, out: TextIO | None = None, rank: int = 0) -> list[str]:
    """Rank 0 of a run that owns its folder: remove the unfinished checkpoint directories (no
    manifest) and temporary files of dead runs from ``<run>/checkpoints``; one line says what
    went. Returns their names."""
    if rank != 0 or cfg.checkpoint.dir or not cfg.train.run_dir:
        return []
    if not held_for_us(Path(cfg.train.run_dir)):
        return []
    storage = open_storage(checkpoint_root(cfg), fsync=False)
    names = storage.listdir()
    unfinished, finished = [], set()
    for name in names:
        parsed = parse_name(name)
        if parsed is not None:
            if storage.exists(f"{name}/{MANIFEST}"):
                finished.add(parsed[1])
            else:
                unfinished.append((name, parsed[1]))
    gone = [n for n, lineage in unfinished if lineage not in finished]
    gone += [n for n in names if TMP_MARK in n]  # a file cut short directly under the root
    for name in gone:
        storage.remove(name)
    if gone and out is not None:
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        print(
            f"checkpoints: removed {len(gone)} unfinished write(s) of runs that died while "
            f"checkpointing (no {MANIFEST}, never restorable) from {storage.url}: {shown}",
            file=out,
            flush=True,
        )
    return gone


def preflight_resume(cfg: Any, out: TextIO | None = None, rank: int = 0) -> ResumeTarget | None:
    """Resolve ``checkpoint.resume`` and check the checkpoint against ``cfg``; None = new run.

    Reads manifests only (after ``sweep_unfinished``). Every failure (nothing to resume, a broken
    or unreadable latest, a model that differs) is a CheckpointError, raised before any table is
    built.
    """
    sweep_unfinished(cfg, out, rank)
    which = cfg.checkpoint.resume.strip()
    if not which:
        return None
    root = checkpoint_root(cfg)
    if which in ("latest", "auto"):
        storage = open_storage(root, fsync=False)
        try:
            name = resolve_checkpoint(storage, None)
        except NoCheckpointError as e:
            if which == "auto":
                if rank == 0 and out is not None:
                    print(f"resume auto: {e}; starting a new run", file=out, flush=True)
                return None
            raise NoCheckpointError(
                f"--resume latest: {e} to resume; drop --resume to start a new run (or use "
                f"--resume auto to resume only when there is a checkpoint)"
            ) from None
    elif which.startswith(PREFIX) and "/" not in which:
        storage, name = open_storage(root, fsync=False), which
    else:
        r, n = split_path(which)
        storage = open_storage(r, fsync=False)
        if not storage.exists(n or ""):
            raise CheckpointError(
                f"checkpoint.resume '{which}': no such checkpoint or directory; use latest, auto "
                f"or the path of a checkpoint (neorec ckpt ls ROOT lists them)"
            )
        try:
            name = resolve_checkpoint(storage, n)
        except NoCheckpointError as e:
            raise NoCheckpointError(f"checkpoint.resume '{which}': {e}") from None
    chain = load_chain(storage, name)
    check_model(storage.path(name), chain[-1]["model"], cfg.describe_model())
    return ResumeTarget(storage, name, chain[-1], which)


class TrainerCheckpoints:
    """Owns the CheckpointManager of a Trainer (duck-typed: cfg, model, opt, step, _epoch, ...)."""

    def __init__(self, trainer: Any, target: ResumeTarget | None = None) -> None:
        self.cfg = trainer.cfg
        self.target = target
        self.manager = CheckpointManager(
            self.cfg.checkpoint, trainer.model, trainer.opt, checkpoint_root(self.cfg)
        )
        model_config = self.cfg.describe_model()["model_config"]
        self.manager.extra_description = {"model_config": model_config}
        if target is None and self.cfg.checkpoint.every_steps and trainer.rank == 0:
            self._note_other_runs(trainer)

    @classmethod
    def create(cls, trainer: Any, target: ResumeTarget | None = None) -> TrainerCheckpoints | None:
        """Hooks when the config checkpoints or resumes, else None."""
        c = trainer.cfg.checkpoint
        return cls(trainer, target) if c.every_steps or target is not None else None

    def _note_other_runs(self, trainer: Any) -> None:
        """One line when a new run writes into a root that holds earlier runs' checkpoints."""
        entries = scan(self.manager.storage)
        if not entries:
            return
        done = [e.manifest for e in entries if e.manifest is not None]
        latest = max(done, key=lambda m: (m["seq"], m["created"]), default=None)
        at = f" (latest: {latest['name']}, step {latest['step']})" if latest else ""
        _say(
            trainer,
            f"checkpoints: {self.manager.storage.url} already holds {len(entries)} checkpoint "
            f"directories of earlier runs{at}; this new run keeps them and writes its own "
            f"(--resume latest would continue the latest instead)",
        )

    def resume(self, trainer: Any, progress: Any) -> list[dict[str, Any]]:
        """Restore model + trainer state from the resume target; returns the evals so far."""
        t = self.target
        if t is None:
            return []
        extra = self.manager.restore_from(t.storage, t.name)
        try:
            trainer.step = int(extra["step"])
            trainer._epoch, trainer._next_batch = int(extra["epoch"]), int(extra["next_batch"])
            samples, per_rank, rng = int(extra["samples"]), extra["losses"], extra["rng"]
            evals = [dict(e) for e in extra["evals"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{t.path}: no trainer state ({type(e).__name__}: {e}); it was not written by "
                f"neorec train: restore it with the CheckpointManager API"
            ) from None
        progress.samples = samples
        # losses are of each rank's own samples: take this rank's (rank 0's under another world)
        mine = per_rank[trainer.rank] if len(per_rank) == trainer.world else per_rank[0]
        progress.losses = [float(x) for x in mine]
        set_rng_state(rng)
        unfinished = [
            e.name for e in scan(t.storage) if e.status == "incomplete" and e.name > t.name
        ]
        note = (
            f"; ignored unfinished (no manifest): {', '.join(unfinished[:3])}" if unfinished else ""
        )
        if note and self.cfg.checkpoint.every_steps:
            note += " (removed at this run's first checkpoint)"
        _say(trainer, f"resumed from step {trainer.step} ({t.which}: {t.path}){note}")
        saved = extra.get("lr_schedule")
        changed = trainer.schedule.differences(saved) if isinstance(saved, dict) else []
        if changed:  # the lr is a function of the step: the same settings resume it exactly
            _say(
                trainer,
                f"resume: the lr schedule differs from the checkpoint's ({'; '.join(changed)}): "
                f"steps from {trainer.step + 1} on follow this run's",
            )
        return evals

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
            "lr_schedule": trainer.schedule.state_dict(),
        }
        self.manager.save(trainer.step, extra)

    def close(self) -> None:
        """Wait for the last background write."""
        self.manager.close()

    def abandon(self, world: int) -> None:
        """After an error or Ctrl-C: let an in-flight write finish (one process) or leave it.

        One process: the write is local and commits (or fails: its error is dropped, the
        original one propagates). Several ranks: the writer's collectives may never complete, so
        it is left; its directory has no manifest, is never taken as a checkpoint, and the next
        writer of this run removes it. Never raises.
        """
        m = self.manager
        if world == 1 and m._thread is not None:
            m._thread.join()
        m._thread, m._error = None, None

    @property
    def last_committed(self) -> str | None:
        """Path of the last checkpoint this process committed (rank 0), for a resume hint."""
        name = self.manager.last_committed
        return None if name is None else self.manager.storage.path(name)
