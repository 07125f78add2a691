"""``neorec bench largebatch``: the large-batch recipe (Goyal et al.; MLPerf DLRMv2's warmup +
decay) on the default model: batch B against k*B with the same samples seen.

Arms, each trained through ``neorec.train.Trainer`` on the default config (``--config``) with the
sizes of ``--set`` / the flags. Every arm of a seed trains on the same samples in the same order
(batch i of k*B holds the B-batches k*i .. k*i + k - 1, ``SameSamples``), from the same init, and
is evaluated on the same eval samples:

- ``B``: batch B at the config's lrs (the reference).
- ``kB recipe``: batch k*B with the warmup, the decay and the scaling of the dense lr and the row
  lr chosen on the selection seeds (``--select-seeds``: every ``--warmups`` x ``--decays`` x
  ``--scalings``; the lowest mean NE wins). A scaling is ``RULE`` (both lrs, through
  ``train.lr_scaling``) or ``DENSE/ROWS`` (each lr by its rule: none, sqrt or linear in k).
- ``kB no warmup``: the recipe without its warmup.
- ``kB plain``: batch k*B at the config's lrs (no warmup, no scaling, no decay).
- ``kB linear``: batch k*B, both lrs scaled linearly (Goyal et al.'s rule for SGD), no warmup.

Reported on other seeds (``--seeds``): each arm's final eval NE (mean over seeds) and its paired
difference to B in % of B's NE with a 95% t interval (``neorec.bench.stats``), and its steps.
JSON ``ne_gap``: mean over seeds of (NE of the recipe - NE of B) / NE of B (target: <= 0.001).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from neorec.bench.stats import paired_difference, parse_seeds
from neorec.config import Config, ConfigError, load_config
from neorec.data.batch import Batch
from neorec.sparse import SparseFeatures
from neorec.train.trainer import Trainer

__all__ = ["main", "ARMS"]

ARMS = ("B", "kB recipe", "kB no warmup", "kB plain", "kB linear")
"""The arms, in table order."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench largebatch", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/default.toml", help="the model and data")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--batch", type=int, default=512, help="B, the reference batch")
    p.add_argument("--factor", type=int, default=8, help="k: the large batch is k*B")
    p.add_argument("--samples", type=int, default=491_520, help="train samples (every arm)")
    p.add_argument("--eval-samples", type=int, default=20_480, help="eval samples")
    p.add_argument("--seeds", default="100-104", help="reported seeds (a-b or a,b,c)")
    p.add_argument("--select-seeds", default="0-2", help="seeds the recipe is chosen on")
    p.add_argument("--warmups", default="0.1", help="warmup shares of the k*B run's steps")
    p.add_argument("--decays", default="cosine", help="decays tried after the warmup")
    p.add_argument("--scalings", default="none", help="lr scaling rules tried: RULE or DENSE/ROWS")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--quick", action="store_true", help="small: 41k samples, 3+1 seeds, < 2 min")
    a = p.parse_args(argv)
    if a.quick:
        a.samples, a.eval_samples, a.seeds, a.select_seeds = 40_960, 10_240, "100-102", "0"
        a.warmups, a.decays, a.scalings = "0.3", "constant,cosine", "none"
    return a


