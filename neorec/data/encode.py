"""A parsed block of a tabular file -> the model's inputs, as ``data.schema`` declares them.

Both readers (:mod:`neorec.data.tabular`: CSV/TSV and Parquet) produce a :class:`Block` of typed
columns; everything after that is this one code path: the train split's statistics and
vocabularies (:class:`Fitter` -> :class:`Fitted`), then :func:`encode` into sample-major jagged
arrays (what the shards store and :func:`jagged_batch` turns into a keyed jagged batch).

Ids: an ``int`` id is its 64-bit value; a ``str`` id is the first 8 bytes of its BLAKE2b digest
(a key). ``hash`` rows are ``splitmix64(key + seed * golden) % rows``; ``vocab`` rows come from the
table's vocabulary (keys sorted by descending count, then key; row 0 = out of vocabulary). Features
that share a table share its vocabulary and its hash, so one id is one row whichever feature
brings it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from neorec.config.schema import SchemaConfig
from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.sparse import SparseFeatures

__all__ = [
    "Block",
    "SparseColumn",
    "Fitted",
    "Fitter",
    "Encoded",
    "encode",
    "jagged_batch",
    "str_keys",
    "hash_rows",
    "table_of",
    "slice_block",
    "concat_encoded",
    "slice_encoded",
    "sample_offsets",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class SparseColumn:
    """The ids of one feature in a block: ``lengths`` [n], ``keys`` [sum] int64 (sample order),
    ``weights`` [sum] float32 or None."""

    lengths: np.ndarray
    keys: np.ndarray
    weights: np.ndarray | None = None


@dataclass
class Block:
    """Typed columns of ``n`` consecutive rows of one file (what a reader yields)."""

    n: int
    labels: np.ndarray  # [n] float32, 0 or 1
    dense: dict[str, tuple[np.ndarray, np.ndarray]]  # column -> (values float64, missing bool)
    sparse: dict[str, SparseColumn]  # feature name -> ids
    where: Callable[[int], str]  # row i of the block -> "file:line" / "file: row r"


def str_keys(values: Sequence[str]) -> np.ndarray:
    """int64 keys of string ids (8 bytes of BLAKE2b of the UTF-8 text), each unique one hashed
    once. Memory grows with the ids' total length, never with rows x the longest id (no
    fixed-width string array)."""
    out = np.empty(len(values), np.int64)
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        s = v if isinstance(v, str) else str(v)
        k = seen.get(s)
        if k is None:
            digest = hashlib.blake2b(s.encode(), digest_size=8).digest()
            k = seen[s] = int.from_bytes(digest, "little", signed=True)
        out[i] = k
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_rows(keys: np.ndarray, seed: int, rows: int) -> np.ndarray:
    """Rows ``[0, rows)`` of int64 keys under the seeded hash."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.int64).view(np.uint64) + np.uint64(seed) * _GOLDEN
        return (_splitmix64(x) % np.uint64(rows)).astype(np.int64)


def table_of(tables: Sequence[Any]) -> dict[str, Any]:
    """Feature name -> the table that reads it."""
    return {f: t for t in tables for f in t.features}


@dataclass
class Fitted:
    """What preprocessing learns from the train split: dense statistics, vocabularies."""

    mean: dict[str, float] = field(default_factory=dict)
    std: dict[str, float] = field(default_factory=dict)
    vocab: dict[str, np.ndarray] = field(default_factory=dict)
    """Table name -> its keys in row order (the key of row r is ``vocab[r - 1]``)."""

    def lookup(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Vocabulary rows of ``keys`` (0 = out of vocabulary)."""
        voc = self.vocab[table]
        order = np.argsort(voc, kind="stable")
        srt = voc[order]
        pos = np.searchsorted(srt, keys)
        hit = pos < len(srt)
        hit[hit] = srt[pos[hit]] == keys[hit]
        rows = np.zeros(len(keys), np.int64)
        rows[hit] = order[pos[hit]] + 1
        return rows

    def to_json(self) -> dict[str, Any]:
        """The statistics (vocabularies are stored as files)."""
        return {
            "mean": self.mean,
            "std": self.std,
            "vocab_rows": {t: len(v) + 1 for t, v in self.vocab.items()},
        }


class Fitter:
    """Accumulates the train split's statistics block by block."""

    def __init__(self, schema: SchemaConfig, tables: Sequence[Any]) -> None:
        self.schema = schema
        owner = table_of(tables)
        self.rows = {f.name: int(owner[f.name].rows) for f in schema.sparse}
        self.table = {f.name: owner[f.name].name for f in schema.sparse}
        self.min_count: dict[str, int] = {}
        for f in schema.sparse:
            if f.ids != "vocab":
                continue
            t = self.table[f.name]
            if self.min_count.setdefault(t, f.min_count) != f.min_count:
                raise DataError(f"features of table '{t}' give different min_count values")
        self.moments = {f.column: np.zeros(3) for f in schema.dense if f.transform == "standardize"}
        self.counts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
            t: [] for t in self.min_count
        }

    @property
    def needed(self) -> bool:
        """Whether anything has to be fitted (else the pass can be skipped)."""
        return bool(self.moments or self.counts)

    def add(self, block: Block) -> None:
        """Count one block (train rows only)."""
        for col, acc in self.moments.items():
            v, miss = block.dense[col]
            x = v[~miss]
            acc += (len(x), x.sum(), (x * x).sum())
        for f in self.schema.sparse:
            t = self.table[f.name]
            if t in self.counts:
                self.counts[t].append(np.unique(block.sparse[f.name].keys, return_counts=True))

    def fitted(self) -> Fitted:
        """The statistics and vocabularies of everything added."""
        out = Fitted()
        for col, (n, s, ss) in self.moments.items():
            mean = s / n if n else 0.0
            var = max(ss / n - mean * mean, 0.0) if n else 0.0
            out.mean[col], out.std[col] = float(mean), float(np.sqrt(var)) if var > 0 else 1.0
        for t, parts in self.counts.items():
            keys = np.concatenate([p[0] for p in parts] or [np.zeros(0, np.int64)])
            cnts = np.concatenate([p[1] for p in parts] or [np.zeros(0, np.int64)])
            uniq, inv = np.unique(keys, return_inverse=True)
            total = np.bincount(inv, weights=cnts, minlength=len(uniq)).astype(np.int64)
            keep = total >= self.min_count[t]
            uniq, total = uniq[keep], total[keep]
            order = np.lexsort((uniq, -total))  # most frequent first, ties by key
            rows = next(r for f, r in self.rows.items() if self.table[f] == t)
            out.vocab[t] = uniq[order][: rows - 1]
        return out


