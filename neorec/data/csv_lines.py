"""CSV / TSV text below the csv module: files opened as UTF-8 (a byte-order mark is not data),
lines read with a cap (a line longer than the cap is refused without being held), and the column
of an over-long field found by streaming the record (split from ``tabular.py``)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

from neorec.errors import DataError

__all__ = ["LINE_FIELDS", "LongLine", "open_text", "capped_lines", "long_field"]


def open_text(path: Path) -> io.TextIOWrapper:
    """UTF-8 text; a leading byte-order mark (as spreadsheet programs write) is not data."""
    try:
        return open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror})") from None


LINE_FIELDS = 64
"""A physical CSV line may hold ``LINE_FIELDS`` x ``max_field_bytes`` characters: a longer one is
refused without being held (the csv module reads whole lines)."""


class LongLine(Exception):
    """A line longer than the cap (``line``: its 1-based number)."""

    def __init__(self, line: int) -> None:
        self.line = line


def capped_lines(f: io.TextIOWrapper, cap: int) -> Iterator[str]:
    """The lines of ``f``; one longer than ``cap`` characters raises ``LongLine``."""
    n = 0
    while line := f.readline(cap + 1):
        n += 1
        if len(line) > cap and not line.endswith("\n"):
            raise LongLine(n)
        yield line


def long_field(path: Path, delimiter: str, line: int, limit: int) -> int | None:
    """The 0-based column of the first field longer than ``limit`` characters in the record that
    starts on ``line`` (streamed in pieces: never holds the field); None if none is found."""
    col = size = 0
    quoted = False
    with open_text(path) as f:
        for _ in range(line - 1):
            while True:  # skip a line without holding it
                piece = f.readline(1 << 16)
                if not piece or piece.endswith("\n"):
                    break
        while piece := f.read(1 << 16):
            for ch in piece:
                if ch == '"':
                    quoted = not quoted
                elif ch == delimiter and not quoted:
                    col, size = col + 1, 0
                    continue
                elif ch == "\n" and not quoted:
                    return None
                size += 1
                if size > limit:
                    return col
    return None
