"""Criteo TSV parsing: exact values, empty fields, .gz, malformed lines (fail and skip)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch

from neorec.config import TableConfig
from neorec.data.criteo import CriteoFormatError, CriteoTSVDataset

ROWS = [1000 + 7 * i for i in range(26)]
TABLES = [TableConfig(name=f"C{i + 1}", rows=r, dim=4) for i, r in enumerate(ROWS)]


def _line(label="1", dense=None, cats=None) -> str:
    dense = dense if dense is not None else [str(i) for i in range(13)]
    cats = cats if cats is not None else [f"{(i + 1) * 0x1000F:08x}" for i in range(26)]
    return "\t".join([label, *dense, *cats]) + "\n"


GOOD = [
    _line(),
    # empty and negative dense, empty categories, upper-case hex
    _line("0", ["", "-3", "7"] + [""] * 10, [""] + ["DEADBEEF"] + [""] * 24),
    _line("1", [str(10**6)] * 13, ["ffffffff"] * 26),
]


def _write(path: Path, lines: list[str]) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.writelines(lines)
    else:
        path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("name", ["day_0.tsv", "day_0.tsv.gz"])
def test_values_equal_hand_computation(tmp_path: Path, name: str) -> None:
    p = _write(tmp_path / name, GOOD)
    batches = list(CriteoTSVDataset(p, TABLES, batch_size=2))
    assert [b.size for b in batches] == [2, 1]  # last partial batch kept
    b0, b1 = batches
    assert b0.labels.tolist() == [1.0, 0.0] and b1.labels.tolist() == [1.0]
    want0 = [math.log(i + 1) for i in range(13)]
    assert torch.allclose(b0.dense[0], torch.tensor(want0))
    want1 = [0.0, 0.0, math.log(8)] + [0.0] * 10  # empty -> 0, -3 -> 0
    assert torch.allclose(b0.dense[1], torch.tensor(want1))
    assert torch.allclose(b1.dense[0], torch.full((13,), math.log(10**6 + 1)))
    sp = b0.sparse
    assert sp.keys == [f"C{i + 1}" for i in range(26)]
    assert sp.lengths.tolist() == [1] * 52
    for j in range(26):
        v, _, _ = sp.feature(f"C{j + 1}")
        assert v.tolist()[0] == ((j + 1) * 0x1000F) % ROWS[j]
        second = 0xDEADBEEF % ROWS[1] if j == 1 else 0  # empty category -> row 0
        assert v.tolist()[1] == second
        v1, _, _ = b1.sparse.feature(f"C{j + 1}")
        assert v1.tolist() == [0xFFFFFFFF % ROWS[j]]
    b0.sparse.validate({t.name: t.rows for t in TABLES})


def test_other_hex_widths_take_the_slow_path(tmp_path: Path) -> None:
    cats = ["1f", "0123456789abc"] + [f"{i:08x}" for i in range(24)]
    p = _write(tmp_path / "w.tsv", [_line(cats=cats)])
    (b,) = list(CriteoTSVDataset(p, TABLES, batch_size=4))
    assert b.sparse.feature("C1")[0].tolist() == [0x1F % ROWS[0]]
    assert b.sparse.feature("C2")[0].tolist() == [0x0123456789ABC % ROWS[1]]


BAD = [
    ("wrong count", "\t".join(["1"] * 39) + "\n", "expected 40"),
    (
        "bad hex",
        _line(cats=["00000001", "00000002", "zz12"] + ["0"] * 23),
        "field C3: 'zz12' is not hex",
    ),
    ("hex prefix", _line(cats=["0x12"] + ["0"] * 25), "field C1: '0x12' is not hex"),
    ("bad dense", _line(dense=["1.5"] + ["0"] * 12), "field I1: '1.5' is not an integer"),
    ("spaced dense", _line(dense=["0"] * 4 + [" 3"] + ["0"] * 8), "field I5"),
    ("bad label", _line(label="2"), "field label: '2' is not 0 or 1"),
    ("empty label", _line(label=""), "field label"),
]


@pytest.mark.parametrize("kind,line,msg", BAD, ids=[b[0] for b in BAD])
def test_malformed_line_names_file_line_field(
    tmp_path: Path, kind: str, line: str, msg: str
) -> None:
    p = _write(tmp_path / "day_0.tsv", [GOOD[0], GOOD[1], line, GOOD[2]])
    with pytest.raises(CriteoFormatError) as e:
        list(CriteoTSVDataset(p, TABLES, batch_size=8))
    assert str(e.value).startswith("day_0.tsv:3: ")
    assert msg in str(e.value)


def test_skip_mode_counts_and_keeps_examples(tmp_path: Path) -> None:
    lines = [GOOD[0]] + [b[1] for b in BAD] + [GOOD[1]]
    p = _write(tmp_path / "day_1.tsv.gz", lines)
    ds = CriteoTSVDataset(p, TABLES, batch_size=8, bad_lines="skip")
    batches = list(ds)
    assert sum(b.size for b in batches) == 2
    assert ds.stats.lines == len(lines) and ds.stats.bad_lines == len(BAD)
    assert len(ds.stats.examples) == 5 and ds.stats.examples[0].startswith("day_1.tsv.gz:2: ")


def test_unhashed_ids_must_fit_table(tmp_path: Path) -> None:
    p = _write(tmp_path / "d.tsv", [_line(cats=["000003e7"] + ["00000001"] * 25), GOOD[0]])
    ok = next(iter(CriteoTSVDataset(p, TABLES, 1, hash_categories=False)))
    assert ok.sparse.feature("C1")[0].tolist() == [999]
    with pytest.raises(CriteoFormatError, match=r"d.tsv:2: field C1: id 65551 >= table rows 1000"):
        list(CriteoTSVDataset(p, TABLES, 8, hash_categories=False))


def test_directory_of_files_in_order(tmp_path: Path) -> None:
    _write(tmp_path / "day_0.tsv", [GOOD[0]])
    _write(tmp_path / "day_1.tsv.gz", [GOOD[1], GOOD[2]])
    ds = CriteoTSVDataset(tmp_path, TABLES, batch_size=2)
    assert [b.labels.tolist() for b in ds] == [[1.0, 0.0], [1.0]]
    assert ds.stats.lines == 3


def test_lone_cr_is_one_bad_line_and_keeps_line_numbers(tmp_path: Path) -> None:
    bad_cr = GOOD[0].replace("\t", "\t1\r2", 1)  # a lone CR inside field I1
    bad_digit = _line(dense=["\u0663"] + ["0"] * 12)  # an Arabic-Indic 3 is not an integer
    p = _write(tmp_path / "d.tsv", [GOOD[0], bad_cr, GOOD[1], bad_digit, GOOD[2]])
    ds = CriteoTSVDataset(p, TABLES, batch_size=8, bad_lines="skip")
    assert sum(b.size for b in ds) == 3 and ds.stats.lines == 5 and ds.stats.bad_lines == 2
    assert [m.split(": ")[0] for m in ds.stats.examples] == ["d.tsv:2", "d.tsv:4"]
    with pytest.raises(CriteoFormatError, match=r"^d\.tsv:2: field I1"):
        list(CriteoTSVDataset(p, TABLES, batch_size=8))


def test_64_bit_limits_and_crlf(tmp_path: Path) -> None:
    big = _line(dense=["9223372036854775807"] + ["0"] * 12).replace("\n", "\r\n")
    over = _line(dense=["1" * 24] + ["0"] * 12)
    p = _write(tmp_path / "d.tsv", [big, over])
    with pytest.raises(CriteoFormatError, match=r"d\.tsv:2: field I1: .* does not fit in 64 bits"):
        list(CriteoTSVDataset(p, TABLES, batch_size=8))
    (b,) = list(CriteoTSVDataset(p, TABLES, batch_size=8, bad_lines="skip"))
    assert b.size == 1 and math.isclose(float(b.dense[0, 0]), math.log1p(2**63 - 1), rel_tol=1e-6)


def test_missing_paths_are_data_errors(tmp_path: Path) -> None:
    from neorec.errors import DataError

    with pytest.raises(DataError, match="absent.tsv: no such file"):
        CriteoTSVDataset(tmp_path / "absent.tsv", TABLES, 4)
    with pytest.raises(DataError, match="no Criteo TSV files"):
        CriteoTSVDataset(tmp_path, TABLES, 4)
