"""Config section ``[distill]``: ExFM students learning from a foundation model's logits.

The FM's logits come with the data (``data.fm_logits``, written by DAS); the student's step never
runs the FM. Two ways to learn from them:

- plain distillation (``aux_head = false``, ``weight`` w > 0): the serving head's loss is
  ``(1 - w) BCE(logit, label) + w T^2 BCE(logit / T, sigmoid(fm / T))``;
- the auxiliary head (``aux_head = true``): a second head on the top MLP's penultimate layer
  learns ``aux_weight T^2 BCE(aux / T, sigmoid(target / T))``; the serving head keeps the
  true-label loss. With ``adapter = true`` the target is the Student Adapter's correction of the
  FM logit (an MLP trained on the true labels), else the raw FM logit.

When ``enabled`` is false the other fields are not used (as ``[towers]`` fields with no towers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.config.checks import check_fields, rule
from neorec.errors import ConfigError

__all__ = ["DistillConfig"]

MAX_ADAPTER = 4096
"""Widest Student Adapter hidden layer."""


@dataclass(kw_only=True)
class DistillConfig:
    """ExFM distillation of the student from the FM's logits (``data.fm_logits``)."""

    enabled: bool = False
    """Learn from the FM's logits (needs ``weight > 0`` or ``aux_head``)."""
    aux_head: bool = False
    """A second output head on the top MLP's penultimate layer learns from the FM; the serving
    head (evaluated, predicted, exported) keeps the true-label loss."""
    aux_weight: float = field(default=0.0, metadata=rule(0, 1e6))
    """Weight of the aux head's loss (0 = the aux head learns nothing: a control run)."""
    adapter: bool = False
    """Student Adapter: an MLP over (FM logit, the student's own logit, detached) trained on the
    true labels; its output, not the raw FM logit, is the aux head's target."""
    adapter_size: int = field(default=16, metadata=rule(1, MAX_ADAPTER))
    """Hidden width of the Student Adapter."""
    temperature: float = field(default=1.0, metadata=rule(gt=0, hi=1e6))
    """T: soft labels are ``sigmoid(fm_logit / T)``, the student's logit is divided by T, and the
    distillation loss is scaled by T^2."""
    weight: float = field(default=0.0, metadata=rule(0, 1))
    """Plain distillation (no aux head): the soft-label share of the serving head's loss."""

    def __post_init__(self) -> None:
        check_fields(self, "distill")
        if not self.enabled:
            return
        if self.aux_head and self.weight > 0:
            raise ConfigError(
                f"distill.weight {self.weight:g} (plain distillation into the serving head) and "
                "distill.aux_head exclude each other; with the aux head set distill.aux_weight"
            )
        if not self.aux_head:
            if self.aux_weight > 0:
                raise ConfigError(
                    f"distill.aux_weight {self.aux_weight:g} needs distill.aux_head = true; for "
                    "plain distillation into the serving head set distill.weight instead"
                )
            if self.adapter:
                raise ConfigError(
                    "distill.adapter corrects the FM logits the aux head learns from: it needs "
                    "distill.aux_head = true"
                )
            if self.weight == 0:
                raise ConfigError(
                    "distill.enabled with distill.weight 0 and no distill.aux_head distills "
                    "nothing; set distill.weight in (0, 1] or distill.aux_head = true"
                )

    @property
    def uses_hidden(self) -> bool:
        """Whether a step needs the penultimate layer (the aux head is on)."""
        return self.enabled and self.aux_head
