"""One training step and evaluation of any model with the DLRM interface (unsharded, sharded,
towered): the dense optimizer, the loss over the dense blocks, the NaN guard, predictions."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from neorec.config import DistillConfig
from neorec.data.batch import Batch
from neorec.distributed.comm import CommStats
from neorec.distributed.dense_blocks import blocks_of, per_block
from neorec.errors import NeorecError
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.dlrm import emit_hidden
from neorec.sparse import SparseFeatures
from neorec.train.distill import distill_arch, distill_loss, serving_bce
from neorec.train.metrics import MetricState

__all__ = [
    "TrainingDiverged",
    "LossGuard",
    "RecModel",
    "StepMarks",
    "train_step",
    "predict",
    "evaluate",
]


class TrainingDiverged(NeorecError, RuntimeError):
    """The loss became NaN or infinite."""


class LossGuard:
    """The NaN guard without a host sync per step: each step records, on the loss's device, the
    first step whose loss was not finite; ``check()`` (a host read) raises ``TrainingDiverged``
    naming it. The trainer checks at log intervals, before evals and checkpoints, at the end and
    when a step fails; steps after the bad one may have moved the weights, but nothing that
    follows a failed check is written."""

    def __init__(self) -> None:
        self.first_bad: Tensor | None = None  # int64 step, -1 = none so far
        self.loss: Tensor | None = None  # the first bad step's loss value

    def record(self, loss: Tensor, step: int) -> None:
        """Note ``loss`` of ``step`` (device ops only)."""
        loss = loss.detach().float()
        if self.first_bad is None:
            self.first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
            self.loss = torch.zeros((), device=loss.device)
        assert self.loss is not None
        new = ~torch.isfinite(loss) & (self.first_bad < 0)
        self.first_bad = torch.where(new, step, self.first_bad)
        self.loss = torch.where(new, loss, self.loss)

    def check(self) -> None:
        """Raise ``TrainingDiverged`` if a recorded loss was not finite (one host read)."""
        if self.first_bad is None or self.loss is None:
            return
        bad = int(self.first_bad)
        if bad >= 0:
            raise _diverged(float(self.loss), bad)


def _diverged(total: float, step: int) -> TrainingDiverged:
    return TrainingDiverged(
        f"loss became {total} at step {step}; lower the learning rates "
        f"(embedding.lr, train.dense_lr) or check the input data"
    )


class RecModel(Protocol):
    """What the trainer needs of a model: ``DLRM``, ``TowerDLRM`` or their distributed forms
    (``DistributedModel``, ``DistributedTowerModel``)."""

    ebc: EmbeddingCollection

    @property
    def comm_stats(self) -> CommStats | None:
        """Bytes and waits of the model's collectives (None: one process)."""

    @property
    def dense_part(self) -> nn.Module:
        """What checkpoints store of the dense side (tower modules too; unwrapped from DDP)."""

    @property
    def all_tables(self) -> list[Any]:
        """Every table of the model (a towered rank's collection holds its tower's only)."""

    def prefetch(self, sparse: SparseFeatures) -> None:
        """Pipeline stage of the next batch before this step runs (a row cache's reads)."""

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None) -> None:
        """Pipeline stage of a later batch from its host copy (checks, input distribution)."""

    def __call__(self, dense: Tensor, sparse: SparseFeatures) -> Tensor: ...

    def train(self, mode: bool = True) -> Any: ...

    def dense_parameters(self) -> Iterator[nn.Parameter]: ...


