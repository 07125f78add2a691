"""Fault campaign "huge inputs": a huge string id, a huge list, a huge row or line in Parquet, CSV
and Criteo TSV. Each is one clear line naming the file, the row and (where there is one) the
column -- or, under the limits, is read -- and the reader's peak memory stays bounded whatever
the input (measured in a fresh process: its peak RSS over what its imports took).

Before the readers bounded their memory, one 1 MiB string id in a 3,000-row Parquet file took
``neorec train`` to 17 GB (fixed-width string arrays: rows x the longest id).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from faults import campaign  # noqa: E402

from neorec.data.example import example_columns, write_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "parquet_example.toml"
HUGE = campaign("huge inputs")
MAX_GROWTH_MB = 200
"""Peak RSS a case may add to its process's start (the data itself is at most ~50 MB on disk)."""

# Reads the data in a fresh process; prints {"error": line | null, "rss_mb": start, "peak_mb": end}.
READER = """
import json, sys

def hwm_mb():  # the process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

import neorec.data.tabular, neorec.data.criteo, neorec.data.tabular_pre  # imports first
import dataclasses
from neorec.builder import data_source
from neorec.config import load_config
from neorec.errors import NeorecError
kind, path, mode = sys.argv[1:4]
start = hwm_mb()
err = None
try:
    if kind == "criteo":
        from neorec.data.criteo import CriteoTSVDataset
        from neorec.config import TableConfig
        tables = [TableConfig(name=f"t{i}", rows=100, dim=4) for i in range(26)]
        for _ in CriteoTSVDataset(path, tables, batch_size=64):
            pass
    else:
        c = load_config(sys.argv[4])
        c.data = dataclasses.replace(c.data, path=path, batch_size=10, workers=0)
        if mode == "direct":
            for _ in data_source(c).train_batches():
                pass
        else:
            from neorec.data.tabular_pre import TabularOptions, preprocess_tabular
            preprocess_tabular([path], path + "_out", c.data.schema, c.embedding.tables,
                               TabularOptions(shard_rows=1024, workers=1))
except NeorecError as e:
    err = str(e)
peak = hwm_mb()
print(json.dumps({"error": err, "rss_mb": start, "peak_mb": peak}))
"""


def _read(kind: str, path: Path, mode: str = "direct") -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-c", READER, kind, str(path), mode, str(CONFIG)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    if r.returncode != 0:
        return {"crash": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def _judge(name: str, out: dict[str, Any], want: tuple[str, ...] | None) -> None:
    """``want``: the parts the error line must hold (None: the data must read)."""
    if "crash" in out:
        HUGE.record(name, "crash", str(out["crash"]))
        return
    growth = out["peak_mb"] - out["rss_mb"]
    detail = f"peak RSS +{growth:.0f} MB ({out['peak_mb']:.0f} MB); {out['error']}"
    print(f"huge inputs: {name}: {detail}")
    if growth > MAX_GROWTH_MB:
        HUGE.record(name, "crash", f"memory not bounded: {detail}")
    elif want is None:
        HUGE.record(name, "handled" if out["error"] is None else "crash", detail)
    elif out["error"] is None:
        HUGE.record(name, "silently accepted", detail)
    else:
        ok = all(w in out["error"] for w in want) and "\n" not in out["error"]
        HUGE.record(name, "clear error" if ok else "crash", detail)


def _parquet(d: Path, n: int, edit: Any) -> Path:
    write_example(d, "parquet", 10, 10)  # part-1: a clean eval file
    cols = example_columns(n, 1)
    edit(cols)
    types = {
        "click": pa.int64(), "price": pa.float64(), "age": pa.float64(), "user": pa.int64(),
        "item": pa.string(), "tags": pa.list_(pa.int64()), "tag_w": pa.list_(pa.float32()),
        "query_tags": pa.list_(pa.int64()),
    }  # fmt: skip
    table = pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})
    pq.write_table(table, d / "part-0.parquet", row_group_size=1024)
    return d


def _put(col: str, i: int, v: Any) -> Any:
    def edit(cols: dict[str, list[Any]]) -> None:
        cols[col][i] = v
        if col == "tags":
            cols["tag_w"][i] = [1.0] * len(v)

    return edit


