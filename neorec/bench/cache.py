"""``neorec bench cache``: row-cache hit rates vs cache size, and training throughput from SSD.

1. Hit rate: the real cache (``CachedEmbeddingBagCollection.prepare``) replayed over batches of
   locality-calibrated ids (``neorec.data.ids.locality_ids``, fitted to ../shared/data) and of Zipf
   ids, for caches of 1, 5, 10, 25% of the rows, LRU and LFU, next to the analytic estimate
   (``neorec.sharding.hit_rate.expected_hit_rate``).
2. Throughput: a training step with every table in DRAM (``EmbeddingBagCollection``) vs an SSD
   store behind a 10% cache with the next batch prefetched while the current one computes.
   Target: SSD >= 50% of DRAM. ``--model tbe`` (default) times the embedding part alone (pooled
   forward + fused backward-update: the cache's whole cost, nothing to hide it behind);
   ``--model dlrm`` a full DLRM step around it (dense MLPs of ``configs/dlrm_benchmark.toml``,
   bottom 512-512-64 / top 1024-1024-1024-1, dot interaction, forward + backward + SGD), the
   samples/s a user trains at, with the prefetch overlapping the dense compute.
3. ``--io``: reading/writing random records of a store file by pread/pwrite vs mmap.

Prints a table, then one JSON line.

    neorec bench cache --tables 8 --rows 1000000 --dim 64 --batch 2048 --pooling 20
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from neorec.config import ModelConfig, TableConfig
from neorec.data.ids import LOCALITY_REF_BATCH, locality_ids, zipf_ids
from neorec.modules.collection import CollectionSpec
from neorec.modules.dlrm import DenseArch
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops import settings
from neorec.ops.row_optim import OPTIMIZERS, RowOptimizer
from neorec.sharding.hit_rate import expected_hit_rate
from neorec.sparse import SparseFeatures
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.store import StoreSettings

__all__ = ["main", "parse_args"]

FRACTIONS = (0.01, 0.05, 0.10, 0.25)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``neorec bench cache``."""
    p = argparse.ArgumentParser(prog="neorec bench cache", description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=20, help="ids per bag")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the zipf ids")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    p.add_argument("--hit-batches", type=int, default=40, help="batches per hit-rate point")
    p.add_argument("--hit-warmup", type=int, default=20, help="batches before counting hits")
    p.add_argument("--hit-tables", type=int, default=2, help="tables in the hit-rate replay")
    p.add_argument(
        "--hit-rows",
        type=int,
        default=10_000_000,
        help="rows per table in the hit-rate replay (a 1%% cache must hold one batch's rows)",
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=20, help="steps that fill the cache first")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setup (median kept)")
    p.add_argument("--cache-fraction", type=float, default=0.10)
    p.add_argument(
        "--model",
        choices=("tbe", "dlrm"),
        default="tbe",
        help="time the embedding step alone, or a full DLRM step (dlrm_benchmark's MLPs)",
    )
    p.add_argument("--bottom-mlp", default="512,512,64", help="--model dlrm: bottom MLP widths")
    p.add_argument("--top-mlp", default="1024,1024,1024,1", help="--model dlrm: top MLP widths")
    p.add_argument("--io-threads", type=int, default=2, help="storage.io_threads")
    p.add_argument(
        "--mapped-mb", type=int, default=0, help="storage.mapped_mb (0: a quarter of the RAM)"
    )
    p.add_argument("--dir", default="", help="directory of the SSD store (default: a temp dir)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hit", action="store_true", help="skip the hit-rate sweep")
    p.add_argument("--skip-train", action="store_true", help="skip the throughput comparison")
    p.add_argument("--io", action="store_true", help="also compare pread/pwrite with mmap")
    return p.parse_args(argv)


