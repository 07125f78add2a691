"""``neorec data movielens --sequential``: order, ties, splits, the on-disk format, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neorec.data.sequential import build_sequences, load_sequential, write_sequential
from neorec.errors import DataError


def _ml100k(d: Path, rows: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "u.data").write_text("".join(r + "\n" for r in rows))
    return d


def test_time_order_ties_keep_file_order(tmp_path: Path) -> None:
    rows = ["7\t30\t5\t200", "7\t10\t3\t100", "7\t20\t1\t200", "2\t20\t4\t50", "7\t40\t2\t300"]
    src = _ml100k(tmp_path / "in", rows)
    m = write_sequential(src, tmp_path / "out")
    s = load_sequential(tmp_path / "out")
    assert s.users.tolist() == [2, 7] and s.item_vocab.tolist() == [10, 20, 30, 40]
    # user 7: t=100 (10), t=200 (30 then 20: the file's order), t=300 (40)
    assert s.history(1).tolist() == [1, 3, 2, 4]
    assert s.timestamps[s.offsets[1] :].tolist() == [100, 200, 200, 300]
    assert s.history(0).tolist() == [2]
    assert m["users"] == 2 and m["items"] == 4 and m["evaluable_users"] == 1
    assert (
        json.loads((tmp_path / "out" / "manifest.json").read_text())["format"]
        == "neorec-sequential"
    )


def test_recbole_inter(tmp_path: Path) -> None:
    d = tmp_path / "rb"
    d.mkdir()
    (d / "x.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t5\t3\t10\n1\t6\t3\t5\n"
    )
    write_sequential(d, tmp_path / "o")
    assert load_sequential(tmp_path / "o").history(0).tolist() == [2, 1]


@pytest.mark.parametrize(
    ("row", "msg"),
    [
        ("1\tx\t3\t10", r"u\.data: row 2, column 2 \(item\): 'x' is not a number"),
        ("1\t2\t3", r"u\.data: row 2: no column 4 \(timestamp\)"),
        ("1\t2\t3\t-5", r"row 2, column 4 \(timestamp\): '-5' is not a whole"),
    ],
)
def test_bad_row_one_line(tmp_path: Path, row: str, msg: str) -> None:
    src = _ml100k(tmp_path / "in", ["1\t1\t3\t10", row])
    with pytest.raises(DataError, match=msg):
        write_sequential(src, tmp_path / "out")


def test_load_rejects_tampered_arrays(tmp_path: Path) -> None:
    write_sequential(_ml100k(tmp_path / "in", ["1\t1\t3\t10", "1\t2\t3\t20"]), tmp_path / "o")
    np.save(tmp_path / "o" / "timestamps.npy", np.array([20, 10]))
    with pytest.raises(DataError, match="earlier than the one before"):
        load_sequential(tmp_path / "o")
    np.save(tmp_path / "o" / "items.npy", np.array([1, 3]))
    with pytest.raises(DataError, match="outside 1..2"):
        load_sequential(tmp_path / "o")


def test_build_two_users_boundary_not_a_time_error() -> None:
    s = build_sequences(np.array([1, 2]), np.array([5, 5]), np.array([100, 1]))
    assert s.offsets.tolist() == [0, 1, 2] and s.items.tolist() == [1, 1]
