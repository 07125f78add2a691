"""SparseFeatures: a keyed jagged batch of categorical ids, feature-major; JaggedFeatures: the same
batch whose ids may carry timestamps and action codes (ordered sequences: a user's history).

Layout (the same as TorchRec's KeyedJaggedTensor): for F features and a batch of B samples,
``lengths`` has F*B entries, ``lengths[f*B + b]`` ids of feature ``f`` for sample ``b``; ``values``
holds the ids in that order; ``weights`` (optional) one float per id. ``to_torchrec`` /
``from_torchrec`` convert to and from TorchRec's ``KeyedJaggedTensor`` (torchrec is imported only
there: neorec does not depend on it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor

from neorec.errors import NeorecError

__all__ = [
    "SparseFeatures",
    "SparseFeatureError",
    "JaggedFeatures",
    "to_torchrec",
    "from_torchrec",
]


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
        if isinstance(self.keys, str) or not isinstance(self.keys, Sequence):
            raise SparseFeatureError(
                f"keys must be a list of feature names, got {type(self.keys).__name__} "
                f"{self.keys!r}"[:200]
            )
        self.keys = list(self.keys)
        bad = [k for k in self.keys if not isinstance(k, str) or not k]
        if bad:
            raise SparseFeatureError(f"feature keys must be non-empty strings, got {bad[:5]}")
        if len(set(self.keys)) != len(self.keys):
            raise SparseFeatureError(f"duplicate feature keys in {self.keys}")
        if not self.keys:
            raise SparseFeatureError("SparseFeatures needs at least one feature key")
        for name, t in (("values", self.values), ("lengths", self.lengths)):
            if not isinstance(t, Tensor) or t.dim() != 1:
                raise SparseFeatureError(f"{name} must be a 1-D tensor, got {_describe(t)}")
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                what = "ids" if name == "values" else "lengths"
                raise SparseFeatureError(
                    f"{name} must hold integer {what} (int64 or int32), got dtype {t.dtype}"
                )
        if self.lengths.numel() % len(self.keys) != 0:
            raise SparseFeatureError(
                f"lengths has {self.lengths.numel()} entries, not a multiple of "
                f"{len(self.keys)} features {self.keys}"
            )
        if self.weights is not None:
            self._check_weights_shape()
        devices = {t.device for t in (self.values, self.lengths, self.weights) if t is not None}
        if any(d.type == "meta" for d in devices):
            raise SparseFeatureError("values, lengths and weights on the meta device hold no data")
        if len(devices) > 1:
            raise SparseFeatureError(
                f"values, lengths and weights must be on one device, got {sorted(map(str, devices))}"
            )

    def _check_weights_shape(self) -> None:
        w = self.weights
        if not isinstance(w, Tensor) or w.shape != self.values.shape:
            raise SparseFeatureError(
                f"weights must be a tensor shaped like values {tuple(self.values.shape)}, "
                f"got {_describe(w)}"
            )
        if not w.is_floating_point():
            raise SparseFeatureError(
                f"per-id weights of features {self.keys} must be floating point (float32, the "
                f"tables' dtype), got dtype {w.dtype}"
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
        if weights is not None and set(weights) != set(keys):
            raise SparseFeatureError(
                f"weights are given for features {sorted(weights)}, ids for {sorted(keys)}"
            )
        vals: list[int] = []
        lens: list[int] = []
        wts: list[float] = []
        for k in keys:
            for i, bag in enumerate(features[k]):
                vals.extend(_id(x, k, i) for x in bag)
                lens.append(len(bag))
                if weights is not None:
                    w = weights[k][i]
                    if len(w) != len(bag):
                        raise SparseFeatureError(
                            f"feature '{k}' sample {i}: {len(w)} weights for {len(bag)} ids"
                        )
                    wts.extend(_weight(x, k, i) for x in w)
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
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        """Raise SparseFeatureError naming the feature and value if the batch is malformed.

        ``num_rows`` maps feature key -> rows of the table it looks up; ids must lie in [0, rows).
        ``table_names`` (feature key -> table name) makes the messages name the table too.
        ``weight_dtype``: the tables' dtype, which per-id weights must have (no silent rounding).
        Per-id weights must be finite: one NaN would make the rows it touches NaN for good.
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
        n = self.values.numel()
        if lens.numel() and int(lens.max()) > n:  # (before the sum, which could overflow)
            f, s = divmod(int(lens.argmax()), b)
            raise SparseFeatureError(
                f"feature '{self.keys[f]}' sample {s}: length {int(lens[f, s])} exceeds the "
                f"{n} values of the batch"
            )
        total = int(self.lengths.sum())
        if total != n:
            raise SparseFeatureError(
                f"lengths sum to {total} but there are {self.values.numel()} values"
            )
        if self.weights is not None:
            self._validate_weights(weight_dtype)
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

    def _validate_weights(self, dtype: torch.dtype | None) -> None:
        self._check_weights_shape()
        w = self.weights
        assert w is not None
        if dtype is not None and w.dtype != dtype:
            raise SparseFeatureError(
                f"per-id weights of features {self.keys} are {w.dtype}, the tables {dtype}: "
                f"convert them (e.g. weights.to({dtype})) if the rounding is intended"
            )
        if bool(torch.isfinite(w).all()):
            return
        pos = int((~torch.isfinite(w)).nonzero()[0, 0])
        bag = int(torch.searchsorted(self.offsets(), torch.tensor(pos), right=True)) - 1
        f, s = divmod(bag, self.batch_size)
        raise SparseFeatureError(
            f"feature '{self.keys[f]}' sample {s}: per-id weight {float(w[pos])} at position "
            f"{pos} is not finite"
        )


