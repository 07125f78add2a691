"""Threshold admission in front of a fixed (hashed) table: ids whose count of sightings is below a
threshold are left out of their bags, so they read zero and their rows get no update from them.

It is the dynamic table's ``admission = "threshold"`` filter (``neorec.ops.id_map``) for a table
without slots: the same count-min sketch (``SKETCH_DEPTH`` rows of int32 counters, saturating,
the id map's salts for a seed), the same halving of every counter once the sketch has seen
``SKETCH_PERIOD_FACTOR`` x width sightings, the same rule (an id is admitted when its smallest
counter reaches the threshold). A hashed table has no slots, so two things differ from the map:
every sighting is counted (the map counts only ids without a slot), and an id is admitted while
its estimate is at or above the threshold (the map keeps an admitted id until it is evicted;
holding a set of admitted ids would cost memory a slot). Eval (``count=False``) only reads the
sketch. Memory: ``sketch_bytes`` = depth x width x 4 bytes a table.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.id_map import SKETCH_PERIOD_FACTOR, _mix64_np, mix64
from neorec.ops.id_map_size import SKETCH_DEPTH
from neorec.sparse import SparseFeatures

__all__ = ["CountMinAdmission", "AdmissionFilter", "sketch_bytes"]

_M64 = (1 << 64) - 1
_I32_MAX = 2**31 - 1


def sketch_bytes(width: int) -> int:
    """Bytes of one table's sketch of ``width`` counters a row."""
    return SKETCH_DEPTH * 4 * int(width)


class CountMinAdmission:
    """One table's threshold admission by a count-min sketch (see the module docstring)."""

    def __init__(self, threshold: int, width: int, seed: int = 0) -> None:
        if threshold < 1:
            raise ConfigError(f"CountMinAdmission: threshold must be >= 1, got {threshold}")
        if width < 1 or width & (width - 1):
            raise ConfigError(f"CountMinAdmission: width must be a power of two, got {width}")
        self.threshold, self.width = int(threshold), int(width)
        s = int(seed) & _M64
        # the id map's salts for this seed (``IdMap._sk_salt``)
        self.salts = [mix64(((s * 8 + d + 1) & _M64) ^ 0xA0761D6478BD642F) for d in range(4)]
        self.period = SKETCH_PERIOD_FACTOR * self.width
        self.sketch = np.zeros(SKETCH_DEPTH * self.width, dtype=np.int32)
        self.total = 0

    def _idx(self, ids: np.ndarray) -> list[np.ndarray]:
        u = ids.astype(np.int64).view(np.uint64)
        mask = np.uint64(self.width - 1)
        return [
            (_mix64_np(u ^ np.uint64(s)) & mask).astype(np.int64) + d * self.width
            for d, s in enumerate(self.salts)
        ]

    def admitted(self, ids: Tensor, count: bool = True) -> Tensor:
        """Bool mask over ``ids``: admitted after this batch's sightings (``count``) or now."""
        x = ids.numpy()
        uniq, inv, cnt = np.unique(x, return_inverse=True, return_counts=True)
        idx = self._idx(uniq)
        sk = self.sketch
        if count and uniq.size:
            wide = sk.astype(np.int64)
            for ix in idx:
                np.add.at(wide, ix, cnt.astype(np.int64))
            sk[:] = np.minimum(wide, _I32_MAX).astype(np.int32)
            self.total += int(cnt.sum())
        est = np.min(np.stack([sk[ix] for ix in idx]), axis=0) if uniq.size else uniq
        keep = est >= self.threshold
        if count:
            while self.total >= self.period:
                sk >>= 1
                self.total >>= 1
        return torch.from_numpy(np.ascontiguousarray(keep[inv.reshape(-1)]))


class AdmissionFilter:
    """Threshold admission for every feature of a batch (one sketch a feature key): unadmitted
    ids are dropped from their bags (sum pooling: they read zero; no gradient reaches a row
    through them), the bags stay."""

    def __init__(self, keys: list[str], threshold: int, width: int, seed: int = 0) -> None:
        self.keys = list(keys)
        self.sketches = {k: CountMinAdmission(threshold, width, seed) for k in self.keys}

    @property
    def bytes(self) -> int:
        """Bytes of all the sketches."""
        return sum(sketch_bytes(s.width) for s in self.sketches.values())

    def __call__(self, sp: SparseFeatures, count: bool = True) -> SparseFeatures:
        lens = sp.lengths.view(len(sp.keys), -1)
        cuts = [0, *torch.cumsum(lens.sum(1), 0).tolist()]
        keep = torch.ones(sp.values.numel(), dtype=torch.bool)
        for f, k in enumerate(sp.keys):
            if k in self.sketches:
                a, b = cuts[f], cuts[f + 1]
                keep[a:b] = self.sketches[k].admitted(sp.values[a:b], count)
        if bool(keep.all()):
            return sp
        bag = torch.repeat_interleave(torch.arange(sp.lengths.numel()), sp.lengths)
        lengths = torch.bincount(bag[keep], minlength=sp.lengths.numel()).to(sp.lengths.dtype)
        w = sp.weights[keep] if sp.weights is not None else None
        return SparseFeatures(sp.keys, sp.values[keep], lengths, w)
