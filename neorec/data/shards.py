"""Preprocessing's units of work and shard writer: a unit (a byte range of a plain file, cut at
line starts, or a whole .gz file) is parsed block by block and written as ``.npy`` shards.

What a worker process runs (:func:`count_unit` for the vocabulary pass, :func:`convert_unit` for
the shards); :mod:`neorec.data.preprocess` plans the units, runs them in a pool and writes the
manifest. Transforms and multi-hot: see that module's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neorec.config import ConfigError
from neorec.data.blocks import ParsedBlock, dense_transform, empty_block, parse_block
from neorec.data.criteo import GZ_ERRORS, LONG_LINE, MAX_LINE_BYTES, NUM_SPARSE, gz_chunks

__all__ = [
    "PreprocessOptions",
    "Unit",
    "UnitResult",
    "plan_units",
    "count_unit",
    "convert_unit",
    "map_rows",
    "sparse_columns",
    "multi_hot_extra",
    "FEATURES",
    "MLPERF_MULTI_HOT",
]

FEATURES = [f"C{j + 1}" for j in range(NUM_SPARSE)]
MLPERF_MULTI_HOT = (
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
)
"""Ids per sample of C1..C26 in MLPerf DLRMv2's multi-hot Criteo 1TB (``--multi_hot_sizes`` of
its reference, torchrec's dlrm_v2): ``neorec data preprocess --multi-hot mlperf``."""
_READ_BYTES = 8 << 20  # a worker parses this much at a time: bounds its memory
_MAX_EXAMPLES = 5
_RARE_ROW, _EMPTY_ROW = 1, 0


