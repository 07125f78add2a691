"""The bad-row policy of tabular files (issue 52, item 5): ``data.bad_rows = "fail"`` names the
first bad row; ``"skip"`` reads what the same files without their bad rows give (the
specification: the clean files), counts and lists the skipped rows (file, line or row, column,
reason), refuses a file over ``data.max_bad_fraction``, and a resumed run counts them once."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from neorec.config import load_config  # noqa: E402
from neorec.data.bad_rows import MAX_RECORDS, BadRowPolicy, BadRows  # noqa: E402
from neorec.data.example import write_example  # noqa: E402
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular  # noqa: E402
from neorec.data.tabular_source import TabularSource  # noqa: E402
from neorec.errors import ConfigError, DataError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "parquet_example.toml"
N_TRAIN, N_EVAL = 300, 100
# CSV line (1-based, header = line 1) -> how the row is broken
CSV_BAD = {
    2: ("click", ""),  # the first row: a missing label
    5: ("click", "x"),  # a label that is not a number
    9: ("price", "abc"),  # a dense value that is not a number
    13: (None, None),  # a field missing
    20: ("user", "1.5"),  # not an integer id
}
PARQUET_BAD = {4: ("click", None), 10: ("price", float("inf")), 17: ("click", 3)}  # 1-based rows


def cfg(path: Path | str, **data: object) -> Any:
    c = load_config(CONFIG)
    c.data = dataclasses.replace(c.data, path=str(path), batch_size=50, workers=0, **data)
    return c


def _csv(src: Path, dst: Path, keep_bad: bool) -> None:
    """``src``'s CSV files, with ``CSV_BAD``'s lines broken in part-0 (or left out)."""
    dst.mkdir(parents=True)
    for f in sorted(src.glob("*.csv")):
        lines = f.read_text().splitlines()
        if f.name == "part-0.csv":
            header = lines[0].split(",")
            out = []
            for n, line in enumerate(lines, 1):
                if n not in CSV_BAD:
                    out.append(line)
                elif keep_bad:
                    col, value = CSV_BAD[n]
                    fields = line.split(",")
                    if col is None:
                        fields = fields[:-1]
                    else:
                        fields[header.index(col)] = str(value)
                    out.append(",".join(fields))
            lines = out
        (dst / f.name).write_text("\n".join(lines) + "\n")


def _parquet(src: Path, dst: Path, keep_bad: bool) -> None:
    """``src``'s Parquet files, with ``PARQUET_BAD``'s rows broken in part-0 (or left out)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dst.mkdir(parents=True)
    for f in sorted(src.glob("*.parquet")):
        t = pq.read_table(f)
        if f.name == "part-0.parquet":
            cols = {n: t.column(n).to_pylist() for n in t.column_names}
            for row, (col, value) in PARQUET_BAD.items():
                cols[col][row - 1] = value
            keep = [i for i in range(t.num_rows) if keep_bad or i + 1 not in PARQUET_BAD]
            cols = {n: [v[i] for i in keep] for n, v in cols.items()}
            t = pa.table({n: pa.array(v, type=t.schema.field(n).type) for n, v in cols.items()})
        pq.write_table(t, dst / f.name, row_group_size=64)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    out = {}
    for fmt, make in (("csv", _csv), ("parquet", _parquet)):
        write_example(d / f"{fmt}_src", fmt, N_TRAIN, N_EVAL, seed=3, row_group=64)
        make(d / f"{fmt}_src", d / fmt, True)
        make(d / f"{fmt}_src", d / f"{fmt}_clean", False)
        out[fmt], out[f"{fmt}_clean"] = d / fmt, d / f"{fmt}_clean"
    return out


def _batches(src: TabularSource) -> list[Any]:
    return [
        (b.labels.tolist(), b.dense.tolist(), b.sparse.values.tolist(), b.sparse.lengths.tolist())
        for b in src.train_batches()
    ]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_fail_names_a_bad_row(data: dict[str, Path], fmt: str) -> None:
    """The default (``fail``, today's behaviour): one line naming the file, line or row, column."""
    where = (
        "part-0.csv:2: column 'click'" if fmt == "csv" else "part-0.parquet: row 4: column 'click'"
    )
    with pytest.raises(DataError, match=where):
        TabularSource(cfg(data[fmt]).data, cfg(data[fmt]).embedding.tables)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_skip_reads_the_files_without_their_bad_rows(data: dict[str, Path], fmt: str) -> None:
    c = cfg(data[fmt], bad_rows="skip", max_bad_fraction=0.05)
    got = TabularSource(c.data, c.embedding.tables)
    want = TabularSource(cfg(data[f"{fmt}_clean"]).data, c.embedding.tables)
    assert got.counts == want.counts and got.counts["train"] == N_TRAIN - len(
        CSV_BAD if fmt == "csv" else PARQUET_BAD
    )
    assert got.num_train_batches() == want.num_train_batches()
    assert _batches(got) == _batches(want)  # (twice: every pass skips the same rows)
    assert _batches(got) == _batches(want)
    assert got.bad_rows is not None
    recs = got.bad_rows.records
    if fmt == "csv":
        assert [(r["line"], r["column"]) for r in recs] == [(n, c) for n, (c, _) in CSV_BAD.items()]
        assert recs[3]["reason"] == "7 fields, the header has 8"
        assert "'x' is not a number" in recs[1]["reason"]
        assert recs[0]["reason"] == "column 'click' is empty"
    else:
        assert [(r["row"], r["column"]) for r in recs] == [
            (n, c) for n, (c, _) in PARQUET_BAD.items()
        ]
        assert "is null" in recs[0]["reason"] and "not 0 or 1" in recs[2]["reason"]
    assert all(r["file"] == str(data[fmt] / f"part-0.{fmt}") for r in recs)
    assert got.bad_rows.summary()["skipped"] == len(recs)


