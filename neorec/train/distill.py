"""ExFM students: the losses of a step that learns from a foundation model's logits.

The FM's logits come with the batch (``Batch.fm_logits`` [b] float32, attached by the data:
DAS, ``data.fm_logits``); nothing here runs the FM. ``distill_loss`` is what ``train_step`` calls
when ``[distill]`` is on:

- serving: ``BCE(logit, label)`` (what is evaluated, predicted and exported);
- plain distillation (no aux head, weight w): the serving head's loss is
  ``(1 - w) BCE(logit, label) + w T^2 BCE(logit / T, sigmoid(fm / T))``;
- aux head: ``aux_weight T^2 BCE(aux / T, sigmoid(target / T))`` with ``aux`` the aux head on
  the top MLP's penultimate layer, ``target`` the FM logit, or with the adapter its correction
  (detached: the adapter does not learn from the aux head, nor the FM's errors from the student);
- adapter: ``BCE(adapter(fm, logit.detach(), dense), label)``: it learns, on the true labels, to undo
  the FM's staleness and the FM / student distribution gap.

The serving and plain-distillation losses are the mean of the dense blocks' means (``per_block``),
as the plain step's loss (world-size invariant); the aux head's and the adapter's are plain means
of the rank's batch. On N ranks the aux head and the adapter sit in the dense arch under DDP
(attached before it wraps it), used outside its forward, in the loss: DDP averages their
gradients with the rest, so with equal local batches they get the global batch's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from neorec.config import ConfigError, DistillConfig
from neorec.data.batch import Batch
from neorec.distributed.dense_blocks import blocks_of, per_block
from neorec.errors import DataError
from neorec.modules.dlrm import DenseArch
from neorec.modules.exfm_heads import StudentAdapter, adapter_and_aux_losses, aux_soft_bce
from neorec.ops.exfm_losses import NonFiniteFM, exfm_losses

FAST_LOSSES = True
"""Take the C kernel where it applies (tests turn it off to compare with the torch path)."""

__all__ = [
    "DistillLoss",
    "distill_arch",
    "fm_logits_of",
    "distill_loss",
    "soft_bce",
    "aux_predictions",
    "serving_bce",
]


@dataclass
class DistillLoss:
    """The losses of one step: ``total`` is backpropagated, ``serving`` (the true-label BCE of
    the serving head) is the step's reported loss; the parts are detached."""

    total: Tensor
    serving: Tensor
    soft: Tensor | None = None
    aux: Tensor | None = None
    adapter: Tensor | None = None


def _mean(fn: Callable[..., Tensor], blocks: int, *inputs: Tensor) -> Tensor:
    """The mean of ``fn`` over the batch, as the mean of the dense blocks' means."""
    parts = per_block(fn, blocks, *inputs)
    return parts[0] if len(parts) == 1 else torch.stack(parts).mean()


