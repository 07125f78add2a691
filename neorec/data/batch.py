"""The unit the loader yields and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from neorec.sparse import SparseFeatures

__all__ = ["Batch"]


@dataclass
class Batch:
    """``dense`` [b, num_dense] float32, ``sparse`` (F features x b samples), ``labels`` [b] float32."""

    dense: Tensor
    sparse: SparseFeatures
    labels: Tensor

    def __post_init__(self) -> None:
        b = self.labels.shape[0]
        if self.dense.dim() != 2 or self.dense.shape[0] != b:
            raise ValueError(f"dense must be [{b}, num_dense], got {tuple(self.dense.shape)}")
        if self.sparse.batch_size != b:
            raise ValueError(f"sparse has batch {self.sparse.batch_size}, labels {b}")

    @property
    def size(self) -> int:
        """Samples in the batch."""
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Copy to a device."""
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    def slice(self, start: int, end: int) -> Batch:
        """Samples ``start:end`` (a rank's part of a global batch)."""
        return Batch(
            self.dense[start:end], self.sparse.select_samples(start, end), self.labels[start:end]
        )
