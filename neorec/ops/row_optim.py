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

if TYPE_CHECKING:
    from neorec.config import EmbeddingConfig

__all__ = ["RowOptimizer", "OPTIMIZERS", "state_shapes", "apply_rows"]

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

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in OPTIMIZERS:
            raise ConfigError(
                f"unknown embedding optimizer {self.kind!r}, expected one of {OPTIMIZERS}"
            )
        for name in ("lr", "eps", "beta1", "beta2", "weight_decay"):
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

    @classmethod
    def from_config(cls, emb: EmbeddingConfig) -> RowOptimizer:
        """The fused optimizer an ``[embedding]`` config section asks for."""
        return cls(kind=emb.optimizer, lr=emb.lr, eps=emb.eps, weight_decay=emb.weight_decay)


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


def apply_rows(
    opt: RowOptimizer,
    w: Tensor,
    g: Tensor,
    state: dict[str, Tensor],
    step: int,
) -> None:
    """Update rows ``w`` [U, D] in place from summed grads ``g`` [U, D].

    ``state`` holds the matching slices: ``momentum1`` [U] or ``exp_avg``/``exp_avg_sq`` [U, D].
    """
    if opt.weight_decay:
        g = g + opt.weight_decay * w
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
