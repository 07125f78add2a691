"""Criteo TSV (plain or .gz) -> columnar shards that :mod:`neorec.data.loader` reads.

Layout of an output directory (a binary columnar layout: one ``.npy`` per column group per shard,
chosen over Parquet by measurement, see ``neorec bench data``)::

    manifest.json                      format version, features, rows per feature, shards, stats
    shards/<name>.labels.npy           [n] uint8
    shards/<name>.dense.npy            [n, 13] float32, DLRM transform applied
    shards/<name>.sparse.npy           [n, K] int32/int64 rows, K = sum of the bag sizes
    vocab/C<j>.npy                     (vocab mode) frequent raw values of feature j, ascending

Transforms (the public DLRM pipeline's, as :mod:`neorec.data.criteo` documents): dense
``log(max(x, 0) + 1)`` with an empty field read as 0 -- so empty and negative values become 0 *by
definition of the transform*, not as error handling; a dense field that is not an integer is bad
input. Categories: ``hash`` mode maps raw hex value v to ``v % rows[j]`` (empty -> row 0);
``vocab`` mode counts every value over all input files and maps values seen at least ``threshold``
times to rows 2.. (ascending raw value), empty to row 0 and rarer/unseen values to row 1.

Multi-hot (MLPerf DLRMv2): feature j with bag size s_j > 1 keeps its row r as the first id and adds
s_j - 1 ids drawn uniformly from [0, rows[j]) and fixed per (feature, r), as MLPerf's
``multi_hot.py`` does with a seeded per-row cache; here the draws come from a counter-based hash
(splitmix64) so no [rows, s_j] cache is held. Same distribution, not the same ids as MLPerf's.

Work is split into units (a byte range of a plain file, cut at line starts, or a whole .gz file)
processed by a process pool; the output does not depend on the number of workers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neorec.data.criteo import (
    _HEX_VALUE,
    NUM_DENSE,
    NUM_FIELDS,
    NUM_SPARSE,
    CriteoFormatError,
    criteo_files,
    parse_line,
)

__all__ = [
    "FORMAT_VERSION",
    "PreprocessOptions",
    "ParsedBlock",
    "parse_block",
    "dense_transform",
    "multi_hot_extra",
    "preprocess",
    "main",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FEATURES = [f"C{j + 1}" for j in range(NUM_SPARSE)]
_READ_BYTES = 8 << 20  # a worker parses this much at a time: bounds its memory
_MAX_EXAMPLES = 5
_DENSE_DIGITS = 18  # < 2**63; longer fields go the slow (exact Python int) path
_HEX_DIGITS = 15  # the raw value must stay < 2**62, as CriteoTSVDataset requires
_RARE_ROW, _EMPTY_ROW = 1, 0
_GZ_ERRORS = (EOFError, OSError, zlib.error)  # truncated or corrupt gzip stream


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

    def __post_init__(self) -> None:
        if self.mode not in ("hash", "vocab"):
            raise ValueError(f"mode must be 'hash' or 'vocab', got '{self.mode}'")
        if self.bad_lines not in ("fail", "skip"):
            raise ValueError(f"bad_lines must be 'fail' or 'skip', got '{self.bad_lines}'")
        if len(self.rows) == 1:
            self.rows = self.rows * NUM_SPARSE
        if len(self.rows) != NUM_SPARSE or min(self.rows) <= 0:
            raise ValueError(f"rows needs 1 or {NUM_SPARSE} positive sizes, got {self.rows}")
        if len(self.multi_hot) == 1:
            self.multi_hot = self.multi_hot * NUM_SPARSE
        if len(self.multi_hot) != NUM_SPARSE or min(self.multi_hot) < 1:
            raise ValueError(f"multi_hot needs 1 or {NUM_SPARSE} sizes >= 1, got {self.multi_hot}")
        if self.threshold < 1 or self.shard_rows < 1 or self.chunk_bytes < 1:
            raise ValueError("threshold, shard_rows and chunk_bytes must be >= 1")


# ---- parsing ----------------------------------------------------------------------------------


@dataclass
class ParsedBlock:
    """Good lines of a block: raw label, dense ints and category values (-1 = empty)."""

    labels: np.ndarray  # [n] uint8
    ints: np.ndarray  # [n, 13] int64, empty = 0
    cats: np.ndarray  # [n, 26] int64, empty = -1
    lines: int  # lines in the block, good and bad
    bad: list[tuple[int, str]]  # (0-based line index in the block, message)


def parse_block(data: bytes) -> ParsedBlock:
    """Parse whole lines (``data`` ends with a newline, or is the end of a file)."""
    if data and not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(buf == 10)
    n = len(nl)
    starts = np.concatenate(([0], nl[:-1] + 1)).astype(np.int64)
    ends = nl.astype(np.int64)
    cr = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
    ends -= cr  # "\r\n" line endings
    tabs = np.flatnonzero(buf == 9)
    tab_line = np.searchsorted(nl, tabs)
    good = np.bincount(tab_line, minlength=n)[:n] == NUM_FIELDS - 1
    gtabs = tabs[good[tab_line]].reshape(-1, NUM_FIELDS - 1)
    # fields of good lines: starts [m, 40] and exclusive ends [m, 40]
    fs = np.concatenate((starts[good][:, None], gtabs + 1), axis=1)
    fe = np.concatenate((gtabs, ends[good][:, None]), axis=1)
    lab_ok = (fe[:, 0] - fs[:, 0] == 1) & ((buf[fs[:, 0]] | 1) == ord("1"))
    ints, dense_bad = _parse_ints(buf, fs[:, 1 : 1 + NUM_DENSE], fe[:, 1 : 1 + NUM_DENSE])
    cats, cat_bad = _parse_hex(buf, fs[:, 1 + NUM_DENSE :], fe[:, 1 + NUM_DENSE :])
    ok = lab_ok & ~dense_bad & ~cat_bad
    line_ids = np.flatnonzero(good)
    slow = np.sort(np.concatenate((np.flatnonzero(~good), line_ids[~ok])))
    labels = (buf[fs[ok, 0]] - ord("0")).astype(np.uint8)
    out = ParsedBlock(labels, ints[ok], cats[ok], n, [])
    if len(slow):
        _slow_lines(data, starts, ends, slow, line_ids[ok], out)
    return out


def _parse_ints(buf: np.ndarray, fs: np.ndarray, fe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers (optional '-') right-aligned digit by digit; (values, bad line mask)."""
    length = fe - fs
    neg = (length > 0) & (buf[np.minimum(fs, len(buf) - 1)] == ord("-"))
    first = fs + neg
    width = int(min(length.max(initial=0), _DENSE_DIGITS))
    val = np.zeros(fs.shape, dtype=np.int64)
    bad = (length > _DENSE_DIGITS) | (neg & (length == 1))
    for w in range(width):
        pos = fe - width + w
        active = pos >= first
        d = buf[np.maximum(pos, 0)].astype(np.int64) - ord("0")
        bad |= active & ((d < 0) | (d > 9))
        val = np.where(active, val * 10 + d, val)
    return np.where(neg, -val, val), bad.any(axis=1)


