"""Fault campaigns "criteo reader", "criteo preprocess" and "criteo source": bad Criteo input.

Mutations of a valid seeded TSV (wrong field counts, 24-digit and 64-bit-overflowing integers,
non-hex and over-long categories, latin-1 bytes, NUL, a lone ``\\r``, other scripts' digits, bad
labels, truncated or fake gzip, empty files and directories, missing paths) go through
``CriteoTSVDataset`` and through ``preprocess`` (two workers, units of a few lines, so the line a
failure names depends on which unit finishes first unless the driver orders them). Fail mode must
be a one-line ``DataError`` naming ``file:line`` -- the same line on every run; skip mode is
"handled" only if the count of skipped lines equals the number of injected bad lines and every
good line is read intact (equal to reading a file of only the good lines). Valid variants
(``\\r\\n`` endings, empty and negative dense, empty categories, the largest 64-bit integer, no final
newline) must read as their canonical form. "criteo source": the trainer's data source refuses bad
paths, splits and table mismatches cheaply (before any table is built), and the README flow
(``neorec data preprocess --input DIR --output OUT``, then ``neorec train``) runs end to end.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults import campaign, judge_cli, run_cli

from neorec.config import Config, TableConfig, load_config
from neorec.data.criteo import CriteoTSVDataset
from neorec.data.preprocess import KAGGLE_ROWS, PreprocessOptions, preprocess
from neorec.errors import NeorecError

READER = campaign("criteo reader")
PRE = campaign("criteo preprocess")
SOURCE = campaign("criteo source")
ROWS = [50 + 13 * j for j in range(26)]
TABLES = [TableConfig(name=f"C{j + 1}", rows=r, dim=4) for j, r in enumerate(ROWS)]
N = 40
KAGGLE = str(Path(__file__).resolve().parent.parent / "configs" / "criteo_kaggle.toml")


def base_lines(seed: int = 0, n: int = N) -> list[bytes]:
    """Valid lines (with their ``\\n``): realistic counts, some empty or negative, 8-digit hex."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        dense = [dense_field(rng) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        out.append(("\t".join([rng.choice("01"), *dense, *cats]) + "\n").encode())
    return out


def dense_field(rng: random.Random) -> str:
    """A count up to 1e5 (log-uniform); 15 % empty, 5 % negative."""
    r = rng.random()
    return (
        ""
        if r < 0.15
        else str(-rng.randint(1, 3))
        if r < 0.2
        else str(int(10 ** rng.uniform(0, 5)))
    )


def set_field(line: bytes, i: int, value: bytes) -> bytes:
    """``line`` with field ``i`` (0 = label, 1..13 dense, 14..39 categories) replaced."""
    f = line.rstrip(b"\n").split(b"\t")
    f[i] = value
    return b"\t".join(f) + b"\n"


def bad(pos: list[int], make: Callable[[bytes], bytes]) -> Callable[[list[bytes]], tuple]:
    """A mutation replacing the lines at 0-based ``pos`` by ``make(line)``: all of them bad."""

    def apply(lines: list[bytes]) -> tuple[list[bytes], list[int]]:
        out = list(lines)
        for p in pos:
            out[p] = make(out[p])
        return out, pos

    return apply


def field_bad(pos: list[int], i: int, value: bytes) -> Callable[[list[bytes]], tuple]:
    return bad(pos, lambda ln: set_field(ln, i, value))