def _id(x: object, key: str, sample: int) -> int:
    """An id from a Python list: an integer that fits int64 (not a float or bool)."""
    if isinstance(x, bool) or not isinstance(x, Integral):
        raise SparseFeatureError(
            f"feature '{key}' sample {sample}: id {x!r} is not an integer"[:200]
        )
    v = int(x)
    if not -(2**63) <= v < 2**63:
        raise SparseFeatureError(f"feature '{key}' sample {sample}: id {v} does not fit int64")
    return v


def _weight(x: object, key: str, sample: int) -> float:
    """A per-id weight from a Python list: a real number (finiteness is checked by validate)."""
    if isinstance(x, bool) or not isinstance(x, Real):
        raise SparseFeatureError(
            f"feature '{key}' sample {sample}: weight {x!r} is not a number"[:200]
        )
    return float(x)


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"tensor of shape {tuple(t.shape)} dtype {t.dtype}"
    return type(t).__name__


_PER_ID = ("weights", "timestamps", "actions")


@dataclass
class JaggedFeatures(SparseFeatures):
    """A ``SparseFeatures`` batch whose ids may carry ``timestamps`` and ``actions`` (int64 [N]
    each, like ``values``): ordered sequences, oldest first. Offsets per key: ``key_offsets()``
    (where each key's ids start) and ``offsets()`` (each sample's sequence)."""

    timestamps: Tensor | None = None
    """int64 [N]: each id's time (non-decreasing within a sequence); None: no times."""
    actions: Tensor | None = None
    """int64 [N]: each id's action code (>= 0: a click, a purchase, ...); None: no actions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("timestamps", "actions"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.shape != self.values.shape:
                raise SparseFeatureError(
                    f"{name} must be a tensor shaped like values {tuple(self.values.shape)}, "
                    f"got {_describe(t)}"
                )
            if t.dtype not in (torch.int64, torch.int32):
                raise SparseFeatureError(f"{name} must be int64 (or int32), got dtype {t.dtype}")
            if t.device != self.values.device:
                raise SparseFeatureError(
                    f"{name} on {t.device}, values on {self.values.device}: one device"
                )

    @classmethod
    def from_sequences(
        cls,
        features: Mapping[str, Sequence[Sequence[int]]],
        timestamps: Mapping[str, Sequence[Sequence[int]]] | None = None,
        actions: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> JaggedFeatures:
        """Build from ``{feature: [[ids of sample 0], ...]}`` and the same shapes of times and
        actions (tests, examples)."""
        base = SparseFeatures.from_lists(features)
        extra: dict[str, Tensor | None] = {"timestamps": None, "actions": None}
        for name, given in (("timestamps", timestamps), ("actions", actions)):
            if given is None:
                continue
            if set(given) != set(features):
                raise SparseFeatureError(
                    f"{name} are given for features {sorted(given)}, ids for {sorted(features)}"
                )
            flat: list[int] = []
            for k in base.keys:
                for i, seq in enumerate(given[k]):
                    if i >= len(features[k]) or len(seq) != len(features[k][i]):
                        raise SparseFeatureError(
                            f"feature '{k}' sample {i}: {len(seq)} {name} for "
                            f"{len(features[k][i]) if i < len(features[k]) else 0} ids"
                        )
                    flat.extend(_id(x, k, i) for x in seq)
            extra[name] = torch.tensor(flat, dtype=torch.int64)
        return cls(base.keys, base.values, base.lengths, None, **extra)

    def key_offsets(self) -> list[int]:
        """Where each key's ids start in ``values``, [F + 1] (host ints)."""
        out = [0]
        for n in self.lengths_per_key().tolist():
            out.append(out[-1] + int(n))
        return out

    def sequence(self, key: str) -> dict[str, Tensor | None]:
        """One key's ``values``, ``lengths``, ``offsets`` [B + 1] and per-id fields."""
        f = self._index(key)
        lo, hi = self.key_offsets()[f : f + 2]
        b = self.batch_size
        lengths = self.lengths[f * b : (f + 1) * b]
        offsets = torch.zeros(b + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        out: dict[str, Tensor | None] = {"values": self.values[lo:hi], "lengths": lengths}
        out["offsets"] = offsets
        for name in _PER_ID:
            t = getattr(self, name)
            out[name] = t[lo:hi] if t is not None else None
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedFeatures:
        """Copy to a device."""
        return self._with(lambda t: t.to(device, non_blocking=non_blocking), None)

    def select(self, keys: Sequence[str]) -> JaggedFeatures:
        """A batch of only the features ``keys``, in that order."""
        keys = list(keys)
        if keys == self.keys:
            return self
        offs = self.key_offsets()
        idx = [self._index(k) for k in keys]
        b = self.batch_size
        pos = torch.cat([torch.arange(offs[f], offs[f + 1]) for f in idx] or [torch.arange(0)])
        lens = torch.cat([self.lengths[f * b : (f + 1) * b] for f in idx])
        pos = pos.to(self.values.device)
        return self._with(lambda t: t[pos], (keys, lens))

    def select_samples(self, start: int, end: int) -> JaggedFeatures:
        """Samples ``start:end`` of every feature."""
        b = self.batch_size
        if not 0 <= start <= end <= b:
            raise SparseFeatureError(f"sample range [{start}, {end}) outside batch of {b}")
        offs = self.offsets().tolist()
        ranges = [
            torch.arange(offs[f * b + start], offs[f * b + end]) for f in range(len(self.keys))
        ]
        pos = torch.cat(ranges).to(self.values.device)
        lens = self.lengths.view(len(self.keys), b)[:, start:end].reshape(-1).clone()
        return self._with(lambda t: t[pos], (self.keys, lens))

    def _with(self, fn: Any, keys_lengths: tuple[list[str], Tensor] | None) -> JaggedFeatures:
        """The batch with ``fn`` applied to values and per-id fields (and new keys, lengths)."""
        keys, lengths = keys_lengths or (self.keys, fn(self.lengths))
        per_id = {
            k: fn(getattr(self, k)) if getattr(self, k) is not None else None for k in _PER_ID
        }
        return JaggedFeatures(keys, fn(self.values), lengths.to(self.values.device), **per_id)

    def validate(
        self,
        num_rows: Mapping[str, int] | None = None,
        table_names: Mapping[str, str] | None = None,
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        """``SparseFeatures.validate``, then per id: ids within their tables, timestamps
        non-decreasing within each sequence, actions >= 0; the error names key, sample and
        position in the sequence."""
        super().validate(None, None, weight_dtype)
        if num_rows is not None:
            missing = [k for k in self.keys if k not in num_rows]
            if missing:
                raise SparseFeatureError(
                    f"feature '{missing[0]}' has no table (known: {sorted(num_rows)})"
                )
            per_key = self.lengths_per_key()
            rows = torch.repeat_interleave(
                torch.tensor([int(num_rows[k]) for k in self.keys], device=per_key.device),
                per_key,
            )
            bad = (self.values < 0) | (self.values >= rows)
            if bool(bad.any()):
                p = int(bad.nonzero()[0, 0])
                key = self._where(p)[0]
                tab = f" (table '{table_names[key]}')" if table_names and key in table_names else ""
                raise SparseFeatureError(
                    f"{self._at(p)}{tab}: id {int(self.values[p])} outside [0, {int(rows[p])})"
                )
        if self.timestamps is not None and self.values.numel() > 1:
            ts = self.timestamps
            starts = torch.zeros_like(ts, dtype=torch.bool)
            starts[self.offsets()[:-1].clamp(max=ts.numel() - 1)] = True
            down = (ts[1:] < ts[:-1]) & ~starts[1:]
            if bool(down.any()):
                p = int(down.nonzero()[0, 0]) + 1
                raise SparseFeatureError(
                    f"{self._at(p)}: timestamp {int(ts[p])} is before the previous one "
                    f"{int(ts[p - 1])} (sequences are oldest first)"
                )
        if self.actions is not None and bool((self.actions < 0).any()):
            p = int((self.actions < 0).nonzero()[0, 0])
            raise SparseFeatureError(f"{self._at(p)}: action code {int(self.actions[p])} < 0")

    def _where(self, p: int) -> tuple[str, int, int]:
        """(key, sample, position in its sequence) of the id at flat position ``p``."""
        offs = self.offsets()
        bag = int(torch.searchsorted(offs, torch.tensor(p, device=offs.device), right=True)) - 1
        f, s = divmod(bag, self.batch_size)
        return self.keys[f], s, p - int(offs[bag])

    def _at(self, p: int) -> str:
        key, s, i = self._where(p)
        return f"feature '{key}' sample {s} position {i}"


def to_torchrec(batch: SparseFeatures, suffixes: tuple[str, str] = ("_ts", "_action")) -> Any:
    """TorchRec's ``KeyedJaggedTensor`` of ``batch`` (needs torchrec). A ``JaggedFeatures``'
    timestamps and actions become keys of their own, ``<key><suffix>`` with the same lengths
    (as HSTU's inputs carry them); per-id weights of those keys are 1."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, values, lengths = list(batch.keys), [batch.values], [batch.lengths]
    weights = [batch.weights] if batch.weights is not None else None
    for name, suffix in zip(("timestamps", "actions"), suffixes):
        extra = getattr(batch, name, None)
        if extra is None:
            continue
        keys += [k + suffix for k in batch.keys]
        values.append(extra.to(batch.values.dtype))
        lengths.append(batch.lengths)
        if weights is not None:
            weights.append(torch.ones_like(batch.weights))  # type: ignore[arg-type]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights is not None else None,
    )


def from_torchrec(kjt: Any, suffixes: tuple[str, str] = ("_ts", "_action")) -> JaggedFeatures:
    """A ``JaggedFeatures`` of TorchRec's ``KeyedJaggedTensor`` ``kjt``: keys ``<key><suffix>``
    whose ``<key>`` is present become its timestamps / actions (the inverse of ``to_torchrec``;
    their lengths must match)."""
    keys = list(kjt.keys())
    lengths = kjt.lengths()
    b = lengths.numel() // max(len(keys), 1)
    offs = [0, *torch.cumsum(lengths.view(len(keys), b).sum(1), 0).tolist()]
    ids = {k: i for i, k in enumerate(keys)}
    extra = {k: k[: -len(sfx)] for sfx in suffixes for k in keys if k.endswith(sfx)}
    extra = {k: base for k, base in extra.items() if base in ids}
    main = [k for k in keys if k not in extra]

    def part(t: Tensor, ks: list[str]) -> Tensor:
        return torch.cat([t[offs[ids[k]] : offs[ids[k] + 1]] for k in ks])

    per_id: dict[str, Tensor | None] = {"timestamps": None, "actions": None}
    for name, sfx in zip(("timestamps", "actions"), suffixes):
        ks = [k + sfx for k in main]
        if not any(k in extra for k in ks):
            continue
        for k in ks:
            if k not in extra:
                raise SparseFeatureError(f"KeyedJaggedTensor has some {name} keys but not '{k}'")
            if not torch.equal(
                lengths[ids[k] * b : (ids[k] + 1) * b],
                lengths[ids[extra[k]] * b : (ids[extra[k]] + 1) * b],
            ):
                raise SparseFeatureError(f"'{k}' has other lengths than '{extra[k]}'")
        per_id[name] = part(kjt.values(), ks).to(torch.int64)
    w = kjt.weights_or_none()
    lens = torch.cat([lengths[ids[k] * b : (ids[k] + 1) * b] for k in main])
    return JaggedFeatures(
        main, part(kjt.values(), main), lens, part(w, main) if w is not None else None, **per_id
    )
