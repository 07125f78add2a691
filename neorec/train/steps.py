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

from neorec.config import Config, DistillConfig
from neorec.data.batch import Batch
from neorec.distributed.dense_blocks import blocks_of, per_block
from neorec.errors import NeorecError
from neorec.modules.dlrm import emit_hidden
from neorec.sparse import SparseFeatures
from neorec.train.distill import distill_arch, distill_loss
from neorec.train.metrics import MetricState

__all__ = [
    "TrainingDiverged",
    "RecModel",
    "make_dense_optimizer",
    "train_step",
    "predict",
    "evaluate",
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
    model: RecModel,
    opt: torch.optim.Optimizer,
    batch: Batch,
    step: int,
    bf16: bool = False,
    distill: DistillConfig | None = None,
) -> Tensor:
    """Forward, loss, backward (the fused embedding update runs inside), dense optimizer step.

    With ``distill`` enabled (an ExFM student, ``neorec.train.distill``) the loss also learns
    from the batch's FM logits; the returned loss is still the serving head's true-label BCE."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    on = distill is not None and distill.enabled
    hidden: Tensor | None = None
    with ctx:
        if on and distill is not None and distill.uses_hidden:
            arch = distill_arch(model)
            with emit_hidden(arch) if arch is not None else nullcontext():
                out = model(batch.dense, batch.sparse)
            if out.dim() == 2:  # [b, 1 + H]: the serving logit, then the penultimate layer
                logits, hidden = out[:, 0].contiguous(), out[:, 1:]
            else:
                logits = out
        else:
            logits = model(batch.dense, batch.sparse)
    if on and distill is not None:
        losses = distill_loss(model, batch, logits.float(), hidden, distill)
        loss, value = losses.total, losses.serving
    else:
        # The mean over the batch, as the mean of the dense blocks' means (the same number:
        # blocks are equal): each sample's loss gradient then comes from a tensor of the block's
        # size.
        parts = per_block(
            F.binary_cross_entropy_with_logits, blocks_of(model), logits.float(), batch.labels
        )
        loss = parts[0] if len(parts) == 1 else torch.stack(parts).mean()
        value = loss.detach()
    # note: a host sync; refusing a non-finite loss before backward keeps the tables clean.
    total = float(loss.detach())
    if not math.isfinite(total):
        raise TrainingDiverged(
            f"loss became {total} at step {step}; lower the learning rates "
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
