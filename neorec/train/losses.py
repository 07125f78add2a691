"""The loss of a training step, chosen once when a run is set up (``make_loss``).

A ``StepLoss`` owns both halves of what differs between steps: how the model's forward runs
(``forward``: under ``train_step``'s autocast) and the loss of its output (``__call__``: the
total that is backpropagated, and the value the step reports). ``train_step`` calls the two and
has no branch of its own:

- ``StepLoss``: the BCE as the mean of the dense blocks' means (the mean over the batch: the
  blocks are equal; each sample's loss gradient comes from a tensor of its block's size);
- ``FusedBce``: the same BCE by the ExFM loss kernel where it applies
  (``neorec.train.distill.serving_bce``; elsewhere the blocks' BCE), so an ExFM student trained
  alone is trained on the same loss engineering as a distilled one;
- ``Distilled``: an ExFM student's losses (``neorec.train.distill.distill_loss``), the forward
  emitting the top MLP's penultimate layer when the aux head needs it; the reported value is
  the serving head's true-label BCE.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from neorec.config import DistillConfig
from neorec.data.batch import Batch
from neorec.distributed.dense_blocks import blocks_of, per_block
from neorec.modules.dlrm import emit_hidden
from neorec.train.distill import distill_arch, distill_loss, serving_bce

__all__ = ["StepLoss", "FusedBce", "Distilled", "BCE", "make_loss"]


class StepLoss:
    """The plain step's loss: the BCE over the dense blocks (the module docstring)."""

    def forward(self, model: Any, batch: Batch) -> Tensor:
        """The model's output on ``batch`` (the logits)."""
        out: Tensor = model(batch.dense, batch.sparse)
        return out

    def __call__(self, model: Any, batch: Batch, out: Tensor) -> tuple[Tensor, Tensor]:
        """(loss to backpropagate, the step's reported value, detached)."""
        loss = self.bce(model, batch, out)
        return loss, loss.detach()

    @staticmethod
    def bce(model: Any, batch: Batch, logits: Tensor) -> Tensor:
        """The mean of the dense blocks' mean BCEs of ``logits``."""
        parts = per_block(
            F.binary_cross_entropy_with_logits, blocks_of(model), logits.float(), batch.labels
        )
        return parts[0] if len(parts) == 1 else torch.stack(parts).mean()


class FusedBce(StepLoss):
    """The BCE by the ExFM loss kernel where it applies, else the blocks' BCE."""

    def __call__(self, model: Any, batch: Batch, out: Tensor) -> tuple[Tensor, Tensor]:
        """(loss to backpropagate, the step's reported value, detached)."""
        fused = serving_bce(out.float(), batch.labels)
        loss = fused if fused is not None else self.bce(model, batch, out)
        return loss, loss.detach()


class Distilled(StepLoss):
    """An ExFM student's losses (``[distill]`` enabled)."""

    def __init__(self, cfg: DistillConfig) -> None:
        self.cfg = cfg

    def forward(self, model: Any, batch: Batch) -> Tensor:
        """The logits, or ``[b, 1 + H]`` (the serving logit, then the penultimate layer) when
        the aux head reads the hidden layer."""
        if not self.cfg.uses_hidden:
            return super().forward(model, batch)
        arch = distill_arch(model)
        with emit_hidden(arch) if arch is not None else nullcontext():
            return super().forward(model, batch)

    def __call__(self, model: Any, batch: Batch, out: Tensor) -> tuple[Tensor, Tensor]:
        """(the total loss, the serving head's BCE)."""
        logits, hidden, full = out, None, None
        if self.cfg.uses_hidden and out.dim() == 2:
            logits, hidden, full = out[:, 0], out[:, 1:], out
        losses = distill_loss(model, batch, logits.float(), hidden, self.cfg, out=full)
        return losses.total, losses.serving


BCE = StepLoss()
"""The plain step's loss (the default of ``train_step``)."""


def make_loss(distill: DistillConfig | None = None, fused_bce: bool = False) -> StepLoss:
    """The loss of a run: ``Distilled`` when ``distill`` is enabled, else ``FusedBce`` when
    ``fused_bce``, else the blocks' BCE."""
    if distill is not None and distill.enabled:
        return Distilled(distill)
    return FusedBce() if fused_bce else BCE