@dataclass
class Encoded:
    """A block as model inputs, sample-major: sample i's ids are ``values[off[i]:off[i+1]]``,
    feature after feature (``lengths[i]``)."""

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, D] float32
    lengths: np.ndarray  # [n, F] int32
    values: np.ndarray  # [T] int64 rows
    weights: np.ndarray | None  # [T] float32


def encode(block: Block, schema: SchemaConfig, tables: Sequence[Any], fitted: Fitted) -> Encoded:
    """The model's inputs of a parsed block."""
    n = block.n
    dense = np.empty((n, len(schema.dense)), np.float32)
    for j, f in enumerate(schema.dense):
        v, miss = block.dense[f.column]
        if f.transform == "log1p":
            v = np.log1p(np.maximum(v, 0.0))
        elif f.transform == "standardize":
            v = (v - fitted.mean[f.column]) / fitted.std[f.column]
        dense[:, j] = np.where(miss, f.fill, v)
    owner = table_of(tables)
    feats = schema.sparse
    lengths = np.stack([block.sparse[f.name].lengths for f in feats], axis=1).astype(np.int64)
    per_sample = lengths.sum(1)
    off = np.concatenate(([0], np.cumsum(per_sample)))
    before = np.cumsum(lengths, axis=1) - lengths  # ids of earlier features of the same sample
    values = np.empty(int(off[-1]), np.int64)
    weighted = any(f.weights for f in feats)
    weights = np.ones(len(values), np.float32) if weighted else None
    for j, f in enumerate(feats):
        col = block.sparse[f.name]
        t = owner[f.name]
        rows = (
            fitted.lookup(t.name, col.keys)
            if f.ids == "vocab"
            else hash_rows(col.keys, schema.hash_seed, int(t.rows))
        )
        lj = lengths[:, j]
        first = np.repeat(np.cumsum(lj) - lj, lj)
        dest = np.repeat(off[:-1] + before[:, j], lj) + (np.arange(len(rows)) - first)
        values[dest] = rows
        if weights is not None and col.weights is not None:
            weights[dest] = col.weights
    return Encoded(block.labels, dense, lengths.astype(np.int32), values, weights)


def jagged_batch(
    keys: Sequence[str],
    labels: np.ndarray,
    dense: np.ndarray,
    lengths: np.ndarray,
    values: np.ndarray,
    weights: np.ndarray | None,
) -> Batch:
    """A Batch of sample-major jagged arrays: the keyed jagged batch is feature-major."""
    b, f = lengths.shape
    fid = np.repeat(np.tile(np.arange(f), b), lengths.reshape(-1))
    order = np.argsort(fid, kind="stable")  # feature-major; samples, then ids, stay in order
    sp = SparseFeatures(
        list(keys),
        torch.from_numpy(values[order].astype(np.int64)),
        torch.from_numpy(np.ascontiguousarray(lengths.T).reshape(-1).astype(np.int64)),
        None if weights is None else torch.from_numpy(weights[order].astype(np.float32)),
    )
    return Batch(
        torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sp,
        torch.from_numpy(labels.astype(np.float32)),
    )


def slice_block(block: Block, a: int, b: int) -> Block:
    """Rows ``a:b`` of a block."""
    sparse = {}
    for name, c in block.sparse.items():
        off = np.concatenate(([0], np.cumsum(c.lengths)))
        lo, hi = int(off[a]), int(off[b])
        w = None if c.weights is None else c.weights[lo:hi]
        sparse[name] = SparseColumn(c.lengths[a:b], c.keys[lo:hi], w)
    dense = {k: (v[a:b], m[a:b]) for k, (v, m) in block.dense.items()}
    where = block.where
    return Block(b - a, block.labels[a:b], dense, sparse, lambda i: where(i + a))


def concat_encoded(parts: Sequence[Encoded]) -> Encoded:
    """Encoded blocks one after the other."""
    w = [p.weights for p in parts]
    return Encoded(
        np.concatenate([p.labels for p in parts]),
        np.concatenate([p.dense for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.values for p in parts]),
        None if w[0] is None else np.concatenate([x for x in w if x is not None]),
    )


def sample_offsets(e: Encoded) -> np.ndarray:
    """Where each sample's ids start in ``e.values`` (and the end): [n + 1]."""
    return np.concatenate(([0], np.cumsum(e.lengths.sum(1, dtype=np.int64))))


def slice_encoded(e: Encoded, a: int, b: int, off: np.ndarray | None = None) -> Encoded:
    """Samples ``a:b`` of an encoded block (``off``: its ``sample_offsets``, when a caller
    slices the same block many times)."""
    off = sample_offsets(e) if off is None else off
    lo, hi = int(off[a]), int(off[b])
    w = None if e.weights is None else e.weights[lo:hi]
    return Encoded(e.labels[a:b], e.dense[a:b], e.lengths[a:b], e.values[lo:hi], w)
