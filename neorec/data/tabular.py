"""Readers of tabular files: CSV / TSV with a header (stdlib ``csv`` + NumPy) and Parquet
(``pyarrow``, the ``neorec[parquet]`` extra: read by row groups, projected to the schema's
columns, never the whole file in memory). Each yields :class:`~neorec.data.encode.Block` s of the
columns ``data.schema`` declares, typed and checked; a value that does not fit is a
:class:`~neorec.errors.DataError` naming the file, the line (CSV) or row (Parquet, 1-based) and the
column.

What a value may be: the label is 0 or 1; a dense value is a finite number or missing (empty
field, null); an ``int`` id is a decimal 64-bit integer (Parquet: an integer column), a ``str`` id
any text (Parquet: a string column); a missing id is an empty bag. A list field (CSV) is ids
joined by ``list_sep`` (empty = no ids), its weights the same way; Parquet lists hold no nulls.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from neorec.config.schema import FeatureSpec, SchemaConfig
from neorec.data.bad_rows import BadRows
from neorec.data.csv_lines import LINE_FIELDS, LongLine, capped_lines, long_field, open_text
from neorec.data.encode import Block, SparseColumn, str_keys
from neorec.errors import DataError

__all__ = ["tabular_files", "file_format", "count_rows", "read_blocks", "need_pyarrow"]

BLOCK_ROWS = 65_536
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "tsv"}


def need_pyarrow() -> Any:
    """``pyarrow.parquet``, or a one-line error naming the extra."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading Parquet needs pyarrow: pip install 'neorec[parquet]'") from None
    return pq


def file_format(path: Path, schema: SchemaConfig) -> str:
    """``parquet``, ``csv`` or ``tsv`` of a file (``data.schema.format``, or its extension)."""
    if schema.format != "auto":
        return schema.format
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"{path}: cannot tell the format from the extension {path.suffix!r}; name the file "
            ".parquet / .csv / .tsv or set data.schema.format"
        )
    return fmt


