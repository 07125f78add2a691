"""Criteo Kaggle / Terabyte click logs (TSV) -> Batches.

Line format (40 tab-separated fields, any of them but the label may be empty)::

    label \\t I1 .. I13 (integers) \\t C1 .. C26 (8 hex digits)

Transforms, as the public DLRM pipeline (facebookresearch/dlrm ``data_utils``) applies them:

- dense: empty -> 0, negative -> 0, then ``log(x + 1)``. Negative counts occur in the public data
  and are zeroed by that pipeline; this is its transform, not silent clamping of bad input: a dense
  field that is not an integer is an error.
- categorical: with ``hash_categories``, row = int(hex, 16) % table rows; an empty category maps to
  row 0 (the reference pipeline reads it as the value 0). Without hashing, the hex value must be
  < table rows (pre-indexed data), else it is an error.
- raw ids: a ``kind = "dynamic"`` table (or every table with ``raw_ids=True``) gets the hex
  value itself as a 64-bit id (< 2**60; empty -> 0), no modulo and no bound: its id map assigns
  rows (``neorec.storage.dynamic``). ``hash_categories`` applies to the other tables only.
- label: must be ``0`` or ``1``.

Lines end at ``\n`` only (one ``\r`` before it is dropped: ``\r\n`` files read as usual); a ``\r``
anywhere else is a byte of a field, so a line holding one is one bad line and never shifts the line
numbers after it. Integers are ASCII decimal digits (an optional ``-``) that fit in 64 bits; other
digits ("٣", full-width) are not integers. A line that is not UTF-8 text is bad; a truncated or
corrupt ``.gz`` stream is one bad line at the line it was cut in (every whole line before it is
read).

A malformed line raises :class:`CriteoFormatError` naming ``file:line`` and the field, or with
``bad_lines="skip"`` is counted in :attr:`CriteoTSVDataset.stats` (first few kept) and skipped:
``stats.bad_lines`` is exactly the number of bad lines, and skipping never raises.
Each categorical feature C<i> reads one table: the tables passed in, in order (26 tables, one
feature each). The last partial batch is kept (a smaller final Batch), so no line is lost in eval.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from neorec.config import ConfigError, TableConfig
from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.sparse import SparseFeatures

__all__ = [
    "CriteoFormatError",
    "CriteoStats",
    "CriteoTSVDataset",
    "parse_line",
    "parse_text",
    "criteo_files",
    "decode_line",
    "decode_text",
    "file_chunks",
    "GZ_ERRORS",
]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
EMPTY_CATEGORY_ROW = 0
_MAX_EXAMPLES = 5
_READ_BYTES = 8 << 20
MAX_HEX_DIGITS = 15
MAX_LINE_BYTES = 1 << 20
"""The longest line a Criteo TSV reader holds (a line of the public layout is < 1 KB): a longer
one is a bad line, named, and never read whole (memory stays bounded)."""
LONG_LINE = f"a line of more than {MAX_LINE_BYTES:,} bytes (a Criteo line is under 1 KB)"
"""A category's raw value must stay < 2**60 (it is hashed or looked up as an int64)."""
GZ_ERRORS = (EOFError, OSError, zlib.error)
"""What reading a truncated or corrupt gzip stream raises."""
_INT = re.compile(r"-?[0-9]+")  # ASCII digits only (str.isdigit also takes "٣")
_HEX = re.compile(r"[0-9a-fA-F]+")
# The fast path: a line in the exact public layout (categories empty or 8 hex digits) is checked by
# one C-level match and its 26 categories decoded for a whole batch at once with numpy. Other lines
# go through parse_line, which accepts any hex width (< 16 digits) or names the bad field.
_GOOD_LINE = re.compile(
    r"[01]" + r"\t(?:-?[0-9]{1,18})?" * NUM_DENSE + r"\t(?:[0-9a-fA-F]{8})?" * NUM_SPARSE
)
_EMPTY_CAT = re.compile(r"(?<![^\t])(?=\t|$)")  # an empty field, also the first
_CAT_WIDTH = NUM_SPARSE * 9 - 1  # 26 fields of 8 hex digits and 25 tabs
_HEX_VALUE = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate("0123456789abcdef"):
    _HEX_VALUE[ord(_c)] = _i
    _HEX_VALUE[ord(_c.upper())] = _i
