"""Parquet / CSV / TSV -> the columnar shards :mod:`neorec.data.loader` reads (jagged layout).

The same steps as Criteo preprocessing (:mod:`neorec.data.preprocess`), after parsing one code
path (:mod:`neorec.data.encode`):

1. rows per file (Parquet footers; CSV records) -> the held-out split, by the Criteo rules: the
   last input file when there are several, else the last 1/7 of the samples;
   ``eval_fraction`` F: the last ``round(F * samples)``; 0: none;
2. a pass over the train split for what the schema asks to learn (dense means and deviations
   for ``standardize``, vocabularies of ``ids = "vocab"`` tables), when it asks any;
3. the conversion, one unit per input file in a process pool (the output does not depend on
   the number of workers): shards of at most ``shard_rows`` samples, cut where the split is.

Layout of a jagged shard ``shards/<name>``: ``labels.npy`` [n] float32, ``dense.npy`` [n, D]
float32, ``lengths.npy`` [n, F] int32 (ids of each feature of each sample), ``values.npy`` [T]
int32/int64 rows, sample-major (sample 0's ids of feature 0, 1, ..., then sample 1's), and with
weight columns ``weights.npy`` [T] float32. ``vocab/<table>.npy`` holds each vocabulary's keys in
row order (row r = ``vocab[r - 1]``, row 0 = out of vocabulary).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neorec.config.schema import SchemaConfig
from neorec.data.bad_rows import RECORDS_FILE, BadRowPolicy, BadRows
from neorec.data.encode import (
    Block,
    Encoded,
    Fitted,
    Fitter,
    concat_encoded,
    encode,
    slice_block,
    table_of,
)
from neorec.data.tabular import count_rows, read_blocks, tabular_files
from neorec.errors import DataError

__all__ = ["TabularOptions", "preprocess_tabular", "fit", "split_counts", "JAGGED_VERSION"]

JAGGED_VERSION = 2
MANIFEST = "manifest.json"
DEFAULT_EVAL_FRACTION = 1 / 7


@dataclass
class TabularOptions:
    """What tabular preprocessing does; stored in the manifest."""

    shard_rows: int = 1 << 20
    workers: int = 0
    eval_fraction: float | None = None
    split_note: str = ""
    """How the input files were split, said instead of the file rule (a recipe's own split)."""
    bad_rows: str = "fail"
    max_bad_fraction: float = 0.01

    @property
    def policy(self) -> BadRowPolicy:
        """The bad-row policy (``data.bad_rows``, ``data.max_bad_fraction``)."""
        return BadRowPolicy(self.bad_rows, self.max_bad_fraction)


def split_counts(where: str, counts: Sequence[int], fraction: float | None) -> tuple[int, str]:
    """(train samples, how) by the Criteo rules; the train split is the first samples."""
    total = sum(counts)
    if fraction is None and len(counts) > 1 and 0 < counts[-1] < total:
        return total - counts[
            -1
        ], "eval = the last input file; --eval-fraction F for the last fraction F instead"
    if fraction == 0:
        return total, "no held-out split (--eval-fraction 0): train with data.eval_path"
    how = (
        f"eval = the last {fraction:g} of the samples (--eval-fraction)"
        if fraction
        else (
            "eval = the last 1/7 of the samples (the default for one input file; --eval-fraction F)"
        )
    )
    n_eval = round((fraction or DEFAULT_EVAL_FRACTION) * total)
    if not 0 < n_eval < total:
        raise DataError(
            f"{where}: a held-out fraction {fraction or DEFAULT_EVAL_FRACTION:g} of {total} samples "
            f"is {n_eval} samples; need at least 1 in each split (more data, or another "
            "--eval-fraction; 0 = none)"
        )
    return total - n_eval, how


def _blocks(
    files: Sequence[Path], schema: SchemaConfig, limit: int | None, policy: BadRowPolicy
) -> Iterator[Block]:
    """Blocks of the files in order, stopping after ``limit`` samples (None = all)."""
    seen = 0
    for p in files:
        for b in read_blocks(p, schema, bad=BadRows(policy) if policy.skip else None):
            if limit is not None and seen + b.n >= limit:
                if limit > seen:
                    yield slice_block(b, 0, limit - seen)
                return
            seen += b.n
            yield b


def fit(
    files: Sequence[Path],
    schema: SchemaConfig,
    tables: Sequence[Any],
    train: int | None,
    policy: BadRowPolicy | None = None,
) -> Fitted:
    """The statistics and vocabularies of the first ``train`` (good) samples of the files."""
    f = Fitter(schema, tables)
    if f.needed:
        for b in _blocks(files, schema, train, policy or BadRowPolicy()):
            f.add(b)
    return f.fitted()


@dataclass
class _Unit:
    index: int
    path: str
    first: int  # global index of the file's first sample
    train_end: int  # global index where the eval split starts


def _write(d: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    for col, arr in arrays.items():
        tmp = d / f"{name}.{col}.tmp.npy"
        np.save(tmp, arr)
        os.replace(tmp, d / f"{name}.{col}.npy")


def _convert(
    unit: _Unit,
    schema: SchemaConfig,
    tables: Sequence[Any],
    fitted: Fitted,
    out_dir: str,
    shard_rows: int,
    dtype: str,
    policy: BadRowPolicy,
) -> list[dict[str, Any]]:
    """Write the shards of one file; returns their manifest entries."""
    shards: list[dict[str, Any]] = []
    pending: list[Encoded] = []
    have, pos = 0, unit.first

    def flush() -> None:
        nonlocal pending, have, pos
        e = concat_encoded(pending)
        split = "train" if pos < unit.train_end else "eval"
        name = f"part-{unit.index:05d}-{len(shards):04d}"
        arrays = {
            "labels": e.labels,
            "dense": e.dense,
            "lengths": e.lengths,
            "values": e.values.astype(dtype),
        }
        if e.weights is not None:
            arrays["weights"] = e.weights
        _write(Path(out_dir) / "shards", name, arrays)
        shards.append({"name": name, "rows": len(e.labels), "source": unit.index, "split": split})
        pos += len(e.labels)
        pending, have = [], 0

    bad = BadRows(policy) if policy.skip else None  # (counted and recorded before)
    for block in read_blocks(Path(unit.path), schema, bad=bad):
        start = 0
        while start < block.n:
            # a shard ends at shard_rows samples, and where the eval split begins
            end_at = unit.train_end if pos + have < unit.train_end else 1 << 62
            take = min(block.n - start, shard_rows - have, end_at - pos - have)
            pending.append(encode(slice_block(block, start, start + take), schema, tables, fitted))
            have += take
            start += take
            if have == shard_rows or pos + have == unit.train_end:
                flush()
    if have:
        flush()
    return shards


def preprocess_tabular(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    schema: SchemaConfig,
    tables: Sequence[Any],
    opts: TabularOptions,
    out: Any = None,
) -> dict[str, Any]:
    """Convert tabular files to jagged shards under ``out_dir``; returns the manifest."""
    from neorec.data.preprocess import _pool, _prepare_output

    t0 = time.perf_counter()
    schema.check_tables(list(tables), len(schema.dense))
    paths = [p for x in inputs for p in tabular_files(x)]
    outp = Path(out_dir)
    _prepare_output(outp, paths)
    bad = BadRows(opts.policy)  # skipping: the good rows counted, the bad ones recorded
    counts = [count_rows(p, schema, bad) for p in paths]
    where = ", ".join(str(p) for p in paths)
    if sum(counts) == 0:
        raise DataError(f"{where}: no samples; nothing to write")
    n_train, how = split_counts(where, counts, opts.eval_fraction)
    how = opts.split_note or how
    fitted = fit(paths, schema, tables, n_train, opts.policy)
    if fitted.vocab:
        (outp / "vocab").mkdir(exist_ok=True)
        for t, v in fitted.vocab.items():
            np.save(outp / "vocab" / f"{t}.npy", v)
    owner = table_of(tables)
    rows = [int(owner[f.name].rows) for f in schema.sparse]
    dtype = "int32" if max(rows) <= np.iinfo(np.int32).max else "int64"
    firsts = np.concatenate(([0], np.cumsum(counts)))
    units = [_Unit(i, str(p), int(firsts[i]), n_train) for i, p in enumerate(paths)]
    args = (schema, list(tables), fitted, str(outp), opts.shard_rows, dtype, opts.policy)
    workers = min(opts.workers or os.cpu_count() or 1, len(units))
    if workers == 1:
        results = [_convert(u, *args) for u in units]
    else:
        with _pool(workers) as pool:
            results = list(pool.map(_convert, units, *([a] * len(units) for a in args)))
    shards = [s for r in results for s in r]
    n_eval = sum(s["rows"] for s in shards if s["split"] == "eval")
    total = sum(s["rows"] for s in shards)
    manifest = {
        "format_version": JAGGED_VERSION,
        "layout": "jagged",
        "num_dense": len(schema.dense),
        "dense": [f.column for f in schema.dense],
        "features": [f.name for f in schema.sparse],
        "tables": [owner[f.name].name for f in schema.sparse],
        "rows": rows,
        "ids": [f.ids for f in schema.sparse],
        "vocab_rows": [
            len(fitted.vocab[owner[f.name].name]) + 1 if f.ids == "vocab" else None
            for f in schema.sparse
        ],
        "weighted": any(f.weights for f in schema.sparse),
        "schema": asdict(schema),
        "fitted": fitted.to_json(),
        "options": asdict(opts),
        "sources": [str(p) for p in paths],
        "shards": shards,
        "split": {"how": how, "train": total - n_eval, "eval": n_eval},
        "bad_rows": bad.summary(),
        "seconds": time.perf_counter() - t0,
    }
    if opts.policy.skip:
        bad.write(outp)
    tmp = outp / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, outp / MANIFEST)
    if out is not None:
        mb = sum(p.stat().st_size for p in paths) / 1e6
        print(
            f"preprocessed {total:,} samples of {len(paths)} file(s) ({mb:,.1f} MB) into "
            f"{len(shards)} shards in {manifest['seconds']:.1f}s\n"
            f"split: {total - n_eval:,} train, {n_eval:,} eval samples ({how})"
            + (
                f"\nskipped {bad.total:,} bad rows (listed in {outp / RECORDS_FILE})"
                if bad.total
                else ""
            ),
            file=out,
            flush=True,
        )
    return manifest