def tabular_files(path: str | Path) -> list[Path]:
    """A file, or the sorted .parquet / .csv / .tsv files of a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in _SUFFIXES)
        if not files:
            raise DataError(f"{p}: no .parquet, .csv or .tsv files in this directory")
        return files
    if not p.exists():
        raise DataError(f"{p}: no such file or directory (the data path); check the path")
    return [p]


def count_rows(path: Path, schema: SchemaConfig, bad: BadRows | None = None) -> int:
    """Data rows of a file (Parquet: from its footer; CSV: its records, header excluded). With
    ``bad`` skipping: its good rows (a pass over the file, the bad ones recorded in ``bad``)."""
    if bad is not None and bad.policy.skip:
        return sum(b.n for b in read_blocks(path, schema, BLOCK_ROWS, bad))
    if file_format(path, schema) == "parquet":
        return int(_parquet_file(path).metadata.num_rows)
    with open_text(path) as f:
        try:
            n = sum(1 for _ in _records(path, _reader(f, schema, path)))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if n == 0:
        raise DataError(f"{path}: empty file (no header line)")
    return n - 1


def read_blocks(
    path: Path, schema: SchemaConfig, rows: int = BLOCK_ROWS, bad: BadRows | None = None
) -> Iterator[Block]:
    """Blocks of about ``rows`` rows of a file, in order; ``bad``: the bad-row policy and what it
    skipped (``neorec.data.bad_rows``; None: fail on the first)."""
    if file_format(path, schema) == "parquet":
        yield from _parquet_blocks(path, schema, rows, bad)
    else:
        yield from _csv_blocks(path, schema, rows, bad)
    if bad is not None:
        bad.end_file(path)


# ---- CSV / TSV -----------------------------------------------------------------------------------


def _delim(schema: SchemaConfig, path: Path) -> str:
    return schema.delimiter or ("," if file_format(path, schema) == "csv" else "\t")


def _reader(f: io.TextIOWrapper, schema: SchemaConfig, path: Path) -> Any:
    """A strict CSV reader: a quote that does not end is an error, not the rest of the file; no
    field longer than ``max_field_bytes`` characters, no line longer than ``LINE_FIELDS`` of
    them, is ever held."""
    csv.field_size_limit(schema.max_field_bytes)
    lines = capped_lines(f, schema.max_field_bytes * LINE_FIELDS)
    return csv.reader(lines, delimiter=_delim(schema, path), strict=True)


def _records(path: Path, reader: Any) -> Iterator[tuple[int, list[str]]]:
    """``(line where the record starts, its fields)``; a malformed record is one ``DataError``
    naming the file and that line (a quote left open names the line it was opened on)."""
    start, header = 1, None
    while True:
        try:
            rec = next(reader)
        except StopIteration:
            return
        except (csv.Error, LongLine) as e:
            msg = str(e)
            if isinstance(e, LongLine):
                start, msg = e.line, "field limit"
            if "unexpected end of data" in msg:
                msg = f"a quoted field opened in this record does not end (an unterminated quote; {msg})"
            elif "field limit" in msg:
                limit = csv.field_size_limit()
                col = long_field(path, reader.dialect.delimiter, start, limit)
                what = f"column {col + 1}" if col is not None else "a field"
                if col is not None and header:
                    what = f"column '{header[col]}'" if col < len(header) else what
                msg = (
                    f"{what}: a field of more than {limit:,} characters "
                    "(data.schema.max_field_bytes), or a quote that does not end"
                )
            raise DataError(f"{path.name}:{start}: {msg}") from None
        if header is None:
            header = rec
        yield start, rec
        start = reader.line_num + 1


def _check_lengths(
    texts: list[str], column: str, where: Callable[[int], str], limit: int
) -> list[str]:
    """``texts``, each at most ``limit`` bytes of UTF-8, else one ``DataError`` naming it."""
    if max(map(len, texts), default=0) * 4 <= limit:  # no field can be over (4 bytes a char)
        return texts
    for i, t in enumerate(texts):
        if len(t) * 4 > limit and len(t.encode()) > limit:
            raise DataError(
                f"{where(i)}: column '{column}': a field of {len(t.encode()):,} bytes, over "
                f"data.schema.max_field_bytes ({limit:,})"
            )
    return texts


def _csv_blocks(
    path: Path, schema: SchemaConfig, rows: int, bad: BadRows | None
) -> Iterator[Block]:
    with open_text(path) as f:
        reader = _records(path, _reader(f, schema, path))
        try:
            _, header = next(reader, (0, None))
            if header is None:
                raise DataError(f"{path}: empty file (no header line)")
            missing = [c for c in schema.columns if c not in header]
            if missing:
                raise DataError(
                    f"{path}: no column(s) {missing} in the header (the schema's); the header "
                    f"has {header[:12]}{'...' if len(header) > 12 else ''}"
                )
            index = {c: header.index(c) for c in schema.columns}
            recs: list[list[str]] = []
            lines: list[int] = []
            for line, rec in reader:
                if len(rec) != len(header):
                    msg = f"{path.name}:{line}: {len(rec)} fields, the header has {len(header)}"
                    if bad is None or not bad.policy.skip:
                        raise DataError(msg)
                    bad.read(path, 1)
                    bad.skip(path, {"line": line}, msg)
                    continue
                recs.append(rec)
                lines.append(line)
                if len(recs) == rows:
                    yield from _csv_good(path, schema, index, (recs, lines), bad)
                    recs, lines = [], []
            if recs:
                yield from _csv_good(path, schema, index, (recs, lines), bad)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _csv_good(
    path: Path,
    schema: SchemaConfig,
    index: dict[str, int],
    got: tuple[list[list[str]], list[int]],
    bad: BadRows | None,
) -> Iterator[Block]:
    """The block of records ``got`` (fields, lines); with ``bad``, of its good ones."""
    recs, lines = got
    if bad is None:
        yield _csv_block(path, schema, index, recs, lines)
        return

    def build(rs: list[int]) -> Block:
        return _csv_block(path, schema, index, [recs[r] for r in rs], [lines[r] for r in rs])

    block = bad.good_rows(build, len(recs), path, lambda r: {"line": lines[r]})
    if block is not None:
        yield block


def _csv_block(
    path: Path, schema: SchemaConfig, index: dict[str, int], recs: list[list[str]], lines: list[int]
) -> Block:
    name = path.name

    def where(i: int) -> str:
        return f"{name}:{lines[i]}"

    def col(c: str) -> list[str]:
        k = index[c]
        return _check_lengths([r[k] for r in recs], c, where, schema.max_field_bytes)

    labels = _labels(
        _floats(col(schema.label), schema.label, where, missing_ok=False), schema.label, where
    )
    dense = {f.column: _dense(col(f.column), f.column, where) for f in schema.dense}
    sparse = {f.name: _csv_sparse(f, col, schema.list_sep, where) for f in schema.sparse}
    _check_ids_per_field(sparse, schema, where)
    return Block(len(recs), labels, dense, sparse, where)


def _check_ids_per_field(
    sparse: dict[str, SparseColumn], schema: SchemaConfig, where: Callable[[int], str]
) -> None:
    """No row's list feature holds more than ``max_ids_per_field`` ids."""
    limit = schema.max_ids_per_field
    for f in schema.sparse:
        lengths = sparse[f.name].lengths
        over = np.flatnonzero(lengths > limit)
        if len(over):
            i = int(over[0])
            raise DataError(
                f"{where(i)}: column '{f.column}': {int(lengths[i]):,} ids, over "
                f"data.schema.max_ids_per_field ({limit:,})"
            )