def soft_bce(logits: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """``T^2 BCE(logits / T, sigmoid(teacher / T))`` (mean over the samples)."""
    t = temperature
    if t == 1.0:  # the same numbers, fewer ops
        return F.binary_cross_entropy_with_logits(logits, torch.sigmoid(teacher))
    return (t * t) * F.binary_cross_entropy_with_logits(logits / t, torch.sigmoid(teacher / t))


def distill_arch(model: object) -> DenseArch | None:
    """The model's ``DenseArch``, or None: ``model.dense_arch`` of a ``DLRM`` / ``TowerDLRM``,
    unwrapped from DDP (``DistributedModel``); a ``DistributedTowerModel``'s is one level down,
    in the tower modules' and dense arch's module (``dense_arch.module.dense_arch`` under
    ``tower_sync="world"``, ``dense_arch.dense_arch`` under ``"host"``)."""
    arch = getattr(model, "dense_arch", None)
    for _ in range(2):
        arch = getattr(arch, "module", arch)
        if isinstance(arch, DenseArch):
            return arch
        arch = getattr(arch, "dense_arch", None)
    return None


def fm_logits_of(batch: Batch, check_finite: bool = True) -> Tensor:
    """The batch's FM logits, checked: [b] float32 and (``check_finite``) finite (``DataError``
    otherwise)."""
    fm = getattr(batch, "fm_logits", None)
    b = batch.size
    if fm is None:
        raise DataError(
            "distill is on but the batch has no FM logits; set data.fm_logits = DIR (the DAS side "
            "files of neorec.data.stream.write_fm_logits) or turn distill.enabled off"
        )
    if not isinstance(fm, Tensor) or tuple(fm.shape) != (b,) or fm.dtype != torch.float32:
        shape = tuple(fm.shape) if isinstance(fm, Tensor) else type(fm).__name__
        dtype = getattr(fm, "dtype", "")
        raise DataError(f"batch fm_logits must be float32 [{b}], got {dtype} {shape}")
    if check_finite and not bool(torch.isfinite(fm).all()):
        _non_finite(int((~torch.isfinite(fm)).sum()))
    return fm


def _non_finite(bad: int) -> None:
    raise DataError(
        f"batch fm_logits hold {bad} non-finite value(s) (NaN/inf); rewrite the DAS side "
        "files from a trained FM"
    )


def _fast_losses(
    model: Any,
    batch: Batch,
    logits: Tensor,
    out: Tensor | None,
    cfg: DistillConfig,
    fm: Tensor,
) -> DistillLoss | None:
    """The step's losses by the C kernel (``neorec.ops.exfm_losses``: float32 on the CPU, the
    rank's batch), or None where it does not apply (the torch path then)."""
    head = adapter = None
    if cfg.aux_head:
        arch = distill_arch(model)
        if out is None or arch is None or not isinstance(arch.aux_head, torch.nn.Linear):
            return None
        head = (arch.aux_head.weight, arch.aux_head.bias)
        if cfg.adapter:
            if not isinstance(arch.adapter, StudentAdapter):
                return None
            adapter = (arch.adapter.first, arch.adapter.second)
        coef = (1.0, 0.0, cfg.aux_weight, 1.0 if cfg.adapter else 0.0)
    else:
        coef = (1.0 - cfg.weight, cfg.weight, 0.0, 0.0)
    src = out if head is not None and out is not None else logits
    try:
        res = exfm_losses(
            src,
            batch.labels,
            fm,
            coef,
            cfg.temperature,
            head=head,
            adapter=adapter,
            dense=batch.dense,
        )
    except NonFiniteFM as e:
        _non_finite(e.count)
    if res is None:
        return None
    total, parts, _ = res
    if head is None:
        return DistillLoss(total, parts[0], soft=parts[1])
    return DistillLoss(
        total, parts[0], aux=parts[2], adapter=parts[3] if adapter is not None else None
    )


_NO_FM: dict[int, Tensor] = {}  # zeros [b] (read-only, so shared across steps)


def serving_bce(logits: Tensor, labels: Tensor) -> Tensor | None:
    """``BCE(logits, labels)`` (batch mean) of a step without distillation by the C kernel of a
    distilled step (``neorec.ops.exfm_losses``, weights (1, 0, 0, 0): the serving loss alone,
    the FM input zeros and weighted 0), with its gradient; None where the kernel does not apply
    (``FAST_LOSSES`` off, not float32 on the CPU, no C compiler): the caller takes torch's BCE.
    The batch mean equals the mean of equal dense blocks' means up to rounding."""
    if not FAST_LOSSES or logits.dim() != 1:
        return None
    b = logits.shape[0]
    fm = _NO_FM.get(b)
    if fm is None:
        fm = _NO_FM[b] = torch.zeros(b)
    res = exfm_losses(logits, labels, fm, (1.0, 0.0, 0.0, 0.0), 1.0)
    return None if res is None else res[0]


def distill_loss(
    model: Any,
    batch: Batch,
    logits: Tensor,
    hidden: Tensor | None,
    cfg: DistillConfig,
    out: Tensor | None = None,
) -> DistillLoss:
    """The step's losses for an ExFM student (see the module docstring). ``logits`` [b] are the
    serving head's (float32), ``hidden`` [b, H] the top MLP's penultimate layer (needed when
    ``cfg.aux_head``), ``out`` the model's ``[b, 1 + H]`` output they were sliced from (lets the
    CPU take the C kernel, ``neorec.ops.exfm_losses``: the same numbers up to float rounding;
    its batch means equal the mean of the dense blocks' means up to rounding). Raises before any update: ``DataError`` for missing / bad FM logits,
    ``ConfigError`` for a model without the aux head / adapter the config asks for."""
    blocks = blocks_of(model)
    labels = batch.labels
    if FAST_LOSSES:
        fm = fm_logits_of(batch, check_finite=False)
        fast = _fast_losses(model, batch, logits, out, cfg, fm)
        if fast is not None:
            return fast
    fm = fm_logits_of(batch)
    logits = logits.contiguous()
    serving = _mean(F.binary_cross_entropy_with_logits, blocks, logits, labels)
    t = cfg.temperature
    if not cfg.aux_head:
        w = cfg.weight
        soft = _mean(lambda x, f: soft_bce(x, f, t), blocks, logits, fm)
        total = (1.0 - w) * serving + w * soft
        return DistillLoss(total, serving.detach(), soft=soft.detach())
    arch = distill_arch(model)
    if arch is None or arch.aux_head is None or (cfg.adapter and arch.adapter is None):
        raise ConfigError(
            "distill.aux_head / distill.adapter need a model built from this config with them "
            "(neorec.builder: build_dlrm, distributed_model, towered_model)"
        )
    if hidden is None:
        raise ConfigError("distill.aux_head needs the penultimate layer: call with hidden")
    head = arch.aux_head
    assert isinstance(head, torch.nn.Linear)
    adapter_loss = None
    if cfg.adapter:
        assert isinstance(arch.adapter, StudentAdapter)
        # The aux head's and the adapter's losses are plain batch means (no blocks).
        # One autograd node: the adapter learns the labels, the aux head its detached output.
        adapter_loss, aux, _ = adapter_and_aux_losses(
            arch.adapter, head, hidden.float(), fm, logits.detach(), batch.dense, labels, t
        )
        total = serving + adapter_loss + cfg.aux_weight * aux
    else:
        aux = aux_soft_bce(hidden.float(), head.weight, head.bias, fm, t)
        total = serving + cfg.aux_weight * aux
    return DistillLoss(
        total,
        serving.detach(),
        aux=aux.detach(),
        adapter=None if adapter_loss is None else adapter_loss.detach(),
    )


@torch.no_grad()
def aux_predictions(model: Any, batch: Batch) -> tuple[Tensor, Tensor | None]:
    """``(aux head logits, adapter output or None)`` of a batch (eval mode; for analysis and the
    bench: the serving head is what ``predict`` uses)."""
    from neorec.modules.dlrm import emit_hidden

    arch = distill_arch(model)
    if arch is None or arch.aux_head is None:
        raise ConfigError("the model has no aux head (distill.aux_head was off when built)")
    was = arch.training
    model.train(False)
    try:
        with emit_hidden(arch):
            out = model(batch.dense, batch.sparse).float()
        logits, hidden = out[:, 0].contiguous(), out[:, 1:]
        aux = arch.aux_head(hidden).squeeze(1)
        adapted = None
        if arch.adapter is not None:
            adapted = arch.adapter(fm_logits_of(batch), logits, batch.dense)
    finally:
        model.train(was)
    return aux, adapted
