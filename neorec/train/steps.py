"""One training step and evaluation of any model with the DLRM interface (unsharded, sharded,
towered): forward, loss (``neorec.train.losses``), backward, the dense optimizer; the NaN guard;
predictions."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from neorec.data.batch import Batch
from neorec.distributed.comm import CommStats
from neorec.distributed.dense_blocks import blocks_of, per_block
from neorec.errors import NeorecError
from neorec.modules.collection import EmbeddingCollection
from neorec.sparse import SparseFeatures
from neorec.train.losses import BCE, StepLoss
from neorec.train.metrics import MetricState

__all__ = [
    "TrainingDiverged",
    "LossGuard",
    "RecModel",
    "Step",
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
    guard: LossGuard | None = None,
    loss_fn: StepLoss = BCE,
) -> Tensor:
    """Forward, loss, backward (the fused embedding update runs inside), dense optimizer step;
    returns the step's reported loss.

    ``loss_fn`` (``neorec.train.losses``) runs the forward and computes the loss: the plain
    BCE, the fused BCE, or an ExFM student's losses (reporting the serving head's BCE). A
    non-finite loss is refused before backward (one host read per step), or with ``guard``
    recorded on the device for a later ``guard.check()`` (no host read: the trainer's path)."""
    with _autocast(batch.dense.device) if bf16 else nullcontext():
        out = loss_fn.forward(model, batch)
    loss, value = loss_fn(model, batch, out)
    if guard is not None:
        guard.record(loss, step)
    elif not math.isfinite(total := float(loss.detach())):  # a host sync: the tables stay clean
        raise _diverged(total, step)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # the embeddings' backward (and fused update) runs last, inside
    opt.step()
    return value


@dataclass
class Step:
    """``train_step`` with the loss and the NaN guard of a run, chosen once: a pipeline's step
    function ``(model, opt, batch, step, bf16) -> loss``."""

    loss_fn: StepLoss = BCE
    guard: LossGuard | None = None

    def __call__(
        self, model: RecModel, opt: torch.optim.Optimizer, batch: Batch, step: int, bf16: bool
    ) -> Tensor:
        """One step (``train_step``)."""
        return train_step(model, opt, batch, step, bf16, self.guard, self.loss_fn)


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
