"""``neorec bench op``: time one TBE training step (pooled forward + fused backward-update).

Each implementation (ours, and FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` when
installed) runs in its own subprocess, so peak memory is per implementation, on the same ids:
every worker regenerates them from the seed. Prints a table, then one JSON line.

    neorec bench op --tables 8 --rows 1000000 --dim 64 --batch 2048 --pooling 100 --alpha 1.05

``--device cuda`` times the GPU path: our backend ``auto`` (triton when installed, else cuda) on
CUDA tensors next to FBGEMM GPU's CUDA TBE (``pip install fbgemm-gpu``, the CUDA wheel matching
torch), each step timed between ``torch.cuda.synchronize()`` calls; peak HBM is reported. Without a
CUDA device, or without fbgemm_gpu (unless ``--compare none``), it stops with a one-line error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from neorec.bench.stats import paired_ratio
from neorec.data.ids import zipf_ids
from neorec.errors import ConfigError
from neorec.ops.memory import table_empty
from neorec.ops.row_optim import OPTIMIZERS, RowOptimizer, state_shapes, zeros_state
from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, get_backend, tbe_lookup

__all__ = ["main", "parse_args", "check_gpu_bench", "fbgemm_tbe"]

_MB = 1024 * 1024


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``neorec bench op``."""
    p = argparse.ArgumentParser(prog="neorec bench op", description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=100, help="ids per bag (mean if variable)")
    p.add_argument("--alpha", type=float, default=0.0, help="Zipf exponent of ids; 0 = uniform")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batches", type=int, default=3, help="distinct pre-generated batches")
    p.add_argument(
        "--backend", default=None, help="neorec TBE backend to time (default: cpu; auto on cuda)"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where tables live")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the implementations in turn this many times and keep each one's best median "
        "(damps noise from other processes on a shared machine)",
    )
    grp = p.add_mutually_exclusive_group()
    grp.add_argument("--fixed-pooling", dest="fixed", action="store_true", default=True)
    grp.add_argument("--variable-pooling", dest="fixed", action="store_false")
    has_fbgemm = importlib.util.find_spec("fbgemm_gpu") is not None
    p.add_argument(
        "--compare",
        choices=("fbgemm", "none"),
        default="fbgemm" if has_fbgemm else "none",
        help="also time this peer implementation (default: fbgemm when installed)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.backend is None:
        a.backend = "auto" if a.device == "cuda" else "cpu"
    if a.device == "cuda" and "--compare" not in (argv or []):
        a.compare = "fbgemm"  # the point of a GPU run: the peer side by side
    return a


def check_gpu_bench(bench: str, device: str, compare: str) -> None:
    """Refuse ``--device cuda`` in one line (``ConfigError``) without a CUDA device, or without
    fbgemm_gpu when it is to be compared."""
    if device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"bench {bench} --device cuda: torch {torch.__version__} sees no CUDA device here; "
            "run it on a GPU host with a CUDA build of torch, or use --device cpu"
        )
    if compare == "fbgemm" and importlib.util.find_spec("fbgemm_gpu") is None:
        raise ConfigError(
            f"bench {bench} --device cuda: fbgemm_gpu is not installed; pip install fbgemm-gpu "
            f"(the CUDA wheel matching torch {torch.__version__}), or pass --compare none"
        )