def test_max_bad_fraction_is_one_line_with_the_count_and_file(data: dict[str, Path]) -> None:
    c = cfg(data["csv"], bad_rows="skip", max_bad_fraction=0.01)
    with pytest.raises(DataError) as e:
        TabularSource(c.data, c.embedding.tables)
    msg = str(e.value)
    assert "\n" not in msg and "part-0.csv: 5 of 300 rows are bad (1.67%)" in msg
    assert "data.max_bad_fraction (0.01)" in msg and "the first at line 2" in msg
    c = cfg(data["csv"], bad_rows="skip", max_bad_fraction=0.02)
    assert TabularSource(c.data, c.embedding.tables).counts["train"] == 295


def test_bad_rows_is_for_tabular_data() -> None:
    with pytest.raises(ConfigError, match="data.bad_rows = 'skip' is for tabular data"):
        load_config(overrides=["data.bad_rows=skip"])


def test_records_are_bounded(tmp_path: Path) -> None:
    """Past ``MAX_RECORDS`` rows are counted, not listed."""
    bad = BadRows(BadRowPolicy("skip", 1.0))
    for i in range(MAX_RECORDS + 5):
        bad.skip(tmp_path / "f.csv", {"line": i + 2}, f"f.csv:{i + 2}: column 'a': bad")
    assert bad.total == MAX_RECORDS + 5 and len(bad.records) == MAX_RECORDS
    lines = bad.write(tmp_path).read_text().splitlines()
    assert len(lines) == MAX_RECORDS
    assert json.loads(lines[0]) == {
        "file": str(tmp_path / "f.csv"),
        "line": 2,
        "column": "a",
        "reason": "column 'a': bad",
    }


def test_preprocess_skips_and_lists(data: dict[str, Path], tmp_path: Path) -> None:
    c = cfg(data["parquet"])
    opts = TabularOptions(shard_rows=128, workers=1, bad_rows="skip", max_bad_fraction=0.05)
    m = preprocess_tabular(
        [data["parquet"]], tmp_path / "pre", c.data.schema, c.embedding.tables, opts
    )
    clean = TabularOptions(shard_rows=128, workers=1)
    want = preprocess_tabular(
        [data["parquet_clean"]], tmp_path / "clean", c.data.schema, c.embedding.tables, clean
    )
    assert m["split"] == want["split"] and m["split"]["train"] == N_TRAIN - len(PARQUET_BAD)
    assert m["bad_rows"]["skipped"] == len(PARQUET_BAD)
    rows = [
        json.loads(x)["row"] for x in (tmp_path / "pre" / "bad_rows.jsonl").read_text().splitlines()
    ]
    assert rows == list(PARQUET_BAD)
    with pytest.raises(DataError, match="3 of 300 rows are bad"):
        preprocess_tabular(
            [data["parquet"]],
            tmp_path / "pre2",
            c.data.schema,
            c.embedding.tables,
            dataclasses.replace(opts, max_bad_fraction=0.001),
        )


def test_a_resumed_run_counts_them_once(data: dict[str, Path], tmp_path: Path) -> None:
    """A run that skips, checkpointed and resumed: one ``bad_rows`` event, the list written
    once, the summary's count that of the data; it ends where the uninterrupted run ends."""
    from neorec.train.trainer import Trainer

    sets = [
        f"data.path='{data['csv']}'", "data.bad_rows='skip'", "data.max_bad_fraction=0.05",
        "data.batch_size=50", "data.workers=0", "train.progress=false", "train.save_model=false",
        "train.epochs=1", "checkpoint.every_steps=2", "checkpoint.policy=consecutive",
        "checkpoint.bits=32", "checkpoint.opt_bits=32", "checkpoint.fsync=false",
    ]  # fmt: skip

    def run(name: str, *extra: str) -> dict[str, Any]:
        c = load_config(CONFIG, [*sets, f"train.run_dir='{tmp_path / name}'", *extra])
        return Trainer(c).fit()

    want = run("whole")
    run("cut", "train.steps=4")
    listed = tmp_path / "cut" / "bad_rows.jsonl"
    first = listed.stat().st_mtime_ns
    got = run("cut", "checkpoint.resume=latest")
    assert listed.stat().st_mtime_ns == first  # not written again
    assert len(listed.read_text().splitlines()) == len(CSV_BAD)
    events = [json.loads(x) for x in (tmp_path / "cut" / "events.jsonl").read_text().splitlines()]
    counted = [e["bad_rows"] for e in events if "bad_rows" in e]
    assert len(counted) == 1 and counted[0]["skipped"] == len(CSV_BAD)
    assert got["bad_rows"] == want["bad_rows"] and got["bad_rows"]["skipped"] == len(CSV_BAD)
    assert got["train"]["steps"] == want["train"]["steps"] == 6  # 295 samples: 5 x 50 + 45
    assert got["eval"] == want["eval"]
