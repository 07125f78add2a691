"""``neorec bench step --compare torchrec``: our step against TorchRec's, rounds in fresh processes.

Each of ``--rounds`` rounds times both sides, each in a fresh process of its own
(``neorec.bench.step ... --worker ours|torchrec``) on the same batches (regenerated from the
seed), in an order rotated by the round (``stats.rotated``: ours first in even rounds, TorchRec's
first in odd ones), so a drift of the machine's speed and whatever a process inherits (allocator
state, page placement, thread pinning) fall on both alike. A worker steps ``--warmup`` untimed
then ``--iters`` timed steps; its figure is their median. ``vs_torchrec`` is ours / TorchRec's:
the geometric mean of the per-round ratios with its 95% t interval over rounds
(``stats.paired_ratio``), so the interval covers the spread between processes, not only between
steps of one.

Both models must be the same model: each worker reports its model's shapes (every table's rows
and dim, the bottom and top MLPs' layers, the interaction's parameter count, the total), and any
difference stops the run with one line before a figure is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from neorec.bench.stats import paired_ratio, rotated
from neorec.errors import ConfigError

__all__ = [
    "SIDES",
    "model_shapes",
    "ours_shapes",
    "torchrec_shapes",
    "check_same_model",
    "run_rounds",
    "check_compare_args",
]

SIDES = ("ours", "torchrec")
"""The two sides, in round 0's order (rotated every round)."""

Json = dict[str, Any]


def _linears(module: nn.Module) -> list[list[int]]:
    """``[in, out]`` of every ``nn.Linear`` in ``module``, in order."""
    return [[m.in_features, m.out_features] for m in module.modules() if isinstance(m, nn.Linear)]