def _tables(
    a: argparse.Namespace, n: int, dim: int, rows: int = 0, **kw: object
) -> list[TableConfig]:
    return [
        TableConfig(name=f"t{i}", rows=rows or a.rows, dim=dim, pooling_factor=a.pooling, **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


def make_batches(
    a: argparse.Namespace, n: int, tables: int, dist: str, seed: int, rows: int = 0
) -> list[SparseFeatures]:
    """``n`` batches of fixed-pooling bags, one feature per table, ids ``locality`` or ``zipf``."""
    g = torch.Generator().manual_seed(seed)
    keys = [f"t{i}" for i in range(tables)]
    lengths = torch.full((tables * a.batch,), a.pooling, dtype=torch.int64)
    rows = rows or a.rows
    out = []
    for _ in range(n):
        vals = []
        for t in range(tables):
            m = a.batch * a.pooling
            if dist == "zipf":
                vals.append(zipf_ids(rows, m, a.alpha, g, salt=t))
            else:
                vals.append(locality_ids(rows, m, a.pooling * LOCALITY_REF_BATCH, g, salt=t))
        out.append(SparseFeatures(keys, torch.cat(vals), lengths))
    return out


# ---- 1. hit rate ---------------------------------------------------------------------------------
def hit_rates(a: argparse.Namespace) -> list[dict]:
    """Measured and expected hit rates for each (ids, policy, cache fraction)."""
    rows = []
    for dist in ("locality", "zipf"):
        n = a.hit_warmup + a.hit_batches
        batches = make_batches(a, n, a.hit_tables, dist, a.seed, a.hit_rows)
        for policy in ("lru", "lfu"):
            for frac in FRACTIONS:
                tables = _tables(
                    a,
                    a.hit_tables,
                    4,
                    a.hit_rows,
                    storage="dram",
                    cache_fraction=frac,
                    cache_policy=policy,
                )
                spec = CollectionSpec(RowOptimizer(kind="sgd"), backend="cpu", seed=a.seed)
                ebc = CachedEmbeddingBagCollection(tables, spec)
                for i, b in enumerate(batches):
                    if i == a.hit_warmup:
                        for c in ebc._cached.values():
                            c.counts = dict.fromkeys(c.counts, 0)
                    ebc.prepare(b)
                st = ebc.stats()
                alpha = None if dist == "locality" else a.alpha
                rows.append(
                    {
                        "ids": dist,
                        "policy": policy,
                        "cache_fraction": frac,
                        "hit_rate": round(float(st["hit_rate"]), 4),
                        "lookup_hit_rate": round(float(st["lookup_hit_rate"]), 4),
                        "expected_lookup_hit_rate": round(
                            expected_hit_rate(tables[0], frac, alpha, policy), 4
                        ),
                    }
                )
    return rows


# ---- 2. throughput -------------------------------------------------------------------------------
def _dense_arch(a: argparse.Namespace) -> DenseArch | None:
    """``--model dlrm``: the dense part (same initial weights for every run)."""
    if a.model != "dlrm":
        return None
    widths = [[int(x) for x in s.split(",")] for s in (a.bottom_mlp, a.top_mlp)]
    cfg = ModelConfig(bottom_mlp=widths[0], top_mlp=widths[1], interaction="dot")
    torch.manual_seed(a.seed)
    return DenseArch(cfg, a.tables, a.dim)


def _time_steps(
    model: torch.nn.Module,
    batches: list[SparseFeatures],
    a: argparse.Namespace,
    prefetch: bool,
    dense_arch: DenseArch | None = None,
) -> list[float]:
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(a.batch, a.tables * a.dim, generator=g)
    dense = torch.randn(a.batch, ModelConfig().num_dense, generator=g)
    labels = torch.randint(0, 2, (a.batch,), generator=g).float()
    sgd = None
    if dense_arch is not None:
        dense_arch = copy.deepcopy(dense_arch)
        sgd = torch.optim.SGD(dense_arch.parameters(), lr=0.01)
    times = []
    n = a.warmup + a.iters
    for i in range(n):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        out = model(b)
        if prefetch:
            # Stage of a pipeline: the next batch's rows are read while this one computes.
            model.prefetch(batches[(i + 1) % len(batches)])  # type: ignore[operator]
        if dense_arch is None:
            out.backward(grad)
        else:
            assert sgd is not None
            sgd.zero_grad(set_to_none=True)
            loss = F.binary_cross_entropy_with_logits(dense_arch(dense, out), labels)
            loss.backward()
            sgd.step()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    return times


def throughput(a: argparse.Namespace, root: Path) -> dict:
    """Median ms per training step: all in DRAM vs SSD store + cache (+ prefetch)."""
    opt = RowOptimizer(kind=a.optimizer, lr=0.01)
    batches = make_batches(a, 2 * (a.warmup + a.iters), a.tables, "locality", a.seed + 7)
    res: dict = {}
    spec = CollectionSpec(opt, backend="cpu", seed=a.seed)
    mem = EmbeddingBagCollection(_tables(a, a.tables, a.dim), spec)
    dram_runs = []
    ssd_runs = []
    t0 = time.perf_counter()
    ssd = CachedEmbeddingBagCollection(
        _tables(a, a.tables, a.dim, storage="ssd", cache_fraction=a.cache_fraction),
        spec,
        storage=StoreSettings(dir=root, io_threads=a.io_threads, mapped_mb=a.mapped_mb),
    )
    res["ssd_create_s"] = round(time.perf_counter() - t0, 2)
    dense_arch = _dense_arch(a)
    for _ in range(a.repeats):  # alternate, so slow spells of a shared machine hit both
        dram_runs.append(statistics.median(_time_steps(mem, batches, a, False, dense_arch)))
        before = ssd.stats()
        ssd_runs.append(statistics.median(_time_steps(ssd, batches, a, True, dense_arch)))
    after = ssd.stats()
    t0 = time.perf_counter()
    ssd.flush()
    res["flush_s"] = round(time.perf_counter() - t0, 2)
    steps = a.warmup + a.iters
    hits = int(after["hits"]) - int(before["hits"])
    misses = int(after["misses"]) - int(before["misses"])
    res.update(
        dram_ms_per_step=round(1e3 * statistics.median(dram_runs), 2),
        ssd_ms_per_step=round(1e3 * statistics.median(ssd_runs), 2),
        dram_runs_ms=[round(1e3 * x, 1) for x in dram_runs],
        ssd_runs_ms=[round(1e3 * x, 1) for x in ssd_runs],
        ssd_hit_rate=round(hits / max(1, hits + misses), 4),
        ssd_mb_read_per_step=round(
            (int(after["ssd_bytes_read"]) - int(before["ssd_bytes_read"])) / steps / 2**20, 2
        ),
        ssd_mb_written_per_step=round(
            (int(after["ssd_bytes_written"]) - int(before["ssd_bytes_written"])) / steps / 2**20,
            2,
        ),
        prefetched_share=round(int(after["staged"]) / max(1, int(after["misses"])), 3),
    )
    res["ssd_vs_dram"] = round(res["dram_ms_per_step"] / res["ssd_ms_per_step"], 3)
    ssd.close()
    return res


# ---- 3. pread/pwrite vs mmap ---------------------------------------------------------------------
def io_compare(a: argparse.Namespace, root: Path) -> dict:
    """Random-record read/write rates (M records/s): the store's mapped C copies (what the cache
    uses) vs pread/pwrite in a C loop (``rowio``, 2 threads), a Python pread loop, and numpy
    fancy indexing on the same mapping."""
    import numpy as np

    from neorec.storage import rowio
    from neorec.storage.store import HEADER_BYTES, SsdStore, record_fields

    fields = record_fields(a.optimizer, a.dim)
    width = sum(w for _, w in fields)
    store = SsdStore.create(
        root / "io.rows", a.rows, fields, lambda lo, hi: torch.zeros(hi - lo, width)
    )
    mm = np.memmap(store.path, np.float32, "r+", HEADER_BYTES, (a.rows, width))
    g = torch.Generator().manual_seed(a.seed)
    n = min(a.rows // 4, 50_000)
    out: dict[str, list[float]] = {}
    rb = store.record_bytes

    def clock(name: str, fn: object) -> None:
        ids = torch.unique(torch.randint(0, a.rows, (n,), generator=g))
        t0 = time.perf_counter()
        fn(ids)  # type: ignore[operator]
        out.setdefault(name, []).append(ids.numel() / (time.perf_counter() - t0) / 1e6)

    rec = torch.rand(n, width)
    buf = torch.empty(n, width)

    def pread(ids: torch.Tensor) -> None:
        rowio.read_records(store.fd, ids, rb, HEADER_BYTES, buf, 2)

    def pwrite(ids: torch.Tensor) -> None:
        rowio.write_records(store.fd, ids, rb, HEADER_BYTES, rec[: ids.numel()], 2)

    for _ in range(max(a.repeats, 3)):
        clock("mapped_read", lambda ids: store.read(ids))
        clock("pread_c", pread)
        settings.NATIVE = False  # rowio's Python path
        clock("pread_python", pread)
        settings.NATIVE = True
        clock("numpy_mmap_read", lambda ids: torch.from_numpy(mm[ids.numpy()]))
        clock("mapped_write", lambda ids: store.write(ids, rec[: ids.numel()]))
        clock("pwrite_c", pwrite)
        clock(
            "numpy_mmap_write", lambda ids: mm.__setitem__(ids.numpy(), rec[: ids.numel()].numpy())
        )
    mm.flush()
    store.close()
    return {k: round(statistics.median(v), 3) for k, v in out.items()}


def _print_hits(rows: list[dict]) -> None:
    print(
        f"{'ids':<10}{'policy':<8}{'cache':>7}{'hit(rows)':>11}{'hit(lookups)':>14}{'expected':>10}"
    )
    for r in rows:
        print(
            f"{r['ids']:<10}{r['policy']:<8}{100 * r['cache_fraction']:>6.0f}%"
            f"{r['hit_rate']:>11.3f}{r['lookup_hit_rate']:>14.3f}{r['expected_lookup_hit_rate']:>10.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the parts, print tables and one JSON line."""
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(a.threads)
    line: dict = {"bench": "cache"}
    if not a.skip_hit:
        hits = hit_rates(a)
        _print_hits(hits)
        line["hit_rates"] = hits
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="neorec-bench-cache-"))
    try:
        if not a.skip_train:
            tp = throughput(a, root)
            print(
                f"\n{a.model.upper()} train step  all-in-DRAM {tp['dram_ms_per_step']:.1f} ms  "
                f"SSD + {100 * a.cache_fraction:.0f}% cache {tp['ssd_ms_per_step']:.1f} ms  "
                f"-> {100 * tp['ssd_vs_dram']:.0f}% of DRAM throughput (target >= 50%)  "
                f"hit {tp['ssd_hit_rate']:.3f}  SSD r/w {tp['ssd_mb_read_per_step']:.1f}/"
                f"{tp['ssd_mb_written_per_step']:.1f} MB/step"
            )
            line.update(tp)
            line["meets_target"] = tp["ssd_vs_dram"] >= 0.5
        if a.io:
            io = io_compare(a, root)
            print("\nrandom records, M/s: " + "  ".join(f"{k} {v:.2f}" for k, v in io.items()))
            line["io_mrecords_per_s"] = io
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    line["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    config = {k: v for k, v in vars(a).items() if k not in ("dir", "skip_hit", "skip_train")}
    print(json.dumps({**line, **config}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
