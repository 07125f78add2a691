"""Criteo TSV (plain or .gz) -> columnar shards that :mod:`neorec.data.loader` reads.

Layout of an output directory (a binary columnar layout: one ``.npy`` per column group per shard,
chosen over Parquet by measurement, see ``neorec bench data``)::

    manifest.json                      format version, features, rows per feature, shards, split,
                                       stats (each shard: name, rows, source file, split)
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
Raw features (``--raw``, or the features of ``kind = "dynamic"`` tables of ``--config``; hash mode,
one-hot) keep the raw hex value as their 64-bit id (< 2**60, empty -> 0, no modulo), as
``CriteoTSVDataset`` gives a dynamic table; their shards are int64.

Multi-hot (MLPerf DLRMv2): feature j with bag size s_j > 1 keeps its row r as the first id and adds
s_j - 1 ids drawn uniformly from [0, rows[j]) and fixed per (feature, r), as MLPerf's
``multi_hot.py`` does with a seeded per-row cache; here the draws come from a counter-based hash
(splitmix64) so no [rows, s_j] cache is held. Same distribution, not the same ids as MLPerf's.

Held-out split (``eval_fraction``): the last ``round(f * samples)`` samples in input order (files
in order, lines in order) are marked ``split = "eval"`` (the shard the cut falls in is split in
two); by default the last input file if there are several (Terabyte's day_23), else the last 1/7
of the samples (Kaggle's train.txt: 7 days, so about its last day). ``0`` = no held-out split.

Work is split into units (a byte range of a plain file, cut at line starts, or a whole .gz file,
see :mod:`neorec.data.shards`) processed by a process pool; the output does not depend on the
number of workers. In fail mode the error is the first bad line in input order, every run: a unit
that fails waits for the units before it, which may hold an earlier one.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from neorec.data.blocks import ParsedBlock, dense_transform, parse_block
from neorec.data.criteo import NUM_DENSE, NUM_SPARSE, CriteoFormatError, criteo_files
from neorec.data.shards import (
    _READ_BYTES,
    _VOCAB,
    FEATURES,
    PreprocessOptions,
    Unit,
    UnitResult,
    convert_unit,
    count_unit,
    multi_hot_extra,
    plan_units,
)
from neorec.errors import DataError

__all__ = [
    "FORMAT_VERSION",
    "KAGGLE_ROWS",
    "PreprocessOptions",
    "ParsedBlock",
    "parse_block",
    "dense_transform",
    "multi_hot_extra",
    "preprocess",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_MAX_EXAMPLES = 5
KAGGLE_ROWS = [
    *(1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194),
    *(27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572),
]
"""The table rows of ``configs/criteo_kaggle.toml`` (distinct values of C1..C26 in Kaggle's
train.txt): the default hash modulus of ``neorec data preprocess``."""
DEFAULT_EVAL_FRACTION = 1 / 7


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
    train_rows: int = 0
    eval_rows: int = 0
    split: str = ""
    """How the held-out split was chosen (one phrase)."""

    def format(self) -> str:
        """Human-readable summary."""
        mbs = self.input_bytes / 1e6 / max(self.seconds, 1e-9)
        lines = [
            f"preprocessed {self.lines:,} lines -> {self.rows:,} samples in {self.shards} shards, "
            f"{self.input_bytes / 1e6:,.1f} MB in {self.seconds:.1f}s ({mbs:,.1f} MB/s)",
            f"bad lines: {self.bad_lines:,}",
            *(f"  {m}" for m in self.bad_examples),
            f"split: {self.train_rows:,} train, {self.eval_rows:,} eval samples ({self.split})",
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


def _eta(spent: float, done: int, total: int) -> str:
    """``, 1m05s, eta 3m10s`` (units are of similar size: the eta scales the time per unit)."""
    from neorec.phases import eta, fmt_duration

    left = eta(spent, done, total)
    return f", {fmt_duration(spent)}" + (f", eta {left}" if left else "")


def _run_units(
    fn: Any, units: list[Unit], args: tuple, opts: PreprocessOptions, what: str, out: Any
) -> list[UnitResult]:
    """Run ``fn(unit, *args)`` over the units in a pool, with progress. On bad input (fail mode)
    the units after the first failed one are cancelled, those before it still finish: the error
    raised is the first bad line in input order, whatever the timing."""
    workers = opts.workers or os.cpu_count() or 1
    results: dict[int, UnitResult] = {}
    failed: dict[int, UnitResult] = {}
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
                if f.cancelled():
                    continue
                r = f.result()
                if r.failed:
                    failed[futs[f]] = r
                    first = min(failed)
                    for p in list(pending):
                        if futs[p] > first and p.cancel():
                            pending.discard(p)
                    continue
                results[futs[f]] = r
                done_bytes += r.bytes
            now = time.perf_counter()
            if out is not None and not failed and (now - last > 1.0 or not pending):
                last = now
                print(
                    f"{what}: {len(results)}/{len(units)} units, {done_bytes / 1e6:,.0f} MB, "
                    f"{done_bytes / 1e6 / max(now - t0, 1e-9):,.1f} MB/s"
                    + _eta(now - t0, len(results), len(units)),
                    file=out,
                    flush=True,
                )
    if failed:
        msg = _messages(failed[min(failed)])[0]
        raise CriteoFormatError(f"{msg} (fix the line, or skip bad lines with --bad-lines skip)")
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


def _prepare_output(outp: Path, inputs: list[Path]) -> None:
    """Check and create the output directory (before any work)."""
    if outp.exists() and not outp.is_dir():
        raise DataError(f"{outp}: the output exists and is not a directory; choose another")
    resolved = {p.resolve() for p in inputs}
    if outp.resolve() in resolved or any(outp.resolve() in p.parents for p in resolved):
        raise DataError(f"{outp}: the output must not be an input file or hold inputs")
    try:
        (outp / "shards").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"{outp}: cannot create the output directory ({e.strerror})") from None
    if (outp / MANIFEST).exists():
        (outp / MANIFEST).unlink()  # a directory without a manifest is an incomplete one


def preprocess(
    inputs: Sequence[str | Path], out_dir: str | Path, opts: PreprocessOptions, out: Any = None
) -> Summary:
    """Convert Criteo TSV files (plain or .gz) to shards under ``out_dir``; returns the summary."""
    t0 = time.perf_counter()
    paths = [p for x in inputs for p in criteo_files(x)]
    outp = Path(out_dir)
    _prepare_output(outp, paths)
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
    if summary.rows == 0:
        raise DataError(
            f"{', '.join(str(p) for p in paths)}: no samples ({summary.lines} lines, "
            f"{summary.bad_lines} bad); nothing to write"
        )
    shards = [s for r in results for s in r.shards]
    shards, summary.split = _split(outp, shards, len(paths), opts.eval_fraction)
    summary.eval_rows = sum(s["rows"] for s in shards if s["split"] == "eval")
    summary.train_rows = summary.rows - summary.eval_rows
    summary.shards = len(shards)
    summary.seconds = time.perf_counter() - t0
    _write_manifest(outp, paths, opts, table_rows, shards, summary)
    if out is not None:
        print(summary.format(), file=out, flush=True)
    return summary


def _split(
    outp: Path, shards: list[dict[str, Any]], files: int, fraction: float | None
) -> tuple[list[dict[str, Any]], str]:
    """The shards marked train or eval (the one the cut falls in split in two), and how."""
    total = sum(s["rows"] for s in shards)
    if fraction is None and files > 1:
        last = max(s["source"] for s in shards)
        n_eval = sum(s["rows"] for s in shards if s["source"] == last)
        how = "eval = the last input file; --eval-fraction F for the last fraction F instead"
        if 0 < n_eval < total:
            return [{**s, "split": "eval" if s["source"] == last else "train"} for s in shards], how
    if fraction is None:  # one file, or a last file with no samples (or with all of them)
        fraction = DEFAULT_EVAL_FRACTION
        how = (
            "eval = the last 1/7 of the samples (the default for one input file; --eval-fraction F)"
        )
    elif fraction == 0:
        return [{**s, "split": "train"} for s in shards], (
            "no held-out split (--eval-fraction 0): train with data.eval_path"
        )
    else:
        how = f"eval = the last {fraction:g} of the samples (--eval-fraction)"
    n_eval = round(fraction * total)
    if not 0 < n_eval < total:
        raise DataError(
            f"{outp}: a held-out fraction {fraction:g} of {total} samples is {n_eval} samples; "
            "need at least 1 in each split (more data, or another --eval-fraction; 0 = none)"
        )
    out: list[dict[str, Any]] = []
    seen = 0
    for s in shards:
        train = min(max(total - n_eval - seen, 0), s["rows"])  # rows of s before the cut
        seen += s["rows"]
        if train == s["rows"]:
            out.append({**s, "split": "train"})
        elif train == 0:
            out.append({**s, "split": "eval"})
        else:
            out += _cut_shard(outp / "shards", s, train)
    return out, how


def _cut_shard(d: Path, s: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """Split shard ``s`` after its first ``k`` samples into a train and an eval shard."""
    name, tail = s["name"], s["name"] + "-eval"
    for col in ("labels", "dense", "sparse"):
        arr = np.load(d / f"{name}.{col}.npy")
        for n, part in ((tail, arr[k:]), (name, arr[:k])):  # the eval part first: name stays
            tmp = d / f"{n}.{col}.tmp.npy"
            np.save(tmp, part)
            os.replace(tmp, d / f"{n}.{col}.npy")
    return [
        {**s, "rows": k, "split": "train"},
        {**s, "name": tail, "rows": s["rows"] - k, "split": "eval"},
    ]


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
    shards: list[dict[str, Any]],
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
        "shards": shards,
        "split": {"how": summary.split, "train": summary.train_rows, "eval": summary.eval_rows},
        "summary": asdict(summary),
    }
    tmp = outp / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, outp / MANIFEST)
