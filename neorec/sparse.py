"""SparseFeatures: a keyed jagged batch of categorical ids, feature-major.

Layout (the same as TorchRec's KeyedJaggedTensor): for F features and a batch of B samples,
``lengths`` has F*B entries, ``lengths[f*B + b]`` ids of feature ``f`` for sample ``b``; ``values``
holds the ids in that order; ``weights`` (optional) one float per id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neorec.errors import NeorecError

__all__ = ["SparseFeatures", "SparseFeatureError"]


class SparseFeatureError(NeorecError, ValueError):
    """Bad sparse input: names the feature and the offending value."""


@dataclass
class SparseFeatures:
    """Keyed jagged batch: ``keys`` (F names), ``values`` [N] int64, ``lengths`` [F*B] int64."""

    keys: list[str]
    values: Tensor
    lengths: Tensor
    weights: Tensor | None = None

    def __post_init__(self) -> None:
        self.keys = list(self.keys)
        if len(set(self.keys)) != len(self.keys):
            raise SparseFeatureError(f"duplicate feature keys in {self.keys}")
        if not self.keys:
            raise SparseFeatureError("SparseFeatures needs at least one feature key")
        for name, t in (("values", self.values), ("lengths", self.lengths)):
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise SparseFeatureError(f"{name} must be a 1-D tensor, got {_describe(t)}")
        if self.lengths.numel() % len(self.keys) != 0:
            raise SparseFeatureError(
                f"lengths has {self.lengths.numel()} entries, not a multiple of "
                f"{len(self.keys)} features {self.keys}"
            )
        if self.weights is not None and (
            not isinstance(self.weights, Tensor) or self.weights.shape != self.values.shape
        ):
            raise SparseFeatureError(
                f"weights must be a tensor shaped like values {tuple(self.values.shape)}, "
                f"got {_describe(self.weights)}"
            )

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_lists(
        cls,
        features: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> SparseFeatures:
        """Build from ``{feature: [[ids of sample 0], [ids of sample 1], ...]}`` (tests, examples)."""
        keys = list(features)
        batch = {len(v) for v in features.values()}
        if len(batch) != 1:
            raise SparseFeatureError(f"features have different batch sizes: {sorted(batch)}")
        vals: list[int] = []
        lens: list[int] = []
        wts: list[float] = []
        for k in keys:
            for i, bag in enumerate(features[k]):
                vals.extend(int(x) for x in bag)
                lens.append(len(bag))
                if weights is not None:
                    w = weights[k][i]
                    if len(w) != len(bag):
                        raise SparseFeatureError(
                            f"feature '{k}' sample {i}: {len(w)} weights for {len(bag)} ids"
                        )
                    wts.extend(float(x) for x in w)
        return cls(
            keys=keys,
            values=torch.tensor(vals, dtype=torch.int64),
            lengths=torch.tensor(lens, dtype=torch.int64),
            weights=torch.tensor(wts, dtype=torch.float32) if weights is not None else None,
        )

    # ---- shape -----------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Samples in the batch (B)."""
        return self.lengths.numel() // len(self.keys)

    def offsets(self) -> Tensor:
        """Exclusive prefix sum of lengths, [F*B + 1]."""
        out = torch.zeros(self.lengths.numel() + 1, dtype=torch.int64, device=self.lengths.device)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    def lengths_per_key(self) -> Tensor:
        """Number of ids of each feature in the batch, [F]."""
        return self.lengths.view(len(self.keys), -1).sum(1)

    def feature(self, key: str) -> tuple[Tensor, Tensor, Tensor | None]:
        """(values, lengths, weights) of one feature."""
        f = self._index(key)
        per_key = self.lengths_per_key().tolist()
        start = sum(per_key[:f])
        end = start + per_key[f]
        b = self.batch_size
        w = self.weights[start:end] if self.weights is not None else None
        return self.values[start:end], self.lengths[f * b : (f + 1) * b], w

    def _index(self, key: str) -> int:
        try:
            return self.keys.index(key)
        except ValueError:
            raise KeyError(f"feature '{key}' not in batch keys {self.keys}") from None

    # ---- transforms ------------------------------------------------------------------------
    def to(self, device: torch.device | str, non_blocking: bool = False) -> SparseFeatures:
        """Copy to a device."""
        w = self.weights.to(device, non_blocking=non_blocking) if self.weights is not None else None
        return SparseFeatures(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            self.lengths.to(device, non_blocking=non_blocking),
            w,
        )

    def select_samples(self, start: int, end: int) -> SparseFeatures:
        """Samples ``start:end`` of every feature (a rank's slice of a global batch)."""
        b = self.batch_size
        if not 0 <= start <= end <= b:
            raise SparseFeatureError(f"sample range [{start}, {end}) outside batch of {b}")
        lens = self.lengths.view(len(self.keys), b)
        offs = self.offsets()
        vals, wts = [], []
        for f in range(len(self.keys)):
            lo = int(offs[f * b + start])
            hi = int(offs[f * b + end])
            vals.append(self.values[lo:hi])
            if self.weights is not None:
                wts.append(self.weights[lo:hi])
        return SparseFeatures(
            self.keys,
            torch.cat(vals),
            lens[:, start:end].reshape(-1).clone(),
            torch.cat(wts) if self.weights is not None else None,
        )

    def reorder(self, keys: Sequence[str]) -> SparseFeatures:
        """The same batch with features in ``keys`` order (error if the key sets differ)."""
        keys = list(keys)
        if keys == self.keys:
            return self
        missing = sorted(set(keys) - set(self.keys))
        extra = sorted(set(self.keys) - set(keys))
        if missing or extra:
            raise SparseFeatureError(
                f"batch features do not match the tables: missing {missing}, unexpected {extra}"
            )
        return self.select(keys)

    def select(self, keys: Sequence[str]) -> SparseFeatures:
        """A batch of only the features ``keys``, in that order."""
        keys = list(keys)
        if keys == self.keys:
            return self
        parts = [self.feature(k) for k in keys]
        weights = None
        if self.weights is not None:
            weights = torch.cat([p[2] for p in parts if p[2] is not None])
        return SparseFeatures(
            keys, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), weights
        )

    # ---- validation ------------------------------------------------------------------------
    def validate(
        self,
        num_rows: Mapping[str, int] | None = None,
        table_names: Mapping[str, str] | None = None,
    ) -> None:
        """Raise SparseFeatureError naming the feature and value if the batch is malformed.

        ``num_rows`` maps feature key -> rows of the table it looks up; ids must lie in [0, rows).
        ``table_names`` (feature key -> table name) makes the messages name the table too.
        """
        if self.values.dtype not in (torch.int64, torch.int32):
            raise SparseFeatureError(
                f"ids must be integers (int32/int64), got dtype {self.values.dtype}"
            )
        if self.lengths.dtype not in (torch.int64, torch.int32):
            raise SparseFeatureError(f"lengths must be integers, got dtype {self.lengths.dtype}")
        b = self.batch_size
        lens = self.lengths.view(len(self.keys), b)
        neg = (lens < 0).nonzero()
        if neg.numel():
            f, s = (int(x) for x in neg[0])
            raise SparseFeatureError(
                f"feature '{self.keys[f]}' sample {s}: negative length {int(lens[f, s])}"
            )
        total = int(self.lengths.sum())
        if total != self.values.numel():
            raise SparseFeatureError(
                f"lengths sum to {total} but there are {self.values.numel()} values"
            )
        if num_rows is None:
            return
        per_key = self.lengths_per_key().tolist()
        start = 0
        for key, n in zip(self.keys, per_key):
            if key not in num_rows:
                raise SparseFeatureError(
                    f"feature '{key}' has no table (known: {sorted(num_rows)})"
                )
            ids = self.values[start : start + n]
            rows = int(num_rows[key])
            where = f"feature '{key}'"
            if table_names is not None and key in table_names:
                where += f" (table '{table_names[key]}')"
            if n:
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0:
                    raise SparseFeatureError(f"{where}: id {lo} < 0")
                if hi >= rows:
                    raise SparseFeatureError(f"{where}: id {hi} >= table rows {rows}")
            start += n


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"tensor of shape {tuple(t.shape)} dtype {t.dtype}"
    return type(t).__name__