# (name, mutation, text the error must contain besides file:line)
BAD_CASES: list[tuple[str, Callable[[list[bytes]], tuple], str]] = [
    ("39 fields", bad([4], lambda ln: ln.rsplit(b"\t", 1)[0] + b"\n"), "expected 40"),
    ("41 fields", bad([4], lambda ln: ln.rstrip(b"\n") + b"\tab\n"), "expected 40"),
    ("empty line", bad([7], lambda ln: b"\n"), "expected 40"),
    ("empty label", field_bad([3], 0, b""), "field label"),
    ("label 2", field_bad([3], 0, b"2"), "field label"),
    ("24-digit dense", field_bad([9], 5, b"123456789012345678901234"), "64 bits"),
    ("2**63 dense", field_bad([9], 2, b"9223372036854775808"), "64 bits"),
    ("-2**63-1 dense", field_bad([9], 2, b"-9223372036854775809"), "64 bits"),
    ("5000-digit dense", field_bad([9], 2, b"7" * 5000), "64 bits"),
    ("float dense", field_bad([2], 1, b"1.5"), "field I1"),
    ("plus dense", field_bad([2], 4, b"+5"), "field I4"),
    ("spaced dense", field_bad([2], 4, b" 5"), "field I4"),
    ("underscore dense", field_bad([2], 4, b"1_0"), "field I4"),
    ("lone minus", field_bad([2], 4, b"-"), "field I4"),
    ("arabic-indic digit", field_bad([11], 3, "\u0663".encode()), "field I3"),
    ("full-width digits", field_bad([11], 3, "\uff11\uff12".encode()), "field I3"),
    ("superscript two", field_bad([11], 3, "\u00b2".encode()), "field I3"),
    ("non-hex category", field_bad([6], 20, b"zzzzzzzz"), "field C7"),
    ("0x category", field_bad([6], 14, b"0x12"), "field C1"),
    ("16 hex digits", field_bad([6], 39, b"0123456789abcdef"), "field C26"),
    ("latin-1 byte in category", field_bad([8], 16, b"caf\xe9"), "not UTF-8"),
    ("latin-1 byte in dense", field_bad([8], 1, b"\xb5"), "not UTF-8"),
    ("NUL in dense", field_bad([5], 7, b"1\x002"), "field I7"),
    ("NUL as label", field_bad([5], 0, b"\x00"), "field label"),
    ("lone CR in a field", field_bad([10], 6, b"12\r34"), "field I6"),
    ("lone CR for a tab", bad([10], lambda ln: ln.replace(b"\t", b"\r", 1)), "expected 40"),
    ("CR CR LF ending", bad([10], lambda ln: ln.rstrip(b"\n") + b"\r\r\n"), "field C26"),
    (
        "three bad lines",
        lambda ls: bad([2, 17, 33], lambda ln: set_field(ln, 9, b"x9"))(ls),
        "field I9",
    ),
]


def valid_variants(lines: list[bytes]) -> list[tuple[str, list[bytes], list[bytes]]]:
    """(name, lines, canonical lines that must read the same)."""
    zero_dense = [set_field(ln, 3, b"") for ln in lines]
    return [
        ("CRLF endings", [ln.replace(b"\n", b"\r\n") for ln in lines], lines),
        ("no final newline", lines[:-1] + [lines[-1].rstrip(b"\n")], lines),
        ("empty dense = 0", zero_dense, [set_field(ln, 3, b"0") for ln in lines]),
        ("negative dense = 0", [set_field(ln, 3, b"-7") for ln in lines], zero_dense),
        (
            "empty category = row 0",
            [set_field(ln, 15, b"") for ln in lines],
            [set_field(ln, 15, b"00000000") for ln in lines],
        ),
        ("upper-case hex", [ln.upper() for ln in lines], lines),
        (
            "largest int64",
            [set_field(ln, 4, b"9223372036854775807") for ln in lines],
            [set_field(ln, 4, b"9223372036854775807") for ln in lines],
        ),
    ]


def write(path: Path, lines: list[bytes]) -> Path:
    data = b"".join(lines)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def read(path: Path | list[Path], skip: bool = False) -> tuple[list[np.ndarray], Any]:
    ds = CriteoTSVDataset(path, TABLES, 16, bad_lines="skip" if skip else "fail")
    out = []
    for b in ds:
        out.append(
            np.concatenate([b.labels[:, None], b.dense, b.sparse.values.reshape(26, -1).t()], 1)
        )
    arr = np.concatenate(out) if out else np.zeros((0, 40))
    return [arr], ds.stats


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b)
    )


