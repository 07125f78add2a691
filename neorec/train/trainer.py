"""Train / eval loop: progress line, NaN guard, metrics.json."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from neorec.config import Config, ConfigError
from neorec.data.batch import Batch
from neorec.distributed.dense_blocks import block_dense, blocks_of, per_block
from neorec.errors import NeorecError
from neorec.modules.dlrm import build_dlrm
from neorec.sparse import SparseFeatures
from neorec.train.metrics import MetricState, binary_metrics
from neorec.train.pipeline import PipelineTimes, make_pipeline
from neorec.train.sources import DataSource, make_source

__all__ = [
    "TrainingDiverged",
    "DataSource",
    "make_source",
    "make_dense_optimizer",
    "train_step",
    "evaluate",
    "Trainer",
    "train",
]


class TrainingDiverged(NeorecError, RuntimeError):
    """The loss became NaN or infinite."""


class RecModel(Protocol):
    """What the trainer needs of a model (unsharded DLRM or its distributed form)."""

    def __call__(self, dense: Tensor, sparse: SparseFeatures) -> Tensor: ...

    def train(self, mode: bool = True) -> Any: ...

    def dense_parameters(self) -> Iterator[nn.Parameter]: ...


def make_dense_optimizer(cfg: Config, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch.optim optimizer for dense parameters."""
    lr = cfg.train.dense_lr
    kind = cfg.train.dense_optimizer
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def train_step(
    model: RecModel, opt: torch.optim.Optimizer, batch: Batch, step: int, bf16: bool = False
) -> Tensor:
    """Forward, loss, backward (the fused embedding update runs inside), dense optimizer step."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    with ctx:
        logits = model(batch.dense, batch.sparse)
    # The mean over the batch, as the mean of the dense blocks' means (the same number: blocks
    # are equal): each sample's loss gradient then comes from a tensor of the block's size.
    parts = per_block(
        F.binary_cross_entropy_with_logits, blocks_of(model), logits.float(), batch.labels
    )
    loss = parts[0] if len(parts) == 1 else torch.stack(parts).mean()
    value = loss.detach()
    # note: a host sync; refusing a non-finite loss before backward keeps the tables clean.
    if not math.isfinite(float(value)):
        raise TrainingDiverged(
            f"loss became {float(value)} at step {step}; lower the learning rates "
            f"(embedding.lr, train.dense_lr) or check the input data"
        )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return value


@torch.no_grad()
def predict(model: RecModel, batches: Iterator[Batch], bf16: bool = False) -> MetricState:
    """Predicted probabilities and labels over ``batches``."""
    model.train(False)
    state = MetricState()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    blocks = blocks_of(model)
    for batch in batches:
        with ctx:
            logits = model(batch.dense, batch.sparse)
        state.update(torch.cat(per_block(torch.sigmoid, blocks, logits.float())), batch.labels)
    model.train(True)
    return state


def evaluate(model: RecModel, batches: Iterator[Batch], bf16: bool = False) -> dict[str, float]:
    """Metrics of the model's predictions over ``batches``."""
    return predict(model, batches, bf16).compute()


def _injected_failure(rank: int) -> int:
    """Step at which this rank must fail (``NEOREC_FAIL_AT=rank:step``, for failure tests)."""
    spec = os.environ.get("NEOREC_FAIL_AT", "")
    if not spec:
        return -1
    r, st = (int(x) for x in spec.split(":"))
    return st if r == rank else -1