def fbgemm_tbe(
    rows: list[int], dim: int, optimizer: str, lr: float, eps: float, device: str
) -> torch.nn.Module:
    """FBGEMM's TBE over ``rows`` tables of ``dim`` (one feature each), trained by its fused
    optimizer; on ``device`` (HBM on cuda, host on cpu). Imported here only."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        PoolingMode as FPooling,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kinds = {
        "sgd": EmbOptimType.EXACT_SGD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adam": EmbOptimType.ADAM,
    }
    cuda = device == "cuda"
    where = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if cuda else (
        EmbeddingLocation.HOST, ComputeDevice.CPU
    )  # fmt: skip
    emb: torch.nn.Module = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, dim, *where) for r in rows],
        optimizer=kinds[optimizer],
        learning_rate=lr,
        eps=eps,
        pooling_mode=FPooling.SUM,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu",
    )
    return emb


def make_batches(a: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """Deterministic (indices, offsets) batches, table-major, one feature per table."""
    gen = torch.Generator().manual_seed(a.seed)
    out = []
    for _ in range(a.batches):
        ids, lens = [], []
        for t in range(a.tables):
            if a.fixed:
                ln = torch.full((a.batch,), a.pooling, dtype=torch.int64)
            else:
                ln = torch.randint(0, 2 * a.pooling + 1, (a.batch,), generator=gen)
            lens.append(ln)
            ids.append(zipf_ids(a.rows, int(ln.sum()), a.alpha, generator=gen, salt=t))
        lengths = torch.cat(lens)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        out.append((torch.cat(ids), offsets))
    return out


def _ours(a: argparse.Namespace) -> Callable[[Tensor, Tensor, Tensor], None]:
    layout = TBELayout(
        rows=(a.rows,) * a.tables, dims=(a.dim,) * a.tables, feature_table=tuple(range(a.tables))
    )
    gen = torch.Generator().manual_seed(a.seed + 1)
    dev = torch.device(a.device)
    weights = table_empty(layout.total_elems).uniform_(-0.01, 0.01, generator=gen).to(dev)
    state = zeros_state(a.optimizer, layout.total_rows, layout.total_elems, dev)
    backend = get_backend(a.backend, dev)
    opt = RowOptimizer(kind=a.optimizer, lr=a.lr, eps=a.eps)
    anchor = torch.empty(0, requires_grad=True, device=dev)
    step = [0]

    def run(indices: Tensor, offsets: Tensor, grad: Tensor) -> None:
        step[0] += 1
        lookup = Lookup(indices, offsets, None, PoolingMode.SUM)

        def update(g: Tensor) -> None:
            backend.backward_update(layout, weights, state, lookup, g, opt, step[0])

        out = tbe_lookup(anchor, backend, layout, weights, lookup, update)
        out.backward(grad)

    return run


def _fbgemm(a: argparse.Namespace) -> Callable[[Tensor, Tensor, Tensor], None]:
    # The peer is imported here only: neorec itself never depends on fbgemm.
    emb = fbgemm_tbe([a.rows] * a.tables, a.dim, a.optimizer, a.lr, a.eps, a.device)

    def run(indices: Tensor, offsets: Tensor, grad: Tensor) -> None:
        emb(indices, offsets).backward(grad)

    return run


def budget_mb(a: argparse.Namespace, n_ids: int) -> float:
    """1.5 x (weights + optimizer state + one batch: ids, offsets, output, output grad)."""
    elems = a.tables * a.rows * a.dim
    state = sum(state_shapes(a.optimizer, a.tables * a.rows, elems).values())
    batch = 8 * n_ids + 8 * (a.tables * a.batch + 1) + 2 * 4 * a.batch * a.tables * a.dim
    return 1.5 * (4 * (elems + state) + batch) / _MB


def worker(a: argparse.Namespace) -> dict:
    """Time one implementation in this process; returns its figures."""
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batches = [(i.to(dev), o.to(dev)) for i, o in make_batches(a)]
    grad = torch.randn(a.batch, a.tables * a.dim, generator=torch.Generator().manual_seed(a.seed))
    grad = grad.to(dev)
    run = _fbgemm(a) if a.worker == "fbgemm" else _ours(a)
    times = []
    for i in range(a.warmup + a.iters):
        indices, offsets = batches[i % len(batches)]
        sync()
        t0 = time.perf_counter()
        run(indices, offsets, grad)
        sync()  # a GPU step is timed to its end, not to its launch
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    hbm = {"peak_hbm_mb": torch.cuda.max_memory_allocated() / _MB} if cuda else {}
    return {
        **hbm,
        "impl": a.worker,
        "ms_per_step": 1e3 * statistics.median(times),
        "ms_mean": 1e3 * statistics.fmean(times),
        "ms_min": 1e3 * min(times),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ids_per_step": batches[0][0].numel(),
    }


def _spawn(impl: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "neorec.bench.op", *argv, "--worker", impl]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker '{impl}' failed ({proc.returncode}):\n{proc.stderr}")
    res: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


def main(argv: list[str] | None = None) -> int:
    """Entry point: run each implementation in a subprocess, print a table and a JSON line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    check_gpu_bench("op", a.device, a.compare)
    impls = [a.backend] + (["fbgemm"] if a.compare == "fbgemm" else [])
    res: dict[str, dict] = {}
    per_repeat: dict[str, list[float]] = {impl: [] for impl in impls}
    for rep in range(max(a.repeats, 1)):
        # alternate, so slow spells of a shared machine hit both; and swap who goes first each
        # repeat, so neither always runs on the cooler (or warmer) machine
        for impl in list(impls) if rep % 2 == 0 else list(reversed(impls)):
            try:
                r = _spawn(impl, argv)
            except RuntimeError as e:
                if impl == a.backend:
                    raise
                # e.g. FBGEMM has no CPU Adam: report ours alone rather than nothing
                print(f"note: {impl} skipped: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
                impls.remove(impl)
                continue
            per_repeat[impl].append(r["ms_per_step"])
            best = res.get(impl)
            if best is None or r["ms_per_step"] < best["ms_per_step"]:
                res[impl] = {**r, "peak_rss_mb": max(r["peak_rss_mb"], (best or r)["peak_rss_mb"])}
    budget = budget_mb(a, res[a.backend]["ids_per_step"])
    print(f"{'impl':<10}{'ms/step':>10}{'mean':>10}{'min':>10}{'peak RSS MB':>14}")
    for impl, r in res.items():
        print(
            f"{impl:<10}{r['ms_per_step']:>10.1f}{r['ms_mean']:>10.1f}{r['ms_min']:>10.1f}"
            f"{r['peak_rss_mb']:>14.0f}"
        )
    ours = res[a.backend]
    line = {
        "bench": "op",
        "backend": a.backend,
        "device": a.device,
        "peak_hbm_mb": ours.get("peak_hbm_mb"),
        "fbgemm_peak_hbm_mb": res.get("fbgemm", {}).get("peak_hbm_mb"),
        "ms_per_step": round(ours["ms_per_step"], 3),
        "peak_rss_mb": round(ours["peak_rss_mb"], 1),
        "rss_budget_mb": round(budget, 1),
        "rss_within_budget": ours["peak_rss_mb"] <= budget,
        "fbgemm_ms_per_step": None,
        "fbgemm_peak_rss_mb": None,
        "speedup_vs_fbgemm": None,
    }
    if "fbgemm" in res:
        fb = res["fbgemm"]
        line["fbgemm_ms_per_step"] = round(fb["ms_per_step"], 3)
        line["fbgemm_peak_rss_mb"] = round(fb["peak_rss_mb"], 1)
        line["speedup_vs_fbgemm"] = round(fb["ms_per_step"] / ours["ms_per_step"], 2)
        if len(per_repeat["fbgemm"]) == len(per_repeat[a.backend]) > 1:
            # FBGEMM's time over ours, paired by repeat (each repeat runs both, alternating)
            iv = paired_ratio(per_repeat["fbgemm"], per_repeat[a.backend])
            line["speedup_vs_fbgemm_interval"] = iv.to_dict()
            print(f"speedup vs FBGEMM, paired by repeat: {iv}")
    print(f"budget: peak RSS <= {budget:.0f} MB (1.5 x weights + state + batch)")
    skip = ("worker", "backend", "compare", "device")
    config = {k: v for k, v in vars(a).items() if k not in skip}
    config["fixed_pooling"] = config.pop("fixed")
    print(json.dumps({**line, **config, "pooling_mode": "sum"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