def fail_same_every_run(
    c: Any, name: str, fn: Callable[[], Any], match: tuple[str, ...], runs: int
) -> None:
    """fn must raise the same one-line NeorecError naming ``match`` on every run."""
    msgs = []
    for _ in range(runs):
        try:
            fn()
            msgs.append(None)
        except NeorecError as e:
            msgs.append(str(e))
        except Exception as e:  # noqa: BLE001 - a crash is what we count
            c.record(name, "crash", f"{type(e).__name__}: {e}")
            return
    if None in msgs:
        c.record(name, "silently accepted", f"no error raised in run {msgs.index(None) + 1}")
    elif len(set(msgs)) > 1:
        c.record(name, "crash", f"differs between runs: {sorted(set(map(str, msgs)))}")
    else:
        c.expect_error(name, lambda: _raise(str(msgs[0])), match)


def _raise(msg: str) -> None:
    """Raise a message already caught again (to judge it with expect_error)."""
    raise NeorecError(msg)


# ---- the TSV reader ----------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["tsv", "tsv.gz"])
def test_reader_bad_lines(tmp_path: Path, suffix: str) -> None:
    lines = base_lines(1)
    for k, (name, mutate, msg) in enumerate(BAD_CASES):
        got, pos = mutate(lines)
        f = write(tmp_path / f"day_{k}.{suffix}", got)
        fail_same_every_run(
            READER,
            f"{suffix} fail: {name}",
            lambda f=f: read(f),
            (f"{f.name}:{pos[0] + 1}: ", msg),
            2,
        )
        good = write(tmp_path / f"good_{k}.tsv", [ln for i, ln in enumerate(got) if i not in pos])
        try:
            arrays, stats = read(f, skip=True)
        except Exception as e:  # noqa: BLE001
            READER.record(f"{suffix} skip: {name}", "crash", f"{type(e).__name__}: {e}")
            continue
        want, _ = read(good)
        exact = stats.bad_lines == len(pos) and stats.lines == len(got) and same(arrays, want)
        where = [m.split(": ")[0] for m in stats.examples]
        exact &= where == [f"{f.name}:{p + 1}" for p in pos]
        READER.record(
            f"{suffix} skip: {name}",
            "handled" if exact else "silently accepted",
            f"skipped {stats.bad_lines} of {len(pos)} at {where}",
        )
    READER.check()


def test_reader_valid_variants(tmp_path: Path) -> None:
    lines = base_lines(2)
    for k, (name, got, canon) in enumerate(valid_variants(lines)):
        f, g = write(tmp_path / f"v{k}.tsv", got), write(tmp_path / f"c{k}.tsv", canon)
        try:
            a, stats = read(f)
            ok = same(a, read(g)[0]) and stats.bad_lines == 0 and stats.lines == N
            READER.record(f"valid: {name}", "handled" if ok else "data lost", "differs")
        except Exception as e:  # noqa: BLE001
            READER.record(f"valid: {name}", "crash", f"{type(e).__name__}: {e}")
    READER.check()


def test_reader_files_and_gzip(tmp_path: Path) -> None:
    lines = base_lines(3, 400)
    whole = gzip.compress(b"".join(lines), mtime=0)
    cut = tmp_path / "day_1.tsv.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    prefix = zlib.decompressobj(31).decompress(cut.read_bytes())
    kept = prefix.count(b"\n")  # whole lines before the cut
    fail_same_every_run(
        READER, "truncated gzip: fail", lambda: read(cut), (f"day_1.tsv.gz:{kept + 1}: ", "gzip"), 2
    )
    a, stats = read(cut, skip=True)
    want, _ = read(write(tmp_path / "kept.tsv", lines[:kept]))
    ok = stats.bad_lines == 1 and same(a, want) and stats.lines == kept + 1
    READER.record("truncated gzip: skip", "handled" if ok else "data lost", f"{stats}")
    fake = write(tmp_path / "fake.tsv", lines[:3])
    fake = fake.rename(tmp_path / "fake.tsv.gz")
    READER.expect_error("plain text named .gz", lambda: read(fake), ("fake.tsv.gz:1: ", "gzip"))
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    a, stats = read(empty)
    READER.record(
        "empty file: no lines, no batches",
        "handled" if a[0].shape[0] == 0 and stats.lines == 0 else "silently accepted",
    )
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.md").write_text("x")
    READER.expect_error(
        "directory without TSV files",
        lambda: read(tmp_path / "nothing"),
        (str(tmp_path / "nothing"), "no Criteo TSV files"),
    )
    READER.expect_error(
        "missing path", lambda: read(tmp_path / "absent.tsv"), ("absent.tsv", "no such file")
    )
    READER.expect_error(
        "25 tables",
        lambda: CriteoTSVDataset(empty, TABLES[:25], 4),
        ("26 embedding tables", "has 25"),
    )
    READER.check()


