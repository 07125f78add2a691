"""Row-sparse optimizer math: update the rows a batch touched, given their summed gradients.

Semantics (all backends must match these):
- ``sgd``:              ``w -= lr * g``
- ``rowwise_adagrad``:  FBGEMM EXACT_ROWWISE_ADAGRAD: ``s += mean(g*g)`` (one float per row),
                        ``w -= lr * g / (sqrt(s) + eps)``
- ``adam``:             per-element state ``m, v`` (same shape as the weights), lazy: only rows in
                        the batch move; bias correction uses the module's step count ``t`` (1-based):
                        ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
                        ``w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``
``g`` is the sum of every gradient of the row in the batch, accumulated in a fixed order.
``weight_decay`` (L2, added to ``g`` before the update) is supported by every optimizer.

CowClip (Zheng et al., AAAI 2023, adaptive column-wise clipping; ``clip_ratio`` r > 0): before the
update, the gradient of each row (L2 term included, as the authors' code clips the gradient of the
regularized loss) is clipped to the norm ``cnt * max(r * ||w||, clip_bound)``, ``cnt`` the row's
occurrences in the batch: ``g *= t / ||g||`` where ``||g|| > t`` (``clip_row_grads``).

Quantization-aware training (``qat``, Naumov et al. 2018): the gradient of a periodic penalty whose
minima are the row's integer grid is added to ``g`` after the L2 term, before clipping
(``neorec.ops.qat.periodic_grad``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.memory import table_zeros
from neorec.ops.qat import Periodic, periodic_grad

if TYPE_CHECKING:
    from neorec.config import EmbeddingConfig

__all__ = ["RowOptimizer", "OPTIMIZERS", "state_shapes", "apply_rows", "clip_row_grads"]

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")


@dataclass(frozen=True)
class RowOptimizer:
    """Hyper-parameters of the fused embedding optimizer."""

    kind: str = "rowwise_adagrad"
    """One of sgd, rowwise_adagrad, adam."""
    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Denominator guard (adagrad, adam)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient of the rows a batch touches."""
    clip_ratio: float = 0.0
    """CowClip's r: a row's gradient is clipped to ``cnt * max(r * ||w||, clip_bound)``; 0 = off."""
    clip_bound: float = 0.0
    """CowClip's zeta: the clip threshold's floor per occurrence (rows near 0 still move)."""
    qat: Periodic | None = None
    """The periodic regularizer of quantization-aware training (None: off)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in OPTIMIZERS:
            raise ConfigError(
                f"unknown embedding optimizer {self.kind!r}, expected one of {OPTIMIZERS}"
            )
        for name in ("lr", "eps", "beta1", "beta2", "weight_decay", "clip_ratio", "clip_bound"):
            _check_number(name, getattr(self, name))
        if not self.lr > 0:
            raise ConfigError(f"embedding optimizer lr must be > 0, got {self.lr}")
        if not self.eps > 0 or float(torch.tensor(self.eps, dtype=torch.float32)) == 0.0:
            raise ConfigError(
                f"embedding optimizer eps must be > 0 (and not round to 0 in float32), "
                f"got {self.eps}"
            )
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"embedding optimizer {name} must be in [0, 1), got {v}")
        if self.weight_decay < 0:
            raise ConfigError(
                f"embedding optimizer weight_decay must be >= 0, got {self.weight_decay}"
            )
        if self.clip_ratio < 0 or self.clip_bound < 0:
            raise ConfigError(
                f"embedding optimizer CowClip ratio and bound must be >= 0, got "
                f"{self.clip_ratio} and {self.clip_bound}"
            )
        if self.clip_bound and not self.clip_ratio:
            raise ConfigError(
                f"embedding optimizer CowClip bound {self.clip_bound} is set but its ratio is 0 "
                "(clipping is off: the bound would be ignored)"
            )
        if self.qat is not None and not isinstance(self.qat, Periodic):
            raise ConfigError(
                f"embedding optimizer qat must be a Periodic or None, got {self.qat!r}"[:200]
            )

    @property
    def clips(self) -> bool:
        """Whether CowClip clips the row gradients (the update then needs each row's count)."""
        return self.clip_ratio > 0

    @classmethod
    def from_config(cls, emb: EmbeddingConfig) -> RowOptimizer:
        """The fused optimizer an ``[embedding]`` config section asks for."""
        return cls(
            kind=emb.optimizer,
            lr=emb.lr,
            eps=emb.eps,
            weight_decay=emb.weight_decay,
            clip_ratio=emb.cowclip_ratio,
            clip_bound=emb.cowclip_bound,
        )


_F32_MAX = float(torch.finfo(torch.float32).max)


def _check_number(name: str, v: object) -> None:
    """A real, finite number that float32 holds (the kernel computes in float32)."""
    if isinstance(v, bool) or not isinstance(v, Real):
        raise ConfigError(
            f"embedding optimizer {name} must be a number, got {type(v).__name__} {v!r}"[:200]
        )
    if not math.isfinite(float(v)) or abs(float(v)) > _F32_MAX:
        raise ConfigError(f"embedding optimizer {name} must be a finite float32 number, got {v}")


def state_shapes(kind: str, total_rows: int, total_elems: int) -> dict[str, int]:
    """Names and flat sizes of the optimizer state tensors for ``kind``."""
    if kind == "sgd":
        return {}
    if kind == "rowwise_adagrad":
        return {"momentum1": total_rows}
    if kind == "adam":
        return {"exp_avg": total_elems, "exp_avg_sq": total_elems}
    raise ConfigError(f"unknown embedding optimizer '{kind}', expected one of {OPTIMIZERS}")


def clip_row_grads(opt: RowOptimizer, w: Tensor, g: Tensor, counts: Tensor) -> Tensor:
    """CowClip: each row of ``g`` [U, D] clipped to the norm ``counts * max(r ||w||, zeta)``
    (``w`` [U, D] the rows before the update, ``counts`` [U] their occurrences in the batch)."""
    thr = counts.to(w.dtype) * torch.clamp(opt.clip_ratio * w.norm(dim=1), min=opt.clip_bound)
    gn = g.norm(dim=1)
    scale = torch.where(gn > thr, thr / torch.where(gn > thr, gn, 1.0), 1.0)
    return g * scale.unsqueeze(1)


def apply_rows(
    opt: RowOptimizer,
    w: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    step: int,
    counts: Tensor | None = None,
) -> None:
    """Update rows ``w`` [U, D] in place from summed grads ``g`` [U, D].

    ``state`` holds the matching slices: ``momentum1`` [U] or ``exp_avg``/``exp_avg_sq`` [U, D].
    ``counts`` [U]: each row's occurrences in the batch (needed by CowClip only).
    """
    if opt.weight_decay:
        g = g + opt.weight_decay * w
    if opt.qat is not None:
        g = g + periodic_grad(opt.qat, w)
    if opt.clips:
        if counts is None:
            raise ConfigError(
                "CowClip (embedding.cowclip_ratio > 0) needs each row's count in the batch, "
                "which this update path does not have (supported: one process, fp32 tables, the "
                "reference and cpu TBE backends)"
            )
        g = clip_row_grads(opt, w, g, counts)
    if opt.kind == "sgd":
        w.sub_(opt.lr * g)
    elif opt.kind == "rowwise_adagrad":
        s = state["momentum1"]
        s.add_((g * g).mean(dim=1))
        w.sub_(opt.lr * g / (s.sqrt() + opt.eps).unsqueeze(1))
    elif opt.kind == "adam":
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(opt.beta1).add_((1.0 - opt.beta1) * g)
        v.mul_(opt.beta2).add_((1.0 - opt.beta2) * g * g)
        bc1 = 1.0 - opt.beta1**step
        bc2 = 1.0 - opt.beta2**step
        w.sub_(opt.lr * (m / bc1) / ((v / bc2).sqrt() + opt.eps))
    else:  # pragma: no cover - guarded by RowOptimizer
        raise ValueError(opt.kind)


def zeros_state(
    kind: str, total_rows: int, total_elems: int, device: torch.device
) -> dict[str, Tensor]:
    """Fresh optimizer state (flat float32 tensors)."""
    return {
        k: table_zeros(n, torch.float32, device)
        for k, n in state_shapes(kind, total_rows, total_elems).items()
    }
