"""``neorec bench qlookup``: the serving tables' pooled lookup (``neorec.ops.quant_lookup``) at
each stored width on the same ids: time per batch, and the speed-up over the fp32 rows.

Per shape ``TxRxD`` (T tables of R rows x D) and id distribution (uniform; Zipf ``--alpha``): a
batch is ``--batch`` bags of ``--pooling`` ids per table, one ``pooled`` call per table (what the
serving loader runs per feature: its Python wrapper included); ``numpy`` is the loader's own fp32
path (gather, then ``index_add_``), what serving ran before the kernel. Each round times every width once,
in a rotated order (the median of ``--iters`` batches after ``--warmup``); the speed-up of a width
is fp32's time over its own, the geometric mean over rounds with its 95% interval, paired by round
(``neorec.bench.stats.paired_ratio``). The defaults: the default model's tables (8 x 10k x 16,
pooling 4, batch 512: they sit in L2 at every width) and 4 x 1M x 64 (fp32 1 GiB: its rows come
from DRAM, as ``--batches`` distinct batches are cycled through).
Integer rows are quantized over each row's [min, max] here (the range search changes the values,
not the work). ``rel_error`` is the largest |pooled - fp32 pooled| over the largest |fp32
pooled| of the first batch.

    neorec bench qlookup --rounds 10 --iters 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from neorec.bench.stats import paired_ratio, rotated
from neorec.data.ids import zipf_ids
from neorec.errors import ConfigError
from neorec.ops import quant_lookup as ql

__all__ = ["main", "parse_args", "parse_shape"]

FP32 = "none"
NUMPY = "numpy"
"""fp32 rows pooled by the loader's NumPy path (what serving ran before the kernel)."""


def parse_shape(text: str) -> tuple[int, int, int]:
    """``TxRxD`` -> (tables, rows, dim), each >= 1; a one-line ``ConfigError`` otherwise."""
    try:
        t, r, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--shapes {text!r}: expected TABLESxROWSxDIM, e.g. 8x10000x16") from None
    if min(t, r, d) < 1:
        raise ConfigError(f"--shapes {text!r}: tables, rows and dim must be >= 1")
    return t, r, d


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``neorec bench qlookup``."""
    p = argparse.ArgumentParser(prog="neorec bench qlookup", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x10000x16,4x1000000x64", help="TxRxD,... tables")
    p.add_argument("--kinds", default="none,fp16,int8,int4,int2", help="widths (none: fp32)")
    p.add_argument("--batch", type=int, default=512, help="bags per table per batch")
    p.add_argument("--pooling", type=int, default=4, help="ids per bag")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the skewed ids")
    p.add_argument("--ids", default="uniform,zipf", help="id distributions: uniform, zipf")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="timed batches per width per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--batches",
        type=int,
        default=64,
        help="distinct pre-generated batches, timed in turn (64 of 4 x 2048 uniform ids on the "
        "1M x 64 tables touch ~128 MB of fp32 rows: more than the L3, so a batch's rows come "
        "from DRAM; a few batches would be L3 hits)",
    )
    p.add_argument("--threads", type=int, default=1, help="kernel threads (a serving worker's)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.shape_list = [parse_shape(s) for s in a.shapes.split(",")]
    a.kind_list = a.kinds.split(",")
    bad = [k for k in a.kind_list if k not in ql.KINDS]
    if bad or FP32 not in a.kind_list:
        raise ConfigError(f"--kinds {a.kinds!r}: choose from {', '.join(ql.KINDS)}, with none")
    a.id_list = a.ids.split(",")
    if not set(a.id_list) <= {"uniform", "zipf"}:
        raise ConfigError(f"--ids {a.ids!r}: choose from uniform, zipf")
    for name in ("batch", "pooling", "rounds", "iters", "batches", "threads"):
        if getattr(a, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(a, name)}")
    return a


def _tables(shape: tuple[int, int, int], kinds: list[str], seed: int) -> dict[str, list[Any]]:
    """Per width, the shape's tables stored at it (from the same fp32 rows)."""
    t, r, d = shape
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[Any]] = {k: [] for k in kinds}
    for _ in range(t):
        w = torch.randn(r, d, generator=g) * 0.01
        for k in kinds:
            out[k].append(ql.quantize_rows(w, k, adaptive_range=False))
    out[NUMPY] = out[FP32]  # the same fp32 rows, the loader's NumPy path
    return out