# ---- preprocess ----------------------------------------------------------------------------


def shards(out: Path, split: str | None = None) -> list[np.ndarray]:
    """Every stored sample as a row (label, dense, sparse), in manifest order."""
    m = json.loads((out / "manifest.json").read_text())
    rows = []
    for s in m["shards"]:
        if split is not None and s["split"] != split:
            continue
        lab, den, spa = (
            np.load(out / "shards" / f"{s['name']}.{c}.npy") for c in ("labels", "dense", "sparse")
        )
        rows.append(np.concatenate([lab[:, None], den, spa], 1, dtype=np.float64))
    return [np.concatenate(rows) if rows else np.zeros((0, 40))]


def pre(files: list[Path], out: Path, skip: bool = False, **kw: Any) -> Any:
    opts = PreprocessOptions(
        rows=ROWS,
        bad_lines="skip" if skip else "fail",
        chunk_bytes=kw.pop("chunk_bytes", 700),
        workers=kw.pop("workers", 2),
        eval_fraction=kw.pop("eval_fraction", 0.0),
        **kw,
    )
    return preprocess(files, out, opts)


def test_preprocess_bad_lines(tmp_path: Path) -> None:
    lines = base_lines(4)
    for k, (name, mutate, msg) in enumerate(BAD_CASES):
        got, pos = mutate(lines)
        f = write(tmp_path / f"day_{k}.tsv", got)
        # units of ~700 bytes (2-3 lines) on two workers: several units may fail; the first wins
        runs = 5 if name == "three bad lines" else 2
        fail_same_every_run(
            PRE,
            f"fail: {name}",
            lambda f=f: pre([f], tmp_path / "o"),
            (f"{f.name}:{pos[0] + 1}: ", msg),
            runs,
        )
        good = write(tmp_path / f"good_{k}.tsv", [ln for i, ln in enumerate(got) if i not in pos])
        try:
            s = pre([f], tmp_path / f"s{k}", skip=True)
        except Exception as e:  # noqa: BLE001
            PRE.record(f"skip: {name}", "crash", f"{type(e).__name__}: {e}")
            continue
        pre([good], tmp_path / f"g{k}", workers=1)
        where = [m.split(": ")[0] for m in s.bad_examples]
        exact = (s.bad_lines, s.lines) == (len(pos), len(got)) and same(
            shards(tmp_path / f"s{k}"), shards(tmp_path / f"g{k}")
        )
        exact &= where == [f"{f.name}:{p + 1}" for p in pos]
        PRE.record(
            f"skip: {name}", "handled" if exact else "silently accepted", f"{s.bad_lines} {where}"
        )
    PRE.check()


def test_preprocess_first_bad_line_is_deterministic(tmp_path: Path) -> None:
    lines = base_lines(5, 200)
    for p in (8, 20, 150):  # lines 9, 21, 151 in different units
        lines[p] = set_field(lines[p], 2, b"1.5")
    f = write(tmp_path / "d.tsv", lines)
    fail_same_every_run(
        PRE,
        "bad lines in many units, 2 KB units, 8 runs",
        lambda: pre([f], tmp_path / "o", chunk_bytes=2048),
        ("d.tsv:9: field I2",),
        8,
    )
    PRE.check()