def _floats(
    texts: list[str], column: str, where: Callable[[int], str], missing_ok: bool
) -> tuple[np.ndarray, np.ndarray]:
    missing = np.array([not t.strip() for t in texts], dtype=bool)
    out = np.zeros(len(texts), np.float64)
    for i, t in enumerate(texts):
        if missing[i]:
            if not missing_ok:
                raise DataError(f"{where(i)}: column '{column}' is empty")
            continue
        try:
            x = float(t)
        except ValueError:
            raise DataError(f"{where(i)}: column '{column}': {t[:40]!r} is not a number") from None
        if not math.isfinite(x):
            raise DataError(f"{where(i)}: column '{column}': {t[:40]!r} is not a finite number")
        out[i] = x
    return out, missing


def _labels(
    vm: tuple[np.ndarray, np.ndarray], column: str, where: Callable[[int], str]
) -> np.ndarray:
    v, miss = vm
    bad = np.flatnonzero(miss | ((v != 0) & (v != 1)))
    if len(bad):
        i = int(bad[0])
        what = "missing" if miss[i] else f"{v[i]:g}"
        raise DataError(f"{where(i)}: label column '{column}' is {what}, not 0 or 1")
    return v.astype(np.float32)


def _dense(
    texts: list[str], column: str, where: Callable[[int], str]
) -> tuple[np.ndarray, np.ndarray]:
    return _floats(texts, column, where, missing_ok=True)


def _int(t: str, column: str, where: str) -> int:
    s = t.strip()
    if not (s.isascii() and (s[1:] if s[:1] == "-" else s).isdigit()):
        raise DataError(f"{where}: column '{column}': {t[:40]!r} is not an integer id")
    x = int(s)
    if not -(1 << 63) <= x < 1 << 63:
        raise DataError(f"{where}: column '{column}': {t[:40]!r} does not fit in 64 bits")
    return x


