"""When quantization-aware training runs: the periodic regularizer (``neorec.ops.qat``) switched
on in the fused row optimizer for the last part of a run.

Train step ``s`` (1-based) of a run of ``T`` steps trains with the regularizer when
``s > start_step = floor(T * (1 - start_fraction))``. The switch is a function of the step (a
resumed run switches at the same step), set before the step's forward like the lr schedule: the
row update runs inside its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neorec.config import ConfigError, QatConfig
from neorec.modules.collection import EmbeddingCollection
from neorec.ops.qat import Periodic

__all__ = ["QatSchedule", "QatHook"]


@dataclass(frozen=True)
class QatSchedule:
    """The regularizer and the last step that trains without it."""

    reg: Periodic
    start_step: int
    """The regularizer runs on train steps after this one."""
    total_steps: int

    @classmethod
    def of(cls, cfg: QatConfig, total_steps: int | None) -> QatSchedule:
        """The schedule ``[train.qat]`` describes for a run of ``total_steps`` (None: unknown,
        refused: the start is a share of the run)."""
        if not total_steps:
            raise ConfigError(
                "train.qat runs over the last train.qat.start_fraction of the run and needs its "
                "length: set train.steps (this data source does not know its number of batches)"
            )
        reg = Periodic(bits=cfg.bits, strength=cfg.strength, shape=cfg.shape)
        return cls(reg, cfg.start_step(total_steps), total_steps)

    def at(self, step: int) -> Periodic | None:
        """The regularizer train step ``step`` (1-based) runs with (None: none)."""
        return self.reg if step > self.start_step else None

    def hook(self, ebc: EmbeddingCollection) -> QatHook:
        """A pipeline's step hook that switches the regularizer on at its start."""
        return QatHook(self, ebc)

    def describe(self) -> str:
        """One line: the regularizer and the steps it runs on."""
        r = self.reg
        return (
            f"QAT: {r.shape} regularizer toward the int{r.bits} row grid, strength {r.strength:g}, "
            f"steps {self.start_step + 1:,}-{self.total_steps:,}"
        )


@dataclass(frozen=True)
class QatHook:
    """Sets the fused row optimizer's regularizer of each train step before it runs (a training
    pipeline's step hook: ``neorec.train.pipeline.StepHook``)."""

    schedule: QatSchedule
    ebc: EmbeddingCollection

    def before_step(self, step: int) -> None:
        """Switch the regularizer on (or off) for train step ``step``."""
        want = self.schedule.at(step)
        if self.ebc.optimizer.qat != want:
            self.ebc.set_qat(want)

    def after_step(self, step: int, loss: Any) -> None:
        """Nothing."""
