"""MovieLens as sequences: each user's time-ordered history with leave-one-out splits.

``neorec data movielens --sequential`` reads the ratings of a GroupLens folder (ML-100K ``u.data``,
ML-1M ``ratings.dat``, ML-20M / 25M ``ratings.csv``) or RecBole's atomic ``*.inter`` and writes,
for every user, the items rated in time order (every rating is an interaction, whatever its
value; ties in time keep the file's order). The splits are leave-one-out and implicit in the
sequences: a user's last interaction is the test target, the one before it the validation
target, the rest is train; a user with fewer than 3 interactions is train only.

On disk (format ``neorec-sequential`` version 1; docs/data.md):

- ``items.npy``      int64 ``[N]``: item indices 1..V (0 is the padding index, never written),
  user after user, each user's in time order
- ``timestamps.npy`` int64 ``[N]``: the interactions' times (seconds), non-decreasing per user
- ``offsets.npy``    int64 ``[U + 1]``: user ``u``'s interactions are ``[offsets[u], offsets[u+1])``
- ``users.npy``      int64 ``[U]``: the raw user id of each user (ascending)
- ``item_vocab.npy`` int64 ``[V]``: the raw item id of item index ``i`` at ``i - 1`` (ascending)
- ``manifest.json``: format, version, counts, the split rule, the source's layout and SHA-256
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neorec.errors import DataError

__all__ = ["SeqData", "read_interactions", "build_sequences", "write_sequential", "load_sequential"]

FORMAT, VERSION = "neorec-sequential", 1
SPLIT_RULE = (
    "leave-one-out per user: last interaction = test target, the one before = validation "
    "target, the rest train; users with < 3 interactions are train only; ties in time keep "
    "the file's order"
)
_ARRAYS = ("items", "timestamps", "offsets", "users", "item_vocab")


@dataclass(frozen=True)
class SeqData:
    """Users' histories: ``items`` / ``timestamps`` cut by ``offsets`` (see the module doc)."""

    items: np.ndarray
    timestamps: np.ndarray
    offsets: np.ndarray
    users: np.ndarray
    item_vocab: np.ndarray

    @property
    def num_items(self) -> int:
        """V: item indices run 1..V."""
        return len(self.item_vocab)

    def history(self, u: int) -> np.ndarray:
        """User ``u``'s item indices in time order."""
        return self.items[self.offsets[u] : self.offsets[u + 1]]

    def lengths(self) -> np.ndarray:
        """Interactions per user."""
        return np.diff(self.offsets)


def _ratings_file(d: Path) -> tuple[Path, str, bool, tuple[int, int, int]]:
    """(file, separator, header, columns of user, item, timestamp) of a MovieLens folder."""
    for name, sep, header, cols in (
        ("u.data", "\t", False, (0, 1, 3)),
        ("ratings.dat", "::", False, (0, 1, 3)),
        ("ratings.csv", ",", True, (0, 1, 3)),
    ):
        if (d / name).is_file():
            return d / name, sep, header, cols
    inter = sorted(d.glob("*.inter"))
    if inter:
        head = inter[0].read_text(encoding="utf-8").split("\n", 1)[0].split("\t")
        names = [h.split(":")[0] for h in head]
        try:
            cols = (names.index("user_id"), names.index("item_id"), names.index("timestamp"))
        except ValueError:
            raise DataError(
                f"{inter[0]}: row 1: the header needs user_id, item_id and timestamp columns, "
                f"has {', '.join(names)}"
            ) from None
        return inter[0], "\t", True, cols
    raise DataError(
        f"{d}: not a MovieLens directory (want u.data, ratings.dat, ratings.csv or RecBole's *.inter)"
    )


def _rows(path: Path, sep: str) -> list[list[str]]:
    if sep == ",":
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.reader(f))
    return [ln.split(sep) for ln in path.read_bytes().decode("latin-1").splitlines()]


