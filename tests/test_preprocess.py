"""Criteo preprocessing: equals a plain Python re-implementation; bad input fails or is counted."""

from __future__ import annotations

import gzip
import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from neorec.cli.data import preprocess_main as main
from neorec.config import TableConfig
from neorec.data.criteo import CriteoFormatError, CriteoTSVDataset
from neorec.data.loader import SampleOrder, ShardedReader
from neorec.data.preprocess import KAGGLE_ROWS, PreprocessOptions, preprocess

ROWS = [50 + 13 * j for j in range(26)]


def make_lines(n: int, seed: int) -> list[str]:
    """Criteo-format lines with empty, negative and big dense values and repeated categories."""
    rng = random.Random(seed)
    pool = [f"{rng.getrandbits(32):08x}" for _ in range(40)] + ["DEADBEEF", "0000000a"]
    out = []
    for _ in range(n):
        dense = [rng.choice(["", "0", "-2", str(rng.randint(0, 10**9))]) for _ in range(13)]
        cats = [rng.choice(["", *pool]) for _ in range(26)]
        out.append("\t".join([rng.choice("01"), *dense, *cats]) + "\n")
    return out


def write(path: Path, lines: list[str]) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.writelines(lines)
    else:
        path.write_text("".join(lines))
    return path


def reference(lines: list[str], row_of) -> list[tuple[int, list[float], list[int]]]:
    """The transform in plain Python: label, log(max(x,0)+1) as float32, category -> row."""
    out = []
    for line in lines:
        f = line.rstrip("\n").split("\t")
        dense = [float(np.float32(math.log1p(max(int(x), 0)) if x else 0.0)) for x in f[1:14]]
        rows = [row_of(j, int(x, 16) if x else None) for j, x in enumerate(f[14:])]
        out.append((int(f[0]), dense, rows))
    return out


def read_all(out: Path) -> list[tuple[int, list[float], list[int]]]:
    """Every sample of a preprocessed directory in stored order."""
    m = json.loads((out / "manifest.json").read_text())
    got = []
    for s in m["shards"]:
        lab, den, spa = (
            np.load(out / "shards" / f"{s['name']}.{c}.npy") for c in ("labels", "dense", "sparse")
        )
        got += [(int(a), b.tolist(), c.tolist()) for a, b, c in zip(lab, den, spa)]
    return got


def hash_row(j: int, v: int | None) -> int:
    return 0 if v is None else v % ROWS[j]


@pytest.mark.parametrize("workers", [1, 2])
def test_hash_mode_equals_python_reference(tmp_path: Path, workers: int) -> None:
    a, b = make_lines(700, 1), make_lines(500, 2)
    files = [write(tmp_path / "day_0.tsv", a), write(tmp_path / "day_1.tsv.gz", b)]
    # small units and shards: a plain file cut into several units, several shards per unit
    opts = PreprocessOptions(rows=ROWS, chunk_bytes=20_000, shard_rows=150, workers=workers)
    s = preprocess(files, tmp_path / "out", opts)
    assert (s.rows, s.lines, s.bad_lines) == (1200, 1200, 0)
    assert read_all(tmp_path / "out") == reference(a + b, hash_row)


def test_same_batches_as_the_tsv_reader(tmp_path: Path) -> None:
    lines = make_lines(300, 3)
    f = write(tmp_path / "d.tsv", lines)
    preprocess([f], tmp_path / "out", PreprocessOptions(rows=ROWS, shard_rows=64, workers=1))
    tables = [TableConfig(name=f"C{j + 1}", rows=r, dim=4) for j, r in enumerate(ROWS)]
    want = list(CriteoTSVDataset(f, tables, batch_size=100))
    got = list(ShardedReader(tmp_path / "out", 100, order=SampleOrder(shuffle=False)))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g.dense.equal(w.dense) and g.labels.equal(w.labels)
        assert g.sparse.values.equal(w.sparse.values) and g.sparse.lengths.equal(w.sparse.lengths)


def test_vocab_mode_equals_python_reference(tmp_path: Path) -> None:
    a, b = make_lines(400, 4), make_lines(300, 5)
    files = [write(tmp_path / "a.tsv", a), write(tmp_path / "b.tsv.gz", b)]
    s = preprocess(
        files, tmp_path / "out", PreprocessOptions(rows=[1], mode="vocab", threshold=20, workers=2)
    )
    counts = [Counter(ln.rstrip("\n").split("\t")[14 + j] for ln in a + b) for j in range(26)]
    vocab = [sorted(int(v, 16) for v, c in counts[j].items() if v and c >= 20) for j in range(26)]

    def vocab_row(j: int, v: int | None) -> int:  # 0 empty, 1 rare, 2.. frequent ascending
        return 0 if v is None else (vocab[j].index(v) + 2 if v in vocab[j] else 1)

    assert read_all(tmp_path / "out") == reference(a + b, vocab_row)
    assert s.vocab_sizes == [len(v) + 2 for v in vocab]
    assert np.load(tmp_path / "out" / "vocab" / "C1.npy").tolist() == vocab[0]


