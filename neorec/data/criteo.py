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
- label: must be ``0`` or ``1``.

A malformed line raises :class:`CriteoFormatError` naming ``file:line`` and the field, or with
``bad_lines="skip"`` is counted in :attr:`CriteoTSVDataset.stats` (first few kept) and skipped.
Each categorical feature C<i> reads one table: the tables passed in, in order (26 tables, one
feature each). The last partial batch is kept (a smaller final Batch), so no line is lost in eval.
"""

from __future__ import annotations

import gzip
import io
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch

from neorec.config import TableConfig
from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.sparse import SparseFeatures

__all__ = ["CriteoFormatError", "CriteoStats", "CriteoTSVDataset", "parse_line", "criteo_files"]

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
EMPTY_CATEGORY_ROW = 0
_MAX_EXAMPLES = 5
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
# The fast path: a line in the exact public layout (categories empty or 8 hex digits) is checked by
# one C-level match and its 26 categories decoded for a whole batch at once with numpy. Other lines
# go through parse_line, which accepts any hex width (< 16 digits) or names the bad field.
_GOOD_LINE = re.compile(
    r"[01]" + r"\t(?:-?[0-9]+)?" * NUM_DENSE + r"\t(?:[0-9a-fA-F]{8})?" * NUM_SPARSE + r"\r?\n?"
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


def criteo_files(path: str | Path) -> list[Path]:
    """A file, or the sorted TSV/txt(.gz) files of a directory."""
    p = Path(path)
    if p.is_dir():
        pats = ("*.tsv", "*.txt", "*.tsv.gz", "*.txt.gz", "day_*")
        files = sorted({f for pat in pats for f in p.glob(pat) if f.is_file()})
        if not files:
            raise FileNotFoundError(f"no Criteo TSV files in directory {p}")
        return files
    if not p.exists():
        raise FileNotFoundError(f"Criteo file not found: {p}")
    return [p]


def parse_line(
    line: str, rows: Sequence[int], hash_categories: bool = True
) -> tuple[int, list[float], list[int]]:
    """(label, 13 dense values after log(x+1), 26 row ids) of one line; raises ValueError naming
    the field (the caller adds file:line)."""
    parts = line.rstrip("\r\n").split("\t")
    if len(parts) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(parts)}")
    lab = parts[0]
    if lab != "0" and lab != "1":
        raise ValueError(f"field label: {lab!r} is not 0 or 1")
    dense = []
    for i in range(1, 1 + NUM_DENSE):
        s = parts[i]
        if not s:
            dense.append(0.0)
            continue
        try:
            x = int(s)
        except ValueError:
            x = None
        if x is None or not s.lstrip("-").isdigit():  # int() also takes " 5", "1_0", "+5"
            raise ValueError(f"field {_FIELD_NAMES[i]}: {s!r} is not an integer")
        dense.append(math.log1p(x) if x > 0 else 0.0)
    ids = []
    for j in range(NUM_SPARSE):
        s = parts[1 + NUM_DENSE + j]
        if not s:
            ids.append(EMPTY_CATEGORY_ROW)
            continue
        # int(s, 16) alone would also take "0x1f", " 1f", "-1f", "1_f": hex ids never look so
        if not _HEX_DIGITS.issuperset(s):
            raise ValueError(f"field {_FIELD_NAMES[1 + NUM_DENSE + j]}: {s!r} is not hex")
        v = int(s, 16)
        if hash_categories:
            v %= rows[j]
        elif v >= rows[j]:
            raise ValueError(
                f"field {_FIELD_NAMES[1 + NUM_DENSE + j]}: id {v} >= table rows {rows[j]} "
                "(set data.hash_categories = true to hash)"
            )
        ids.append(v)
    return int(lab), dense, ids


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


class CriteoTSVDataset:
    """Iterates Batches over Criteo TSV files (plain or .gz), in file and line order."""

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tables: list[TableConfig],
        batch_size: int,
        bad_lines: str = "fail",
        hash_categories: bool = True,
    ) -> None:
        if isinstance(paths, (str, Path)):
            self.paths = criteo_files(paths)
        else:
            self.paths = [p for x in paths for p in criteo_files(x)]
        if len(tables) != NUM_SPARSE:
            raise ValueError(f"Criteo needs {NUM_SPARSE} tables (C1..C26), got {len(tables)}")
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
        self.stats = CriteoStats()

    def __iter__(self) -> Iterator[Batch]:
        """Batches of ``batch_size`` lines; the last one may be smaller. Resets ``stats``."""
        self.stats = CriteoStats()
        heads: list[list[int]] = []  # label + 13 dense ints per sample
        cats: list[str] = []  # the 26 categories as fixed-width text (fast path) ...
        slow: dict[int, list[int]] = {}  # ... or already parsed (other hex widths)
        where: list[str] = []  # "file:line" of each sample, for errors found per batch
        for path in self.paths:
            with _open(path) as fh:
                for lineno, line in enumerate(fh, 1):
                    self.stats.lines += 1
                    text = line.rstrip("\r\n")
                    if _GOOD_LINE.fullmatch(line) is not None:
                        fields = text.split("\t", 1 + NUM_DENSE)
                        heads.append([int(x) if x else 0 for x in fields[: 1 + NUM_DENSE]])
                        cats.append(_EMPTY_CAT.sub("00000000", fields[-1]))
                    else:
                        parsed = self._slow_line(text, path, lineno)
                        if parsed is None:
                            continue
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

    def _slow_line(self, text: str, path: Path, lineno: int) -> tuple[list[int], list[int]] | None:
        """(label + dense ints, 26 raw category values) of a line off the fast path, or None if
        it is bad (skip mode; fail mode raises)."""
        try:
            parse_line(text, [1 << 62] * NUM_SPARSE, hash_categories=True)  # validate only
        except ValueError as e:
            self._bad(f"{path.name}:{lineno}: {e}")
            return None
        fields = text.split("\t")
        head = [int(x) if x else 0 for x in fields[: 1 + NUM_DENSE]]
        raw = [int(x, 16) if x else EMPTY_CATEGORY_ROW for x in fields[1 + NUM_DENSE :]]
        if max(raw) >= 1 << 62:
            self._bad(f"{path.name}:{lineno}: a category has more than 15 hex digits")
            return None
        return head, raw

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
        table_rows = torch.tensor(self.rows, dtype=torch.int64)
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
