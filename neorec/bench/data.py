"""``neorec bench data``: preprocessing MB/s and reader samples/s per core vs the train step's need.

Writes a synthetic Criteo TSV file, preprocesses it (1 worker and all cores), then reads it back
with :class:`ShardedReader` in the calling process (one core, no workers: the per-core rate) for
the one-hot Criteo layout and the MLPerf DLRMv2 multi-hot layout. The tabular path next to it:
the same ``--tabular-rows`` rows of ``neorec data example-parquet``'s generator (dense, hashed and
vocabulary ids, a weighted multi-hot list) as one Parquet and one CSV file, each preprocessed
(1 worker: one file is one unit) and read directly (``data.source = "tabular"``, no
preprocessing: batches parsed and encoded in the calling process), with the schema of
``--tabular-config``; rows/s and input MB/s. The training step's consumption rate comes from
``neorec bench step`` (``--step-samples-per-s`` to pass a measured one). Medians of ``--repeat``
runs: the cores are shared and timings are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from neorec.config import Config, load_config
from neorec.data.loader import SampleOrder, ShardedReader
from neorec.data.preprocess import PreprocessOptions, preprocess
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular
from neorec.data.tabular_source import TabularSource
from neorec.errors import DataError

__all__ = ["main", "write_tsv", "MLPERF_MULTI_HOT"]

# MLPerf DLRMv2 (Criteo 1TB multi-hot) bag sizes of C1..C26
MLPERF_MULTI_HOT = [
    3,
    2,
    1,
    2,
    6,
    1,
    1,
    1,
    1,
    7,
    3,
    8,
    1,
    6,
    9,
    5,
    1,
    1,
    1,
    12,
    100,
    27,
    10,
    3,
    1,
    1,
]


def write_tsv(path: Path, lines: int, seed: int = 0) -> int:
    """A Criteo-shaped TSV file (about 10% empty fields, Kaggle-like value ranges); its bytes."""
    rng = random.Random(seed)
    pool = [f"{rng.getrandbits(32):08x}" for _ in range(50_000)]
    with open(path, "w") as f:
        for _ in range(lines):
            dense = [
                "" if rng.random() < 0.1 else str(int(rng.expovariate(0.01)) - 2) for _ in range(13)
            ]
            cats = ["" if rng.random() < 0.1 else rng.choice(pool) for _ in range(26)]
            f.write("\t".join([str(int(rng.random() < 0.25)), *dense, *cats]) + "\n")
    return path.stat().st_size


def _cpu_s() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _preprocess_mbs(
    src: Path, out: Path, workers: int, repeat: int, **kw: object
) -> tuple[float, float]:
    """Median (MB/s wall, MB per CPU second); the second does not suffer from shared cores."""
    rates, per_cpu = [], []
    for _ in range(repeat):
        opts = PreprocessOptions(
            rows=[10_000_000],
            workers=workers,
            chunk_bytes=8 << 20,
            eval_fraction=0.0,
            **kw,  # type: ignore[arg-type]
        )
        c0 = _cpu_s()
        s = preprocess([src], out, opts)
        rates.append(s.input_bytes / 1e6 / s.seconds)
        per_cpu.append(s.input_bytes / 1e6 / max(_cpu_s() - c0, 1e-9))
    return statistics.median(rates), statistics.median(per_cpu)


def _reader_rate(path: Path, batch: int, repeat: int, seconds: float) -> tuple[float, float]:
    """Median (samples/s wall, samples per CPU second) of one rank reading shuffled batches in
    the calling process (one core, no workers)."""
    rates, per_cpu = [], []
    for r in range(repeat):
        reader = ShardedReader(
            path, batch, order=SampleOrder(seed=r, shuffle=True, shuffle_buffer=1 << 18)
        )
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            for b in reader:
                n += b.size
                if time.perf_counter() - t0 > seconds:
                    break
        rates.append(n / (time.perf_counter() - t0))
        per_cpu.append(n / max(time.process_time() - c0, 1e-9))
    return statistics.median(rates), statistics.median(per_cpu)


def _tabular_preprocess(src: Path, out: Path, cfg: Config, repeat: int) -> tuple[float, float]:
    """Median (rows/s wall, rows per CPU second) of preprocessing one tabular file."""
    rates, per_cpu = [], []
    for _ in range(repeat):
        opts = TabularOptions(workers=1, eval_fraction=0)
        c0, t0 = _cpu_s(), time.perf_counter()
        m = preprocess_tabular([src], out, cfg.data.schema, cfg.embedding.tables, opts)
        rows = m["split"]["train"]
        rates.append(rows / (time.perf_counter() - t0))
        per_cpu.append(rows / max(_cpu_s() - c0, 1e-9))
    return statistics.median(rates), statistics.median(per_cpu)


def _tabular_direct(
    files: list[Path], config: str, repeat: int, seconds: float
) -> tuple[float, float]:
    """Median (rows/s wall, rows per CPU second) of reading train batches straight from a
    tabular file (after the source's fitting pass, which is not timed)."""
    cfg = load_config(config, [f"data.path='{files[0]}'", f"data.eval_path='{files[1]}'"])
    src = TabularSource(cfg.data, cfg.embedding.tables)
    rates, per_cpu = [], []
    for _ in range(repeat):
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            for b in src.train_batches():
                n += b.size
                if time.perf_counter() - t0 > seconds:
                    break
        rates.append(n / (time.perf_counter() - t0))
        per_cpu.append(n / max(time.process_time() - c0, 1e-9))
    return statistics.median(rates), statistics.median(per_cpu)


def tabular_rates(d: Path, rows: int, config: str, repeat: int, seconds: float) -> dict[str, Any]:
    """The tabular path's figures on ``rows`` generated rows as Parquet and as CSV."""
    from neorec.data.example import write_example
    from neorec.data.tabular import need_pyarrow

    cfg = load_config(config, [])
    out: dict[str, Any] = {"tabular_rows": rows}
    fmts = ["parquet", "csv"]
    try:
        need_pyarrow()
    except DataError as e:
        print(f"tabular: Parquet skipped ({e})", flush=True)
        fmts = ["csv"]
    for fmt in fmts:
        files = write_example(
            d / f"tab_{fmt}", fmt, train=rows, eval=max(cfg.data.batch_size, rows // 50), seed=0
        )
        mb = files[0].stat().st_size / 1e6
        pre, pre_cpu = _tabular_preprocess(files[0], d / f"tab_{fmt}_pre", cfg, repeat)
        direct, direct_cpu = _tabular_direct(files, config, repeat, seconds)
        out.update({
            f"tabular_{fmt}_mb": round(mb, 1),
            f"preprocess_{fmt}_rows_s": round(pre),
            f"preprocess_{fmt}_mb_s": round(pre * mb / rows, 2),
            f"preprocess_{fmt}_rows_per_cpu_s": round(pre_cpu),
            f"direct_{fmt}_rows_s": round(direct),
            f"direct_{fmt}_mb_s": round(direct * mb / rows, 2),
            f"direct_{fmt}_rows_per_cpu_s": round(direct_cpu),
        })  # fmt: skip
    read, _ = _reader_rate(d / f"tab_{fmts[0]}_pre", 2048, repeat, seconds)
    out["reader_tabular_samples_s_per_core"] = round(read)
    return out


def _step_rate(iters: int) -> float:
    from neorec.bench.step import main as step_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        step_main(["--iters", str(iters), "--warmup", "1"])
    return float(json.loads(buf.getvalue().strip().splitlines()[-1])["samples_per_s"])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    p = argparse.ArgumentParser(prog="neorec bench data", description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=200_000, help="synthetic TSV lines")
    p.add_argument("--batch", type=int, default=2048, help="global batch of the reader")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--read-seconds", type=float, default=2.0, help="per reader measurement")
    p.add_argument("--step-iters", type=int, default=5, help="iterations of `bench step`")
    p.add_argument(
        "--step-samples-per-s",
        type=float,
        default=0.0,
        help="use this train step rate instead of running `bench step`",
    )
    p.add_argument("--dir", default="", help="work directory (default: a temporary one)")
    p.add_argument(
        "--tabular-rows", type=int, default=100_000, help="rows of the tabular files (0: skip)"
    )
    p.add_argument(
        "--tabular-config",
        default="configs/parquet_example.toml",
        help="the schema and tables the tabular files are read with",
    )
    a = p.parse_args(argv)
    if a.tabular_rows:
        load_config(a.tabular_config, [])  # checked before any work
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(dir=a.dir or None) as tmp:
        d = Path(tmp)
        src = d / "day_0.tsv"
        size = write_tsv(src, a.lines)
        one, one_cpu = _preprocess_mbs(src, d / "one", 1, a.repeat)
        allc, _ = _preprocess_mbs(src, d / "all", cores, a.repeat)
        mh, mh_cpu = _preprocess_mbs(src, d / "mh", cores, 1, multi_hot=MLPERF_MULTI_HOT)
        read, read_cpu = _reader_rate(d / "one", a.batch, a.repeat, a.read_seconds)
        read_mh, read_mh_cpu = _reader_rate(d / "mh", a.batch, a.repeat, a.read_seconds)
        shard_bytes = sum(f.stat().st_size for f in (d / "one" / "shards").iterdir())
        tab = (
            tabular_rates(d, a.tabular_rows, a.tabular_config, a.repeat, a.read_seconds)
            if a.tabular_rows
            else {}
        )
    step = a.step_samples_per_s or _step_rate(a.step_iters)
    result = {
        "bench": "data",
        "lines": a.lines,
        "input_mb": round(size / 1e6, 1),
        "output_bytes_per_sample": round(shard_bytes / a.lines, 1),
        "cores": cores,
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "preprocess_mb_s_1_worker": round(one, 1),
        "preprocess_rows_s_1_worker": round(one * 1e6 * a.lines / size),
        "preprocess_mb_per_cpu_s": round(one_cpu, 1),
        "preprocess_mb_s_all_cores": round(allc, 1),
        "preprocess_multi_hot_mb_per_cpu_s": round(mh_cpu, 1),
        "reader_samples_s_per_core": round(read),
        "reader_samples_per_cpu_s": round(read_cpu),
        "reader_multi_hot_samples_s_per_core": round(read_mh),
        "reader_multi_hot_samples_per_cpu_s": round(read_mh_cpu),
        "train_step_samples_s": round(step, 1),
        "reader_to_step_ratio": round(read / step, 1),
        "reader_multi_hot_to_step_ratio": round(read_mh / step, 1),
        **tab,
    }
    print(f"{'metric':<40}{'value':>14}")
    for k, v in result.items():
        if k != "bench":
            print(f"{k:<40}{v!s:>14}")
    print(json.dumps(result))
    return 0
