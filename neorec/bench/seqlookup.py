"""``neorec bench seqlookup``: one training step of a sequence (non-pooled) lookup: forward,
backward and row update, on the same ids for each implementation.

- ``neorec``: ``SequenceEmbeddingCollection`` (one fused kernel call forward, one backward-update);
- ``torch``: one ``nn.Embedding(sparse=True)`` per table and torch's optimizer matching the row
  optimizer (``SGD``; ``Adagrad`` for row-wise Adagrad, element-wise there; ``SparseAdam``);
- ``fbgemm`` (when ``fbgemm_gpu`` imports): FBGEMM's TBE used as TorchRec does on CPU, a pooled
  lookup over bags of length 1 with its fused optimizer (no CPU Adam: skipped then).

Each table is read by one sequence feature; every feature has the same sequences (a history's
item ids, their categories, ...): per sample a length from a Zipf law on [1, ``--max-len``] whose
exponent gives mean ``--mean-len``, ids Zipf(``--alpha``). Rounds run every implementation once,
in rotated order; ``speedup_vs_torch`` / ``speedup_vs_fbgemm`` are the paired ratios of the
per-round median step times with 95% intervals (``neorec.bench.stats``). Prints a table, then one
JSON line.

    neorec bench seqlookup --tables 2 --rows 1000000 --dim 64 --batch 1024 --rounds 10
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from neorec.bench.stats import paired_ratio, rotated
from neorec.config import TableConfig
from neorec.data.ids import zipf_ids
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec
from neorec.modules.sequence import SequenceEmbeddingCollection
from neorec.ops.row_optim import OPTIMIZERS, RowOptimizer
from neorec.sparse import JaggedFeatures

__all__ = ["main", "parse_args", "zipf_lengths"]

Step = Callable[[Tensor, Tensor], None]
"""One training step on (ids [T*N], lengths [B])."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``neorec bench seqlookup``."""
    p = argparse.ArgumentParser(prog="neorec bench seqlookup", description=__doc__.splitlines()[0])
    p.add_argument("--tables", type=int, default=2, help="tables, one sequence feature each")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024, help="sequences per step")
    p.add_argument("--mean-len", type=float, default=50.0, help="mean sequence length")
    p.add_argument("--max-len", type=int, default=200, help="longest sequence")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of ids; 0 = uniform")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--rounds", type=int, default=10, help="paired rounds")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation a round")
    p.add_argument("--batches", type=int, default=3, help="distinct pre-generated batches")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    has_fbgemm = importlib.util.find_spec("fbgemm_gpu") is not None
    p.add_argument(
        "--compare", choices=("fbgemm", "none"), default="fbgemm" if has_fbgemm else "none"
    )
    a = p.parse_args(argv)
    for name in ("tables", "rows", "dim", "batch", "max_len", "rounds", "steps", "batches"):
        if getattr(a, name) < 1:
            raise ConfigError(f"bench seqlookup: --{name.replace('_', '-')} must be >= 1")
    if not 1 <= a.mean_len <= (a.max_len + 1) / 2:
        raise ConfigError(
            f"bench seqlookup: --mean-len {a.mean_len} must lie in [1, (max_len + 1) / 2] "
            f"(a Zipf law on [1, {a.max_len}] has a mean at most the uniform one)"
        )
    return a


def zipf_lengths(n: int, mean: float, max_len: int, gen: torch.Generator) -> Tensor:
    """``n`` lengths in [1, max_len], P(l) proportional to l^-s, s >= 0 chosen (bisection) so the
    mean is ``mean``."""
    ls = torch.arange(1, max_len + 1, dtype=torch.float64)

    def mean_of(s: float) -> float:
        p = ls.pow(-s)
        return float((p * ls).sum() / p.sum())

    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_of(mid) > mean else (lo, mid)
    p = ls.pow(-lo)
    return torch.multinomial(p / p.sum(), n, replacement=True, generator=gen) + 1


