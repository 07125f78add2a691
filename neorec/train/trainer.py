"""Train / eval loop: NaN guard, periodic evals, the run folder's files (metrics.json, events)."""

from __future__ import annotations

import functools
import inspect
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

from neorec.build import (
    apply_system,
    build_model,
    check_run,
    data_source,
    dense_optimizer,
    lr_schedule,
    scaling_line,
)
from neorec.config import Config, ConfigError
from neorec.data.batch import Batch
from neorec.data.sources import DataSource
from neorec.distributed.comm import rank_device
from neorec.errors import NeorecError
from neorec.metrics import binary_metrics
from neorec.train.metrics import DynamicLine, dynamic_counters, dynamic_fields
from neorec.train.pipeline import make_pipeline
from neorec.train.progress import Progress, banner, eval_line, every_of
from neorec.train.runs import RunFolder, RunLog, Tee, resolve_run, utc_now
from neorec.train.steps import (
    LossGuard,
    RecModel,
    TrainingDiverged,
    evaluate,
    predict,
    train_step,
)
from neorec.train.summary import RunSummary
from neorec.train.tb import TBWriter, tensorboard_wanted

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
        self._host_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))  # on this host
        check_run(cfg, self.world, one_host=self.world == self._host_ranks)
        self.device = rank_device(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        apply_system(cfg.system)
        self.tb: TBWriter | None = None
        self._tb_wanted = tensorboard_wanted(cfg.train.tensorboard)  # "on" and missing: refused
        # The data's checks (paths, splits, table sizes) come before the tables are built.
        self.source = data_source(cfg)
        from neorec.train.checkpoints import TrainerCheckpoints, preflight_resume

        # So does the checkpoint to resume: found, its chain read, its model compared with cfg.
        resume = preflight_resume(cfg, self.out, self.rank)
        self._resumed_step = None if resume is None else int(resume.manifest["step"])
        total, at = self.total_steps(), self._resumed_step
        if resume is not None and at is not None and total is not None and at > total:
            raise ConfigError(
                f"the checkpoint to resume ({resume.path}) is at step {at}, past this run's "
                f"{total} steps (train.steps / train.epochs); a resumed run trains on from its "
                f"checkpoint: set train.steps above {at}"
            )
        self.schedule = lr_schedule(cfg, total)  # checked before the tables are built
        self.plan: Any = None
        self.tower_groups: list[list[str]] | None = None
        self.model = model if model is not None else self._build_model()
        self.opt = dense_optimizer(cfg.train, self.model.dense_parameters())
        self.step = 0
        fail = cfg.system.fail_rank_step  # fault injection for tests
        self._fail_at = fail[1] if fail is not None and fail[0] == self.rank else -1
        self._epoch = self._next_batch = 0  # data position: the next batch to read (checkpointed)
        self.ckpt = TrainerCheckpoints.create(self, resume)
        self.eval_every = every_of(
            cfg.train.eval_every, cfg.train.eval_fraction, self.total_steps()
        )
        self._window: dict[str, float] = {}
        self._eval_s = 0.0  # seconds of the periodic evals (inside the train time)

    def _build_model(self) -> RecModel:
        built = build_model(
            self.cfg, self.source, self.device, self.rank, self.world, self._host_ranks
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
            self._epoch, self._next_batch = position
            yield batch

    def positioned_batches(self) -> Iterator[tuple[Batch, tuple[int, int]]]:
        """Train batches from the data position on, each with the position after it.

        Stops after train.steps steps in all. Changes no trainer state, so a loader thread may
        run it ahead of training; the trainer moves its position when a batch is trained on.
        """
        limit = self.cfg.train.steps
        left = max(0, limit - self.step) if limit else -1
        epoch, start = self._epoch, self._next_batch
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
                raise ConfigError("the train split produced no batches (too few samples?)")
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
        self.runlog = RunLog(self.run, self.tee)
        self.runlog.open(self._config_record(), self._resumed_step)
        if self._tb_wanted:
            resumed = self._resumed_step
            self.tb = TBWriter(self.run.path, None if resumed is None else resumed + 1)
        if self.cfg.train.progress:
            dense = sum(p.numel() for p in self.model.dense_parameters())
            text = banner(
                self.cfg,
                folder=str(self.run.path),
                resumed=self._resumed_step is not None,
                world=self.world,
                dense_params=dense,
                total_steps=total,
                eval_every=self.eval_every,
                plan=self.plan,
                towers=self.tower_groups,
            )
            print(text, file=self.out, flush=True)
            lines = [scaling_line(self.cfg)]
            if self.cfg.train.schedule.active:
                lines.append(self.schedule.describe())
            for line in lines:
                if line is not None:
                    print(line, file=self.out, flush=True)

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, write the run folder's files; return the metrics."""
        try:
            return self._fit()
        except BaseException as e:
            if self.tee is not None:  # train.log says how it ended (the terminal got the error)
                self.tee.log_only(f"stopped at step {self.step}: {type(e).__name__}: {e}\n")
            raise
        finally:
            if self.runlog is not None:
                self.runlog.close()
            if self.tb is not None:
                self.tb.close()

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        total = self.total_steps()
        progress = Progress(
            total,
            max(1, cfg.train.log_every),
            self.out,
            cfg.train.progress and self.rank == 0,
        )
        self._open_run(total)
        evals = self.ckpt.resume(self, progress) if self.ckpt is not None else []
        if dynamic_counters(self.model.ebc):  # dynamic tables: their counters in the progress
            progress.extra = DynamicLine(self.model.ebc)
        first_step = self.step
        # A periodic eval at the last step of the eval_fraction schedule is the final eval.
        skip_last = total if not cfg.train.eval_every else None
        progress.begin(self.step)
        t0 = progress.start
        positions: deque[tuple[int, int]] = deque()
        from neorec.train.lowp import TrainerLowp

        self.lowp = TrainerLowp.create(self)
        step_fn: Any = train_step
        if cfg.distill.enabled:  # an ExFM student: the FM's logits come with the batches
            step_fn = functools.partial(train_step, distill=cfg.distill)
        self.guard = LossGuard()  # the NaN guard, read at log intervals (no host sync per step)
        if "guard" in inspect.signature(step_fn).parameters:  # (a custom step checks itself)
            step_fn = functools.partial(step_fn, guard=self.guard)
        step_fn = step_fn if self.lowp is None else self.lowp.wrap(step_fn)
        if cfg.train.schedule.active or cfg.train.lr_scaling != "none":
            step_fn = self.schedule.wrap(step_fn, self.model.ebc)  # both lrs, before each step
        pipe = make_pipeline(
            cfg.train.pipeline,
            self.model,
            self.opt,
            self._feed(positions),
            step_fn,
            bf16=cfg.train.bf16_dense,
            device=self.device,
        )
        self._window = self._counters()
        try:
            while True:
                if self.step + 1 == self._fail_at:
                    if self.cfg.system.fail_at.endswith(":kill"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError(
                        f"injected failure on rank {self.rank} at step {self._fail_at}"
                    )
                try:
                    out = pipe.progress(self.step + 1)
                except NeorecError:
                    self.guard.check()  # a failed step after a non-finite loss: that is the cause
                    raise
                if out is None:
                    break
                self.step += 1
                self._epoch, self._next_batch = positions.popleft()
                logged = progress.update(self.step, out.batch.size * self.world, out.loss)
                ev, every = None, cfg.checkpoint.every_steps if self.ckpt is not None else 0
                # The NaN guard's host read: at log lines, and before any eval or checkpoint.
                if logged is not None or self._due(self.eval_every) or self._due(every):
                    self.guard.check()
                if self.eval_every and self.step % self.eval_every == 0 and self.step != skip_last:
                    te, c0 = time.perf_counter(), self._counters()
                    ev = {"step": self.step, **self.evaluate(periodic=True)}
                    self._eval_s += time.perf_counter() - te
                    c1 = self._counters()  # the eval's traffic and cache use are not training's
                    for k in ("bytes", "wait_s", "hits", "misses"):
                        if k in c1:
                            self._window[k] = self._window.get(k, 0.0) + c1[k] - c0[k]
                    evals.append(ev)
                    self._print_eval(ev)
                if logged is not None or ev is not None:
                    self._event(logged, ev)
                if self.ckpt is not None:
                    self.ckpt.after_step(self, progress, evals)
        except BaseException:
            # Ctrl-C or an error: an in-flight checkpoint write commits (one process) or is left
            # unfinished (never visible as a checkpoint); the exception itself propagates.
            if self.ckpt is not None:
                self.ckpt.abandon(self.world)
            raise
        finally:
            progress.close()
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
        self._event(None, {"step": self.step, **final}, final=True)
        self.finish_model()
        return self.summarize(final, evals, progress, train_s, first_step)

    def _due(self, every: int) -> bool:
        return bool(every) and self.step % every == 0

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
        save_model(self.model, self.cfg, fresh, step=self.step)
        if fresh != final and self.rank == 0:
            old = final.with_name("model.old")
            os.replace(final, old)
            os.replace(fresh, final)
            shutil.rmtree(old)
        self.model_dir = final

    def _counters(self) -> dict[str, float]:
        """Running totals this rank can read without a collective: bytes it sent and seconds it
        waited on communication (distributed), row cache hits and misses (a cached model)."""
        out: dict[str, float] = {"step": float(self.step)}
        stats = self.model.comm_stats
        if stats is not None and self.world > 1:
            out["bytes"] = float(sum(stats.bytes_sent.values()))
            out["wait_s"] = float(sum(stats.wait_s.values()))
        s = self.model.ebc.stats()
        if s:  # a row cache's hits and misses; dynamic tables' counters
            out["hits"], out["misses"] = float(s.get("hits", 0)), float(s.get("misses", 0))
            out.update(dynamic_counters(self.model.ebc))
        return out

    def _event(
        self, logged: dict[str, Any] | None, ev: dict[str, Any] | None, final: bool = False
    ) -> None:
        """One line of events.jsonl (rank 0): the logged step's values since the previous line,
        and the eval's metrics when there was one at this step."""
        if self.runlog is None:
            return
        rec: dict[str, Any] = {"step": self.step, "time_utc": utc_now()}
        if logged is not None:
            rec.update(logged)
            rec["lr"] = float(self.opt.param_groups[0]["lr"])
            rec["embedding_lr"] = float(self.model.ebc.optimizer.lr)
            now, before = self._counters(), self._window
            steps = max(1.0, now["step"] - before.get("step", 0.0))
            if "bytes" in now:
                rec["comm_bytes_per_step"] = (now["bytes"] - before.get("bytes", 0.0)) / steps
                waited = now["wait_s"] - before.get("wait_s", 0.0)
                rec["comm_wait_ms_per_step"] = 1000 * waited / steps
            if "hits" in now:
                hits = now["hits"] - before.get("hits", 0.0)
                misses = now["misses"] - before.get("misses", 0.0)
                rec["cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
            rec.update(dynamic_fields(now, before, steps))
            self._window = now
        if ev is not None:
            rec.update({f"eval_{k}": v for k, v in ev.items() if k != "step"})
            if final:
                rec["final"] = True
            elif self.cfg.train.eval_batches:
                rec["eval_batches"] = self.cfg.train.eval_batches
        self.runlog.event(rec)
        if self.tb is not None:
            self.tb.event(rec)

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


def train(cfg: Config, out: TextIO | None = None, run: RunFolder | None = None) -> dict[str, Any]:
    """Train and evaluate a config in its run folder (``run``, else resolved from ``cfg``)."""
    return Trainer(cfg, out=out, run=run).fit()