def _floats(text: str, flag: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected numbers a,b,c") from None
    if not out or not all(0 <= x < 1 for x in out):
        raise ConfigError(f"{flag} {text!r}: warmup shares must be in [0, 1)")
    return out


def _base(a: argparse.Namespace) -> list[str]:
    """The overrides every run shares."""
    return [
        *a.set,
        f"data.train_samples={a.samples}",
        f"data.eval_samples={a.eval_samples}",
        "train.progress=false",
        "train.save_model=false",
        "train.tensorboard='off'",
        "train.eval_fraction=0",
        "train.epochs=1",
    ]


RULES = ("none", "sqrt", "linear")
"""lr scaling rules: the factor k**0, k**0.5, k**1 of the batch ratio k."""


def _rules(text: str) -> tuple[str, str]:
    """``dense/rows`` (or one rule for both) as (dense rule, rows rule)."""
    parts = text.split("/")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(r in RULES for r in parts):
        raise ConfigError(
            f"--scalings {text!r}: expected RULE or DENSE/ROWS with rules from {', '.join(RULES)}"
        )
    return parts[0], parts[1]


def _scaled(a: argparse.Namespace, dense: str, rows: str) -> list[str]:
    """Overrides scaling the dense lr by rule ``dense`` and the row lr by rule ``rows``: one rule
    through ``train.lr_scaling``, two through the lrs themselves (from the config's)."""
    if dense == rows == "none":
        return []
    if dense == rows:
        return [f"train.lr_scaling='{dense}'", f"train.reference_batch={a.batch}"]
    base = load_config(a.config, list(a.set))
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
    return [
        f"train.dense_lr={base.train.dense_lr * a.factor ** power[dense]!r}",
        f"embedding.lr={base.embedding.lr * a.factor ** power[rows]!r}",
    ]


def arm_overrides(
    arm: str, a: argparse.Namespace, warmup: float, decay: str, scaling: str = "linear"
) -> list[str]:
    """The overrides of an arm (the recipe's: ``warmup``, a share of the k*B run's steps, the
    decay and the scaling ``dense/rows`` rules)."""
    if arm == "B":
        return [f"data.batch_size={a.batch}"]
    out = [f"data.batch_size={a.batch * a.factor}"]
    if arm == "kB linear":
        return out + _scaled(a, "linear", "linear")
    if arm == "kB plain":
        return out
    out += _scaled(a, *_rules(scaling))
    steps = a.samples // (a.batch * a.factor)
    if warmup > 0 and arm == "kB recipe":
        out.append(f"train.schedule.warmup_steps={max(1, round(warmup * steps))}")
    if decay != "constant":
        out.append(f"train.schedule.decay='{decay}'")
    return out


def _cfg(a: argparse.Namespace, over: list[str], seed: int, run_dir: Path) -> Config:
    return load_config(
        a.config,
        [*_base(a), *over, f"train.seed={seed}", f"data.seed={seed}", f"train.run_dir='{run_dir}'"],
    )


def concat(parts: list[Batch]) -> Batch:
    """One batch holding ``parts``' samples in order (feature-major ids kept per feature)."""
    keys = parts[0].sparse.keys
    values, lengths, weights = [], [], []
    for key in keys:
        for b in parts:
            v, n, w = b.sparse.feature(key)
            values.append(v)
            lengths.append(n)
            weights.append(w)
    has_w = parts[0].sparse.weights is not None
    sparse = SparseFeatures(
        keys,
        torch.cat(values),
        torch.cat(lengths),
        torch.cat([w for w in weights if w is not None]) if has_w else None,
    )
    return Batch(torch.cat([b.dense for b in parts]), sparse, torch.cat([b.labels for b in parts]))


class SameSamples:
    """The synthetic data of batch ``k * small`` as ``k`` concatenated batches of ``small``:
    every arm of a seed trains on the same samples in the same order and is evaluated on the
    same eval samples (the generator draws each batch from (seed, split, index, batch size), so
    two batch sizes would otherwise see different samples)."""

    def __init__(self, source: Any, small: int) -> None:
        self.data, self.small = source.data, small
        self.k = source.bs // small

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Batch i: the small batches k*i .. k*i + k - 1."""
        for i in range(start, self.num_train_batches()):
            yield concat(
                [self.data.batch("train", self.k * i + j, self.small) for j in range(self.k)]
            )

    def eval_batches(self) -> Iterator[Batch]:
        """The eval split in batches of ``small`` (the same for every arm)."""
        return self.data.batches("eval", self.small)

    def num_train_batches(self) -> int:
        """Large batches per epoch."""
        return int(self.data.num_batches("train", self.small)) // self.k

    def reference_metrics(self) -> dict[str, float] | None:
        """The teacher's metrics on the eval split."""
        return dict(self.data.teacher_metrics("eval", self.small))


def train_once(cfg: Config, small: int) -> tuple[float, int]:
    """(final eval NE, train steps) of one run on the samples of batches of ``small`` (its
    folder removed after)."""
    try:
        trainer = Trainer(cfg, out=io.StringIO())
        trainer.source = SameSamples(trainer.source, small)
        m = trainer.fit()
    finally:
        shutil.rmtree(cfg.train.run_dir, ignore_errors=True)
    return float(m["eval"]["ne"]), int(m["train"]["steps"])


def choose(
    a: argparse.Namespace, work: Path, say: Any
) -> tuple[tuple[float, str, str], dict[str, float]]:
    """The recipe's (warmup share, decay, scaling): the lowest mean NE on the selection seeds
    (a grid of one setting, e.g. one chosen by an earlier run, is taken without training)."""
    tried: dict[str, float] = {}
    settings: dict[str, tuple[float, str, str]] = {}
    grid = [
        (w, d, r)
        for w in _floats(a.warmups, "--warmups")
        for d in a.decays.split(",")
        for r in a.scalings.split(",")
    ]
    if len(grid) == 1:
        return grid[0], tried
    for w, d, r in grid:
        nes = []
        for s in parse_seeds(a.select_seeds, "--select-seeds"):
            over = arm_overrides("kB recipe", a, w, d, r)
            nes.append(train_once(_cfg(a, over, s, work / f"sel-{w}-{d}-{r}-{s}"), a.batch)[0])
        key = f"warmup {w:g} {d} {r}"
        tried[key], settings[key] = statistics.fmean(nes), (w, d, r)
        say(f"  select {key}: NE {tried[key]:.5f}")
    return settings[min(tried, key=lambda k: tried[k])], tried


def run(a: argparse.Namespace, work: Path, say: Any) -> dict[str, Any]:
    """Selection, then every arm on the reported seeds; the result dict."""
    from neorec.machine import cpu_model_and_flags

    t0 = time.perf_counter()
    (warmup, decay, scaling), tried = choose(a, work, say)
    select_s = time.perf_counter() - t0
    seeds = parse_seeds(a.seeds, "--seeds")
    ne: dict[str, list[float]] = {arm: [] for arm in ARMS}
    steps: dict[str, int] = {}
    for s in seeds:
        for arm in ARMS:
            cfg = _cfg(a, arm_overrides(arm, a, warmup, decay, scaling), s, work / f"{arm}-{s}")
            value, steps[arm] = train_once(cfg, a.batch)
            ne[arm].append(value)
        say(f"  seed {s}: " + ", ".join(f"{k} {v[-1]:.5f}" for k, v in ne.items()))
    recipe = {"warmup_share": warmup, "decay": decay, "scaling": scaling}
    return _summary(a, ne, steps, seeds, recipe, tried, select_s, cpu_model_and_flags()[0])


def _summary(
    a: argparse.Namespace,
    ne: dict[str, list[float]],
    steps: dict[str, int],
    seeds: list[int],
    recipe: dict[str, Any],
    tried: dict[str, float],
    select_s: float,
    cpu: str,
) -> dict[str, Any]:
    ref = ne["B"]
    arms = {}
    for arm in ARMS:
        rel = [100.0 * (x - r) / r for x, r in zip(ne[arm], ref)]
        iv = paired_difference(rel, [0.0] * len(rel)) if arm != "B" else None
        arms[arm] = {
            "batch": a.batch * (1 if arm == "B" else a.factor),
            "steps": steps.get(arm, 0),
            "ne": ne[arm],
            "ne_mean": statistics.fmean(ne[arm]),
            "ne_vs_B_pct": None if iv is None else iv.to_dict(),
        }
    gaps = [(x - r) / r for x, r in zip(ne["kB recipe"], ref)]
    return {
        "bench": "largebatch",
        "cpu": cpu,
        "batch": a.batch,
        "factor": a.factor,
        "samples": a.samples,
        "eval_samples": a.eval_samples,
        "seeds": seeds,
        "select_seeds": parse_seeds(a.select_seeds, "--select-seeds"),
        "recipe": recipe,
        "selection": tried,
        "select_s": round(select_s, 1),
        "arms": arms,
        "ne_gap": statistics.fmean(gaps),
        "target": 0.001,
    }


def print_table(r: dict[str, Any]) -> None:
    """The arms: batch, steps, mean NE, difference to B in % with its 95% interval."""
    rec = r["recipe"]
    print(
        f"large batch: B {r['batch']} vs {r['factor']}B, {r['samples']:,} samples each, "
        f"seeds {r['seeds']}, {r['cpu']}; recipe ("
        + (f"chosen on seeds {r['select_seeds']}" if r["selection"] else "given, not selected")
        + "): "
        f"{rec['scaling']} scaling, warmup {rec['warmup_share']:g} of the steps, {rec['decay']} decay"
    )
    print(f"{'arm':<12}{'batch':>7}{'steps':>7}{'NE':>10}   {'NE vs B, % [95% CI]':<28}")
    for arm, v in r["arms"].items():
        iv = v["ne_vs_B_pct"]
        rel = "-" if iv is None else f"{iv['value']:+.3f} [{iv['lo']:+.3f}, {iv['hi']:+.3f}]"
        name = arm.replace("kB", f"{r['factor']}B")
        print(f"{name:<12}{v['batch']:>7}{v['steps']:>7}{v['ne_mean']:>10.5f}   {rel:<28}")
    ok = "within" if r["ne_gap"] <= r["target"] else "NOT within"
    print(f"ne_gap {r['ne_gap'] * 100:+.3f}% ({ok} the 0.1% target)")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    if a.batch < 1 or a.factor < 2:
        raise ConfigError("--batch must be >= 1 and --factor >= 2")
    parse_seeds(a.seeds, "--seeds")
    parse_seeds(a.select_seeds, "--select-seeds")
    _floats(a.warmups, "--warmups")
    for text in a.scalings.split(","):
        _rules(text)
    _cfg(a, arm_overrides("kB recipe", a, 0.1, "cosine"), 0, Path("x"))  # flags checked first
    if a.threads:
        torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="neorec-largebatch-"))
    t0 = time.perf_counter()
    try:
        result = run(a, work, lambda s: print(s, flush=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