def test_multi_hot_bags(tmp_path: Path) -> None:
    lines = make_lines(200, 6)
    f = write(tmp_path / "a.tsv", lines)
    sizes = [1, 3] * 13
    opts = PreprocessOptions(rows=ROWS, multi_hot=sizes, workers=1)
    preprocess([f], tmp_path / "o1", opts)
    preprocess([f], tmp_path / "o2", opts)
    one, ref = read_all(tmp_path / "o1"), reference(lines, hash_row)
    assert one == read_all(tmp_path / "o2")  # deterministic
    bags: dict[tuple[int, int], list[int]] = {}
    for (_, _, got), (_, _, want) in zip(one, ref):
        col = 0
        for j, s in enumerate(sizes):
            bag = got[col : col + s]
            col += s
            assert bag[0] == want[j] and all(0 <= x < ROWS[j] for x in bag)
            assert bags.setdefault((j, want[j]), bag) == bag  # fixed per (feature, row)
    assert len(one[0][2]) == sum(sizes)
    batch = next(iter(ShardedReader(tmp_path / "o1", 8, order=SampleOrder(shuffle=False))))
    assert batch.sparse.lengths.tolist() == [s for s in sizes for _ in range(8)]


def bad_lines() -> list[str]:
    good = make_lines(10, 7)
    f = good[3].split("\t")
    hexbad = "\t".join(f[:20] + ["xyz12345"] + f[21:])
    densebad = "\t".join(f[:2] + ["1.5"] + f[3:])
    # lines 4, 7 and 9 (1-based) are bad
    return good[:3] + ["1\t2\t3\n"] + good[3:5] + [hexbad] + good[5:6] + [densebad] + good[6:]


def test_bad_lines_fail_with_file_and_line(tmp_path: Path) -> None:
    lines = make_lines(2000, 8)
    lines[1234] = lines[1234].replace("\t", "\t+", 1)  # dense "+5" is not an integer
    f = write(tmp_path / "day_0.tsv", lines)
    # cut into several units: the line number must count the lines of the units before
    opts = PreprocessOptions(rows=ROWS, chunk_bytes=30_000, workers=2)
    with pytest.raises(CriteoFormatError, match=r"day_0\.tsv:1235: field I1"):
        preprocess([f], tmp_path / "out", opts)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_lines_skip_counts_and_names_them(tmp_path: Path) -> None:
    lines = bad_lines()
    f = write(tmp_path / "d.tsv", lines)
    s = preprocess([f], tmp_path / "out", PreprocessOptions(rows=ROWS, bad_lines="skip"))
    assert (s.lines, s.bad_lines, s.rows) == (13, 3, 10)
    assert [m.split(": ")[0] for m in s.bad_examples] == ["d.tsv:4", "d.tsv:7", "d.tsv:9"]
    assert "field C7: 'xyz12345' is not hex" in s.bad_examples[1]
    assert "field I2: '1.5' is not an integer" in s.bad_examples[2]
    good = [ln for i, ln in enumerate(lines) if i not in (3, 6, 8)]
    assert read_all(tmp_path / "out") == reference(good, hash_row)


def test_truncated_gz(tmp_path: Path) -> None:
    lines = make_lines(3000, 9)
    whole = write(tmp_path / "x.tsv.gz", lines).read_bytes()
    cut = tmp_path / "day_1.tsv.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(CriteoFormatError, match=r"day_1\.tsv\.gz:\d+: truncated"):
        preprocess([cut], tmp_path / "o1", PreprocessOptions(rows=ROWS))
    s = preprocess([cut], tmp_path / "o2", PreprocessOptions(rows=ROWS, bad_lines="skip"))
    assert s.bad_lines == 1 and s.rows == s.lines > 1000
    assert s.bad_examples[0].startswith(f"day_1.tsv.gz:{s.rows + 1}: truncated")
    # every whole line before the cut is kept, exactly
    assert read_all(tmp_path / "o2") == reference(lines[: s.rows], hash_row)


def test_cli_progress_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "a.tsv", bad_lines())
    args = ["--input", str(f), "--output", str(tmp_path / "o"), "--rows", "1000"]
    with pytest.raises(CriteoFormatError, match="a.tsv:4: expected 40 tab-separated fields, got 3"):
        main(args)
    assert main([*args, "--bad-lines", "skip", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "convert: 1/1 units" in out and "bad lines: 3" in out and "C26=1000" in out


def test_default_rows_are_the_kaggle_config_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from neorec.config import load_config

    cfg = load_config(str(Path(__file__).parent.parent / "configs" / "criteo_kaggle.toml"))
    assert KAGGLE_ROWS == [t.rows for t in cfg.embedding.tables]
    f = write(tmp_path / "train.txt", make_lines(70, 12))
    assert main(["--input", str(tmp_path), "--output", str(tmp_path / "o"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "rows: the Criteo Kaggle table sizes" in out and "10 eval samples" in out
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["rows"] == KAGGLE_ROWS and m["split"]["eval"] == 10 and f.exists()


def test_eval_split_marks_the_last_samples(tmp_path: Path) -> None:
    lines = make_lines(100, 13)
    f = write(tmp_path / "d.tsv", lines)
    s = preprocess(
        [f], tmp_path / "o", PreprocessOptions(rows=ROWS, shard_rows=30, eval_fraction=0.25)
    )
    assert (s.train_rows, s.eval_rows) == (75, 25)
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert [(sh["rows"], sh["split"]) for sh in m["shards"]] == [
        (30, "train"),
        (30, "train"),
        (15, "train"),
        (15, "eval"),
        (10, "eval"),
    ]
    assert read_all(tmp_path / "o") == reference(lines, hash_row)  # nothing lost or repeated
