"""The unit the loader yields and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from neorec.sparse import SparseFeatures

__all__ = ["Batch"]


@dataclass
class Batch:
    """``dense`` [b, num_dense] float32, ``sparse`` (F features x b samples), ``labels`` [b] float32,
    and optionally ``fm_logits`` [b] float32: a foundation model's logits of the same samples,
    attached by the data (DAS, neorec.data.stream), never computed in the training step."""

    dense: Tensor
    sparse: SparseFeatures
    labels: Tensor
    fm_logits: Tensor | None = None

    def __post_init__(self) -> None:
        b = self.labels.shape[0]
        if self.dense.dim() != 2 or self.dense.shape[0] != b:
            raise ValueError(f"dense must be [{b}, num_dense], got {tuple(self.dense.shape)}")
        if self.sparse.batch_size != b:
            raise ValueError(f"sparse has batch {self.sparse.batch_size}, labels {b}")
        fm = self.fm_logits
        if fm is not None and (fm.shape != (b,) or fm.dtype != torch.float32):
            raise ValueError(f"fm_logits must be [{b}] float32, got {tuple(fm.shape)} {fm.dtype}")

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Copy to a device."""
        fm = self.fm_logits
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            None if fm is None else fm.to(device, non_blocking=non_blocking),
        )

    def slice(self, start: int, end: int) -> Batch:
        """Samples ``start:end`` (a rank's part of a global batch)."""
        fm = self.fm_logits
        return Batch(
            self.dense[start:end],
            self.sparse.select_samples(start, end),
            self.labels[start:end],
            None if fm is None else fm[start:end],
        )
