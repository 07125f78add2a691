"""Vectorised parsing of whole-line blocks of Criteo TSV bytes (what preprocessing workers run).

A line in the public layout (label, 13 ASCII decimal integers of at most 18 digits, 26 hex fields of
at most 15 digits, any but the label empty) is parsed with numpy over the whole block; every other
line goes through :func:`neorec.data.criteo.parse_text`, which parses it exactly or names its bad
field, so both paths accept the same lines as :class:`~neorec.data.criteo.CriteoTSVDataset`.
Lines end at ``\n``; one ``\r`` before it is dropped, any other ``\r`` is a byte of a field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neorec.data.criteo import (
    _HEX_VALUE,
    NUM_DENSE,
    NUM_FIELDS,
    NUM_SPARSE,
    decode_text,
    parse_text,
)

__all__ = ["ParsedBlock", "parse_block", "dense_transform", "empty_block"]

_DENSE_DIGITS = 18  # < 2**63; longer fields go the slow (exact Python int) path
_HEX_DIGITS = 15  # the raw value must stay < 2**60, as parse_text requires


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
            text = decode_text(raw)
            parse_text(text, [1 << 62] * NUM_SPARSE, hash_categories=True)  # validate only
            parts = text.split("\t")
            head = [int(x) if x else 0 for x in parts[: 1 + NUM_DENSE]]
            cats = [int(x, 16) if x else -1 for x in parts[1 + NUM_DENSE :]]
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


def empty_block() -> ParsedBlock:
    """A block of no lines."""
    z = np.zeros(0, dtype=np.int64)
    return ParsedBlock(z.astype(np.uint8), z.reshape(0, NUM_DENSE), z.reshape(0, NUM_SPARSE), 0, [])
