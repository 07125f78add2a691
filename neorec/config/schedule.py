"""Config section ``[train.schedule]``: the learning-rate schedule of both optimizers.

The schedule is a factor of the base learning rates (``train.dense_lr`` and ``embedding.lr``,
after ``train.lr_scaling``) per train step ``s`` (1-based) of a run of ``T`` steps: a linear
warmup over the first ``warmup_steps``, then a decay (``neorec.modules.schedule.LrSchedule`` has
the closed forms). The dense optimizer and the fused row optimizer follow the same factor, or
(``rows = false``) the dense optimizer only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from neorec.config.checks import check_fields, rule
from neorec.errors import ConfigError

__all__ = ["ScheduleConfig", "DECAYS", "DECAY_FIELDS"]

DECAYS = ("constant", "step", "polynomial", "cosine")
"""What follows the warmup."""
DECAY_FIELDS = {
    "constant": (),
    "step": ("step_size", "gamma"),
    "polynomial": ("power", "end_factor"),
    "cosine": ("end_factor",),
}
"""The fields each decay reads; another decay's fields set away from their defaults are refused
(they would be ignored)."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """Linear warmup, then constant / step / polynomial / cosine decay over the run's steps."""

    warmup_steps: int = field(default=0, metadata=rule(0, 2**48))
    """Steps of linear warmup: step s <= warmup_steps trains at factor
    ``warmup_start + (1 - warmup_start) * s / warmup_steps`` (1 at the last warmup step)."""
    warmup_start: float = field(default=0.0, metadata=rule(0, 1))
    """The warmup's factor before its first step (Goyal et al.: 1/k of the scaled lr, or 0)."""
    decay: str = field(default="constant", metadata=rule(choices=DECAYS))
    """After the warmup: ``constant``, ``step`` (x ``gamma`` every ``step_size`` steps),
    ``polynomial`` (to ``end_factor`` with ``power``) or ``cosine`` (to ``end_factor``), over the
    steps left of the run (train.steps, or the epochs' batches)."""
    step_size: int = field(default=0, metadata=rule(0, 2**48))
    """decay = step: steps between two multiplications by ``gamma`` (> 0)."""
    gamma: float = field(default=0.1, metadata=rule(hi=1, gt=0))
    """decay = step: the factor applied every ``step_size`` steps."""
    power: float = field(default=1.0, metadata=rule(hi=100, gt=0))
    """decay = polynomial: ``end + (1 - end) * (1 - p)^power`` at progress p of the decay."""
    end_factor: float = field(default=0.0, metadata=rule(0, 1))
    """decay = polynomial / cosine: the factor the decay reaches after the run's last step."""
    rows: bool = True
    """The fused row optimizer's lr follows the schedule too; false: the dense lr only (CowClip's
    recipe warms up the dense lr and keeps the embedding lr constant)."""

    def __post_init__(self) -> None:
        check_fields(self, "train.schedule")
        used = DECAY_FIELDS[self.decay]
        changed = [
            f.name
            for f in fields(self)
            if f.name in _DECAY_ONLY and f.name not in used and getattr(self, f.name) != f.default
        ]
        if changed:
            names = ", ".join(f"train.schedule.{n}" for n in changed)
            raise ConfigError(
                f"{names}: not read by train.schedule.decay = {self.decay!r} (it would be "
                f"ignored); remove {names} or choose the decay that reads it"
            )
        if self.warmup_start != 0.0 and self.warmup_steps == 0:
            raise ConfigError(
                f"train.schedule.warmup_start {self.warmup_start} is set but warmup_steps is 0 "
                "(it would be ignored); set train.schedule.warmup_steps or remove warmup_start"
            )
        if self.decay == "step" and self.step_size == 0:
            raise ConfigError(
                "train.schedule.step_size must be > 0 with decay = 'step' (the steps between two "
                "multiplications by gamma), got 0"
            )

    @property
    def active(self) -> bool:
        """Whether the factor ever differs from 1 (a warmup or a decay)."""
        return self.warmup_steps > 0 or self.decay != "constant"


_DECAY_ONLY = frozenset(n for names in DECAY_FIELDS.values() for n in names)