def test_preprocess_valid_variants_and_files(tmp_path: Path) -> None:
    lines = base_lines(6)
    for k, (name, got, canon) in enumerate(valid_variants(lines)):
        try:
            pre([write(tmp_path / f"v{k}.tsv", got)], tmp_path / f"v{k}")
            pre([write(tmp_path / f"c{k}.tsv", canon)], tmp_path / f"c{k}")
            ok = same(shards(tmp_path / f"v{k}"), shards(tmp_path / f"c{k}"))
            PRE.record(f"valid: {name}", "handled" if ok else "data lost", "differs")
        except Exception as e:  # noqa: BLE001
            PRE.record(f"valid: {name}", "crash", f"{type(e).__name__}: {e}")
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    PRE.expect_error("only an empty file", lambda: pre([empty], tmp_path / "e"), "no samples")
    allbad = write(tmp_path / "allbad.tsv", [b"1\t2\n"] * 3)
    PRE.expect_error(
        "skip mode, every line bad", lambda: pre([allbad], tmp_path / "b", skip=True), "3 bad"
    )
    PRE.expect_error(
        "missing input", lambda: pre([tmp_path / "nope"], tmp_path / "n"), "no such file"
    )
    (tmp_path / "dir").mkdir()
    PRE.expect_error(
        "empty input directory", lambda: pre([tmp_path / "dir"], tmp_path / "n"), "no Criteo"
    )
    PRE.expect_error(
        "output is a file", lambda: pre([empty], empty), ("empty.tsv", "not a directory")
    )
    for frac in (1.0, -0.1, float("nan")):
        PRE.expect_error(
            f"eval fraction {frac}",
            lambda frac=frac: pre([empty], tmp_path / "x", eval_fraction=frac),
            "--eval-fraction",
        )
    PRE.expect_error("bad --rows", lambda: PreprocessOptions(rows=[5, 6]), "--rows")
    PRE.check()


@pytest.mark.parametrize("fraction", [0.1, 0.25, 1 / 3, 0.5, None])
def test_eval_fraction_split_is_exact(tmp_path: Path, fraction: float | None) -> None:
    lines = base_lines(7, 101)
    f = write(tmp_path / "train.txt", lines)
    s = pre([f], tmp_path / "o", eval_fraction=fraction, shard_rows=16, workers=1)
    pre([f], tmp_path / "all", shard_rows=16, workers=1)
    n_eval = round((1 / 7 if fraction is None else fraction) * 101)
    everything = shards(tmp_path / "all")[0]
    ok = (s.train_rows, s.eval_rows) == (101 - n_eval, n_eval)
    ok &= same(shards(tmp_path / "o", "eval"), [everything[101 - n_eval :]])
    ok &= same(shards(tmp_path / "o", "train"), [everything[: 101 - n_eval]])
    PRE.record(f"eval fraction {fraction}: last {n_eval} of 101", "handled" if ok else "data lost")
    PRE.expect_error(
        f"eval fraction {fraction} of 3 samples",
        lambda: pre([write(tmp_path / "t.txt", lines[:3])], tmp_path / "t", eval_fraction=0.01),
        "need at least 1",
    )
    PRE.check()


def test_default_split_of_several_files_is_the_last(tmp_path: Path) -> None:
    lines = base_lines(8, 60)
    files = [
        write(tmp_path / "day_0.tsv", lines[:35]),
        write(tmp_path / "day_1.tsv.gz", lines[35:]),
    ]
    s = pre(files, tmp_path / "o", eval_fraction=None)
    ok = (s.train_rows, s.eval_rows) == (35, 25)
    PRE.record("two files: eval = the last file", "handled" if ok else "data lost", str(s.split))
    PRE.check()


# ---- the trainer's data source and the README flow ------------------------------------------


