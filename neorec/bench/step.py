"""``neorec bench step``: one full DLRM training step (embeddings + dense + optimizers)."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from neorec.config import load_config
from neorec.data.batch import Batch
from neorec.data.ids import zipf_ids
from neorec.modules.dlrm import build_dlrm
from neorec.sparse import SparseFeatures
from neorec.train.trainer import make_dense_optimizer, train_step

__all__ = ["main"]

DEFAULT_CONFIG = "configs/dlrm_benchmark.toml"


def make_batches(cfg, n: int, alpha: float, seed: int = 0) -> list[Batch]:
    """``n`` random batches of the config's shape; fixed pooling, Zipf(alpha) ids (0 = uniform)."""
    g = torch.Generator().manual_seed(seed)
    b = cfg.data.batch_size
    out = []
    for _ in range(n):
        values, lengths = [], []
        for i, t in enumerate(cfg.embedding.tables):
            for _f in t.features:
                pf = int(round(t.pooling_factor))
                values.append(zipf_ids(t.rows, b * pf, alpha, g, salt=i))
                lengths.append(torch.full((b,), pf, dtype=torch.int64))
        sparse = SparseFeatures(cfg.embedding.feature_names, torch.cat(values), torch.cat(lengths))
        dense = torch.randn(b, cfg.model.num_dense, generator=g)
        labels = (torch.rand(b, generator=g) < 0.25).float()
        out.append(Batch(dense, sparse, labels))
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench step", description=__doc__)
    p.add_argument("--config", default=None, help=f"TOML config (default {DEFAULT_CONFIG})")
    p.add_argument("--tables", type=int)
    p.add_argument("--rows", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--pooling", type=float)
    p.add_argument("--alpha", type=float, default=0.0, help="Zipf exponent of ids (0 = uniform)")
    p.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad", "adam"])
    p.add_argument("--backend", default=None, help="TBE backend (auto, cpu, reference)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bf16", action="store_true", help="dense MLPs under bf16 autocast (AMX)")
    p.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    path = a.config or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).exists() else None)
    sets = []
    for flag, key in [
        (a.tables, "embedding.num_tables"),
        (a.rows, "embedding.rows"),
        (a.dim, "embedding.dim"),
        (a.batch, "data.batch_size"),
        (a.pooling, "embedding.pooling_factor"),
        (a.optimizer, "embedding.optimizer"),
        (a.backend, "embedding.backend"),
    ]:
        if flag is not None:
            sets.append(f"{key}={flag!r}" if isinstance(flag, str) else f"{key}={flag}")
    if a.dim is not None:
        cfg0 = load_config(path)
        sets.append(f"model.bottom_mlp={cfg0.model.bottom_mlp[:-1] + [a.dim]}")
    if a.tables is not None or a.rows is not None or a.dim is not None or a.pooling is not None:
        sets.append("embedding.tables=[]")
    cfg = load_config(path, sets)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build_dlrm(cfg)
    opt = make_dense_optimizer(cfg, model.dense_parameters())
    batches = make_batches(cfg, 4, a.alpha)
    times = []
    for i in range(a.warmup + a.iters):
        t0 = time.perf_counter()
        train_step(model, opt, batches[i % len(batches)], i + 1, bf16=a.bf16)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    ms = 1000 * statistics.median(times)
    backend_name = str(model.ebc.backend.name)  # type: ignore[union-attr]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = cfg.embedding.tables
    result = {
        "bench": "step",
        "tables": len(t),
        "rows": t[0].rows,
        "dim": t[0].dim,
        "batch": cfg.data.batch_size,
        "pooling": t[0].pooling_factor,
        "alpha": a.alpha,
        "optimizer": cfg.embedding.optimizer,
        "backend": backend_name,
        "bf16_dense": a.bf16,
        "threads": torch.get_num_threads(),
        "ms_per_step": round(ms, 2),
        "ms_per_step_mean": round(1000 * statistics.mean(times), 2),
        "samples_per_s": round(cfg.data.batch_size / (ms / 1000), 1),
        "peak_rss_mb": round(rss_mb, 1),
    }
    print(f"{'metric':<22}{'value':>14}")
    for k in ("tables", "rows", "dim", "batch", "pooling", "alpha", "optimizer", "backend"):
        print(f"{k:<22}{result[k]!s:>14}")
    for k in ("bf16_dense", "ms_per_step", "ms_per_step_mean", "samples_per_s", "peak_rss_mb"):
        print(f"{k:<22}{result[k]!s:>14}")
    print(json.dumps(result))
    return 0