def read_interactions(d: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, Path]:
    """(raw user ids, raw item ids, timestamps) in file order, and the file read; a bad row is one
    :class:`DataError` naming the file, the row (1-based, header included) and the column."""
    d = Path(d)
    if not d.is_dir():
        raise DataError(f"{d}: no such directory (the MovieLens input)")
    path, sep, header, cols = _ratings_file(d)
    rows = _rows(path, sep)
    names = ("user", "item", "timestamp")
    out = np.empty((len(rows), 3), np.int64)
    n = 0
    for i, r in enumerate(rows):
        if (header and i == 0) or not "".join(r).strip():
            continue
        for j, (c, name) in enumerate(zip(cols, names)):
            if c >= len(r):
                raise DataError(
                    f"{path}: row {i + 1}: no column {c + 1} ({name}); {len(r)} columns"
                )
            try:
                x = float(r[c]) if j == 2 else int(r[c])
            except ValueError:
                raise DataError(
                    f"{path}: row {i + 1}, column {c + 1} ({name}): {r[c]!r} is not a number"
                ) from None
            if j == 2 and (x != x or x < 0 or x != int(x)):
                raise DataError(
                    f"{path}: row {i + 1}, column {c + 1} ({name}): {r[c]!r} is not a whole "
                    "non-negative number of seconds"
                )
            out[n, j] = int(x)
        n += 1
    if n == 0:
        raise DataError(f"{path}: no interactions")
    return out[:n, 0], out[:n, 1], out[:n, 2], path


def build_sequences(users: np.ndarray, items: np.ndarray, ts: np.ndarray) -> SeqData:
    """The histories of raw (user, item, time) triples in file order: users ascending by raw id,
    each user's interactions by time (a stable sort: ties keep the file's order), item indices
    1..V by ascending raw id."""
    order = np.lexsort((ts, users))  # lexsort is stable: equal (user, time) keep file order
    u, it, t = users[order], items[order], ts[order]
    vocab, idx = np.unique(it, return_inverse=True)
    uniq, counts = np.unique(u, return_counts=True)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return SeqData(
        (idx + 1).astype(np.int64), t.astype(np.int64), offsets, uniq.astype(np.int64),
        vocab.astype(np.int64),
    )  # fmt: skip


def write_sequential(inp: str | Path, out: str | Path, stdout: Any = None) -> dict[str, Any]:
    """Read a MovieLens folder, write its sequences into ``out``; the manifest."""
    users, items, ts, path = read_interactions(inp)
    s = build_sequences(users, items, ts)
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    for name in _ARRAYS:
        np.save(o / f"{name}.npy", getattr(s, name))
    lens = s.lengths()
    m = {
        "format": FORMAT,
        "version": VERSION,
        "source": path.name,
        "source_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "users": len(s.users),
        "items": s.num_items,
        "interactions": len(s.items),
        "evaluable_users": int((lens >= 3).sum()),
        "padding_index": 0,
        "split": SPLIT_RULE,
        "arrays": {n: f"{n}.npy" for n in _ARRAYS},
    }
    (o / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    if stdout is not None:
        print(f"{path}: {len(s.items):,} interactions, {len(s.users):,} users "
              f"({m['evaluable_users']:,} with valid + test targets), {s.num_items:,} items "
              f"-> {o}", file=stdout, flush=True)  # fmt: skip
    return m


def load_sequential(d: str | Path) -> SeqData:
    """Read a folder :func:`write_sequential` wrote, checked (one line naming what is wrong)."""
    d = Path(d)
    mf = d / "manifest.json"
    if not mf.is_file():
        raise DataError(f"{d}: no manifest.json (write it with neorec data movielens --sequential)")
    m = json.loads(mf.read_text())
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DataError(
            f"{mf}: format {m.get('format')!r} v{m.get('version')}, want {FORMAT} v{VERSION}"
        )
    arr = {}
    for n in _ARRAYS:
        p = d / f"{n}.npy"
        if not p.is_file():
            raise DataError(f"{p}: missing")
        arr[n] = np.load(p)
    s = SeqData(**arr)
    _check(s, d)
    return s


def _check(s: SeqData, d: Path) -> None:
    o, n = s.offsets, len(s.items)
    if len(o) != len(s.users) + 1 or o[0] != 0 or o[-1] != n or (np.diff(o) < 0).any():
        raise DataError(f"{d}/offsets.npy: not {len(s.users) + 1} non-decreasing offsets 0..{n}")
    if len(s.timestamps) != n:
        raise DataError(f"{d}/timestamps.npy: {len(s.timestamps)} values, items.npy has {n}")
    bad = np.flatnonzero((s.items < 1) | (s.items > s.num_items))
    if len(bad):
        raise DataError(
            f"{d}/items.npy: index {bad[0]} holds {s.items[bad[0]]}, outside 1..{s.num_items}"
        )
    same_user = np.ones(max(n - 1, 0), bool)
    same_user[o[1:-1][(o[1:-1] > 0) & (o[1:-1] < n)] - 1] = False
    down = np.flatnonzero(same_user & (np.diff(s.timestamps) < 0))
    if len(down):
        raise DataError(f"{d}/timestamps.npy: index {down[0] + 1} is earlier than the one before "
                        "within one user's history")  # fmt: skip