def small_config(path: str, **data: Any) -> Config:
    cfg = load_config(KAGGLE)
    cfg.embedding.tables = [
        dataclasses.replace(t, rows=r) for t, r in zip(cfg.embedding.tables, ROWS)
    ]
    cfg.data = dataclasses.replace(
        cfg.data, **{"path": path, "batch_size": 16, "workers": 0, **data}
    )
    return cfg


def test_source_checks_come_first(tmp_path: Path) -> None:
    from neorec.builder import data_source
    from neorec.train.trainer import Trainer

    f = write(tmp_path / "train.txt", base_lines(9, 120))
    good = tmp_path / "pre"
    pre([f], good, eval_fraction=0.2, workers=1)
    src = data_source(small_config(str(good)))
    n = sum(b.size for b in src.eval_batches())
    SOURCE.record("preprocessed with a split", "handled" if n == 24 else "data lost", f"eval {n}")
    nosplit = tmp_path / "nosplit"
    pre([f], nosplit, eval_fraction=0.0, workers=1)
    cases: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
        ("empty data.path", lambda: data_source(small_config("")), ("data.path",)),
        (
            "missing data.path",
            lambda: data_source(small_config(str(tmp_path / "gone"))),
            ("gone", "no such"),
        ),
        (
            "missing data.eval_path",
            lambda: data_source(small_config(str(good), eval_path=str(tmp_path / "ev"))),
            ("ev", "data.eval_path"),
        ),
        (
            "no held-out split",
            lambda: data_source(small_config(str(nosplit))),
            (str(nosplit), "--eval-fraction"),
        ),
        ("one raw TSV file", lambda: data_source(small_config(str(f))), ("train.txt", "eval_path")),
    ]
    other = small_config(str(good))
    other.embedding.tables = [
        dataclasses.replace(t, rows=t.rows + 1) for t in other.embedding.tables
    ]
    cases.append(
        ("hashed with other rows", lambda: data_source(other), ("feature C1", "hashed modulo 50"))
    )
    three = small_config(str(good))
    three.embedding.tables = three.embedding.tables[:3]
    cases.append(
        ("3 tables for 26 features", lambda: data_source(three), ("26 features", "3 tables"))
    )
    for name, fn, match in cases:
        SOURCE.expect_error(name, fn, match)
    broken = tmp_path / "broken"
    pre([f], broken, eval_fraction=0.2, workers=1)
    m = json.loads((broken / "manifest.json").read_text())
    shard = broken / "shards" / f"{m['shards'][0]['name']}.dense.npy"
    shard.write_bytes(shard.read_bytes()[:200])
    SOURCE.expect_error(
        "truncated shard", lambda: data_source(small_config(str(broken))), (shard.name,)
    )
    shard.unlink()
    SOURCE.expect_error(
        "missing shard", lambda: data_source(small_config(str(broken))), (shard.name,)
    )
    (broken / "manifest.json").write_text("{not json")
    SOURCE.expect_error(
        "garbage manifest", lambda: data_source(small_config(str(broken))), ("manifest.json",)
    )
    (broken / "manifest.json").unlink()
    SOURCE.expect_error(
        "no manifest (cut short)",
        lambda: data_source(small_config(str(broken))),
        (str(broken), "preprocess"),
    )
    # The Kaggle config (tables of 34M rows, a minute to build): refused in seconds.
    kaggle = load_config(KAGGLE)
    kaggle.data = dataclasses.replace(kaggle.data, path=str(nosplit), workers=0)
    t0 = time.perf_counter()
    SOURCE.expect_error(
        "kaggle config, no held-out split", lambda: Trainer(kaggle), "--eval-fraction"
    )
    kaggle.data = dataclasses.replace(kaggle.data, path=str(tmp_path / "criteo_pre"))
    SOURCE.expect_error("kaggle config, missing data.path", lambda: Trainer(kaggle), "criteo_pre")
    took = time.perf_counter() - t0
    SOURCE.record("refused before the tables", "handled" if took < 10 else "crash", f"{took:.1f}s")
    SOURCE.check()


