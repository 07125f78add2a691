"""The trainer's checkpoint hooks: resume checks, periodic save, resume.

A checkpoint keeps, beside the model, the run's ``TrainState`` (step, data position, periodic
evals) and its ``RunProgressState`` (samples seen, recent losses, RNG states, the lr schedule's
settings: its factor is a function of the step; a resume that changes them says so), both
registered with the ``CheckpointManager``, so that a resumed run prints and writes the same
metrics.

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

import torch
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
from neorec.config import Config
from neorec.modules.schedule import LrSchedule
from neorec.train.progress import Progress
from neorec.train.runlock import held_for_us
from neorec.train.state import TrainState, evals_from_events

__all__ = [
    "TrainerCheckpoints",
    "RunProgressState",
    "ResumeTarget",
    "checkpoint_root",
    "preflight_resume",
    "sweep_unfinished",
]


def checkpoint_root(cfg: Any) -> str:
    """checkpoint.dir, or <run folder>/checkpoints (the Trainer sets train.run_dir to the run folder)."""
    return cfg.checkpoint.dir or str(Path(cfg.train.run_dir) / "checkpoints")


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


class RunProgressState:
    """What a checkpoint keeps of a run besides its ``TrainState``: the progress's samples and
    recent losses (every rank's, gathered), the RNG states and the lr schedule's settings. A
    ``Stateful`` registered with the ``CheckpointManager``."""

    def __init__(self, progress: Progress, schedule: LrSchedule, rank: int, world: int) -> None:
        self.progress, self.schedule, self.rank, self.world = progress, schedule, rank, world
        self.saved_schedule: dict[str, Any] | None = None
        """The restored checkpoint's lr schedule settings (None: none restored)."""

    def state_dict(self) -> dict[str, Any]:
        """Samples, each rank's recent losses (a collective), RNG states, schedule settings."""
        return {
            "samples": self.progress.samples,
            "losses": _gather(self.progress.losses, self.world),  # the last ``keep``
            "rng": rng_state(),
            "lr_schedule": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the progress and the RNG states of a checkpoint."""
        samples, per_rank, rng = int(state["samples"]), state["losses"], state["rng"]
        # losses are of each rank's own samples: take this rank's (rank 0's under another world)
        mine = per_rank[self.rank] if len(per_rank) == self.world else per_rank[0]
        losses = [float(x) for x in mine]
        self.progress.samples, self.progress.losses = samples, losses
        set_rng_state(rng)
        saved = state.get("lr_schedule")
        self.saved_schedule = saved if isinstance(saved, dict) else None


class TrainerCheckpoints:
    """Check-N-Run for a run: the ``CheckpointManager`` of its model and dense optimizer, with
    the run's ``TrainState`` and progress registered; resume and periodic save."""

    def __init__(
        self,
        cfg: Config,
        model: Any,
        opt: torch.optim.Optimizer,
        state: TrainState,
        run: RunProgressState,
        out: TextIO,
        target: ResumeTarget | None = None,
    ) -> None:
        self.cfg, self.state, self.run, self.out, self.target = cfg, state, run, out, target
        self.manager = CheckpointManager(cfg.checkpoint, model, opt, checkpoint_root(cfg))
        model_config = cfg.describe_model()["model_config"]
        self.manager.extra_description = {"model_config": model_config}
        self.manager.register("trainer", state)
        self.manager.register("progress", run)
        if target is None and cfg.checkpoint.every_steps:
            self._note_other_runs()

    @classmethod
    def create(
        cls,
        cfg: Config,
        model: Any,
        opt: torch.optim.Optimizer,
        state: TrainState,
        run: RunProgressState,
        out: TextIO,
        target: ResumeTarget | None = None,
    ) -> TrainerCheckpoints | None:
        """Hooks when the config checkpoints or resumes, else None."""
        c = cfg.checkpoint
        if not c.every_steps and target is None:
            return None
        return cls(cfg, model, opt, state, run, out, target)

    def _say(self, msg: str) -> None:
        if self.run.rank == 0:
            print(msg, file=self.out, flush=True)

    def _note_other_runs(self) -> None:
        """One line when a new run writes into a root that holds earlier runs' checkpoints."""
        if self.run.rank != 0:
            return
        entries = scan(self.manager.storage)
        if not entries:
            return
        done = [e.manifest for e in entries if e.manifest is not None]
        latest = max(done, key=lambda m: (m["seq"], m["created"]), default=None)
        at = f" (latest: {latest['name']}, step {latest['step']})" if latest else ""
        self._say(
            f"checkpoints: {self.manager.storage.url} already holds {len(entries)} checkpoint "
            f"directories of earlier runs{at}; this new run keeps them and writes its own "
            f"(--resume latest would continue the latest instead)",
        )

    def resume(self) -> None:
        """Restore the model, the ``TrainState`` and the progress from the resume target."""
        t = self.target
        if t is None:
            return
        self.manager.restore_from(t.storage, t.name)
        unfinished = [
            e.name for e in scan(t.storage) if e.status == "incomplete" and e.name > t.name
        ]
        note = (
            f"; ignored unfinished (no manifest): {', '.join(unfinished[:3])}" if unfinished else ""
        )
        if note and self.cfg.checkpoint.every_steps:
            note += " (removed at this run's first checkpoint)"
        step = self.state.step
        self._say(f"resumed from step {step} ({t.which}: {t.path}){note}")
        self._evals_back(step)
        saved = self.run.saved_schedule
        changed = self.run.schedule.differences(saved) if saved is not None else []
        if changed:  # the lr is a function of the step: the same settings resume it exactly
            self._say(
                f"resume: the lr schedule differs from the checkpoint's ({'; '.join(changed)}): "
                f"steps from {step + 1} on follow this run's",
            )

    def _evals_back(self, step: int) -> None:
        """Check that the run's ``events.jsonl`` holds the periodic evals before ``step`` (a
        checkpoint holds their number, not them; the summary reads them there); one line when
        some are missing."""
        st = self.state
        path = Path(self.cfg.train.run_dir) / "events.jsonl"
        held = len(evals_from_events(path, step)) if st.evals_count else 0
        if held != st.evals_count:
            self._say(
                f"resume: {path} holds {held} of the {st.evals_count} periodic evals "
                f"before step {step}; metrics.json lists those it holds"
            )

    def after_step(self) -> None:
        """Checkpoint when the step is a multiple of checkpoint.every_steps."""
        if self.state.due(self.cfg.checkpoint.every_steps):
            self.manager.save(self.state.step)

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