def _numel(modules: Iterable[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def model_shapes(
    tables: Iterable[tuple[str, int, int]], bottom: nn.Module, interaction: nn.Module,
    top: nn.Module,
) -> Json:  # fmt: skip
    """What must match between the two models: each table (name, rows, dim), the MLPs' layers
    ``[in, out]``, the interaction's parameter count, and the parameters in all."""
    emb = sorted((name, int(rows), int(dim)) for name, rows, dim in tables)
    return {
        "embeddings": [list(t) for t in emb],
        "bottom_mlp": _linears(bottom),
        "interaction_params": _numel([interaction]),
        "top_mlp": _linears(top),
        "params": sum(r * d for _, r, d in emb) + _numel([bottom, interaction, top]),
    }


def ours_shapes(model: Any) -> Json:
    """``model_shapes`` of our DLRM (its tables are buffers of the collection, not parameters)."""
    ebc, arch = model.ebc, model.dense_arch
    tables = [(t.name, *ebc.table_weight(t.name).shape) for t in ebc.tables]
    extra = [m for m in (arch.aux_head, arch.adapter) if m is not None]
    shapes = model_shapes(tables, arch.bottom, arch.interaction, arch.top)
    shapes["params"] += _numel(extra)  # an ExFM student's parts: a model TorchRec's is not
    return shapes


def torchrec_shapes(model: Any) -> Json:
    """``model_shapes`` of TorchRec's DLRM (``step_torchrec``): its tables as FBGEMM holds them."""
    ebc = model.sparse_arch.embedding_bag_collection
    prefix = "embedding_bags."
    tables = [
        (k[len(prefix) : -len(".weight")], *w.shape)
        for k, w in ebc.state_dict().items()
        if k.startswith(prefix) and k.endswith(".weight")
    ]
    return model_shapes(tables, model.dense_arch, model.inter_arch, model.over_arch)


def check_same_model(ours: Json, theirs: Json) -> None:
    """One line (``ConfigError``) naming the first part where the two models differ."""
    for part in ("embeddings", "bottom_mlp", "interaction_params", "top_mlp", "params"):
        if ours[part] != theirs[part]:
            raise ConfigError(
                f"bench step --compare torchrec: the two models differ in {part}: ours "
                f"{ours[part]}, TorchRec's {theirs[part]} ({ours['params']:,} vs "
                f"{theirs['params']:,} parameters); not the same model, so no comparison"
            )


def check_compare_args(
    a: argparse.Namespace, modes: Sequence[str], precisions: Sequence[str]
) -> int:
    """The rounds of ``--compare torchrec`` (default 5); one line for what it cannot compare."""
    if a.compare != "torchrec":
        if a.rounds is not None:
            raise ConfigError("bench step --rounds: only with --compare torchrec")
        return 0
    if a.device != "cpu":
        raise ConfigError("bench step --compare torchrec: CPU only (--device cpu)")
    if len(modes) > 1 or len(precisions) > 1:
        raise ConfigError(
            f"bench step --compare torchrec: one variant at a time (got --lowp {a.lowp!r}, "
            f"--precision {a.precision!r}); set one mode with --set lowp.mode=..."
        )
    rounds = 5 if a.rounds is None else a.rounds
    if rounds < 2:
        raise ConfigError(f"bench step --rounds {rounds}: at least 2 (the interval is over rounds)")
    if importlib.util.find_spec("torchrec") is None:
        raise ConfigError(
            "bench step --compare torchrec: torchrec is not installed; install it as "
            "docs/performance.md says (make install-peers)"
        )
    return rounds


def spawn_worker(argv: Sequence[str], side: str) -> Json:
    """One side's figures from a fresh process (``--worker side``); its JSON line."""
    cmd = [sys.executable, "-m", "neorec.bench.step", *argv, "--worker", side]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"bench step --worker {side} exited {proc.returncode}: {last}")
    out: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def step_shape(cfg: Any, a: argparse.Namespace, backend: str) -> Json:
    """The head of a ``bench step`` result: the step's shape and settings (both step forms)."""
    t = cfg.embedding.tables
    return {
        "bench": "step",
        "tables": len(t),
        "rows": t[0].rows,
        "dim": t[0].dim,
        "batch": cfg.data.batch_size,
        "pooling": t[0].pooling_factor,
        "alpha": a.alpha,
        "optimizer": cfg.embedding.optimizer,
        "backend": backend,
        "bf16_dense": a.bf16,
    }


def run_rounds(rounds: int, spawn: Callable[[str], Json]) -> Json:
    """Every side once per round, in rotated order; the models compared after the first round.

    Returns per side the rounds' results (in round order) and each round's order."""
    by_side: dict[str, list[Json]] = {s: [] for s in SIDES}
    orders = []
    for r in range(rounds):
        order = rotated(SIDES, r)
        orders.append(order)
        for side in order:
            by_side[side].append(spawn(side))
        for o, t in zip(by_side["ours"], by_side["torchrec"]):
            check_same_model(o["shapes"], t["shapes"])
    return {"by_side": by_side, "orders": orders}


def summary(runs: Json) -> Json:
    """The JSON fields of the comparison: medians over rounds, the paired ratio, the model."""
    ours, theirs = runs["by_side"]["ours"], runs["by_side"]["torchrec"]
    ms = [r["ms"] for r in ours]
    peer_ms = [r["ms"] for r in theirs]
    out: Json = {
        "rounds": len(ms),
        "round_orders": [",".join(o) for o in runs["orders"]],
        "ms_rounds": [round(x, 3) for x in ms],
        "torchrec_ms_rounds": [round(x, 3) for x in peer_ms],
        "torchrec_ms_per_step": round(statistics.median(peer_ms), 2),
        "torchrec_peak_rss_mb": round(max(r["peak_rss_mb"] for r in theirs), 1),
        "torchrec_bf16_autocast": theirs[0]["bf16_autocast"],
        # ours / TorchRec's: geometric mean of the per-round ratios, 95% interval over rounds
        "vs_torchrec": paired_ratio(ms, peer_ms).to_dict(),
        "params": ours[0]["shapes"]["params"],
        "same_model": True,  # check_same_model passed in every round
    }
    plans = [r["plan"] for r in ours if "plan" in r]
    if plans:  # LoKA decides in each process: say whether every round timed the same plan
        out["plan"] = plans[0]
        out["lowp_sites"] = ours[0]["lowp_sites"]
        out["plan_same_every_round"] = all(p == plans[0] for p in plans)
    return out


def run_compare(cfg: Any, a: argparse.Namespace, argv: Sequence[str], rounds: int) -> int:
    """The rounds, then a table and the JSON line of ``bench step --compare torchrec``."""
    from neorec.bench.step_torchrec import PEER_NAME, check_peer_config

    check_peer_config(cfg)  # before any process starts
    runs = run_rounds(rounds, lambda side: spawn_worker(argv, side))
    ours = runs["by_side"]["ours"]
    ms = statistics.median(r["ms"] for r in ours)
    result: Json = {
        **step_shape(cfg, a, ours[0]["backend"]),
        "threads": ours[0]["threads"],
        "ms_per_step": round(ms, 2),
        "samples_per_s": round(cfg.data.batch_size / (ms / 1000), 1),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in ours), 1),
        "device": a.device,
        "iters": a.iters,
        "warmup": a.warmup,
        "peer": PEER_NAME,
        "lowp_mode": ours[0]["mode"] or "off",
        **summary(runs),
    }
    print(f"{rounds} rounds, each side in a fresh process, order rotated; ms/step: median of "
          f"{a.iters} steps")  # fmt: skip
    print(f"{'round':<8}{'order':<18}{'ours':>10}{'TorchRec':>10}{'ratio':>8}")
    for r, (o, p) in enumerate(zip(result["ms_rounds"], result["torchrec_ms_rounds"])):
        print(f"{r:<8}{result['round_orders'][r]:<18}{o:>10.2f}{p:>10.2f}{o / p:>8.3f}")
    iv = result["vs_torchrec"]
    print(f"same model: {result['params']:,} parameters each (tables, MLP layers, interaction)")
    print(f"vs_torchrec (ours / TorchRec's) {iv['value']:.3f}x [{iv['lo']:.3f}, {iv['hi']:.3f}]")
    print(json.dumps(result))
    return 0