@dataclass
class PreprocessOptions:
    """What preprocessing does; stored in the manifest."""

    rows: list[int]
    """Rows per feature: the hash modulus (hash mode; vocab mode sizes tables by the vocabulary)."""
    mode: str = "hash"
    """``hash`` (value % rows) or ``vocab`` (frequency-threshold vocabulary)."""
    threshold: int = 1
    """Vocab mode: a value needs this many occurrences to get its own row."""
    multi_hot: list[int] = field(default_factory=lambda: [1] * NUM_SPARSE)
    """Ids per sample of each feature (MLPerf DLRMv2 multi-hot); all 1 = one-hot Criteo."""
    multi_hot_seed: int = 0
    """Seed of the multi-hot draws."""
    bad_lines: str = "fail"
    """``fail`` (raise naming file:line) or ``skip`` (count and report)."""
    shard_rows: int = 1 << 20
    """Most samples per output shard."""
    chunk_bytes: int = 64 << 20
    """Plain files are split into units of about this many bytes (parallelism within a file)."""
    workers: int = 0
    """Worker processes; 0 = one per core."""
    eval_fraction: float | None = None
    """Held-out split: the last ``round(eval_fraction * samples)`` samples in input order (file
    order, then line order); 0 = none; None = the last input file if there are several, else
    the last 1/7 of the samples (Kaggle's train.txt is 7 days: about its last day)."""
    raw: list[bool] = field(default_factory=lambda: [False] * NUM_SPARSE)
    """Features whose categories stay raw ids (the hex value, < 2**60; empty -> 0; no modulo),
    for ``kind = "dynamic"`` tables (1 or 26 flags; hash mode, one-hot)."""

    def __post_init__(self) -> None:
        if self.mode not in ("hash", "vocab"):
            raise ConfigError(f"preprocess mode must be 'hash' or 'vocab', got '{self.mode}'")
        if self.bad_lines not in ("fail", "skip"):
            raise ConfigError(f"--bad-lines must be 'fail' or 'skip', got '{self.bad_lines}'")
        self.rows, self.multi_hot = list(self.rows), list(self.multi_hot)
        if len(self.rows) == 1:
            self.rows = self.rows * NUM_SPARSE
        if len(self.rows) != NUM_SPARSE or min(self.rows) <= 0:
            raise ConfigError(
                f"--rows needs 1 or {NUM_SPARSE} positive sizes, got {len(self.rows)}: "
                f"{self.rows[:4]}{'...' if len(self.rows) > 4 else ''}"
            )
        if len(self.multi_hot) == 1:
            self.multi_hot = self.multi_hot * NUM_SPARSE
        if len(self.multi_hot) != NUM_SPARSE or min(self.multi_hot) < 1:
            raise ConfigError(
                f"--multi-hot needs 1 or {NUM_SPARSE} sizes >= 1, got {self.multi_hot}"
            )
        for name, v in (
            ("--vocab-threshold", self.threshold),
            ("--shard-rows", self.shard_rows),
            ("--chunk-mb", self.chunk_bytes),
        ):
            if v < 1:
                raise ConfigError(f"{name} must be >= 1, got {v}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 0 (0 = one per core), got {self.workers}")
        f = self.eval_fraction
        if f is not None and not (0.0 <= f < 1.0):  # (also refuses NaN)
            raise ConfigError(f"--eval-fraction must be in [0, 1), got {f}")
        self._check_raw()

    def _check_raw(self) -> None:
        self.raw = [bool(x) for x in self.raw]
        if len(self.raw) == 1:
            self.raw = self.raw * NUM_SPARSE
        if len(self.raw) != NUM_SPARSE:
            raise ConfigError(f"--raw needs 1 or {NUM_SPARSE} flags, got {len(self.raw)}")
        raw = [f"C{j + 1}" for j, r in enumerate(self.raw) if r]
        if raw and self.mode != "hash":
            raise ConfigError(
                f"raw ids of {raw} are for hash mode; drop --vocab-threshold or --raw (and "
                "dynamic tables from --config)"
            )
        multi = [f for j, f in enumerate(raw) if self.multi_hot[int(f[1:]) - 1] > 1]
        if multi:
            raise ConfigError(
                f"features {multi} are raw ids and multi-hot: multi-hot draws extra rows of a "
                "fixed table; give them --multi-hot 1 or make them hashed"
            )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def multi_hot_extra(
    rows_ids: np.ndarray, feature: int, size: int, rows: int, seed: int
) -> np.ndarray:
    """[n, size] bags: the row itself, then size-1 uniform rows fixed per (seed, feature, row)."""
    out = np.empty((len(rows_ids), size), dtype=np.int64)
    out[:, 0] = rows_ids
    if size > 1:
        base = rows_ids.astype(np.uint64) * np.uint64(size) + np.uint64(
            (seed * NUM_SPARSE + feature) << 40
        )
        k = np.arange(1, size, dtype=np.uint64)
        h = _splitmix64(base[:, None] + k[None, :])
        out[:, 1:] = (h % np.uint64(rows)).astype(np.int64)
    return out


# ---- units of work ------------------------------------------------------------------------------


@dataclass
class Unit:
    """A piece of one input file: a byte range of a plain file or a whole .gz file."""

    file_index: int
    path: str
    start: int
    end: int  # -1 = to the end (gz)
    index: int  # unit number within the file


