"""The shards of a preprocessed directory: its manifest (``read_manifest``) and the fixed-size
bags of the Criteo layout (``ShardSet``), memory-mapped ``.npy`` files gathered per sample. The
jagged layout builds on it (``neorec.data.jagged``)."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.sparse import SparseFeatures

__all__ = ["MANIFEST", "is_preprocessed", "read_manifest", "ShardSet"]

MANIFEST = "manifest.json"
_FORMAT_VERSIONS = (1, 2)  # 2: the jagged layout (neorec.data.jagged)


def is_preprocessed(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``neorec data preprocess``."""
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a preprocessed directory (checks the format version and its fields);
    a :class:`~neorec.errors.DataError` naming the file if it cannot be used."""
    p = Path(path) / MANIFEST
    if not Path(path).exists():
        raise DataError(f"{path}: no such file or directory (the data path); check the path")
    if not p.is_file():
        raise DataError(
            f"{path} is not a preprocessed Criteo directory (no {MANIFEST}); run "
            f"`neorec data preprocess --input RAW --output {path}` (again, if it was cut short)"
        )
    try:
        m = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{p}: unreadable ({type(e).__name__}); preprocess again") from None
    if not isinstance(m, dict) or m.get("format_version") not in _FORMAT_VERSIONS:
        v = m.get("format_version") if isinstance(m, dict) else None
        raise DataError(f"{p}: format_version {v!r} is not supported; preprocess again")
    try:
        rows, shards = m["rows"], m["shards"]
        ok = (
            isinstance(m["features"], list)
            and isinstance(rows, list)
            and len(rows) == len(m["features"])
            and (m.get("layout") == "jagged" or len(rows) == len(m["multi_hot"]))
            and all(isinstance(s["name"], str) and int(s["rows"]) >= 0 for s in shards)
            and int(m["num_dense"]) > 0
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise DataError(f"{p}: missing or malformed fields; preprocess again")
    return m


class ShardSet:
    """Some shards of a preprocessed directory, memory-mapped lazily (once per process)."""

    def __init__(self, path: str | Path, shards: Sequence[dict[str, Any]] | None = None):
        self.path = Path(path)
        self.manifest = read_manifest(path)
        self.shards = list(self.manifest["shards"] if shards is None else shards)
        self.sizes = np.array([s["rows"] for s in self.shards], dtype=np.int64)
        self.num_samples = int(self.sizes.sum())
        self.bag_sizes = list(self.manifest.get("multi_hot") or [])
        self._maps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._pid = -1

    def check_files(self) -> None:
        """Every shard's three files exist with the shapes the manifest says (headers only)."""
        d = self.path / "shards"
        want = {
            "labels": lambda n: (n,),
            "dense": lambda n: (n, self.manifest["num_dense"]),
            "sparse": lambda n: (n, sum(self.bag_sizes)),
        }
        for s in self.shards:
            for c in _COLS:
                f = d / f"{s['name']}.{c}.npy"
                try:
                    shape = np.load(f, mmap_mode="r").shape
                except (OSError, ValueError) as e:
                    raise DataError(
                        f"{f}: cannot read this shard ({type(e).__name__}); preprocess again"
                    ) from None
                if shape != want[c](int(s["rows"])):
                    raise DataError(
                        f"{f}: shape {shape}, the manifest says {want[c](int(s['rows']))}; "
                        "preprocess again"
                    )

    def make_batch(self, keys: Sequence[str], arrays: tuple[np.ndarray, ...]) -> Batch:
        """The Batch of gathered (labels, dense, sparse) arrays: fixed-size bags."""
        labels, dense, sparse = arrays
        b = len(labels)
        col = 0
        values = []
        for s in self.bag_sizes:  # feature-major: all of feature f's bags, then f+1's
            values.append(
                torch.from_numpy(np.ascontiguousarray(sparse[:, col : col + s])).reshape(-1)
            )
            col += s
        lengths = torch.tensor(self.bag_sizes, dtype=torch.int64).repeat_interleave(b)
        sp = SparseFeatures(list(keys), torch.cat(values), lengths)
        return Batch(torch.from_numpy(dense), sp, torch.from_numpy(labels))

    def fingerprint(self) -> str:
        """Identifies the samples and their order before shuffling (checked on resume)."""
        names = ",".join(f"{s['name']}:{s['rows']}" for s in self.shards)
        return f"{len(self.shards)}/{self.num_samples}/{zlib.crc32(names.encode()):08x}"

    def _arrays(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        # memmaps are opened per process: a forked worker must not share the parent's handles
        if self._maps is None or self._pid != os.getpid():
            d = self.path / "shards"
            self._maps = [
                tuple(np.load(d / f"{s['name']}.{c}.npy", mmap_mode="r") for c in _COLS)  # type: ignore[misc]
                for s in self.shards
            ]
            self._pid = os.getpid()
        return self._maps

    def gather(self, shard: np.ndarray, row: np.ndarray) -> tuple[np.ndarray, ...]:
        """(labels [n], dense [n, 13], sparse [n, K]) of the given (shard, row) pairs, in order."""
        maps = self._arrays()
        n = len(shard)
        k = sum(self.bag_sizes)
        labels = np.empty(n, dtype=np.float32)
        dense = np.empty((n, self.manifest["num_dense"]), dtype=np.float32)
        sparse = np.empty((n, k), dtype=np.int64)
        for s in np.unique(shard).tolist():
            sel = np.flatnonzero(shard == s)
            rows = row[sel]
            order = np.argsort(rows, kind="stable")  # ascending rows read the file forward
            lab, den, spa = maps[s]
            labels[sel[order]] = lab[rows[order]]
            dense[sel[order]] = den[rows[order]]
            sparse[sel[order]] = spa[rows[order]]
        return labels, dense, sparse


_COLS = ("labels", "dense", "sparse")