def _csv_sparse(
    f: FeatureSpec, col: Callable[[str], list[str]], sep: str, where: Callable[[int], str]
) -> SparseColumn:
    texts = col(f.column)
    if f.type == "id":
        items = [[t] if t.strip() else [] for t in texts]
    else:
        items = [t.split(sep) if t.strip() else [] for t in texts]
    lengths = np.array([len(x) for x in items], np.int64)
    flat = [x for it in items for x in it]
    rows_of = np.repeat(np.arange(len(items)), lengths)
    if f.dtype == "int":
        keys = np.array(
            [_int(x, f.column, where(int(r))) for x, r in zip(flat, rows_of)], dtype=np.int64
        )
    else:
        keys = str_keys(flat)
    weights = None
    if f.weights:
        wt = col(f.weights)
        witems = (
            [[t] if t.strip() else [] for t in wt]
            if f.type == "id"
            else [t.split(sep) if t.strip() else [] for t in wt]
        )
        for i, (a, b) in enumerate(zip(items, witems)):
            if len(a) != len(b):
                raise DataError(
                    f"{where(i)}: column '{f.weights}' has {len(b)} weight(s) for the "
                    f"{len(a)} id(s) of column '{f.column}'"
                )
        weights = _floats(
            [x for it in witems for x in it], f.weights, lambda k: where(int(rows_of[k])), False
        )[0].astype(np.float32)
    return SparseColumn(lengths, keys, weights)


# ---- Parquet -------------------------------------------------------------------------------------


def _parquet_file(path: Path) -> Any:
    pq = need_pyarrow()
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _arrow_kind(t: Any) -> str:
    import pyarrow as pa

    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list<" + _arrow_kind(t.value_type) + ">"
    return str(t)


def _want(f: FeatureSpec | None, weights: bool = False) -> tuple[str, ...]:
    """The Arrow kinds a column may have."""
    if f is None or f.type == "dense":
        return ("int", "float", "bool")
    if weights:
        return ("int", "float") if f.type == "id" else ("list<int>", "list<float>")
    base = f.dtype
    return (base,) if f.type == "id" else (f"list<{base}>",)


def _check_parquet_schema(path: Path, pf: Any, schema: SchemaConfig) -> None:
    arrow = pf.schema_arrow
    names = list(arrow.names)
    missing = [c for c in schema.columns if c not in names]
    if missing:
        raise DataError(
            f"{path}: no column(s) {missing} (the schema's); the file has {names[:12]}"
            f"{'...' if len(names) > 12 else ''}"
        )
    checks: list[tuple[str, tuple[str, ...], str]] = [(schema.label, _want(None), "the label")]
    for f in schema.features:
        checks.append(
            (
                f.column,
                _want(f),
                f"a {f.type} feature ({f.dtype} ids)" if f.type != "dense" else "a dense feature",
            )
        )
        if f.weights:
            checks.append((f.weights, _want(f, True), f"the weights of '{f.column}'"))
    for col, ok, what in checks:
        kind = _arrow_kind(arrow.field(col).type)
        if kind not in ok:
            raise DataError(
                f"{path}: column '{col}' is {kind}, but it is {what} (want {' or '.join(ok)})"
            )


def _parquet_blocks(
    path: Path, schema: SchemaConfig, rows: int, bad: BadRows | None
) -> Iterator[Block]:
    pf = _parquet_file(path)
    _check_parquet_schema(path, pf, schema)
    first = 0
    try:
        batches = pf.iter_batches(batch_size=rows, columns=schema.columns)
        for rb in batches:
            numbers = np.arange(first + 1, first + rb.num_rows + 1)  # 1-based row numbers
            if bad is None:
                yield _parquet_block(path, schema, rb, numbers)
            elif (block := _parquet_good(path, schema, rb, numbers, bad)) is not None:
                yield block
            first += rb.num_rows
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged row group
        raise DataError(
            f"{path}: cannot read rows after {first} ({type(e).__name__}: {e})"
        ) from None


def _parquet_good(
    path: Path, schema: SchemaConfig, rb: Any, numbers: np.ndarray, bad: BadRows
) -> Block | None:
    """The block of the good rows of record batch ``rb`` (row numbers ``numbers``)."""

    def build(rs: list[int]) -> Block:
        return _parquet_block(path, schema, rb.take(rs), numbers[rs])

    return bad.good_rows(build, rb.num_rows, path, lambda r: {"row": int(numbers[r])})


def _null_mask(arr: Any) -> np.ndarray:
    import pyarrow.compute as pc

    return np.asarray(pc.is_null(arr).to_numpy(zero_copy_only=False), dtype=bool)