def test_huge_parquet_inputs(tmp_path: Path) -> None:
    for mode in ("direct", "preprocess"):
        d = _parquet(tmp_path / f"id-{mode}", 3000, _put("item", 100, "x" * (1 << 20)))
        _judge(
            f"parquet: a 1 MiB string id ({mode})",
            _read("tabular", d, mode),
            ("part-0.parquet: row 101", "'item'", "1,048,576 bytes", "max_field_bytes"),
        )
    # under the limit: 2,000 ids, one of 50,000 characters, is read (it took 1.5 GiB)
    d = _parquet(tmp_path / "long-ok", 2000, _put("item", 7, "y" * 50_000))
    _judge("parquet: one 50,000-character id, read", _read("tabular", d), None)
    d = _parquet(tmp_path / "list", 1000, _put("tags", 40, list(range(100_000))))
    _judge(
        "parquet: a list of 100,000 ids",
        _read("tabular", d),
        ("part-0.parquet: row 41", "'tags'", "100,000 ids", "max_ids_per_field"),
    )
    HUGE.check()


def _csv(d: Path, line: str, at: int, n: int = 300) -> Path:
    write_example(d, "csv", n, 10)
    lines = (d / "part-0.csv").read_text().splitlines(keepends=True)
    lines[at - 1] = line
    (d / "part-0.csv").write_text("".join(lines))
    return d


def test_huge_csv_inputs(tmp_path: Path) -> None:
    d = tmp_path / "probe"
    write_example(d, "csv", 5, 5)
    header = (d / "part-0.csv").read_text().splitlines()[0].split(",")
    fields = (d / "part-0.csv").read_text().splitlines()[1].split(",")
    item = header.index("item")
    big = list(fields)
    big[item] = "z" * (1 << 20)
    for mode in ("direct", "preprocess"):
        dd = _csv(tmp_path / f"field-{mode}", ",".join(big) + "\n", at=50)
        _judge(
            f"csv: a 1 MiB field ({mode})",
            _read("tabular", dd, mode),
            ("part-0.csv:50", "column 'item'", "max_field_bytes"),
        )
    mid = list(fields)
    mid[item] = "漢" * 30_000  # 90,000 bytes: over the limit in bytes, not in characters
    dd = _csv(tmp_path / "field-mid", ",".join(mid) + "\n", at=9)
    _judge(
        "csv: a 90,000-byte field",
        _read("tabular", dd),
        ("part-0.csv:9", "column 'item'", "90,000 bytes"),
    )
    row = ",".join(["9" * (50 << 20)] + fields[1:]) + "\n"  # a 50 MB row
    dd = _csv(tmp_path / "row", row, at=3)
    _judge(
        "csv: a 50 MB row",
        _read("tabular", dd),
        ("part-0.csv:3", "column 'click'", "max_field_bytes"),
    )
    HUGE.check()


def test_huge_criteo_lines(tmp_path: Path) -> None:
    good = "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["a1b2"] * 26) + "\n"
    p = tmp_path / "day_0.tsv"
    with open(p, "w") as f:
        f.write(good * 20)
        f.write("1\t" + "7" * (50 << 20) + "\n")  # line 21: 50 MB
        f.write(good * 20)
    _judge(
        "criteo: a 50 MB line",
        _read("criteo", p),
        ("day_0.tsv:21", "more than 1,048,576 bytes"),
    )
    tail = tmp_path / "day_1.tsv"
    tail.write_text(good * 5 + "0\t" + "5" * (30 << 20))  # no newline at the end
    _judge("criteo: a 30 MB last line", _read("criteo", tail), ("day_1.tsv:6", "1,048,576"))
    out = tmp_path / "pre"
    r = subprocess.run(
        [sys.executable, "-m", "neorec", "data", "preprocess", "--input", str(p), "--output",
         str(out), "--rows", ",".join(["100"] * 26), "--eval-fraction", "0", "--workers", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    err = r.stderr.strip().splitlines()
    msg = err[-1] if err else ""
    ok = r.returncode != 0 and "day_0.tsv:21" in msg and "1,048,576" in msg
    HUGE.record("criteo preprocess: a 50 MB line", "clear error" if ok else "crash", msg)
    HUGE.check()
