"""``neorec data preprocess`` raw ids (issue 21): the features of dynamic tables keep the raw hex
value as their 64-bit id (no modulo), equal to the TSV reader's raw ids; refusals in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from faults import campaign, run_cli
from test_preprocess import ROWS, make_lines, read_all, reference, write

from neorec.cli.data import preprocess_main as main
from neorec.config import TableConfig
from neorec.data.criteo import CriteoTSVDataset
from neorec.data.loader import SampleOrder, ShardedReader
from neorec.data.preprocess import PreprocessOptions, preprocess

RAW = [j % 3 == 1 for j in range(26)]  # C2, C5, C8, ...


def _row(j: int, v: int | None) -> int:
    if RAW[j]:
        return 0 if v is None else v  # the raw value; empty -> 0 (as CriteoTSVDataset)
    return 0 if v is None else v % ROWS[j]


def _big_lines(n: int, seed: int) -> list[str]:
    """Lines whose categories are up to 15 hex digits (raw ids far above any table's rows)."""
    rng = random.Random(seed)
    out = []
    for ln in make_lines(n, seed):
        f = ln.rstrip("\n").split("\t")
        f[14:] = [x and f"{rng.getrandbits(59):x}" if rng.random() < 0.5 else x for x in f[14:]]
        out.append("\t".join(f) + "\n")
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_raw_features_keep_the_value(tmp_path: Path, workers: int) -> None:
    a, b = _big_lines(300, 1), _big_lines(200, 2)
    files = [write(tmp_path / "d0.tsv", a), write(tmp_path / "d1.tsv.gz", b)]
    opts = PreprocessOptions(rows=ROWS, raw=RAW, chunk_bytes=20_000, shard_rows=90, workers=workers)
    preprocess(files, tmp_path / "out", opts)
    got = read_all(tmp_path / "out")
    assert got == reference(a + b, _row)
    assert max(r[2][1] for r in got) > 2**40  # raw ids, not rows
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["options"]["raw"] == RAW
    shard = m["shards"][0]["name"]
    assert np.load(tmp_path / "out" / "shards" / f"{shard}.sparse.npy").dtype == np.int64


def test_reader_gives_the_tsv_readers_raw_ids(tmp_path: Path) -> None:
    f = write(tmp_path / "d.tsv", _big_lines(250, 3))
    preprocess([f], tmp_path / "out", PreprocessOptions(rows=ROWS, raw=RAW, workers=1))
    tables = [
        TableConfig(name=f"C{j + 1}", rows=r, dim=4, kind="dynamic" if RAW[j] else "fixed")
        for j, r in enumerate(ROWS)
    ]
    want = list(CriteoTSVDataset(f, tables, batch_size=100))
    got = list(ShardedReader(tmp_path / "out", 100, order=SampleOrder(shuffle=False)))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.sparse.values.equal(w.sparse.values) and g.sparse.lengths.equal(w.sparse.lengths)
        assert g.dense.equal(w.dense) and g.labels.equal(w.labels)
    assert int(got[0].sparse.values.max()) > 2**40


def test_config_dynamic_tables_are_raw_and_flag_parsing(tmp_path: Path) -> None:
    f = write(tmp_path / "a.tsv", _big_lines(40, 4))
    cfg = tmp_path / "m.toml"
    tables = ", ".join(
        f"{{name='C{j + 1}', rows={r}, dim=16{', kind=' + repr('dynamic') if RAW[j] else ''}}}"
        for j, r in enumerate(ROWS)
    )
    cfg.write_text(f"[embedding]\ntables = [{tables}]\n")
    base = ["--input", str(f), "--workers", "1", "--eval-fraction", "0"]
    assert main([*base, "--output", str(tmp_path / "o1"), "--config", str(cfg)]) == 0
    m = json.loads((tmp_path / "o1" / "manifest.json").read_text())
    assert m["options"]["raw"] == RAW and m["rows"] == ROWS
    assert main([*base, "--output", str(tmp_path / "o2"), "--rows", "7", "--raw", "C2,5"]) == 0
    m = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert [j for j, r in enumerate(m["options"]["raw"]) if r] == [1, 4]
    assert main([*base, "--output", str(tmp_path / "o3"), "--rows", "7", "--raw", "all"]) == 0
    assert all(json.loads((tmp_path / "o3" / "manifest.json").read_text())["options"]["raw"])


def test_faults_preprocess_raw(tmp_path: Path) -> None:
    c = campaign("preprocess raw ids")
    c.expect_error(
        "raw + vocab", lambda: PreprocessOptions(rows=[1], mode="vocab", raw=[True]),
        ("hash mode", "C1"),
    )  # fmt: skip
    c.expect_error(
        "raw + multi-hot", lambda: PreprocessOptions(rows=ROWS, multi_hot=[2], raw=RAW),
        ("C2", "multi-hot 1"),
    )  # fmt: skip
    c.expect_error(
        "raw flags count", lambda: PreprocessOptions(rows=ROWS, raw=[True, False]),
        ("--raw needs 1 or 26",),
    )  # fmt: skip
    f = write(tmp_path / "a.tsv", make_lines(5, 5))
    argv = ["data", "preprocess", "--input", str(f), "--output", str(tmp_path / "o")]
    c.expect_cli_error("--raw C27", [*argv, "--raw", "C27"], ("C27",))
    c.expect_cli_error(
        "--raw with vocab", [*argv, "--vocab-threshold", "2", "--raw", "all"], ("hash mode",)
    )
    r = run_cli([*argv, "--rows", "9", "--raw", "none", "--workers", "1"])
    c.record("--raw none", "handled" if r.returncode == 0 else "crash", r.stderr[-200:])
    c.check()