def make_batches(a: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """(ids [T*N] table-major, lengths [B]) per batch; every table has the same lengths."""
    gen = torch.Generator().manual_seed(a.seed)
    out = []
    for _ in range(a.batches):
        lens = zipf_lengths(a.batch, a.mean_len, a.max_len, gen)
        n = int(lens.sum())
        ids = [zipf_ids(a.rows, n, a.alpha, generator=gen, salt=t) for t in range(a.tables)]
        out.append((torch.cat(ids), lens))
    return out


def _ours(a: argparse.Namespace) -> Step:
    keys = [f"f{t}" for t in range(a.tables)]
    tables = [TableConfig(name=f"t{t}", rows=a.rows, dim=a.dim, features=[keys[t]]) for t in range(a.tables)]  # fmt: skip
    opt = RowOptimizer(kind=a.optimizer, lr=a.lr, eps=a.eps)
    ec = SequenceEmbeddingCollection(
        tables, CollectionSpec(optimizer=opt, backend="cpu", seed=a.seed)
    )

    def step(ids: Tensor, lens: Tensor) -> None:
        out = ec(JaggedFeatures(keys, ids, lens.repeat(a.tables)))
        out.backward(_grad(out.numel()))

    return step


def _torch(a: argparse.Namespace) -> Step:
    embs = [torch.nn.Embedding(a.rows, a.dim, sparse=True) for _ in range(a.tables)]
    params = [p for e in embs for p in e.parameters()]
    opt: torch.optim.Optimizer
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=a.lr)
    elif a.optimizer == "rowwise_adagrad":
        opt = torch.optim.Adagrad(params, lr=a.lr, eps=a.eps)
    else:
        opt = torch.optim.SparseAdam(params, lr=a.lr, eps=a.eps)

    def step(ids: Tensor, lens: Tensor) -> None:
        n = ids.numel() // a.tables
        outs = [e(ids[t * n : (t + 1) * n]) for t, e in enumerate(embs)]
        torch.cat(outs).backward(_grad(n * a.tables * a.dim).view(-1, a.dim))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _fbgemm(a: argparse.Namespace) -> Step:
    from neorec.bench.op import fbgemm_tbe  # the peer is imported here only

    emb = fbgemm_tbe([a.rows] * a.tables, a.dim, a.optimizer, a.lr, a.eps, "cpu")

    def step(ids: Tensor, lens: Tensor) -> None:
        offsets = torch.arange(ids.numel() + 1, dtype=torch.int64)  # bags of length 1
        out = emb(ids, offsets)  # [N, T*D]
        out.backward(_grad(out.numel()).view_as(out))

    return step


_GRAD = torch.empty(0)


def _grad(n: int) -> Tensor:
    """The same output gradient values for every implementation (first ``n`` of a fixed draw)."""
    global _GRAD
    if _GRAD.numel() < n:
        _GRAD = torch.randn(n, generator=torch.Generator().manual_seed(1))
    return _GRAD[:n]


def _time(step: Step, batches: list[tuple[Tensor, Tensor]], steps: int, r: int) -> float:
    """Median ms of ``steps`` steps after one warm-up step."""
    times = []
    for i in range(steps + 1):
        ids, lens = batches[(r + i) % len(batches)]
        t0 = time.perf_counter()
        step(ids, lens)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Entry point: paired rounds of every implementation, a table, one JSON line."""
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(a.threads)
    batches = make_batches(a)
    makers = {"neorec": _ours, "torch": _torch}
    if a.compare == "fbgemm":
        makers["fbgemm"] = _fbgemm
    steps: dict[str, Step] = {}
    for name, make in makers.items():
        try:
            steps[name] = make(a)
            _time(steps[name], batches, 1, 0)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this optimizer is skipped
            if name == "neorec":
                raise
            print(f"note: {name} skipped: {str(e).strip().splitlines()[-1][:200]}", file=sys.stderr)
            steps.pop(name, None)
    ms: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(a.rounds):
        for name in rotated(list(steps), r):
            ms[name].append(_time(steps[name], batches, a.steps, r))
    ids_per_step = statistics.fmean(int(b[0].numel()) for b in batches)
    print(f"{'impl':<10}{'ms/step':>10}{'min':>10}")
    for name, xs in ms.items():
        print(f"{name:<10}{statistics.median(xs):>10.2f}{min(xs):>10.2f}")
    line: dict = {"bench": "seqlookup", "ms_per_step": round(statistics.median(ms["neorec"]), 3)}
    for peer in ("torch", "fbgemm"):
        line[f"{peer}_ms_per_step"] = round(statistics.median(ms[peer]), 3) if peer in ms else None
        line[f"speedup_vs_{peer}"] = None
        if peer in ms:
            ratio = statistics.median(ms[peer]) / statistics.median(ms["neorec"])
            iv = paired_ratio(ms[peer], ms["neorec"]).to_dict() if a.rounds > 1 else None
            line[f"speedup_vs_{peer}"] = iv or {"value": ratio, "lo": None, "hi": None, "n": 1}
            print(f"speedup vs {peer}, paired by round: {line[f'speedup_vs_{peer}']}")
    print(json.dumps({**line, "ids_per_step": ids_per_step, **vars(a)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