def test_raw_tsv_source_skip_mode_reports_the_count(tmp_path: Path) -> None:
    import contextlib
    import io

    from neorec.builder import data_source

    lines = base_lines(11, 50)
    lines[3] = set_field(lines[3], 2, b"x")
    lines[30] = lines[30].replace(b"\t", b"\r", 1)
    write(tmp_path / "day_0.tsv", lines[:40])
    write(tmp_path / "day_1.tsv", lines[40:])
    src = data_source(small_config(str(tmp_path), bad_lines="skip"))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        n = sum(b.size for b in src.train_batches())
    said = (
        "data: skipped 2 bad lines of 40 in the train files (first: day_0.tsv:4: " in buf.getvalue()
    )
    SOURCE.record(
        "raw TSV, skip mode: counted and said",
        "handled" if n == 38 and said else "silently accepted",
        buf.getvalue(),
    )
    SOURCE.check()


def cli_error(name: str, r: Any, match: tuple[str, ...]) -> None:
    """A CLI run that must exit 2 with one ``neorec: error:`` line."""
    outcome, detail = judge_cli(r, match)
    if outcome == "clear error" and r.returncode != 2:
        outcome, detail = "crash", f"exit {r.returncode}: {detail}"
    SOURCE.record(name, outcome, detail)


def test_readme_flow_end_to_end(tmp_path: Path) -> None:
    raw = tmp_path / "criteo_raw"
    raw.mkdir()
    write(raw / "train.txt", base_lines(10, 300))
    r = run_cli(
        ["data", "preprocess", "--input", "criteo_raw/", "--output", "criteo_pre/"],
        cwd=str(tmp_path),
    )
    ok = r.returncode == 0
    m = json.loads((tmp_path / "criteo_pre" / "manifest.json").read_text()) if ok else {}
    ok = ok and m["rows"] == KAGGLE_ROWS and m["split"]["eval"] == round(300 / 7)
    SOURCE.record("README preprocess command", "handled" if ok else "crash", r.stderr[-300:])
    if ok:  # the Kaggle config accepts it (its checks only: building its tables takes a minute)
        from neorec.builder import data_source

        kaggle = load_config(KAGGLE)
        kaggle.data = dataclasses.replace(kaggle.data, path=str(tmp_path / "criteo_pre"), workers=0)
        try:
            data_source(kaggle)
            SOURCE.record("kaggle config reads the README output", "handled")
        except Exception as e:  # noqa: BLE001
            SOURCE.record("kaggle config reads the README output", "crash", str(e))
    # end to end with a small model: preprocess for its tables, then train (one CLI run each)
    cfg = tmp_path / "small.toml"
    text = Path(KAGGLE).read_text()
    for t, rows in zip(load_config(KAGGLE).embedding.tables, ROWS):
        text = text.replace(
            f'name = "{t.name}"\nrows = {t.rows}\n', f'name = "{t.name}"\nrows = {rows}\n'
        )
    cfg.write_text(text)
    run_cli(
        ["data", "preprocess", "--input", "criteo_raw", "--output", "small", "--config", str(cfg)],
        cwd=str(tmp_path),
    )
    sets = "data.path=small data.batch_size=32 train.steps=3 train.run_dir=run data.workers=0"
    argv = ["train", "--config", str(cfg)] + [a for kv in sets.split() for a in ("--set", kv)]
    r = run_cli(argv, cwd=str(tmp_path), timeout=300)
    ok = r.returncode == 0 and (tmp_path / "run" / "metrics.json").exists()
    SOURCE.record(
        "preprocess + train end to end", "handled" if ok else "crash", (r.stderr or r.stdout)[-400:]
    )
    r = run_cli(["data", "preprocess", "--input", "missing/", "--output", "o/"], cwd=str(tmp_path))
    cli_error("CLI: missing input, exit 2", r, ("neorec: error:", "missing"))
    r = run_cli(["train", "--config", str(cfg), "--set", "data.path=nowhere/"], cwd=str(tmp_path))
    cli_error("CLI: train, missing data.path", r, ("neorec: error:", "nowhere"))
    SOURCE.check()