def _parse_hex(buf: np.ndarray, fs: np.ndarray, fe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex values right-aligned digit by digit (-1 = empty); (values, bad line mask)."""
    length = fe - fs
    width = int(min(length.max(initial=0), _HEX_DIGITS))
    val = np.zeros(fs.shape, dtype=np.int64)
    bad = length > _HEX_DIGITS
    for w in range(width):
        pos = fe - width + w
        active = pos >= fs
        d = _HEX_VALUE[buf[np.maximum(pos, 0)]]
        bad |= active & (d < 0)
        val = np.where(active, val * 16 + d, val)
    return np.where(length == 0, -1, val), bad.any(axis=1)


def _slow_lines(
    data: bytes,
    starts: np.ndarray,
    ends: np.ndarray,
    slow: np.ndarray,
    fast_ids: np.ndarray,
    out: ParsedBlock,
) -> None:
    """Lines off the fast path: parse_line names the bad field; the rest are parsed exactly."""
    extra: list[tuple[int, list[int], list[int]]] = []
    for i in slow.tolist():
        raw = data[starts[i] : ends[i]]
        try:
            text = raw.decode("utf-8")
            parse_line(text, [1 << 62] * NUM_SPARSE, hash_categories=True)
            parts = text.split("\t")
            head = [int(x) if x else 0 for x in parts[: 1 + NUM_DENSE]]
            cats = [int(x, 16) if x else -1 for x in parts[1 + NUM_DENSE :]]
            if max(cats) >= 1 << 62:
                raise ValueError("a category has more than 15 hex digits")
            if max(abs(x) for x in head) >= 1 << 63:
                raise ValueError("a dense value does not fit in 64 bits")
        except UnicodeDecodeError:
            out.bad.append((i, "line is not valid UTF-8"))
            continue
        except ValueError as e:
            out.bad.append((i, str(e)))
            continue
        extra.append((i, head, cats))
    if not extra:
        return
    # merge the exactly-parsed lines back in line order
    ids = np.concatenate((fast_ids, [e[0] for e in extra]))
    order = np.argsort(ids, kind="stable")
    out.labels = np.concatenate((out.labels, [e[1][0] for e in extra])).astype(np.uint8)[order]
    out.ints = np.concatenate((out.ints, [e[1][1:] for e in extra]))[order]
    out.cats = np.concatenate((out.cats, [e[2] for e in extra]))[order]


def dense_transform(ints: np.ndarray) -> np.ndarray:
    """DLRM: log(max(x, 0) + 1) as float32 (negatives and empty fields give 0 by definition)."""
    return np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)


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
                rest = f.readline()  # to the end of the line holding that byte
                nxt = cuts[-1] + chunk_bytes - 1 + len(rest)
                if nxt >= size:
                    break
                cuts.append(nxt)
        cuts.append(size)
        units += [Unit(fi, str(p), a, b, i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return units


def _gz_chunks(path: str) -> Iterator[bytes]:
    """Decompressed pieces of a (multi-member) gzip file; raises EOFError if it is truncated.

    zlib directly rather than gzip.open: gzip.open loses what it decompressed in the read call
    that hits a truncation, and those whole lines must be kept (skip) or counted.
    """
    with open(path, "rb") as f:
        d = zlib.decompressobj(31)
        fed = False
        while raw := f.read(1 << 20):
            while raw:
                fed = True
                yield d.decompress(raw)
                raw = b""
                if d.eof:  # the next gzip member, if any, starts in unused_data
                    raw, fed = d.unused_data, False
                    d = zlib.decompressobj(31)
        yield d.flush()
        if fed and not d.eof:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")


def _plain_chunks(unit: Unit) -> Iterator[bytes]:
    with open(unit.path, "rb") as f:
        f.seek(unit.start)
        left = unit.end - unit.start
        while left > 0 and (chunk := f.read(min(_READ_BYTES, left))):
            left -= len(chunk)
            yield chunk


def _blocks(unit: Unit) -> Iterator[tuple[bytes, str | None]]:
    """(whole-line blocks, error) of a unit; a gzip error ends the stream with its message."""
    chunks = _gz_chunks(unit.path) if unit.end < 0 else _plain_chunks(unit)
    pieces: list[bytes] = []
    size = 0
    try:
        for chunk in chunks:
            pieces.append(chunk)
            size += len(chunk)
            if size < _READ_BYTES:
                continue
            carry = b"".join(pieces)
            cut = carry.rfind(b"\n") + 1
            if cut:
                yield carry[:cut], None
                carry = carry[cut:]
            pieces, size = [carry], len(carry)
    except _GZ_ERRORS as e:
        carry = b"".join(pieces)
        cut = carry.rfind(b"\n") + 1
        if cut:
            yield carry[:cut], None
        # the partial line before the cut is not a line: it is reported, never parsed
        yield b"", f"truncated or corrupt gzip stream ({type(e).__name__}: {e})"
        return
    carry = b"".join(pieces)
    if carry:
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
        block = parse_block(data) if data else ParsedBlock(*_empty_block(), 0, [])
        bad = [(res.lines + i, m) for i, m in block.bad]
        if err is not None:
            bad.append((res.lines + block.lines, err))  # the line the stream was cut in
        res.lines += block.lines
        res.bad_count += len(bad)
        res.bad += bad[: max(0, _MAX_EXAMPLES - len(res.bad))]
        if bad and fail:
            res.failed = True
            return
        yield block


def _empty_block() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = np.zeros(0, dtype=np.int64)
    return z.astype(np.uint8), z.reshape(0, NUM_DENSE), z.reshape(0, NUM_SPARSE)


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
    """[n, 26] raw values (-1 = empty) -> rows."""
    out = np.empty_like(cats)
    for j in range(NUM_SPARSE):
        v = cats[:, j]
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
    dtype = np.int32 if max(table_rows) <= np.iinfo(np.int32).max else np.int64
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


# ---- driver ----------------------------------------------------------------------------------


@dataclass
class Summary:
    """What a preprocessing run did."""

    rows: int = 0
    lines: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    input_bytes: int = 0
    seconds: float = 0.0
    shards: int = 0
    vocab_sizes: list[int] = field(default_factory=list)

    def format(self) -> str:
        """Human-readable summary."""
        mbs = self.input_bytes / 1e6 / max(self.seconds, 1e-9)
        lines = [
            f"preprocessed {self.lines:,} lines -> {self.rows:,} samples in {self.shards} shards, "
            f"{self.input_bytes / 1e6:,.1f} MB in {self.seconds:.1f}s ({mbs:,.1f} MB/s)",
            f"bad lines: {self.bad_lines:,}",
            *(f"  {m}" for m in self.bad_examples),
            "rows per feature: " + " ".join(f"{f}={r}" for f, r in zip(FEATURES, self.vocab_sizes)),
        ]
        return "\n".join(lines)


def _pool(workers: int) -> ProcessPoolExecutor:
    # fork: workers need only numpy and inherit the imported modules (no re-import of torch)
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def _line_offset(unit: Unit) -> int:
    """Lines of the file before the unit (plain files; a gz unit is the whole file)."""
    if unit.start == 0:
        return 0
    n, left = 0, unit.start
    with open(unit.path, "rb") as f:
        while left:
            chunk = f.read(min(left, _READ_BYTES))
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def _messages(res: UnitResult) -> list[str]:
    base = _line_offset(res.unit) + 1
    name = Path(res.unit.path).name
    return [f"{name}:{base + i}: {m}" for i, m in res.bad]


def _run_units(
    fn: Any, units: list[Unit], args: tuple, opts: PreprocessOptions, what: str, out: Any
) -> list[UnitResult]:
    """Run ``fn(unit, *args)`` over the units in a pool, with progress; fail fast on bad input."""
    workers = opts.workers or os.cpu_count() or 1
    results: dict[int, UnitResult] = {}
    t0 = last = time.perf_counter()
    done_bytes = 0
    with _pool(min(workers, len(units))) as pool:
        futs: dict[Future[UnitResult], int] = {
            pool.submit(fn, u, *args): i for i, u in enumerate(units)
        }
        pending = set(futs)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                r = f.result()
                if r.failed:
                    for p in pending:
                        p.cancel()
                    raise CriteoFormatError(_messages(r)[0])
                results[futs[f]] = r
                done_bytes += r.bytes
            now = time.perf_counter()
            if out is not None and (now - last > 1.0 or not pending):
                last = now
                print(
                    f"{what}: {len(results)}/{len(units)} units, {done_bytes / 1e6:,.0f} MB, "
                    f"{done_bytes / 1e6 / max(now - t0, 1e-9):,.1f} MB/s",
                    file=out,
                    flush=True,
                )
    return [results[i] for i in range(len(units))]


def build_vocab(
    counts: list[list[tuple[np.ndarray, np.ndarray]]], threshold: int
) -> list[np.ndarray]:
    """Per feature: raw values counted at least ``threshold`` times over all units, ascending."""
    out = []
    for j in range(NUM_SPARSE):
        vals = np.concatenate([c[j][0] for c in counts] or [np.zeros(0, np.int64)])
        cnts = np.concatenate([c[j][1] for c in counts] or [np.zeros(0, np.int64)])
        uniq, inv = np.unique(vals, return_inverse=True)
        total = np.bincount(inv, weights=cnts, minlength=len(uniq))
        out.append(uniq[total >= threshold])
    return out


def preprocess(
    inputs: Sequence[str | Path], out_dir: str | Path, opts: PreprocessOptions, out: Any = None
) -> Summary:
    """Convert Criteo TSV files (plain or .gz) to shards under ``out_dir``; returns the summary."""
    t0 = time.perf_counter()
    paths = [p for x in inputs for p in criteo_files(x)]
    outp = Path(out_dir)
    (outp / "shards").mkdir(parents=True, exist_ok=True)
    if (outp / MANIFEST).exists():
        (outp / MANIFEST).unlink()  # a directory without a manifest is an incomplete one
    units = plan_units(paths, opts.chunk_bytes)
    table_rows = list(opts.rows)
    if opts.mode == "vocab":
        counted = _run_units(count_unit, units, (opts,), opts, "count", out)
        vocab = build_vocab([r.counts for r in counted if r.counts is not None], opts.threshold)
        (outp / "vocab").mkdir(exist_ok=True)
        for f, v in zip(FEATURES, vocab):
            np.save(outp / "vocab" / f"{f}.npy", v)
        table_rows = [len(v) + 2 for v in vocab]
        _VOCAB.pop(str(outp), None)
    results = _run_units(convert_unit, units, (opts, str(outp), table_rows), opts, "convert", out)
    summary = _summarize(results, table_rows, time.perf_counter() - t0)
    _write_manifest(outp, paths, opts, table_rows, results, summary)
    if out is not None:
        print(summary.format(), file=out, flush=True)
    return summary


def _summarize(results: list[UnitResult], table_rows: list[int], seconds: float) -> Summary:
    s = Summary(seconds=seconds, vocab_sizes=table_rows)
    for r in results:
        s.rows += r.rows
        s.lines += r.lines
        s.bad_lines += r.bad_count
        s.input_bytes += r.bytes
        s.shards += len(r.shards)
        if len(s.bad_examples) < _MAX_EXAMPLES and r.bad:
            s.bad_examples += _messages(r)[: _MAX_EXAMPLES - len(s.bad_examples)]
    return s


def _write_manifest(
    outp: Path,
    paths: list[Path],
    opts: PreprocessOptions,
    table_rows: list[int],
    results: list[UnitResult],
    summary: Summary,
) -> None:
    manifest = {
        "format_version": FORMAT_VERSION,
        "num_dense": NUM_DENSE,
        "features": FEATURES,
        "rows": table_rows,
        "multi_hot": opts.multi_hot,
        "options": asdict(opts),
        "sources": [str(p) for p in paths],
        "shards": [s for r in results for s in r.shards],
        "summary": asdict(summary),
    }
    tmp = outp / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, outp / MANIFEST)


def _rows_from_config(path: str) -> list[int]:
    from neorec.config import load_config

    tables = load_config(path).embedding.tables
    if len(tables) != NUM_SPARSE:
        raise ValueError(f"{path}: Criteo needs {NUM_SPARSE} tables, the config has {len(tables)}")
    return [t.rows for t in tables]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """``neorec data preprocess``: flags -> preprocess() with progress and a summary."""
    p = argparse.ArgumentParser(prog="neorec data preprocess", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="TSV(.gz) files or directories")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument(
        "--config", help="take the hash modulus of each feature from this config's tables"
    )
    p.add_argument("--rows", type=_ints, help="hash modulus: one size, or 26 comma-separated")
    p.add_argument(
        "--vocab-threshold", type=int, default=0, help="vocab mode: min count (0 = hash)"
    )
    p.add_argument("--multi-hot", type=_ints, default=[1], help="bag size per feature (1 or 26)")
    p.add_argument("--multi-hot-seed", type=int, default=0)
    p.add_argument("--bad-lines", choices=["fail", "skip"], default="fail")
    p.add_argument("--shard-rows", type=int, default=1 << 20)
    p.add_argument("--chunk-mb", type=int, default=64, help="plain files: MB per unit of work")
    p.add_argument("--workers", type=int, default=0, help="processes (0 = one per core)")
    a = p.parse_args(argv)
    if a.vocab_threshold:
        rows = a.rows or [1 << 62]
    elif a.config or a.rows:
        rows = _rows_from_config(a.config) if a.config else a.rows
    else:
        p.error("hash mode needs --config or --rows (or use --vocab-threshold)")
    try:
        opts = PreprocessOptions(
            rows=rows,
            mode="vocab" if a.vocab_threshold else "hash",
            threshold=max(1, a.vocab_threshold),
            multi_hot=a.multi_hot,
            multi_hot_seed=a.multi_hot_seed,
            bad_lines=a.bad_lines,
            shard_rows=a.shard_rows,
            chunk_bytes=a.chunk_mb << 20,
            workers=a.workers,
        )
        preprocess(a.input, a.output, opts, out=sys.stdout)
    except (CriteoFormatError, FileNotFoundError, ValueError) as e:
        print(f"neorec data preprocess: {e}", file=sys.stderr)
        return 1
    return 0
