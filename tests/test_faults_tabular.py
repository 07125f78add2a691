"""Fault campaign "tabular": bad rows and schema mismatches of Parquet / CSV data are one clear
line each, naming the file, the row (CSV: its line) and the column -- through preprocessing and
through direct reading -- and configs that do not fit the data are refused before any work."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from faults import campaign, run_cli  # noqa: E402

from neorec.builder import data_source  # noqa: E402
from neorec.config import load_config  # noqa: E402
from neorec.data.example import example_columns, write_example  # noqa: E402
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular  # noqa: E402

TAB = campaign("tabular")
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "parquet_example.toml"
N = 30


def config(**data: Any) -> Any:
    c = load_config(CONFIG)
    c.data = dataclasses.replace(c.data, batch_size=10, workers=0, **data)
    return c


def write_csv(path: Path, cols: dict[str, list[Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(cols))
        for row in zip(*cols.values()):
            w.writerow(
                [
                    "" if v is None else "|".join(map(str, v)) if isinstance(v, list) else v
                    for v in row
                ]
            )


def put(col: str, i: int, v: Any) -> Callable[[dict[str, list[Any]]], None]:
    def f(cols: dict[str, list[Any]]) -> None:
        cols[col][i] = v

    return f


def drop(col: str) -> Callable[[dict[str, list[Any]]], None]:
    return lambda cols: cols.pop(col) and None


CSV_CASES: list[tuple[str, Callable[[dict[str, list[Any]]], None], tuple[str, ...]]] = [
    ("label 2", put("click", 4, 2), ("part-0.csv:6", "label column 'click' is 2")),
    ("label missing", put("click", 0, None), ("part-0.csv:2", "'click' is empty")),
    ("dense not a number", put("age", 7, "abc"), ("part-0.csv:9", "column 'age'", "not a number")),
    ("dense nan", put("price", 3, "nan"), ("part-0.csv:5", "'price'", "not a finite number")),
    ("id not an integer", put("user", 9, "12x"), ("part-0.csv:11", "'user'", "not an integer id")),
    ("id over 64 bits", put("user", 2, str(2**64)), ("part-0.csv:4", "'user'", "64 bits")),
    (
        "list id not an integer",
        put("tags", 5, ["3", "x"]),
        ("part-0.csv:7", "'tags'", "not an integer"),
    ),
    (
        "weights count",
        put("tag_w", 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]),
        ("part-0.csv:8", "'tag_w'", "weight(s) for the"),
    ),
    ("weight not a number", put("tag_w", 1, ["x"] * 0 + ["zz"]), ("part-0.csv:3", "'tag_w'")),
    ("column missing", drop("age"), ("part-0.csv", "no column(s) ['age']")),
]


def _pq_types() -> dict[str, Any]:
    return {
        "click": pa.int64(), "price": pa.float64(), "age": pa.float64(), "user": pa.int64(),
        "item": pa.string(), "tags": pa.list_(pa.int64()), "tag_w": pa.list_(pa.float32()),
        "query_tags": pa.list_(pa.int64()),
    }  # fmt: skip


PQ_CASES: list[
    tuple[str, Callable[[dict[str, list[Any]]], None], dict[str, Any], tuple[str, ...]]
] = [
    ("label null", put("click", 3, None), {}, ("part-0.parquet: row 4", "'click' is null")),
    ("dense nan", put("age", 5, float("nan")), {}, ("row 6", "'age'", "not a finite number")),
    ("null inside a list", put("tags", 8, [1, None]), {}, ("row 9", "'tags'", "null id")),
    ("weights length", put("tag_w", 2, [0.5] * 9), {}, ("row 3", "'tag_w'", "weight(s) for the")),
    (
        "id column of strings",
        lambda c: None,
        {"user": pa.string()},
        ("column 'user' is str", "want int"),
    ),
    ("dense column of strings", lambda c: None, {"age": pa.string()}, ("column 'age' is str",)),
    (
        "list column not a list",
        lambda c: None,
        {"tags": pa.int64()},
        ("column 'tags' is int", "list<int>"),
    ),
    ("column missing", drop("item"), {}, ("no column(s) ['item']",)),
    (
        "uint64 id over 63 bits",
        put("user", 1, 2**63 + 5),
        {"user": pa.uint64()},
        ("row 2", "64 bits"),
    ),
]


def _cols() -> dict[str, list[Any]]:
    cols = example_columns(N, 1)
    cols["user"] = [int(x) for x in cols["user"]]
    return cols


def _both(name: str, d: Path, match: tuple[str, ...]) -> None:
    """Preprocessing and direct reading refuse the data alike."""
    c = config()
    opts = TabularOptions(shard_rows=16, workers=1)
    TAB.expect_error(
        f"{name} (preprocess)",
        lambda: preprocess_tabular(
            [d], d.parent / f"{d.name}_out", c.data.schema, c.embedding.tables, opts
        ),
        match,
    )

    def direct() -> None:
        src = data_source(config(path=str(d)))
        for _ in src.train_batches():
            pass

    TAB.expect_error(f"{name} (direct)", direct, match)


@pytest.mark.parametrize("case", CSV_CASES, ids=[c[0] for c in CSV_CASES])
def test_csv_faults(tmp_path: Path, case: tuple) -> None:
    name, mutate, match = case
    d = tmp_path / "csv"
    write_example(d, "csv", 5, 10)  # part-1: a clean eval file
    cols = _cols()
    mutate(cols)
    write_csv(d / "part-0.csv", cols)
    _both(f"csv: {name}", d, match)
    TAB.check()


@pytest.mark.parametrize("case", PQ_CASES, ids=[c[0] for c in PQ_CASES])
def test_parquet_faults(tmp_path: Path, case: tuple) -> None:
    name, mutate, types, match = case
    d = tmp_path / "pq"
    write_example(d, "parquet", 5, 10)
    cols = _cols()
    mutate(cols)
    t = {**_pq_types(), **types}
    if types.get("user") == pa.string():
        cols["user"] = [str(x) for x in cols["user"]]
    if types.get("age") == pa.string():
        cols["age"] = [str(x) for x in cols["age"]]
    if types.get("tags") == pa.int64():
        cols["tags"] = [len(x) for x in cols["tags"]]
    pq.write_table(
        pa.table({k: pa.array(v, type=t[k]) for k, v in cols.items()}),
        d / "part-0.parquet",
        row_group_size=4,
    )
    _both(f"parquet: {name}", d, match)
    TAB.check()


def test_files_and_configs_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    write_example(d, "parquet", 40, 20)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "part-0.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "junk" / "part-1.parquet").write_bytes(b"nope")
    _both(
        "not a Parquet file", tmp_path / "junk", ("part-0.parquet", "not a readable Parquet file")
    )
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.csv").write_bytes(b"click,price\n1,\xff\xfe\n")
    (tmp_path / "bin" / "b.csv").write_bytes(b"click\n1\n")
    _both("CSV not UTF-8", tmp_path / "bin", ("a.csv", "not UTF-8"))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.csv").write_text("")
    (tmp_path / "e" / "b.csv").write_text("")
    _both("empty CSV", tmp_path / "e", ("a.csv", "empty file"))
    one = tmp_path / "one"
    one.mkdir()
    (d / "part-0.parquet").rename(one / "part-0.parquet")
    TAB.expect_error(
        "direct, one file, no eval_path",
        lambda: data_source(config(path=str(one))),
        ("no held-out split",),
    )
    # configs that do not fit the data or the model: refused before any work
    text = CONFIG.read_text()
    bad = {
        "feature read by no table": (
            text.replace('features = ["tags", "query_tags"]', 'features = ["tags"]'),
            "read by no table",
        ),
        "schema table disagrees": (
            text.replace('table = "user"', 'table = "item"'),
            ".table = 'item'",
        ),
        "num_dense mismatch": (
            text.replace("num_dense = 2", "num_dense = 3"),
            "model.num_dense is 3",
        ),
        "table feature not in the schema": (
            text.replace(
                'features = ["tags", "query_tags"]', 'features = ["tags", "query_tags", "extra"]'
            ),
            "['extra']",
        ),
        "unknown feature key": (
            text.replace('transform = "log1p"', 'transfrom = "log1p"'),
            "did you mean",
        ),
        "dense option on an id": (
            text.replace(
                'type = "id"\ntable = "user"', 'type = "id"\ntable = "user"\ntransform = "log1p"'
            ),
            "for dense features",
        ),
    }
    for name, (t, match) in bad.items():
        p = tmp_path / f"{name.replace(' ', '_')}.toml"
        p.write_text(t)
        TAB.expect_error(f"config: {name}", lambda p=p: load_config(p), match)
    # a preprocessed directory against another schema / another source
    c = config()
    preprocess_tabular(
        [d],
        tmp_path / "pre",
        c.data.schema,
        c.embedding.tables,
        TabularOptions(workers=1, eval_fraction=0.25),
    )
    other = tmp_path / "other.toml"
    other.write_text(text.replace("rows = 1000", "rows = 999"))
    o = load_config(other)
    o.data = dataclasses.replace(o.data, path=str(tmp_path / "pre"), workers=0, batch_size=10)
    TAB.expect_error(
        "preprocessed with other table rows", lambda: data_source(o), ("hashed modulo 1000", "999")
    )
    crit = config(path=str(tmp_path / "pre"))
    crit.data = dataclasses.replace(crit.data, source="criteo", schema=type(crit.data.schema)())
    TAB.expect_error(
        "tabular shards, criteo source", lambda: data_source(crit), ("data.source = 'tabular'",)
    )
    r = run_cli(
        [
            "data",
            "preprocess",
            "--config",
            str(CONFIG),
            "--input",
            str(one),
            "--output",
            str(tmp_path / "x"),
            "--rows",
            "5",
        ]
    )
    ok = r.returncode == 2 and "Traceback" not in r.stderr and "--rows" in r.stderr
    TAB.record(
        "CLI: Criteo flag with a tabular config", "clear error" if ok else "crash", r.stderr[-300:]
    )
    TAB.check()


def _batches(d: Path) -> list[Any]:
    return list(data_source(config(path=str(d))).train_batches())


def test_csv_with_a_byte_order_mark_reads_like_without(tmp_path: Path) -> None:
    """A UTF-8 byte-order mark (as spreadsheet programs write) is not part of the header."""
    plain, bom = tmp_path / "plain", tmp_path / "bom"
    write_example(plain, "csv", 20, 10)
    write_example(bom, "csv", 20, 10)
    for f in bom.iterdir():
        f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    want, got = _batches(plain), _batches(bom)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a.dense.equal(b.dense) and a.labels.equal(b.labels)
        assert a.sparse.values.equal(b.sparse.values)


def test_unterminated_quote_names_the_line_it_opens(tmp_path: Path) -> None:
    d = tmp_path / "csv"
    write_example(d, "csv", 5, 10)
    cols = _cols()
    write_csv(d / "part-0.csv", cols)
    lines = (d / "part-0.csv").read_text().splitlines(keepends=True)
    lines[6] = lines[6].replace(",", ',"x', 1)  # line 7: a quote that never ends
    (d / "part-0.csv").write_text("".join(lines))
    _both("csv: unterminated quote", d, ("part-0.csv:7", "unterminated quote"))
    TAB.check()
