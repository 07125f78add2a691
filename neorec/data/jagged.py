"""Reading jagged shards (tabular preprocessing, :mod:`neorec.data.tabular_pre`): variable-length
bags and per-id weights, gathered per sample like the fixed-width Criteo shards."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from neorec.data.batch import Batch
from neorec.data.encode import jagged_batch
from neorec.data.shard_set import ShardSet
from neorec.errors import ConfigError, DataError

__all__ = ["JaggedShardSet", "check_jagged_tables"]


class JaggedShardSet(ShardSet):
    """Shards of the jagged layout: lengths [n, F], sample-major values (and weights)."""

    def __init__(self, path: Any, shards: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(path, shards)
        self.num_features = len(self.manifest["features"])
        self.weighted = bool(self.manifest.get("weighted"))
        self._jmaps: list[dict[str, np.ndarray]] | None = None
        self._jpid = -1

    @property
    def cols(self) -> tuple[str, ...]:
        """The files of a shard."""
        base = ("labels", "dense", "lengths", "values")
        return (*base, "weights") if self.weighted else base

    def check_files(self) -> None:
        """Every shard's files exist with the shapes the manifest says (headers only)."""
        d = self.path / "shards"
        nd, nf = self.manifest["num_dense"], self.num_features
        for s in self.shards:
            n = int(s["rows"])
            shapes = {}
            for c in self.cols:
                f = d / f"{s['name']}.{c}.npy"
                try:
                    shapes[c] = np.load(f, mmap_mode="r").shape
                except (OSError, ValueError) as e:
                    raise DataError(
                        f"{f}: cannot read this shard ({type(e).__name__}); preprocess again"
                    ) from None
            want = {"labels": (n,), "dense": (n, nd), "lengths": (n, nf)}
            if len(shapes["values"]) != 1:
                raise DataError(f"{d / s['name']}.values.npy: not 1-D; preprocess again")
            for c, w in want.items():
                if shapes[c] != w:
                    raise DataError(
                        f"{d / s['name']}.{c}.npy: shape {shapes[c]}, the manifest says {w}; "
                        "preprocess again"
                    )
            if "weights" in shapes and shapes["weights"] != shapes["values"]:
                raise DataError(f"{d / s['name']}.weights.npy: not shaped like its values")

    def _jarrays(self) -> list[dict[str, np.ndarray]]:
        if self._jmaps is None or self._jpid != os.getpid():
            d = self.path / "shards"
            maps = []
            for s in self.shards:
                m = {c: np.load(d / f"{s['name']}.{c}.npy", mmap_mode="r") for c in self.cols}
                lengths = np.asarray(m["lengths"], dtype=np.int64)
                m["offsets"] = np.concatenate(([0], np.cumsum(lengths.sum(1))))
                maps.append(m)
            self._jmaps, self._jpid = maps, os.getpid()
        return self._jmaps

    def gather(self, shard: np.ndarray, row: np.ndarray) -> tuple[Any, ...]:
        """(labels, dense, lengths [n, F], values, weights) of (shard, row) pairs, in order."""
        maps = self._jarrays()
        n = len(shard)
        labels = np.empty(n, np.float32)
        dense = np.empty((n, self.manifest["num_dense"]), np.float32)
        lengths = np.empty((n, self.num_features), np.int64)
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            m = maps[s]
            labels[sel] = m["labels"][row[sel]]
            dense[sel] = m["dense"][row[sel]]
            lengths[sel] = m["lengths"][row[sel]]
        counts = lengths.sum(1)
        off = np.concatenate(([0], np.cumsum(counts)))
        values = np.empty(int(off[-1]), np.int64)
        weights = np.empty(int(off[-1]), np.float32) if self.weighted else None
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            m = maps[s]
            c = counts[sel]
            src0 = m["offsets"][row[sel]]
            intra = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
            src = np.repeat(src0, c) + intra
            dst = np.repeat(off[sel], c) + intra
            values[dst] = m["values"][src]
            if weights is not None:
                weights[dst] = m["weights"][src]
        return labels, dense, lengths, values, weights

    def make_batch(self, keys: Sequence[str], arrays: tuple[Any, ...]) -> Batch:
        """The keyed jagged batch of gathered arrays."""
        return jagged_batch(keys, *arrays)


def check_jagged_tables(data: ShardSet, tables: Sequence[Any], schema: Any, num_dense: int) -> None:
    """The shards' features must be the schema's and fit their tables (hashed modulo the
    table's rows; a vocabulary no larger than the table)."""
    m = data.manifest
    want = [f.name for f in schema.sparse]
    if sorted(m["features"]) != sorted(want):
        raise ConfigError(
            f"{data.path} holds features {m['features']}, data.schema declares {want}; "
            "preprocess with this config (--config)"
        )
    if int(m["num_dense"]) != num_dense:
        raise ConfigError(
            f"{data.path} has {m['num_dense']} dense features, model.num_dense is {num_dense}"
        )
    owner = {f: t for t in tables for f in t.features}
    for f, r, ids, vr in zip(m["features"], m["rows"], m["ids"], m["vocab_rows"]):
        t = owner[f]
        need = r if ids == "hash" else vr
        ok = r == t.rows if ids == "hash" else vr <= t.rows
        if not ok:
            what = f"was hashed modulo {r}" if ids == "hash" else f"has a vocabulary of {vr} rows"
            raise ConfigError(
                f"feature {f} of {data.path} {what}, table '{t.name}' has {t.rows} rows "
                f"(preprocess with --config of this model, or set the table's rows to {need})"
            )
