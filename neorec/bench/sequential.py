"""``neorec bench sequential``: SASRec on real MovieLens-100K, next-item ranking against the full
item corpus (leave-one-out; docs/data.md, "Sequential MovieLens").

The data are ``neorec data movielens --sequential``'s (written to a temporary folder and read
back through the on-disk format). Settings (dropout and epochs) are chosen by mean validation
NDCG@10 (target = each user's second-to-last interaction) over ``--select-seeds``; the chosen
setting is then trained on ``--seeds`` other seeds (``--seed-base`` on) and reported on the test
split (target = the last interaction, the validation item part of the input): HR@K, NDCG@K, MRR@K
(K = 10, 50) and MRR, each the mean over seeds with its t interval (``n`` = seeds), and an
interval over users (``users``: the per-user values averaged over seeds, mean +- 1.96 standard
errors) that says how much the figure would move on other users of the same kind. A popularity
ranking (train targets' counts; deterministic) is reported next to it for scale.

Without ``--input``, ML-100K comes from RecBole 1.2.1's wheel as ``bench movielens`` fetches it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from neorec.bench.stats import mean_interval, parse_seeds
from neorec.errors import ConfigError

__all__ = ["main", "QUICK", "pop_ranks", "summarize"]

QUICK = {"dropout": 0.5, "epochs": 40}
"""``--quick``'s settings (no search): those the full search chose on ML-100K (select seed 0,
validation NDCG@10 0.0590; dropout 0.2 / 0.5 x epochs 20 / 40 / 60)."""
METRICS = ("hr@10", "ndcg@10", "mrr@10", "hr@50", "ndcg@50", "mrr@50", "mrr")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags (checked before any work)."""
    p = argparse.ArgumentParser(prog="neorec bench sequential", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["sasrec"], default="sasrec")
    p.add_argument("--input", default="", help="a MovieLens folder (default: fetch ML-100K)")
    p.add_argument("--cache", default="", help="where a fetched ML-100K is kept")
    p.add_argument("--exclude-seen", choices=["on", "off"], default="off",
                   help="remove the user's history from the candidates (the target stays)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help="how many reported seeds")
    p.add_argument("--seed-base", type=int, default=100, help="the first reported seed")
    p.add_argument("--select-seeds", default="0", help="seeds settings are chosen on (a-b, a,b)")
    p.add_argument("--dropouts", type=_floats, default=[0.2, 0.5], help="dropout grid")
    p.add_argument("--epochs", type=_ints, default=[20, 40, 60], help="epochs grid (one run each "
                   "dropout and seed, evaluated at each)")  # fmt: skip
    p.add_argument("--loss", choices=["full", "sampled"], default="full")
    p.add_argument("--negatives", type=int, default=256, help="sampled softmax: negatives")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--max-len", type=int, default=50)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help=f"no search: {QUICK}")
    a = p.parse_args(argv)
    if a.seeds < 1 or a.seed_base < 0:
        raise ConfigError(
            f"--seeds must be >= 1 and --seed-base >= 0, got {a.seeds}, {a.seed_base}"
        )
    dev = parse_seeds(a.select_seeds, "--select-seeds")
    rep = set(range(a.seed_base, a.seed_base + a.seeds))
    if not a.quick and rep & set(dev):
        raise ConfigError(f"--select-seeds {a.select_seeds} overlap the reported seeds "
                          f"{a.seed_base}..{a.seed_base + a.seeds - 1}: choose others")  # fmt: skip
    if not a.dropouts or any(not 0 <= d < 1 for d in a.dropouts):
        raise ConfigError(f"--dropouts {a.dropouts}: want values in [0, 1)")
    if not a.epochs or min(a.epochs) < 1:
        raise ConfigError(f"--epochs {a.epochs}: want positive integers")
    if min(a.dim, a.max_len, a.blocks, a.batch, a.negatives, a.threads) < 1 or a.lr <= 0:
        raise ConfigError(
            "--dim, --max-len, --blocks, --batch, --negatives, --threads, --lr must be > 0"
        )
    return a


def pop_ranks(data: Any, ev: Any, exclude_seen: bool) -> np.ndarray:
    """Ranks of a popularity scorer (train targets' counts)."""
    from neorec.data.seq_batches import item_counts
    from neorec.metrics_rank import target_ranks

    counts = item_counts(data).astype(np.float64)
    scores = np.broadcast_to(counts, (len(ev.targets), len(counts)))
    return target_ranks(scores, ev.targets, ev.seen, exclude_seen)


def summarize(per_seed: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per metric: mean over seeds with its t interval; ``users``: the interval over users."""
    out: dict[str, Any] = {"users": {}}
    for m in METRICS:
        vals = [float(p[m].mean()) for p in per_seed]
        out[m] = mean_interval(vals).to_dict() if len(vals) > 1 else {
            "value": vals[0], "lo": vals[0], "hi": vals[0], "n": 1}  # fmt: skip
        per_user = np.mean([p[m] for p in per_seed], axis=0)
        half = 1.96 * float(per_user.std(ddof=1)) / math.sqrt(len(per_user))
        mu = float(per_user.mean())
        out["users"][m] = {"value": mu, "lo": mu - half, "hi": mu + half, "n": len(per_user)}
    return out


def _settings(a: argparse.Namespace, dropout: float, epochs: int) -> Any:
    from neorec.train.sequential import SeqSettings

    return SeqSettings(dim=a.dim, max_len=a.max_len, blocks=a.blocks, dropout=dropout, lr=a.lr,
                       batch_size=a.batch, epochs=epochs, loss=a.loss, negatives=a.negatives)  # fmt: skip


def _recorder(got: dict[int, list[float]], ev: Any, excl: bool) -> Callable[[int, Any], None]:
    """An ``on_epoch`` that appends the validation NDCG@10 at the epochs ``got`` names."""
    from neorec.metrics_rank import rank_metrics
    from neorec.train.sequential import ranks_of

    def on_epoch(epoch: int, model: Any) -> None:
        if epoch in got:
            got[epoch].append(rank_metrics(ranks_of(model, ev, excl))["ndcg@10"])

    return on_epoch


def select(
    a: argparse.Namespace, data: Any, excl: bool, say: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, float]]:
    """The (dropout, epochs) of the best mean validation NDCG@10 over the select seeds."""
    from neorec.data.seq_batches import eval_set
    from neorec.train.sequential import fit

    ev = eval_set(data, "valid", a.max_len)
    tried: dict[str, float] = {}
    for d in a.dropouts:
        got: dict[int, list[float]] = {e: [] for e in a.epochs}
        for s in parse_seeds(a.select_seeds, "--select-seeds"):
            fit(data, _settings(a, d, max(a.epochs)), s, _recorder(got, ev, excl))
        for e in a.epochs:
            tried[f"dropout {d:g} epochs {e}"] = statistics.fmean(got[e])
        say(f"  select dropout {d:g}: valid NDCG@10 by epochs "
            + " ".join(f"{e}: {statistics.fmean(got[e]):.4f}" for e in a.epochs))  # fmt: skip
    best = max(tried, key=lambda k: tried[k])
    _, d_s, _, e_s = best.split()
    return {"dropout": float(d_s), "epochs": int(e_s)}, tried


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return _run(a)
    finally:
        torch.set_num_threads(threads)  # a caller's (a test's) own setting back


def _run(a: argparse.Namespace) -> int:
    """Selection, the reported seeds, the table and the JSON line."""
    from neorec.bench.movielens import RECBOLE, cache_dir, fetch_ml100k
    from neorec.data.seq_batches import eval_set
    from neorec.data.sequential import load_sequential, write_sequential
    from neorec.machine import cpu_model_and_flags
    from neorec.metrics_rank import per_user_metrics
    from neorec.train.sequential import fit, ranks_of

    def say(s: str) -> None:
        print(s, flush=True)

    t0 = time.perf_counter()
    src = Path(a.input) if a.input else fetch_ml100k(Path(a.cache) if a.cache else cache_dir(), say)
    with tempfile.TemporaryDirectory(prefix="neorec-bench-seq-") as tmp:
        manifest = write_sequential(src, tmp)
        data = load_sequential(tmp)
    excl = a.exclude_seen == "on"
    chosen, tried = (dict(QUICK), {}) if a.quick else select(a, data, excl, say)
    say(f"chosen: {chosen}")
    test = eval_set(data, "test", a.max_len)
    sas = []
    for s in range(a.seed_base, a.seed_base + a.seeds):
        model = fit(data, _settings(a, chosen["dropout"], chosen["epochs"]), s)
        sas.append(per_user_metrics(ranks_of(model, test, excl)))
        say(f"  seed {s}: test HR@10 {sas[-1]['hr@10'].mean():.4f} "
            f"NDCG@10 {sas[-1]['ndcg@10'].mean():.4f}")  # fmt: skip
    result: dict[str, Any] = {
        "bench": "sequential",
        "sasrec": summarize(sas),
        "pop": summarize([per_user_metrics(pop_ranks(data, test, excl))]),
        "protocol": {
            "split": "test: each user's last interaction (leave-one-out; the one before = valid)",
            "candidates": f"full corpus ({data.num_items} items)",
            "exclude_seen": excl,
            "ties": "pessimistic (the target ranks last among equal scores)",
            "users": len(test.targets),
        },
        "settings": {
            **chosen,
            "loss": a.loss,
            "negatives": a.negatives if a.loss == "sampled" else None,
            "dim": a.dim,
            "max_len": a.max_len,
            "blocks": a.blocks,
            "lr": a.lr,
            "batch": a.batch,
        },  # fmt: skip
        "selection": tried,
        "select_seeds": [] if a.quick else parse_seeds(a.select_seeds, "--select-seeds"),
        "seeds": list(range(a.seed_base, a.seed_base + a.seeds)),
        "quick": a.quick,
        "input": a.input or None,
        "dataset": None if a.input else f"ML-100K from {RECBOLE}'s wheel",
        "source_sha256": manifest["source_sha256"],
        "cpu": cpu_model_and_flags()[0],
        "threads": a.threads,
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    print(json.dumps(result, sort_keys=True))
    return 0


def print_table(r: dict[str, Any]) -> None:
    """One row per model: the reported metrics, mean [95% interval over seeds]."""
    p = r["protocol"]
    print(f"\ntest split, {p['candidates']}, seen items {'excluded' if p['exclude_seen'] else 'kept'}, "
          f"{p['users']} users; seeds {r['seeds']}")  # fmt: skip
    print(f"{'model':8s}" + "".join(f"{m:>24s}" for m in ("hr@10", "ndcg@10", "mrr@10", "hr@50")))
    for name in ("sasrec", "pop"):
        row = r[name]
        print(f"{name:8s}" + "".join(
            f"{row[m]['value']:>8.4f} [{row[m]['lo']:.4f}, {row[m]['hi']:.4f}]"
            for m in ("hr@10", "ndcg@10", "mrr@10", "hr@50")))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
