"""Train / eval loop: NaN guard, periodic evals, the run folder's files (metrics.json, events)."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.builder import (
    apply_system,
    apply_threads,
    build_model,
    check_run,
    data_source,
    dense_optimizer,
    lr_schedule,
    qat_schedule,
    scaling_line,
)
from neorec.config import Config, ConfigError
from neorec.data.bad_rows import RECORDS_FILE
from neorec.data.batch import Batch
from neorec.data.sources import DataSource
from neorec.distributed.comm import rank_device
from neorec.errors import NeorecError
from neorec.metrics import binary_metrics
from neorec.phases import Phase
from neorec.train.checkpoints import RunProgressState, TrainerCheckpoints, preflight_resume
from neorec.train.events import EventLog
from neorec.train.losses import make_loss
from neorec.train.lowp import TrainerLowp
from neorec.train.metrics import DynamicLine, dynamic_counters
from neorec.train.pipeline import StepHook, StepOutput, TrainPipeline, make_pipeline
from neorec.train.progress import Progress, banner, eval_line, every_of, whole_batches_line
from neorec.train.runs import RunFolder, RunLog, Tee, resolve_run, utc_now
from neorec.train.sigterm import sigterm_unwinds
from neorec.train.state import TrainState, evals_from_events
from neorec.train.steps import (
    LossGuard,
    RecModel,
    Step,
    TrainingDiverged,
    evaluate,
    predict,
    train_step,
)
from neorec.train.summary import RunSummary
from neorec.train.tb import TBWriter, tensorboard_wanted
from neorec.train.towers_warmup import resolve_tower_groups

__all__ = [
    "TrainingDiverged",
    "DataSource",
    "train_step",
    "evaluate",
    "predict",
    "Progress",
    "Trainer",
    "train",
]


class Trainer(RunSummary):
    """Runs training and evaluation for a config and writes the run folder's files.

    Under torch.distributed, every rank reads the same global batches and keeps its slice
    ``[rank*b, (rank+1)*b)``; eval predictions are gathered so every rank computes the metrics of
    the whole split; rank 0 prints and writes. The run folder (``neorec.train.runs``) is the one
    ``run`` names, else the launcher's (``NEOREC_RUN_DIR``), else rank 0 resolves it from the
    config and tells the other ranks; ``self.cfg`` is the config with ``train.run_dir`` set to it.
    """

    def __init__(
        self,
        cfg: Config,
        model: RecModel | None = None,
        out: TextIO | None = None,
        run: RunFolder | None = None,
    ):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.given_cfg = cfg
        self.run = run if run is not None else self._resolve_run(cfg)
        try:
            self._setup(self.run.apply(cfg), model, out)
        except BaseException:
            self.run.discard_if_empty()  # a folder reserved for a run that never started
            raise

    def _resolve_run(self, cfg: Config) -> RunFolder:
        """The run folder; under torch.distributed without a launcher's, rank 0's choice."""
        if self.world == 1 or RunFolder.from_env() is not None:
            return resolve_run(cfg)
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [resolve_run(cfg)]
            except NeorecError as e:
                box = [e]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], NeorecError):
            raise box[0]
        return cast(RunFolder, box[0])

    def _setup(self, cfg: Config, model: RecModel | None, out: TextIO | None) -> None:
        self.cfg = cfg
        # Rank 0 prints through a Tee: the terminal, and the run's train.log once it is open.
        self.tee = Tee(out or sys.stdout) if self.rank == 0 else None
        self.out: TextIO = cast(TextIO, self.tee) if self.tee is not None else out or sys.stdout
        self.runlog: RunLog | None = None
        if self.tee is not None:
            self.tee.on_closed = self._stdout_closed
        self._host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))  # on this host
        check_run(cfg, self.world, one_host=self.world == self._host_ranks)
        self.device = rank_device(cfg.train.device)
        self._threads_line = apply_threads(cfg.train.threads, self._host_ranks)
        apply_system(cfg.system)
        self.tb: TBWriter | None = None
        self._tb_wanted = tensorboard_wanted(cfg.train.tensorboard)  # "on" and missing: refused
        # The data's checks (paths, splits, table sizes) come before the tables are built.
        self.source = data_source(cfg)
        # So does the checkpoint to resume: found, its chain read, its model compared with cfg.
        resume = preflight_resume(cfg, self.out, self.rank)
        at = None if resume is None else int(resume.manifest["step"])
        self.state = TrainState(resumed_step=at)
        total = self.total_steps()
        if resume is not None and at is not None and total is not None and at > total:
            raise ConfigError(
                f"the checkpoint to resume ({resume.path}) is at step {at}, past this run's "
                f"{total} steps (train.steps / train.epochs); a resumed run trains on from its "
                f"checkpoint: set train.steps above {at}"
            )
        self.schedule = lr_schedule(cfg, total)  # checked before the tables are built
        self.qat = qat_schedule(cfg, total)
        self.plan: Any = None
        self.tower_groups: list[list[str]] | None = None
        self.model = model if model is not None else self._build_model()
        self.opt = dense_optimizer(cfg.train, self.model.dense_parameters())
        fail = cfg.system.fail_rank_step  # fault injection for tests
        self._fail_at = fail[1] if fail is not None and fail[0] == self.rank else -1
        t = cfg.train
        self.progress = Progress(
            total, max(1, t.log_every), self.out, t.progress and self.rank == 0
        )
        run = RunProgressState(self.progress, self.schedule, self.rank, self.world)
        self.ckpt = TrainerCheckpoints.create(
            cfg, self.model, self.opt, self.state, run, self.out, resume
        )
        self.eval_every = every_of(t.eval_every, t.eval_fraction, total)
        # A periodic eval at the last step of the eval_fraction schedule is the final eval.
        self._skip_eval_at = total if not t.eval_every else None
        self._eval_s = 0.0  # seconds of the periodic evals (inside the train time)
        self.guard = LossGuard()  # the NaN guard, read at log intervals (no host sync per step)
        self.lowp: TrainerLowp | None = None
        self.events = EventLog(
            self.state, self.model, self.opt, self.world, eval_batches=t.eval_batches
        )

    def _build_model(self) -> RecModel:
        """The run's model, its towers decided first (the learned partition warms up here)."""
        cfg, rank, world = self.cfg, self.rank, self.world
        groups = resolve_tower_groups(cfg, self.source, rank, world)
        built = build_model(
            cfg, self.source, self.device, rank, world, self._host_ranks, groups=groups
        )
        self.tower_groups, self.plan = built.tower_groups, built.plan
        plan = built.plan
        if plan is not None and self.rank == 0 and self.cfg.train.progress:
            if plan.tables:
                print(plan.format_table(), file=self.out, flush=True)
            dynamic = [t.name for t in self.cfg.embedding.tables if t.kind == "dynamic"]
            if dynamic:
                print(
                    f"dynamic tables {dynamic}: row-wise by the hash of the raw id over all "
                    f"{self.world} ranks (ceil(capacity / {self.world}) slots each)",
                    file=self.out,
                    flush=True,
                )
        return cast(RecModel, built.model)

    def _local(self, batch: Batch) -> Batch:
        if self.world == 1 or getattr(self.source, "yields_local", False):
            return batch  # (a source that yields local batches read only this rank's part)
        if batch.size % self.world:
            raise ConfigError(
                f"a global batch of {batch.size} samples cannot be split over {self.world} ranks; "
                f"use a batch size and split sizes divisible by the number of ranks"
            )
        b = batch.size // self.world
        return batch.slice(self.rank * b, (self.rank + 1) * b)

    def total_steps(self) -> int | None:
        """Steps this run will take (None if the data length is unknown)."""
        if self.cfg.train.steps:
            return self.cfg.train.steps
        n = self.source.num_train_batches()
        return None if n is None else n * self.cfg.train.epochs

    def batches(self) -> Iterator[Batch]:
        """Train batches over epochs, stopping at train.steps if set (advances the position)."""
        for batch, position in self.positioned_batches():
            self.state.epoch, self.state.next_batch = position
            yield batch

    def positioned_batches(self) -> Iterator[tuple[Batch, tuple[int, int]]]:
        """Train batches from the data position on, each with the position after it.

        Stops after train.steps steps in all. Changes no trainer state, so a loader thread may
        run it ahead of training; the trainer moves its position when a batch is trained on.
        """
        limit = self.cfg.train.steps
        left = max(0, limit - self.state.step) if limit else -1
        epoch, start = self.state.position
        while left != 0 and (limit or epoch < self.cfg.train.epochs):
            produced = 0
            set_epoch = getattr(self.source, "set_epoch", None)
            if set_epoch is not None:  # sources whose order depends on the epoch (shuffled)
                set_epoch(epoch)
            for b in self.source.train_batches(start):
                if left == 0:
                    return
                produced, left = produced + 1, left - 1
                yield b, (epoch, start + produced)
            if produced == 0 and start == 0:
                d = self.cfg.data
                where = f"{d.path}: the train split" if d.path else f"the {d.source} train split"
                raise ConfigError(
                    f"{where} produced no batches (fewer samples than one batch of {d.batch_size}?)"
                )
            epoch, start = epoch + 1, 0

    def _feed(self, positions: deque[tuple[int, int]]) -> Iterator[Batch]:
        """This rank's slices of the train batches; notes each one's position (any thread)."""
        for batch, position in self.positioned_batches():
            positions.append(position)
            yield self._local(batch)

    def _config_record(self) -> dict[str, Any]:
        """The config as config.toml keeps it: as given (a resume starts from it), with the run's
        name when it has one and no checkpoint.resume (``--config runs/NAME/config.toml`` trains
        it again, in a new folder NAME-2)."""
        d = self.given_cfg.to_dict()
        d["checkpoint"]["resume"] = ""  # it trains again from the start (resume: --resume)
        if self.run.root is not None:
            d["train"]["name"], d["train"]["run_dir"] = self.run.name, ""
        return d

    def _open_run(self, total: int | None) -> None:
        """Rank 0: the run folder's files, ``latest``, and the banner."""
        if self.rank != 0 or self.tee is None:
            return
        resumed = self.state.resumed_step
        self.runlog = RunLog(self.run, self.tee)
        self.runlog.open(self._config_record(), resumed)
        if self._tb_wanted:
            self.tb = TBWriter(self.run.path, None if resumed is None else resumed + 1)
        self.events.runlog, self.events.tb = self.runlog, self.tb
        if self.tee.terminal_closed:  # closed while the run was set up: train.log has it
            self._stdout_closed(log=False)
        self._note_bad_rows(resumed is not None)
        if self.cfg.train.progress:
            dense = sum(p.numel() for p in self.model.dense_parameters())
            text = banner(
                self.cfg,
                folder=str(self.run.path),
                resumed=resumed is not None,
                world=self.world,
                dense_params=dense,
                total_steps=total,
                eval_every=self.eval_every,
                plan=self.plan,
                towers=self.tower_groups,
            )
            print(text, file=self.out, flush=True)
            lines = [self._threads_line, whole_batches_line(self.cfg), scaling_line(self.cfg)]
            if self.cfg.train.schedule.active:
                lines.append(self.schedule.describe())
            lines.append(self.qat.describe() if self.qat is not None else None)
            for line in lines:
                if line is not None:
                    print(line, file=self.out, flush=True)

    def _stdout_closed(self, log: bool = True) -> None:
        """The terminal's reader went away (``| head``): say so in train.log and events.jsonl
        (now, or when they open); training goes on."""
        note = (
            f"stdout closed at step {self.state.step} (its reader ended): training goes on, its "
            "lines in train.log"
        )
        if self.tee is not None and log:
            self.tee.log_line(note)
        if self.runlog is not None:
            self.runlog.event({"step": self.state.step, "time_utc": utc_now(), "note": note})

    def _note_bad_rows(self, resumed: bool) -> None:
        """Rank 0, ``data.bad_rows = "skip"``: the rows the source skips (the same in every pass
        and every attempt: derived from the files) listed in ``bad_rows.jsonl`` and counted in an
        event at the run's start; a resumed run keeps the first attempt's (counted once)."""
        bad = getattr(self.source, "bad_rows", None)  # (tabular sources that skip)
        if bad is None or self.runlog is None:
            return
        listed = self.run.path / RECORDS_FILE
        if not (resumed and listed.is_file()):
            bad.write(self.run.path)
        if not resumed:
            self.runlog.event({"step": 0, "time_utc": utc_now(), "bad_rows": bad.summary()})
        if bad.total and self.cfg.train.progress:
            s = bad.summary()
            print(
                f"data: skipped {s['skipped']:,} bad rows of {s['rows']:,} (listed in {listed})",
                file=self.out,
                flush=True,
            )

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, write the run folder's files; return the metrics. At the end, also
        after an error, Ctrl-C or SIGTERM (``train.sigterm``), the embedding collection's row
        stores are flushed (``_close_tables``)."""
        with sigterm_unwinds():
            ended = False
            try:
                out = self._fit()
                ended = True
                return out
            except BaseException as e:
                if self.tee is not None:  # train.log says how it ended (the terminal got the error)
                    self.tee.log_only(
                        f"stopped at step {self.state.step}: {type(e).__name__}: {e}\n"
                    )
                if self.runlog is not None:  # the step reached, for `neorec runs`
                    stop = {"step": self.state.step, "time_utc": utc_now()}
                    self.runlog.event({**stop, "stopped": type(e).__name__})
                raise
            finally:
                try:
                    self._close_tables(ended)
                finally:
                    if self.runlog is not None:
                        self.runlog.close()
                    if self.tb is not None:
                        self.tb.close()

    def _close_tables(self, ended: bool) -> None:
        """The collection's row stores flushed (a no-op for tables in memory): the store files
        hold the final rows. After a failure, Ctrl-C or SIGTERM also closed (the process ends);
        a finished run's stay open for the caller (``model.ebc`` readable; closed with it). After
        a failure a flush error is noted in train.log only: the first error is the one to see."""
        ebc = self.model.ebc
        try:
            ebc.flush()
            if not ended:
                ebc.close()
        except Exception as e:
            if ended:
                raise
            if self.tee is not None:
                self.tee.log_only(f"row stores not flushed: {type(e).__name__}: {e}\n")

    def _fit(self) -> dict[str, Any]:
        self._open_run(self.total_steps())
        if self.ckpt is not None:
            self.ckpt.resume()
        if dynamic_counters(self.model.ebc):  # dynamic tables: their counters in the progress
            self.progress.extra = DynamicLine(self.model.ebc)
        first_step = self.state.step
        self.progress.begin(first_step)
        t0 = self.progress.start
        positions: deque[tuple[int, int]] = deque()
        self.lowp = TrainerLowp.create(self.cfg, self.model, self.out, self.rank, self.world)
        pipe = self._pipeline(positions)
        self.events.start_window()
        try:
            self._train(pipe, positions)
        except BaseException:
            # Ctrl-C or an error: an in-flight checkpoint write commits (one process) or is left
            # unfinished (never visible as a checkpoint); the exception itself propagates.
            if self.ckpt is not None:
                self.ckpt.abandon(self.world)
            raise
        finally:
            self.progress.close()
            pipe.close()
            if self.lowp is not None:
                self.lowp.close()  # the probe's table and lowp.json; every site back to fp32
        self.guard.check()
        self.pipe_times = pipe.times
        self._comm = self.comm_metrics()
        if self.ckpt is not None:
            self.ckpt.close()
        train_s = time.perf_counter() - t0
        final = self.evaluate()
        self.events.event(None, {"step": self.state.step, **final}, final=True)
        self.finish_model()
        return self.summarize(final, self._evals(), self.progress, train_s, first_step)

    def _pipeline(self, positions: deque[tuple[int, int]]) -> TrainPipeline:
        """The run's pipeline: its step (the run's loss, the NaN guard) between its hooks (the
        lr schedule, LoKA's dispatch), over this rank's batches."""
        cfg = self.cfg
        hooks: list[StepHook] = []
        if cfg.train.schedule.active or cfg.train.lr_scaling != "none":
            hooks.append(self.schedule.hook(self.opt, self.model.ebc))  # both lrs, before a step
        if self.qat is not None:
            hooks.append(self.qat.hook(self.model.ebc))  # the regularizer, from its start step
        if self.lowp is not None:
            hooks.append(self.lowp)
        return make_pipeline(
            cfg.train.pipeline,
            self.model,
            self.opt,
            self._feed(positions),
            Step(make_loss(cfg.distill), self.guard),
            bf16=cfg.train.bf16_dense,
            device=self.device,
            hooks=hooks,
        )

    def _train(self, pipe: TrainPipeline, positions: deque[tuple[int, int]]) -> None:
        """Train until the batches end; after each step, its bookkeeping (``_after_step``)."""
        while True:
            self._inject_failure()
            try:
                out = pipe.progress(self.state.step + 1)
            except NeorecError:
                self.guard.check()  # a failed step after a non-finite loss: that is the cause
                raise
            if out is None:
                return
            self.state.advance(positions.popleft())
            self._after_step(out)

    def _inject_failure(self) -> None:
        """``system.fail_at`` (tests): fail, or be killed, before this rank's step."""
        if self.state.step + 1 == self._fail_at:
            if self.cfg.system.fail_at.endswith(":kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self._fail_at}")

    def _after_step(self, out: StepOutput) -> None:
        """A finished step's progress, the NaN guard's read, periodic eval, events, checkpoint."""
        st = self.state
        logged = self.progress.update(st.step, out.batch.size * self.world, out.loss)
        every = self.cfg.checkpoint.every_steps if self.ckpt is not None else 0
        # The NaN guard's host read: at log lines, and before any eval or checkpoint.
        if logged is not None or st.due(self.eval_every) or st.due(every):
            self.guard.check()
        ev = None
        if st.due(self.eval_every) and st.step != self._skip_eval_at:
            ev = self._periodic_eval()
        if logged is not None or ev is not None:
            self.events.event(logged, ev)
        if self.ckpt is not None:
            self.ckpt.after_step()

    def _periodic_eval(self) -> dict[str, Any]:
        """An eval over the first ``train.eval_batches`` batches, kept in the state's evals."""
        te, before = time.perf_counter(), self.events.counters()
        ev = {"step": self.state.step, **self.evaluate(periodic=True)}
        self._eval_s += time.perf_counter() - te
        self.events.exclude_since(before)  # the eval's traffic and cache use are not training's
        self.state.evals_count += 1  # the eval itself: in events.jsonl
        self._print_eval(ev)
        return ev

    def _evals(self) -> list[dict[str, Any]]:
        """The run's periodic evals, read back from its events.jsonl (rank 0; [] elsewhere). A
        resumed run whose file lost some said so when it resumed."""
        if self.runlog is None:
            return []
        evals = evals_from_events(self.run.path / "events.jsonl", self.state.step)
        return evals

    def finish_model(self) -> None:
        """At the end of training (every rank; after the final eval, before metrics.json): save
        the final model to ``<run folder>/model`` (a full snapshot by global rows, loadable under
        any world size; ``neorec eval | predict | export``), unless ``train.save_model`` is off."""
        if not self.cfg.train.save_model:
            return
        from neorec.serve import save_model  # serve builds on train: imported when used

        final = Path(self.cfg.train.run_dir) / "model"
        # A resumed run that had already finished replaces its model only once the new one is
        # complete: written beside it, then swapped in by rank 0.
        fresh = final.with_name("model.new") if final.exists() else final
        if fresh != final and self.rank == 0 and fresh.exists():
            shutil.rmtree(fresh)  # a swap that never happened
        if self.world > 1:
            dist.barrier()
        save_model(self.model, self.cfg, fresh, step=self.state.step)
        if fresh != final and self.rank == 0:
            old = final.with_name("model.old")
            os.replace(final, old)
            os.replace(fresh, final)
            shutil.rmtree(old)
        self.model_dir = final

    @property
    def step(self) -> int:
        """Train steps done (``self.state.step``)."""
        return self.state.step

    def _print_eval(self, e: dict[str, Any]) -> None:
        """One line of eval metrics (rank 0, progress on)."""
        if self.rank == 0 and self.cfg.train.progress:
            print(eval_line(e, self.cfg.train.eval_batches), file=self.out, flush=True)

    def evaluate(self, periodic: bool = False) -> dict[str, float]:
        """Eval metrics now (on every rank): over the whole eval split, or (``periodic``) over
        its first ``train.eval_batches`` batches."""
        source: Iterator[Batch] = iter(self.source.eval_batches())
        if periodic and self.cfg.train.eval_batches:
            source = itertools.islice(source, self.cfg.train.eval_batches)
        if not periodic:  # the final eval's progress line, when it takes a while
            shown = self.rank == 0 and self.cfg.train.progress
            with Phase("final eval", self._eval_total(), "batches", self.out, shown) as phase:
                return self._evaluate(_counted(source, phase))
        return self._evaluate(source)

    def _eval_total(self) -> int | None:
        """Batches of the eval split, when the source can tell (the progress line's ETA)."""
        counter = getattr(getattr(self.source, "data", None), "num_batches", None)
        if callable(counter):
            return int(counter("eval", self.cfg.data.batch_size))
        try:
            return len(self.source.eval)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            return None

    def _evaluate(self, source: Iterator[Batch]) -> dict[str, float]:
        dev = self.device
        batches = (self._local(b) if dev.type == "cpu" else self._local(b).to(dev) for b in source)
        if self.world == 1:
            return evaluate(self.model, batches, self.cfg.train.bf16_dense)
        state = predict(self.model, batches, self.cfg.train.bf16_dense)
        mine = list(zip(state.probs, state.labels))
        parts: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(self.world)]
        dist.all_gather_object(parts, mine)
        # Back to global sample order: global batch i is rank 0's slice i, rank 1's slice i, ...
        probs = torch.cat([p[i][0] for i in range(len(mine)) for p in parts])
        labels = torch.cat([p[i][1] for i in range(len(mine)) for p in parts])
        return binary_metrics(probs, labels)


def _counted(batches: Iterator[Batch], phase: Phase) -> Iterator[Batch]:
    """``batches``, each counted by ``phase`` once it has been used."""
    for b in batches:
        yield b
        phase.advance(1)


def train(cfg: Config, out: TextIO | None = None, run: RunFolder | None = None) -> dict[str, Any]:
    """Train and evaluate a config in its run folder (``run``, else resolved from ``cfg``)."""
    return Trainer(cfg, out=out, run=run).fit()
