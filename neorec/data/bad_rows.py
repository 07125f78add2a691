"""The bad-row policy of tabular files (``data.bad_rows``, ``data.max_bad_fraction``).

``fail`` (the default): the first bad row is one ``DataError`` naming its file, line or row and
column. ``skip``: a block of rows that fails is cut in halves until each bad row stands alone (a
block without bad rows is built once, as before; k bad rows cost about log2(k) + 2 more builds of
the block); every bad row is left out, counted per file and recorded (file, line or row, column,
reason) up to ``MAX_RECORDS`` records; a file whose bad rows exceed ``max_bad_fraction`` of its
rows is one ``DataError`` with the count and the file, once the file is read.

Which rows are bad depends on the files alone, so every pass over them skips the same rows: the
count is derived, not accumulated (a resumed run counts and records them once, like the first).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from neorec.errors import DataError

__all__ = ["BadRowPolicy", "BadRows", "MAX_RECORDS", "RECORDS_FILE"]

MAX_RECORDS = 10_000
"""Skipped rows recorded one by one (the count goes on beyond)."""
RECORDS_FILE = "bad_rows.jsonl"

B = TypeVar("B")
_COLUMN = re.compile(r"(?:label )?column '([^']*)'")


@dataclass(frozen=True)
class BadRowPolicy:
    """What a reader does with a bad row: ``fail`` or ``skip`` (at most ``max_fraction`` of a
    file's rows)."""

    mode: str = "fail"
    max_fraction: float = 0.01

    @property
    def skip(self) -> bool:
        """Bad rows are left out (else the first one is an error)."""
        return self.mode == "skip"


@dataclass
class BadRows:
    """The bad rows of one pass over files: count per file, the first ``MAX_RECORDS`` records."""

    policy: BadRowPolicy = field(default_factory=BadRowPolicy)
    rows: dict[str, int] = field(default_factory=dict)  # rows read per file (bad ones included)
    skipped: dict[str, int] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Rows skipped in all files."""
        return sum(self.skipped.values())

    def read(self, path: Path, n: int) -> None:
        """``n`` more rows of ``path`` were read (bad ones included)."""
        self.rows[path.name] = self.rows.get(path.name, 0) + n

    def skip(self, path: Path, where: dict[str, int], error: str) -> None:
        """One bad row of ``path`` at ``where`` (``{"line": n}`` or ``{"row": n}``): its error
        message becomes the record's column and reason."""
        self.skipped[path.name] = self.skipped.get(path.name, 0) + 1
        if len(self.records) >= MAX_RECORDS:
            return
        col = _COLUMN.search(error)
        reason = error.split(": ", 1)[1] if ": " in error else error
        if where.get("row") is not None and reason.startswith("row "):
            reason = reason.split(": ", 1)[1] if ": " in reason else reason
        self.records.append(
            {
                "file": str(path),
                **where,
                "column": col.group(1) if col else None,
                "reason": reason,
            }
        )

    def good_rows(
        self, build: Callable[[list[int]], B], n: int, path: Path, locate: Callable[[int], dict]
    ) -> B | None:
        """``build`` over the rows of a block of ``n`` that do not fail it (each failing row
        skipped at ``locate(row)``); None when none is left. Counts the ``n`` rows read."""
        self.read(path, n)
        rows = list(range(n))
        try:
            return build(rows)
        except DataError:
            if not self.policy.skip:
                raise
        good = self._bisect(build, rows, path, locate)
        return build(good) if good else None

    def _bisect(
        self, build: Callable[[list[int]], Any], rows: list[int], path: Path, locate: Any
    ) -> list[int]:
        try:
            build(rows)
            return rows
        except DataError as e:
            if len(rows) == 1:
                self.skip(path, locate(rows[0]), str(e))
                return []
        mid = len(rows) // 2
        return self._bisect(build, rows[:mid], path, locate) + self._bisect(
            build, rows[mid:], path, locate
        )

    def end_file(self, path: Path) -> None:
        """After the last row of ``path``: its bad rows within ``max_fraction``, else one line."""
        k, n = self.skipped.get(path.name, 0), self.rows.get(path.name, 0)
        mine = [i for i, r in enumerate(self.records) if r["file"] == str(path)]
        if mine:  # (in file order: a CSV record of the wrong length is seen before its block)
            lo = mine[0]
            self.records[lo:] = sorted(
                self.records[lo:], key=lambda r: int(r.get("line", r.get("row", 0)))
            )
        if k and k > self.policy.max_fraction * n:
            first = next((r for r in self.records if r["file"] == str(path)), None)
            at = ""
            if first is not None:
                loc = f"line {first['line']}" if "line" in first else f"row {first['row']}"
                at = f"; the first at {loc}: {first['reason']}"
            raise DataError(
                f"{path}: {k:,} of {n:,} rows are bad ({k / max(n, 1):.2%}), over "
                f"data.max_bad_fraction ({self.policy.max_fraction:g}){at}"
            )

    def summary(self) -> dict[str, Any]:
        """``{"skipped", "rows", "files": {name: skipped}, "recorded"}`` (for events and the
        run's summary)."""
        return {
            "skipped": self.total,
            "rows": sum(self.rows.values()),
            "files": {k: v for k, v in self.skipped.items() if v},
            "recorded": len(self.records),
        }

    def write(self, folder: Path) -> Path:
        """The records as ``folder/bad_rows.jsonl`` (written whole, then renamed: a rerun or a
        resumed run replaces it with the same lines)."""
        out = folder / RECORDS_FILE
        tmp = out.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            for r in self.records:
                fh.write(json.dumps(r) + "\n")
        tmp.replace(out)
        return out