@dataclass
class Progress:
    """Prints a progress line with samples/s."""

    total: int | None
    every: int
    out: TextIO = field(default_factory=lambda: sys.stdout)
    enabled: bool = True
    start: float = field(default_factory=time.perf_counter)
    samples: int = 0
    losses: list[float] = field(default_factory=list)
    start_samples: int = 0
    """Samples already trained when this process began (a resumed run's), left out of rates."""

    def begin(self) -> None:
        """Start the clock: rates count what this process trains from now on."""
        self.start, self.start_samples = time.perf_counter(), self.samples

    def rate(self, elapsed: float) -> float:
        """Samples per second this process trained over ``elapsed`` seconds."""
        return (self.samples - self.start_samples) / max(elapsed, 1e-9)

    def update(self, step: int, batch_size: int, loss: Tensor) -> None:
        """Record a step; print every ``every`` steps."""
        self.samples += batch_size
        self.losses.append(float(loss))
        if not self.enabled or (step % self.every and step != self.total):
            return
        elapsed = time.perf_counter() - self.start
        rate = self.rate(elapsed)
        recent = self.losses[-self.every :]
        total = f"/{self.total}" if self.total else ""
        print(
            f"step {step}{total}  loss {sum(recent) / len(recent):.4f}  "
            f"{rate:,.0f} samples/s  {elapsed:.1f}s",
            file=self.out,
            flush=True,
        )


def _memory_mb() -> dict[str, float]:
    """Peak RSS of this process, and its RSS now split into anonymous memory (what it owns) and
    file-backed pages (mapped store files: page cache the kernel can reclaim), in MiB."""
    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[f"{key[3:].lower()}_rss_mb"] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