_FIELD_NAMES = ["label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27))]


class CriteoFormatError(DataError):
    """A malformed Criteo line: names file, line number and field."""


@dataclass
class CriteoStats:
    """Counts of what a pass over the files saw."""

    lines: int = 0
    """Lines read (good and bad)."""
    bad_lines: int = 0
    """Malformed lines skipped (bad_lines='skip')."""
    examples: list[str] = field(default_factory=list)
    """The first few bad-line messages."""


_PATTERNS = ("*.tsv", "*.txt", "*.tsv.gz", "*.txt.gz", "day_*")


def criteo_files(path: str | Path) -> list[Path]:
    """A file, or the sorted TSV/txt(.gz) files of a directory; a missing path or a directory
    without such files is a :class:`~neorec.errors.DataError` naming it."""
    p = Path(path)
    if p.is_dir():
        files = sorted({f for pat in _PATTERNS for f in p.glob(pat) if f.is_file()})
        if not files:
            raise DataError(
                f"{p}: no Criteo TSV files in this directory (looked for "
                f"{', '.join(_PATTERNS)}); point the data path at a TSV file or a directory of them"
            )
        return files
    if not p.exists():
        raise DataError(f"{p}: no such file or directory (the Criteo data path); check the path")
    return [p]


def _show(s: str) -> str:
    """repr of a field, shortened: a message stays one readable line."""
    return repr(s if len(s) <= 40 else s[:37] + "...")


def parse_line(
    line: str, rows: Sequence[int], hash_categories: bool = True, raw: Sequence[bool] = ()
) -> tuple[int, list[float], list[int]]:
    """(label, 13 dense values after log(x+1), 26 row ids) of one line; raises ValueError naming
    the field (the caller adds file:line). One trailing ``\n`` and then one ``\r`` are dropped.
    ``raw[j]``: feature j keeps its raw value (a dynamic table's id)."""
    if line.endswith("\n"):
        line = line[:-1]
    if line.endswith("\r"):
        line = line[:-1]
    return parse_text(line, rows, hash_categories, raw)


def parse_text(
    text: str, rows: Sequence[int], hash_categories: bool = True, raw: Sequence[bool] = ()
) -> tuple[int, list[float], list[int]]:
    """:func:`parse_line` of a line's text (its ``\n`` and ``\r`` already dropped: any other
    ``\r`` is part of a field)."""
    parts = text.split("\t")
    if len(parts) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(parts)}")
    lab = parts[0]
    if lab != "0" and lab != "1":
        raise ValueError(f"field label: {_show(lab)} is not 0 or 1")
    dense = []
    for i in range(1, 1 + NUM_DENSE):
        s = parts[i]
        if not s:
            dense.append(0.0)
            continue
        # int() alone would also take " 5", "1_0", "+5" and other scripts' digits ("٣")
        if _INT.fullmatch(s) is None:
            raise ValueError(f"field {_FIELD_NAMES[i]}: {_show(s)} is not an integer")
        if len(s) > 20 or not -(1 << 63) <= (x := int(s)) < 1 << 63:
            raise ValueError(f"field {_FIELD_NAMES[i]}: {_show(s)} does not fit in 64 bits")
        dense.append(math.log1p(x) if x > 0 else 0.0)
    ids = []
    for j in range(NUM_SPARSE):
        name = _FIELD_NAMES[1 + NUM_DENSE + j]
        s = parts[1 + NUM_DENSE + j]
        if not s:
            ids.append(EMPTY_CATEGORY_ROW)
            continue
        # int(s, 16) alone would also take "0x1f", " 1f", "-1f", "1_f": hex ids never look so
        if _HEX.fullmatch(s) is None:
            raise ValueError(f"field {name}: {_show(s)} is not hex")
        if len(s) > MAX_HEX_DIGITS:
            raise ValueError(f"field {name}: {_show(s)} has more than {MAX_HEX_DIGITS} hex digits")
        v = int(s, 16)
        if raw and raw[j]:
            pass  # a raw id: no modulo, no bound
        elif hash_categories:
            v %= rows[j]
        elif v >= rows[j]:
            raise ValueError(
                f"field {name}: id {v} >= table rows {rows[j]} "
                "(set data.hash_categories = true to hash)"
            )
        ids.append(v)
    return int(lab), dense, ids