def train_step(
    model: RecModel,
    opt: torch.optim.Optimizer,
    batch: Batch,
    step: int,
    bf16: bool = False,
    distill: DistillConfig | None = None,
    guard: LossGuard | None = None,
    fused_bce: bool = False,
    phases: StepMarks | None = None,
) -> Tensor:
    """Forward, loss, backward (the fused embedding update runs inside), dense optimizer step.

    With ``distill`` enabled (an ExFM student, ``neorec.train.distill``) the loss also learns
    from the batch's FM logits; the returned loss is still the serving head's true-label BCE.
    A non-finite loss is refused before backward (one host read per step), or with ``guard``
    recorded on the device for a later ``guard.check()`` (no host read: the trainer's path).
    ``fused_bce``: without distillation, the BCE by the ExFM loss kernel where it applies
    (``neorec.train.distill.serving_bce``: a distilled step's kernel, so an ExFM student
    trained alone is timed and trained on the same loss engineering).
    ``phases``: marks the end of each phase of the step (``neorec bench step --breakdown``);
    None (the trainer's path) costs one test per phase and changes nothing."""
    ctx = _autocast(batch.dense.device) if bf16 else nullcontext()
    on = distill is not None and distill.enabled
    hidden: Tensor | None = None
    out: Tensor | None = None
    with ctx:
        if on and distill is not None and distill.uses_hidden:
            arch = distill_arch(model)
            with emit_hidden(arch) if arch is not None else nullcontext():
                out = model(batch.dense, batch.sparse)
            if out.dim() == 2:  # [b, 1 + H]: the serving logit, then the penultimate layer
                logits, hidden = out[:, 0], out[:, 1:]
            else:
                logits, out = out, None
        else:
            logits = model(batch.dense, batch.sparse)
    _mark(phases, "dense_forward")
    if on and distill is not None:
        losses = distill_loss(model, batch, logits.float(), hidden, distill, out=out)
        loss, value = losses.total, losses.serving
    elif fused_bce and (fused := serving_bce(logits.float(), batch.labels)) is not None:
        loss = fused
        value = loss.detach()
    else:
        # The mean over the batch, as the mean of the dense blocks' means (the same number:
        # blocks are equal): each sample's loss gradient then comes from a tensor of the block's
        # size.
        parts = per_block(
            F.binary_cross_entropy_with_logits, blocks_of(model), logits.float(), batch.labels
        )
        loss = parts[0] if len(parts) == 1 else torch.stack(parts).mean()
        value = loss.detach()
    if guard is not None:
        guard.record(loss, step)
    else:
        # note: a host sync; refusing a non-finite loss before backward keeps the tables clean.
        total = float(loss.detach())
        if not math.isfinite(total):
            raise _diverged(total, step)
    _mark(phases, "loss")
    opt.zero_grad(set_to_none=True)
    _mark(phases, "dense_optimizer")
    loss.backward()  # the embeddings' backward (and fused update) runs last, inside
    _mark(phases, "tbe_backward_update")
    opt.step()
    _mark(phases, "dense_optimizer")
    return value


class StepMarks(Protocol):
    """Receives the end of each phase of a step (a benchmark's timer)."""

    def mark(self, phase: str) -> None:
        """The phase named ``phase`` ends now."""


def _mark(phases: StepMarks | None, phase: str) -> None:
    if phases is not None:
        phases.mark(phase)


def _autocast(device: torch.device) -> Any:
    """bf16 autocast of the dense part on ``device``'s type."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


@torch.no_grad()
def predict(model: RecModel, batches: Iterator[Batch], bf16: bool = False) -> MetricState:
    """Predicted probabilities and labels over ``batches``."""
    model.train(False)
    state = MetricState()
    blocks = blocks_of(model)
    for batch in batches:
        with _autocast(batch.dense.device) if bf16 else nullcontext():
            logits = model(batch.dense, batch.sparse)
        probs = torch.cat(per_block(torch.sigmoid, blocks, logits.float()))
        state.update(probs.cpu(), batch.labels.cpu())  # metrics are summed on the host
    model.train(True)
    return state


def evaluate(model: RecModel, batches: Iterator[Batch], bf16: bool = False) -> dict[str, float]:
    """Metrics of the model's predictions over ``batches``."""
    return predict(model, batches, bf16).compute()