class Trainer:
    """Runs training and evaluation for a config and writes metrics.json.

    Under torch.distributed, every rank reads the same global batches and keeps its slice
    ``[rank*b, (rank+1)*b)``; eval predictions are gathered so every rank computes the metrics of
    the whole split; rank 0 prints and writes.
    """

    def __init__(self, cfg: Config, model: RecModel | None = None, out: TextIO | None = None):
        self.cfg = cfg
        self.out = out or sys.stdout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if cfg.data.batch_size % self.world:
            raise ConfigError(
                f"data.batch_size {cfg.data.batch_size} must be divisible by the {self.world} ranks"
            )
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        from neorec.config import check_trainable
        from neorec.modules.embedding import check_tables_memory

        check_trainable(cfg)  # one dim, the dense part's size, splits of at least one batch
        if self.world == int(os.environ.get("LOCAL_WORLD_SIZE", self.world)):  # one host
            check_tables_memory(cfg.embedding.tables, cfg.embedding.optimizer)
        if self.world == 1 and cfg.sharding.plan:
            from neorec.sharding.types import ShardingPlan

            # Read and checked although one process shards nothing: a plan for N ranks is
            # refused (it says to run --nproc N), not ignored.
            ShardingPlan.load(cfg.sharding.plan, tables=cfg.embedding.tables, world_size=1)
        # The data's checks (paths, splits, table sizes) come before the tables are built.
        self.source = make_source(cfg)
        from neorec.checkpoint.hooks import TrainerCheckpoints, preflight_resume

        # So does the checkpoint to resume: found, its chain read, its model compared with cfg.
        resume = preflight_resume(cfg, self.out, self.rank)
        self.model = model if model is not None else self._build_model()
        self.opt = make_dense_optimizer(cfg, self.model.dense_parameters())
        self.step = 0
        self._fail_at = _injected_failure(self.rank)
        self._epoch = self._next_batch = 0  # data position: the next batch to read (checkpointed)
        self.ckpt = TrainerCheckpoints.create(self, resume)

    def _build_model(self) -> RecModel:
        if self.world == 1:
            model = build_dlrm(self.cfg)
            if self.cfg.train.dense_blocks > 1:
                # The dense gradient summed in the blocks' tree: what N ranks compute (bitwise).
                block_dense(model.dense_arch, self.cfg.train.dense_blocks)
            return model
        from neorec.distributed.model_parallel import (
            DistributedModel,
            check_same_everywhere,
            resolve_plan,
        )

        check_same_everywhere("configs", self.cfg.to_dict())
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        plan = resolve_plan(self.cfg, self.world, local)
        check_same_everywhere("sharding plans", plan.to_dict())
        if self.rank == 0 and self.cfg.train.progress:
            print(plan.format_table(), file=self.out, flush=True)
        self.plan = plan
        return DistributedModel(self.cfg, plan)

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

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, write metrics.json; return the metrics."""
        cfg = self.cfg
        progress = Progress(
            self.total_steps(),
            max(1, cfg.train.log_every),
            self.out,
            cfg.train.progress and self.rank == 0,
        )
        evals = self.ckpt.resume(self, progress) if self.ckpt is not None else []
        first_step = self.step
        progress.begin()
        t0 = progress.start
        positions: deque[tuple[int, int]] = deque()
        from neorec.lowp.hooks import TrainerLowp

        self.lowp = TrainerLowp.create(self)
        step_fn = train_step if self.lowp is None else self.lowp.wrap(train_step)
        pipe = make_pipeline(
            cfg.train.pipeline,
            self.model,
            self.opt,
            self._feed(positions),
            step_fn,
            bf16=cfg.train.bf16_dense,
        )
        try:
            while True:
                if self.step + 1 == self._fail_at:
                    raise RuntimeError(
                        f"injected failure on rank {self.rank} at step {self._fail_at}"
                    )
                out = pipe.progress(self.step + 1)
                if out is None:
                    break
                self.step += 1
                self._epoch, self._next_batch = positions.popleft()
                progress.update(self.step, out.batch.size * self.world, out.loss)
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    evals.append({"step": self.step, **self.evaluate()})
                    self._print_eval(evals[-1])
                if self.ckpt is not None:
                    self.ckpt.after_step(self, progress, evals)
        except BaseException:
            # Ctrl-C or an error: an in-flight checkpoint write commits (one process) or is left
            # unfinished (never visible as a checkpoint); the exception itself propagates.
            if self.ckpt is not None:
                self.ckpt.abandon(self.world)
            raise
        finally:
            pipe.close()
            if self.lowp is not None:
                self.lowp.close()  # the probe's table and lowp.json; every site back to fp32
        self.pipe_times = pipe.times
        self._comm = self.comm_metrics()
        if self.ckpt is not None:
            self.ckpt.close()
        train_s = time.perf_counter() - t0
        final = self.evaluate()
        return self.summarize(final, evals, progress, train_s, first_step)

    def _print_eval(self, e: dict[str, Any]) -> None:
        """One line of eval metrics (rank 0, progress on)."""
        if self.rank == 0 and self.cfg.train.progress:
            print(
                f"eval at step {e['step']}  auc {e['auc']:.4f}  logloss {e['logloss']:.4f}  "
                f"ne {e['ne']:.4f}  calibration {e['calibration']:.3f}",
                file=self.out,
                flush=True,
            )

    def evaluate(self) -> dict[str, float]:
        """Eval metrics now (over the whole eval split, on every rank)."""
        batches = (self._local(b) for b in self.source.eval_batches())
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

    def comm_metrics(self) -> dict[str, Any]:
        """Pipeline and wire codecs; bytes sent per step (all ranks) and ms per step waiting on
        communication, data, codecs, and the rest (compute), over training so far (collective)."""
        c, times = self.cfg.comm, getattr(self, "pipe_times", PipelineTimes()).summary()
        out: dict[str, Any] = {
            "pipeline": self.cfg.train.pipeline,
            "codecs": {"forward": c.forward, "backward": c.backward, "allreduce": c.allreduce},
            **times,
        }
        stats = getattr(self.model, "stats", None)
        if stats is None or self.world == 1:
            return out
        steps = max(1, int(times["steps"]))
        mine = (dict(stats.bytes_sent), dict(stats.wait_s), stats.codec_s)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine)
        sent = {k: sum(p[0].get(k, 0) for p in parts) / steps for k in stats.bytes_sent}
        wait = {k: 1000 * v / steps for k, v in stats.wait_s.items()}  # this rank's
        out["bytes_per_step"] = sent
        out["bytes_per_step_total"] = sum(sent.values())
        out["wait_ms_per_step"] = wait
        out["comm_wait_ms_per_step"] = sum(wait.values())
        out["codec_ms_per_step"] = 1000 * stats.codec_s / steps
        out["compute_ms_per_step"] = (
            times["step_ms_mean"] - out["comm_wait_ms_per_step"] - times["load_wait_ms_per_step"]
        )
        return out

    def summarize(
        self,
        final: dict[str, float],
        evals: list[dict],
        progress: Progress,
        train_s: float,
        first_step: int = 0,
    ) -> dict[str, Any]:
        """Build, print and write the run summary (rates: what this process trained)."""
        teacher = self.source.reference_metrics()
        result: dict[str, Any] = {
            "train": {
                "steps": self.step,
                "resumed_at_step": first_step,
                "samples": progress.samples,
                "seconds": round(train_s, 3),
                "samples_per_s": round(progress.rate(train_s), 1),
                "final_loss": sum(progress.losses[-50:]) / max(1, len(progress.losses[-50:])),
                **_memory_mb(),
            },
            "eval": final,
            "evals": evals,
            "teacher": teacher,
            "config": self.cfg.to_dict(),
            "comm": getattr(self, "_comm", None),
        }
        ebc = getattr(self.model, "ebc", None)
        # callable: the sharded collection's ``stats`` is its CommStats, not a cache report.
        if ebc is not None and callable(getattr(ebc, "stats", None)):
            result["storage"] = ebc.stats()  # row cache hit rate, bytes per tier, evictions
        lowp = getattr(self, "lowp", None)
        if lowp is not None:
            result["lowp"] = lowp.summary()
        if teacher:
            result["eval_ne_gap_vs_teacher"] = final["ne"] / teacher["ne"] - 1.0
        self.write(result)
        self.print_summary(result)
        return result

    def write(self, result: dict[str, Any]) -> None:
        """metrics.json in the run directory (atomic replace; rank 0 only)."""
        if self.rank != 0:
            return
        run_dir = Path(self.cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=float))
        os.replace(tmp, run_dir / "metrics.json")

    def print_summary(self, r: dict[str, Any]) -> None:
        """Human-readable summary (rank 0 only)."""
        if self.rank != 0:
            return
        tr, ev, te = r["train"], r["eval"], r["teacher"]
        first = tr.get("resumed_at_step", 0)
        rate = f"in {tr['seconds']:.1f}s ({tr['samples_per_s']:,.0f} samples/s)"
        if first:
            done = f"trained steps {first + 1}-{tr['steps']} (resumed) {rate}; {tr['samples']:,}"
            done += " samples in all"
        else:
            done = f"trained {tr['steps']} steps, {tr['samples']:,} samples {rate}"
        lines = [
            "",
            done,
            f"{'':10}{'auc':>8}{'logloss':>10}{'ne':>8}{'calib':>8}",
            f"{'eval':10}{ev['auc']:8.4f}{ev['logloss']:10.4f}{ev['ne']:8.4f}{ev['calibration']:8.3f}",
        ]
        if te:
            lines.append(
                f"{'teacher':10}{te['auc']:8.4f}{te['logloss']:10.4f}{te['ne']:8.4f}"
                f"{te.get('calibration', 1.0):8.3f}"
            )
            lines.append(f"eval NE is {100 * r['eval_ne_gap_vs_teacher']:+.2f}% vs the teacher")
        lines.append(f"metrics written to {Path(self.cfg.train.run_dir) / 'metrics.json'}")
        print("\n".join(lines), file=self.out, flush=True)


def train(cfg: Config, out: TextIO | None = None) -> dict[str, Any]:
    """Train and evaluate a config (single process)."""
    return Trainer(cfg, out=out).fit()