def decode_line(raw: bytes) -> str:
    """A line's text (without its ``\n`` and one ``\r`` before it); ValueError if not UTF-8."""
    return decode_text(raw[:-1] if raw.endswith(b"\r") else raw)


def decode_text(raw: bytes) -> str:
    """UTF-8 text of a line's bytes (line ending already dropped); ValueError naming the column
    of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        ) from None


def gz_chunks(path: str | Path) -> Iterator[bytes]:
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


def file_chunks(path: str | Path) -> Iterator[bytes]:
    """The bytes of a plain or ``.gz`` file in pieces (gzip errors: see :data:`GZ_ERRORS`)."""
    if Path(path).suffix == ".gz":
        yield from gz_chunks(path)
        return
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            yield chunk


def _raw_lines(path: Path) -> Iterator[tuple[bytes | None, str | None]]:
    """(line without its ``\n``, None) per line of a file, (None, message) for a line longer than
    ``MAX_LINE_BYTES`` (never held whole), then (None, message) if a gzip stream is truncated or
    corrupt: the partial line it was cut in is not a line."""
    carry, skipping = b"", False
    try:
        for chunk in file_chunks(path):
            if skipping:  # the rest of a line too long to hold
                nl = chunk.find(b"\n")
                if nl < 0:
                    continue
                chunk, skipping = chunk[nl + 1 :], False
            data = carry + chunk
            lines = data.split(b"\n")
            carry = lines.pop()
            for raw in lines:
                yield (raw, None) if len(raw) <= MAX_LINE_BYTES else (None, LONG_LINE)
            if len(carry) > MAX_LINE_BYTES:
                yield None, LONG_LINE
                carry, skipping = b"", True
    except GZ_ERRORS as e:
        yield None, f"truncated or corrupt gzip stream ({type(e).__name__}: {e})"
        return
    if carry:
        yield carry, None


class CriteoTSVDataset:
    """Iterates Batches over Criteo TSV files (plain or .gz), in file and line order."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tables: list[TableConfig],
        batch_size: int,
        bad_lines: str = "fail",
        hash_categories: bool = True,
        raw_ids: bool | None = None,
    ) -> None:
        """``raw_ids``: True = every feature's raw hex value as its id (no modulo, no bound);
        None = only for ``kind = "dynamic"`` tables; False = never (a dynamic table then reads
        hashed or checked rows like the others)."""
        if isinstance(paths, (str, Path)):
            self.paths = criteo_files(paths)
        else:
            self.paths = [p for x in paths for p in criteo_files(x)]
        if len(tables) != NUM_SPARSE:
            raise ConfigError(
                f"Criteo data needs {NUM_SPARSE} embedding tables (C1..C26, one feature each), "
                f"the config has {len(tables)}; use configs/criteo_kaggle.toml's tables"
            )
        if bad_lines not in ("fail", "skip"):
            raise ValueError(f"bad_lines must be 'fail' or 'skip', got '{bad_lines}'")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.tables = tables
        self.keys = [t.features[0] for t in tables]
        self.rows = [t.rows for t in tables]
        self.batch_size = batch_size
        self.bad_lines = bad_lines
        self.hash_categories = hash_categories
        self.raw = [
            bool(raw_ids) if raw_ids is not None else getattr(t, "kind", "fixed") == "dynamic"
            for t in tables
        ]
        """Per feature: ids are raw values (dynamic tables), not rows."""
        self.stats = CriteoStats()

    def __iter__(self) -> Iterator[Batch]:
        """Batches of ``batch_size`` lines; the last one may be smaller. Resets ``stats``."""
        self.stats = CriteoStats()
        heads: list[list[int]] = []  # label + 13 dense ints per sample
        cats: list[str] = []  # the 26 categories as fixed-width text (fast path) ...
        slow: dict[int, list[int]] = {}  # ... or already parsed (other hex widths)
        where: list[str] = []  # "file:line" of each sample, for errors found per batch
        for path in self.paths:
            lineno = 0
            for raw, err in _raw_lines(path):
                lineno += 1
                self.stats.lines += 1
                if raw is None:
                    self._bad(f"{path.name}:{lineno}: {err}")
                    continue
                parsed = self._line(raw, path, lineno)
                if parsed is None:
                    continue
                if isinstance(parsed, str):  # the fast path: categories as fixed-width text
                    fields = parsed.split("\t", 1 + NUM_DENSE)
                    heads.append([int(x) if x else 0 for x in fields[: 1 + NUM_DENSE]])
                    cats.append(_EMPTY_CAT.sub("00000000", fields[-1]))
                else:
                    heads.append(parsed[0])
                    slow[len(cats)] = parsed[1]
                    cats.append("0" * _CAT_WIDTH)
                where.append(f"{path.name}:{lineno}")
                if len(heads) == self.batch_size:
                    batch = self._batch(heads, cats, slow, where)
                    heads, cats, slow, where = [], [], {}, []
                    if batch is not None:
                        yield batch
        if heads:
            batch = self._batch(heads, cats, slow, where)
            if batch is not None:
                yield batch

    def _line(
        self, raw: bytes, path: Path, lineno: int
    ) -> str | tuple[list[int], list[int]] | None:
        """A line in the exact public layout (its text), another good line parsed (label + dense
        ints, 26 raw category values), or None if it is bad (skip mode; fail mode raises)."""
        try:
            text = decode_line(raw)
            if _GOOD_LINE.fullmatch(text) is not None:
                return text
            parse_text(text, [1 << 62] * NUM_SPARSE, hash_categories=True)  # validate only
        except ValueError as e:
            self._bad(f"{path.name}:{lineno}: {e}")
            return None
        fields = text.split("\t")
        head = [int(x) if x else 0 for x in fields[: 1 + NUM_DENSE]]
        return head, [int(x, 16) if x else EMPTY_CATEGORY_ROW for x in fields[1 + NUM_DENSE :]]

    def _bad(self, msg: str) -> None:
        if self.bad_lines == "fail":
            raise CriteoFormatError(msg)
        self.stats.bad_lines += 1
        if len(self.stats.examples) < _MAX_EXAMPLES:
            self.stats.examples.append(msg)

    def _batch(
        self, heads: list[list[int]], cats: list[str], slow: dict[int, list[int]], where: list[str]
    ) -> Batch | None:
        head = torch.tensor(heads, dtype=torch.int64)  # [B, 14]
        ids = torch.from_numpy(_decode_hex("".join(cats), len(cats)))  # [B, 26]
        for i, raw in slow.items():
            ids[i] = torch.tensor(raw, dtype=torch.int64)
        # raw-id features: a modulus / bound no id reaches (values < 2**60)
        table_rows = torch.tensor(
            [1 << 62 if r else n for r, n in zip(self.raw, self.rows)], dtype=torch.int64
        )
        if self.hash_categories:
            ids = ids % table_rows
        else:
            over = ids >= table_rows
            if bool(over.any()):
                keep = torch.ones(len(heads), dtype=torch.bool)
                for i, j in over.nonzero().tolist():
                    if keep[i]:
                        keep[i] = False
                        self._bad(
                            f"{where[i]}: field {_FIELD_NAMES[1 + NUM_DENSE + j]}: id "
                            f"{int(ids[i, j])} >= table rows {self.rows[j]} "
                            "(set data.hash_categories = true to hash)"
                        )
                head, ids = head[keep], ids[keep]
                if head.shape[0] == 0:
                    return None
        b = head.shape[0]
        # negatives -> 0 then log(x + 1): the public DLRM pipeline's dense transform
        dense = torch.log1p(head[:, 1:].clamp(min=0).to(torch.float64)).float()
        # one id per feature per sample; feature-major layout = the transpose of [B, 26]
        values = ids.t().reshape(-1).contiguous()
        sparse = SparseFeatures(self.keys, values, torch.ones(NUM_SPARSE * b, dtype=torch.int64))
        return Batch(dense, sparse, head[:, 0].float())


def _decode_hex(text: str, n: int) -> np.ndarray:
    """[n, 26] int64 from n rows of 26 tab-separated 8-digit hex fields, concatenated."""
    chars = np.frombuffer(text.encode("ascii"), dtype=np.uint8).reshape(n, _CAT_WIDTH)
    padded = np.empty((n, NUM_SPARSE * 9), dtype=np.uint8)
    padded[:, :_CAT_WIDTH] = chars
    digits = _HEX_VALUE[padded.reshape(n, NUM_SPARSE, 9)[:, :, :8]]  # [n, 26, 8]
    weights = 16 ** np.arange(7, -1, -1, dtype=np.int64)
    return digits @ weights
