"""The learning-rate schedule of a run: a pure factor per step, applied to both optimizers.

For train step ``s`` (1-based) of a run of ``T`` steps with ``W`` warmup steps:

- ``s <= W``: ``f = start + (1 - start) * s / W`` (linear warmup, 1 at step W)
- ``s > W``, with ``p = (s - W - 1) / (T - W)`` (0 at the first step after the warmup; the decay
  reaches its end after the last step, so no step trains at an end factor of 0):

  - ``constant``: ``f = 1``
  - ``step``: ``f = gamma ** floor((s - W - 1) / step_size)``
  - ``polynomial``: ``f = end + (1 - end) * (1 - p) ** power``
  - ``cosine``: ``f = end + (1 - end) * (1 + cos(pi * p)) / 2``

The lr of step s is ``base * f(s)`` for the dense optimizer (every param group) and (unless
``rows`` is false) for the fused row optimizer (``EmbeddingCollection.set_lr``: every rank computes the same factor from the same
step, so every shard of a sharded collection trains at the same lr). Its state is its settings:
the factor is a function of the step, which checkpoints keep.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from neorec.config import ConfigError, ScheduleConfig
from neorec.modules.collection import EmbeddingCollection

__all__ = ["LrSchedule", "ScheduleHook"]


@dataclass(frozen=True)
class LrSchedule:
    """Base lrs (after scaling), the schedule's settings and the run's length, as plain values."""

    dense_lr: float
    """Base lr of the dense optimizer (train.dense_lr, scaled)."""
    rows_lr: float
    """Base lr of the fused row optimizer (embedding.lr, scaled)."""
    total_steps: int
    """T: steps of the run (0: unknown, only a schedule without decay)."""
    warmup_steps: int = 0
    warmup_start: float = 0.0
    decay: str = "constant"
    step_size: int = 0
    gamma: float = 0.1
    power: float = 1.0
    end_factor: float = 0.0
    rows: bool = True
    """The row lr follows the factor (else it stays at ``rows_lr``)."""

    @classmethod
    def of(cls, cfg: ScheduleConfig, dense_lr: float, rows_lr: float, total: int) -> LrSchedule:
        """The schedule ``[train.schedule]`` describes for base lrs and a run of ``total``."""
        return cls(dense_lr, rows_lr, total, **asdict(cfg))

    def factor(self, step: int) -> float:
        """f(step): the share of the base lrs that train step ``step`` (1-based) uses."""
        w = self.warmup_steps
        if step <= w:
            return self.warmup_start + (1.0 - self.warmup_start) * step / w
        if self.decay == "constant":
            return 1.0
        if self.decay == "step":
            return self.gamma ** ((step - w - 1) // self.step_size)
        p = min(1.0, (step - w - 1) / (self.total_steps - w))
        end = self.end_factor
        if self.decay == "polynomial":
            return end + (1.0 - end) * (1.0 - p) ** self.power
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * p))

    def lrs(self, step: int) -> tuple[float, float]:
        """(dense lr, row lr) of train step ``step``."""
        f = self.factor(step)
        return self.dense_lr * f, self.rows_lr * (f if self.rows else 1.0)

    def apply(self, step: int, opt: torch.optim.Optimizer, ebc: EmbeddingCollection) -> None:
        """Set both optimizers' lr for train step ``step`` (before its forward: the row update
        runs inside its backward)."""
        dense, rows = self.lrs(step)
        for group in opt.param_groups:
            group["lr"] = dense
        if ebc.optimizer.lr != rows:
            ebc.set_lr(rows)

    def hook(self, opt: torch.optim.Optimizer, ebc: EmbeddingCollection) -> ScheduleHook:
        """A pipeline's step hook that sets both optimizers' lrs before each step."""
        return ScheduleHook(self, opt, ebc)

    def check(self) -> None:
        """Refuse a schedule the run cannot follow: a decay over an unknown or too short run,
        or a row lr that becomes 0 in float32 (the kernel's precision)."""
        t, w = self.total_steps, self.warmup_steps
        if self.decay != "constant" and not t:
            raise ConfigError(
                f"train.schedule.decay = {self.decay!r} needs the run's length: set train.steps "
                "(this data source does not know its number of batches)"
            )
        if t and w >= t and (self.decay != "constant" or w > t):
            raise ConfigError(
                f"train.schedule.warmup_steps {w:,} leaves no step of the run's {t:,} for the "
                f"{self.decay} decay; lower warmup_steps below {t:,} or raise train.steps"
            )
        ends = [self.factor(1)] + ([self.factor(t)] if t else []) if self.rows else [1.0]
        low = min(ends) * self.rows_lr
        if not float(torch.tensor(low, dtype=torch.float32)) > 0:
            raise ConfigError(
                f"train.schedule: the row lr reaches {low:.3g}, 0 in float32 (embedding.lr "
                f"{self.rows_lr:g} x factor {min(ends):.3g}); raise gamma or step_size"
            )

    def describe(self) -> str:
        """One line: the warmup and the decay."""
        parts = []
        if self.warmup_steps:
            parts.append(f"warmup {self.warmup_steps:,} steps from x{self.warmup_start:g}")
        left = max(0, self.total_steps - self.warmup_steps)
        if self.decay == "step":
            parts.append(f"x{self.gamma:g} every {self.step_size:,} steps")
        elif self.decay == "polynomial":
            parts.append(f"polynomial (power {self.power:g}) to x{self.end_factor:g} over {left:,}")
        elif self.decay == "cosine":
            parts.append(f"cosine to x{self.end_factor:g} over {left:,} steps")
        else:
            parts.append("constant")
        return "lr schedule: " + ", then ".join(parts) + ("" if self.rows else " (dense lr only)")

    def state_dict(self) -> dict[str, Any]:
        """Its settings (checkpoints keep them beside the step)."""
        return asdict(self)

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """``key saved -> now`` for each setting that differs from a checkpoint's ``saved``
        (the run's length only where a decay reads it)."""
        now = self.state_dict()
        skip = {"total_steps"} if now["decay"] == saved.get("decay") == "constant" else set()
        return [
            f"{k} {saved.get(k)!r} -> {v!r}"
            for k, v in now.items()
            if saved.get(k, True if k == "rows" else None) != v and k not in skip  # rows: newer
        ]


@dataclass(frozen=True)
class ScheduleHook:
    """Sets the lrs of each train step on both optimizers before it runs (a training pipeline's
    step hook: ``neorec.train.pipeline.StepHook``)."""

    schedule: LrSchedule
    opt: torch.optim.Optimizer
    ebc: EmbeddingCollection

    def before_step(self, step: int) -> None:
        """Set the lrs of train step ``step``."""
        self.schedule.apply(step, self.opt, self.ebc)

    def after_step(self, step: int, loss: Any) -> None:
        """Nothing."""