def _numbers(
    arr: Any, column: str, where: Callable[[int], str], missing_ok: bool
) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa

    miss = _null_mask(arr)
    if pa.types.is_boolean(arr.type):
        arr = arr.cast(pa.int8())
    v = np.asarray(arr.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(v) | (miss & (not missing_ok)))
    if len(bad):
        i = int(bad[0])
        what = "null" if miss[i] else f"{v[i]} (not a finite number)"
        raise DataError(f"{where(i)}: column '{column}' is {what}")
    return v, miss


def _int_keys(flat: Any, column: str, where: Callable[[int], str]) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_uint64(flat.type):
        v = np.asarray(flat.to_numpy(zero_copy_only=False))
        big = np.flatnonzero(v >= np.uint64(1 << 63))
        if len(big):
            raise DataError(
                f"{where(int(big[0]))}: column '{column}': id {int(v[big[0]])} does not fit in 64 bits"
            )
    return np.asarray(flat.to_numpy(zero_copy_only=False)).astype(np.int64)


def _parquet_sparse(
    f: FeatureSpec, rb: Any, where: Callable[[int], str], max_bytes: int
) -> SparseColumn:
    import pyarrow.compute as pc

    arr = rb.column(f.column)
    n = len(arr)
    miss = _null_mask(arr)
    if f.type == "id":
        lengths = (~miss).astype(np.int64)
        flat = arr.drop_null()
        rows_of = np.flatnonzero(~miss)
    else:
        lengths = np.asarray(
            pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False), np.int64
        )
        flat = arr.flatten()
        rows_of = np.repeat(np.arange(n), lengths)
        if flat.null_count:
            i = int(rows_of[np.flatnonzero(_null_mask(flat))[0]])
            raise DataError(f"{where(i)}: column '{f.column}' has a null id in its list")

    def at(k: int) -> str:
        return where(int(rows_of[k]))

    if f.dtype == "str" and len(flat):
        sizes = np.asarray(pc.binary_length(flat).to_numpy(zero_copy_only=False), np.int64)
        over = np.flatnonzero(sizes > max_bytes)
        if len(over):
            k = int(over[0])
            raise DataError(
                f"{at(k)}: column '{f.column}': an id of {int(sizes[k]):,} bytes, over "
                f"data.schema.max_field_bytes ({max_bytes:,})"
            )
    keys = _int_keys(flat, f.column, at) if f.dtype == "int" else str_keys(flat.to_pylist())
    weights = None
    if f.weights:
        w = rb.column(f.weights)
        if f.type == "id":
            wmiss = _null_mask(w)
            wl = (~wmiss).astype(np.int64)
            wflat = w.drop_null()
        else:
            wl = np.asarray(
                pc.list_value_length(w).fill_null(0).to_numpy(zero_copy_only=False), np.int64
            )
            wflat = w.flatten()
        diff = np.flatnonzero(wl != lengths)
        if len(diff):
            i = int(diff[0])
            raise DataError(
                f"{where(i)}: column '{f.weights}' has {wl[i]} weight(s) for the {lengths[i]} "
                f"id(s) of column '{f.column}'"
            )
        weights = _numbers(wflat, f.weights, at, missing_ok=False)[0].astype(np.float32)
    return SparseColumn(lengths, keys, weights)


def _parquet_block(path: Path, schema: SchemaConfig, rb: Any, numbers: np.ndarray) -> Block:
    name = path.name

    def where(i: int) -> str:
        return f"{name}: row {int(numbers[i])}"

    labels = _labels(
        _numbers(rb.column(schema.label), schema.label, where, False), schema.label, where
    )
    dense = {f.column: _numbers(rb.column(f.column), f.column, where, True) for f in schema.dense}
    sparse = {f.name: _parquet_sparse(f, rb, where, schema.max_field_bytes) for f in schema.sparse}
    _check_ids_per_field(sparse, schema, where)
    return Block(rb.num_rows, labels, dense, sparse, where)