def plan_units(paths: Sequence[Path], chunk_bytes: int) -> list[Unit]:
    """Units of every file; plain files cut at line starts every ~chunk_bytes."""
    units = []
    for fi, p in enumerate(paths):
        if p.suffix == ".gz":
            units.append(Unit(fi, str(p), 0, -1, 0))
            continue
        size = p.stat().st_size
        cuts = [0]
        with open(p, "rb") as f:
            while cuts[-1] + chunk_bytes < size:
                f.seek(cuts[-1] + chunk_bytes - 1)
                rest = 0  # to the end of the line holding that byte, read in pieces
                while (piece := f.readline(1 << 16)) and not piece.endswith(b"\n"):
                    rest += len(piece)
                nxt = cuts[-1] + chunk_bytes - 1 + rest + len(piece)
                if nxt >= size:
                    break
                cuts.append(nxt)
        cuts.append(size)
        units += [Unit(fi, str(p), a, b, i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return units


def _plain_chunks(unit: Unit) -> Iterator[bytes]:
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        left = unit.end - unit.start
        while left > 0 and (chunk := f.read(min(_READ_BYTES, left))):
            left -= len(chunk)
            yield chunk


def _blocks(unit: Unit) -> Iterator[tuple[bytes, str | None]]:
    """(whole-line blocks, error) of a unit; a line longer than ``MAX_LINE_BYTES`` is
    ``(b"", LONG_LINE)`` (one bad line, skipped without being held); a gzip error ends the stream
    with its message."""
    chunks = gz_chunks(unit.path) if unit.end < 0 else _plain_chunks(unit)
    pieces: list[bytes] = []
    size, skipping = 0, False
    try:
        for chunk in chunks:
            if skipping:  # the rest of a line too long to hold
                nl = chunk.find(b"\n")
                if nl < 0:
                    continue
                chunk, skipping = chunk[nl + 1 :], False
            pieces.append(chunk)
            size += len(chunk)
            if size < _READ_BYTES:
                continue
            carry = b"".join(pieces)
            cut = carry.rfind(b"\n") + 1
            if cut:
                yield carry[:cut], None
                carry = carry[cut:]
            if len(carry) > MAX_LINE_BYTES:
                yield b"", LONG_LINE
                carry, skipping = b"", True
            pieces, size = [carry], len(carry)
    except GZ_ERRORS as e:
        carry = b"".join(pieces)
        cut = carry.rfind(b"\n") + 1
        if cut:
            yield carry[:cut], None
        # the partial line before the cut is not a line: it is reported, never parsed
        yield b"", f"truncated or corrupt gzip stream ({type(e).__name__}: {e})"
        return
    carry = b"".join(pieces)
    if len(carry) > MAX_LINE_BYTES:
        yield b"", LONG_LINE
    elif carry:
        yield carry, None


@dataclass
class UnitResult:
    """What a worker did with a unit."""

    unit: Unit
    lines: int = 0
    rows: int = 0
    bytes: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)  # (0-based line in unit, message)
    bad_count: int = 0
    failed: bool = False
    shards: list[dict[str, Any]] = field(default_factory=list)
    counts: list[tuple[np.ndarray, np.ndarray]] | None = None  # vocab pass: (values, counts)


def _parsed(unit: Unit, res: UnitResult, fail: bool) -> Iterator[ParsedBlock]:
    """Parsed blocks of a unit; bad lines recorded in ``res`` (stops at the first if ``fail``)."""
    for data, err in _blocks(unit):
        res.bytes += len(data)
        block = parse_block(data) if data else empty_block()
        bad = [(res.lines + i, m) for i, m in block.bad]
        if err is not None:
            bad.append((res.lines + block.lines, err))  # the line the stream was cut in
        res.lines += block.lines + (err == LONG_LINE)  # a long line is a line
        res.bad_count += len(bad)
        res.bad += bad[: max(0, _MAX_EXAMPLES - len(res.bad))]
        if bad and fail:
            res.failed = True
            return
        yield block


def count_unit(unit: Unit, opts: PreprocessOptions) -> UnitResult:
    """Vocab pass: distinct raw values and their counts per feature (empty excluded)."""
    res = UnitResult(unit)
    acc: list[list[np.ndarray]] = [[] for _ in range(NUM_SPARSE)]
    for block in _parsed(unit, res, opts.bad_lines == "fail"):
        for j in range(NUM_SPARSE):
            v = block.cats[:, j]
            acc[j].append(v[v >= 0])
    if not res.failed:
        res.counts = [
            np.unique(np.concatenate(a or [np.zeros(0, np.int64)]), return_counts=True) for a in acc
        ]
    return res


_VOCAB: dict[str, list[np.ndarray]] = {}  # per worker process: vocab arrays, loaded once


def _vocab(out_dir: str) -> list[np.ndarray]:
    if out_dir not in _VOCAB:
        _VOCAB[out_dir] = [np.load(Path(out_dir) / "vocab" / f"{f}.npy") for f in FEATURES]
    return _VOCAB[out_dir]


def map_rows(
    cats: np.ndarray, opts: PreprocessOptions, vocab: list[np.ndarray] | None
) -> np.ndarray:
    """[n, 26] raw values (-1 = empty) -> rows (raw features: the values, empty -> 0)."""
    out = np.empty_like(cats)
    for j in range(NUM_SPARSE):
        v = cats[:, j]
        if opts.raw[j]:  # a dynamic table's raw id (what CriteoTSVDataset(raw_ids=...) gives)
            out[:, j] = np.where(v < 0, 0, v)
            continue
        if vocab is None:
            out[:, j] = np.where(v < 0, _EMPTY_ROW, v % opts.rows[j])
            continue
        voc = vocab[j]
        pos = np.searchsorted(voc, v)
        hit = pos < len(voc)
        hit[hit] = voc[pos[hit]] == v[hit]
        out[:, j] = np.where(v < 0, _EMPTY_ROW, np.where(hit, pos + 2, _RARE_ROW))
    return out


def sparse_columns(
    rows: np.ndarray, opts: PreprocessOptions, table_rows: Sequence[int]
) -> np.ndarray:
    """[n, K] bags of every feature side by side (K = sum of the multi-hot sizes)."""
    if max(opts.multi_hot) == 1:
        return rows
    parts = [
        multi_hot_extra(rows[:, j], j, s, table_rows[j], opts.multi_hot_seed)
        for j, s in enumerate(opts.multi_hot)
    ]
    return np.concatenate(parts, axis=1)


def convert_unit(
    unit: Unit, opts: PreprocessOptions, out_dir: str, table_rows: list[int]
) -> UnitResult:
    """Parse, transform and write the shards of one unit."""
    res = UnitResult(unit)
    vocab = _vocab(out_dir) if opts.mode == "vocab" else None
    small = max(table_rows) <= np.iinfo(np.int32).max and not any(opts.raw)
    dtype = np.int32 if small else np.int64
    pending: list[ParsedBlock] = []
    have = 0
    for block in _parsed(unit, res, opts.bad_lines == "fail"):
        pending.append(block)
        have += len(block.labels)
        while have >= opts.shard_rows:
            have = _flush(pending, opts.shard_rows, res, opts, out_dir, vocab, dtype, table_rows)
    if res.failed:
        return res
    while have:
        have = _flush(pending, have, res, opts, out_dir, vocab, dtype, table_rows)
    return res


def _flush(
    pending: list[ParsedBlock],
    n: int,
    res: UnitResult,
    opts: PreprocessOptions,
    out_dir: str,
    vocab: list[np.ndarray] | None,
    dtype: Any,
    table_rows: list[int],
) -> int:
    """Write the first ``n`` pending samples as a shard; returns how many remain pending."""
    labels = np.concatenate([b.labels for b in pending])
    ints = np.concatenate([b.ints for b in pending])
    cats = np.concatenate([b.cats for b in pending])
    rest = ParsedBlock(labels[n:], ints[n:], cats[n:], 0, [])
    pending[:] = [rest]
    u = res.unit
    name = f"part-{u.file_index:05d}-{u.index:05d}-{len(res.shards):04d}"
    sparse = sparse_columns(map_rows(cats[:n], opts, vocab), opts, table_rows).astype(dtype)
    shard_dir = Path(out_dir) / "shards"
    for col, arr in (
        ("labels", labels[:n]),
        ("dense", dense_transform(ints[:n])),
        ("sparse", sparse),
    ):
        tmp = shard_dir / f"{name}.{col}.tmp.npy"
        np.save(tmp, arr)
        os.replace(tmp, shard_dir / f"{name}.{col}.npy")
    res.shards.append({"name": name, "rows": n, "source": u.file_index})
    res.rows += n
    return len(rest.labels)