def _batches(a: argparse.Namespace, shape: tuple[int, int, int], dist: str) -> list[Any]:
    """``--batches`` batches: per table (ids, offsets) of fixed-length bags."""
    t, r, _ = shape
    g = torch.Generator().manual_seed(a.seed + 1)
    offsets = np.arange(a.batch + 1, dtype=np.int64) * a.pooling
    alpha = a.alpha if dist == "zipf" else 0.0
    return [
        [(zipf_ids(r, a.batch * a.pooling, alpha, g, salt=j).numpy(), offsets) for j in range(t)]
        for _ in range(a.batches)
    ]


def _numpy(tab: Any, ids: np.ndarray, off: np.ndarray) -> torch.Tensor:
    """The loader's own fp32 path (``standalone.Predictor``: gather, then ``index_add_``)."""
    rows = torch.from_numpy(np.ascontiguousarray(tab.data[ids]))
    lens = torch.from_numpy(np.diff(off))
    seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    return torch.zeros(lens.numel(), tab.dim).index_add_(0, seg, rows)


def _run(kind: str, tables: list[Any], batch: list[Any], threads: int) -> list[torch.Tensor]:
    if kind == NUMPY:
        return [_numpy(tab, ids, off) for tab, (ids, off) in zip(tables, batch)]
    return [ql.pooled(tab, ids, off, threads=threads) for tab, (ids, off) in zip(tables, batch)]


def _time(kind: str, tables: list[Any], batches: list[Any], a: argparse.Namespace) -> float:
    """Median seconds per batch over ``--iters`` batches after ``--warmup``."""
    times = []
    for i in range(a.warmup + a.iters):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        _run(kind, tables, b, a.threads)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _case(a: argparse.Namespace, shape: tuple[int, int, int], tables: dict, dist: str) -> dict:
    batches = _batches(a, shape, dist)
    ref = torch.cat(_run(FP32, tables[FP32], batches[0], a.threads))
    err = {
        k: float((torch.cat(_run(k, tabs, batches[0], a.threads)) - ref).abs().max())
        / max(float(ref.abs().max()), 1e-30)
        for k, tabs in tables.items()
    }
    secs: dict[str, list[float]] = {k: [] for k in tables}
    for r in range(a.rounds):
        for k in rotated(list(tables), r):
            secs[k].append(_time(k, tables[k], batches, a))
    return {
        "shape": "x".join(map(str, shape)),
        "ids": dist,
        "ms_per_batch": {k: round(1e3 * statistics.median(v), 4) for k, v in secs.items()},
        "speedup_vs_fp32": {
            k: paired_ratio(secs[FP32], v).to_dict() if a.rounds > 1 else None
            for k, v in secs.items()
            if k != FP32
        },
        "bytes_per_row": {k: ql.row_bytes(k, shape[2]) for k in tables if k != NUMPY},
        "rel_error": {k: float(f"{v:.3g}") for k, v in err.items()},
    }


def _print(cases: list[dict], kinds: list[str]) -> None:
    names = {FP32: "fp32", NUMPY: "fp32 numpy"}
    head = f"{'tables':<15}{'ids':<9}" + "".join(f"{names.get(k, k):>26}" for k in kinds)
    print(head)
    for c in cases:
        cells = []
        for k in kinds:
            ms = c["ms_per_batch"][k]
            sp = c["speedup_vs_fp32"].get(k)
            x = f" {sp['value']:.2f}x [{sp['lo']:.2f},{sp['hi']:.2f}]" if sp else ""
            cells.append(f"{ms:>9.3f} ms{x}".rjust(26))
        print(f"{c['shape']:<15}{c['ids']:<9}" + "".join(cells))
    print("(ms per batch; speed-up = fp32's time / the width's, 95% interval paired by round)")


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the table, then one JSON line."""
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if ql.native_lib() is None:
        raise ConfigError("bench qlookup times the compiled kernel: no C compiler found (CC)")
    torch.set_num_threads(a.threads)
    cases = []
    for i, shape in enumerate(a.shape_list):
        tables = _tables(shape, a.kind_list, a.seed + 10 * i)
        cases += [_case(a, shape, tables, dist) for dist in a.id_list]
        del tables
    _print(cases, [*a.kind_list, NUMPY])
    line = {
        "bench": "qlookup",
        "cases": cases,
        "int4_speedup_vs_fp32": {
            f"{c['shape']}/{c['ids']}": c["speedup_vs_fp32"].get("int4") for c in cases
        },
        **{k: getattr(a, k) for k in ("batch", "pooling", "alpha", "rounds", "iters", "threads")},
        "shapes": a.shapes,
        "kinds": a.kinds,
        "seed": a.seed,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
