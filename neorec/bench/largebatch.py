"""``neorec bench largebatch``: the large-batch recipe (Goyal et al.; MLPerf DLRMv2's warmup +
decay) on the default model: batch B against k*B with the same samples seen.

Arms, each trained through ``neorec.train.Trainer`` on the default config (``--config``) with the
sizes of ``--set`` / the flags. Every arm of a seed trains on the same samples in the same order
(batch i of k*B holds the B-batches k*i .. k*i + k - 1, ``SameSamples``), from the same init, and
is evaluated on the same eval samples:

Every arm trains its tables with ``--emb-optimizer`` at ``--emb-lr`` (Adam at 1e-3, as in the
CowClip paper; chosen on the selection seeds). The defaults of the grids below are single values,
the settings chosen on the selection seeds (docs/running.md has the grid); ``--jobs`` runs train
side by side in fresh processes.

- ``B``: batch B at the config's lrs (the reference).
- ``kB recipe``: batch k*B with the warmup, the decay and the scaling of the dense lr and the row
  lr chosen on the selection seeds (``--select-seeds``: every ``--warmups`` x ``--decays`` x
  ``--scalings``; the lowest mean NE wins). A scaling is ``RULE`` (both lrs, through
  ``train.lr_scaling``) or ``DENSE/ROWS`` (each lr by its rule: none, sqrt or linear in k).
- ``kB cowclip``: batch k*B with CowClip (Zheng et al., AAAI 2023): each touched row's gradient
  clipped to ``count * max(r ||w||, zeta)``, the embedding lr times a multiplier m and its L2 x k;
  ``--clip-rule cowclip``: the paper's lrs (the dense lr x sqrt(k) with a warmup of the dense lr
  only, ``train.lr_scaling = 'cowclip'``), ``recipe``: the recipe arm's lrs and schedule; r, zeta,
  m and the decay chosen on the selection seeds (every ``--clip-ratios`` x ``--clip-bounds`` x
  ``--clip-row-lrs`` x ``--clip-decays``).
- ``k2B both``: batch k*k*B (32·B at k = 8 with ``--big 4``: ``--big`` x k) with CowClip's
  settings and the recipe's warmup and decay on both lrs.

Reported on other seeds (``--seeds``): each arm's final eval NE and AUC (mean over seeds) and its
paired NE difference to B in % of B's NE with a 95% t interval (``neorec.bench.stats``), and its
steps. JSON ``ne_gap``: mean over seeds of (NE of CowClip - NE of B) / NE of B; ``verdict``: the
target (the interval's upper end <= 0.1%) met or not, and no verdict at all when B's NE >= 1 (a
reference that does not beat the base rate proves nothing).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from neorec.bench.stats import paired_difference, parse_seeds
from neorec.config import Config, ConfigError, load_config
from neorec.data.batch import Batch
from neorec.sparse import SparseFeatures
from neorec.train.trainer import Trainer

__all__ = ["main", "ARMS"]

ARMS = ("B", "kB recipe", "kB cowclip", "k2B both")
"""The arms, in table order."""

EMB_OPTIMIZER, EMB_LR = "adam", 1e-3
"""Every arm's row optimizer and its lr at B (``--emb-optimizer``, ``--emb-lr``)."""

CLIP_RULE = "recipe"
"""The lrs of the CowClip arms (``--clip-rule``): ``cowclip``, the paper's rule (dense lr x
sqrt(k), embedding lr unchanged, its L2 x k, warmup and decay of the dense lr only), or
``recipe``: the recipe arm's lrs and schedule with the clip (and the L2 x k) added."""


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
    p.add_argument("--select-seeds", default="0-1", help="seeds the recipe is chosen on")
    p.add_argument("--warmups", default="0.1", help="warmup shares of the k*B run's steps")
    p.add_argument("--decays", default="cosine", help="decays tried after the warmup")
    p.add_argument("--scalings", default="none", help="lr scaling rules tried: RULE or DENSE/ROWS")
    p.add_argument("--big", type=int, default=4, help="the last arm's batch is big*k*B")
    p.add_argument("--clip-ratios", default="1e-3", help="CowClip r values tried")
    p.add_argument("--clip-bounds", default="4e-11", help="CowClip zeta values tried")
    p.add_argument("--clip-row-lrs", default="1", help="row lr multipliers tried with CowClip")
    p.add_argument("--clip-decays", default="cosine", help="dense decays with CowClip")
    p.add_argument(
        "--clip-rule",
        default=CLIP_RULE,
        choices=("cowclip", "recipe"),
        help="CowClip's lrs: its rule (dense x sqrt(k), dense-only warmup) or the recipe's",
    )
    p.add_argument("--emb-optimizer", default=EMB_OPTIMIZER, help="every arm's row optimizer")
    p.add_argument("--emb-lr", type=float, default=EMB_LR, help="every arm's row lr (at B)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--jobs", type=int, default=4, help="runs trained side by side (processes)")
    p.add_argument("--quick", action="store_true", help="small: 41k samples, 3+1 seeds, < 2 min")
    a = p.parse_args(argv)
    if a.quick:
        a.samples, a.eval_samples, a.seeds, a.select_seeds = 40_960, 20_480, "100-102", "0"
        a.warmups, a.decays, a.scalings = "0.3", "cosine", "none"
        a.clip_ratios, a.clip_bounds, a.clip_row_lrs, a.clip_decays = "1e-3", "4e-11", "1", "cosine"
    return a


def _floats(text: str, flag: str, hi: float = 1.0) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected numbers a,b,c") from None
    if hi == 1.0 and (not out or not all(0 <= x < 1 for x in out)):
        raise ConfigError(f"{flag} {text!r}: warmup shares must be in [0, 1)")
    if not out or not all(0 <= x < hi for x in out):
        raise ConfigError(f"{flag} {text!r}: expected numbers in [0, {hi:g})")
    return out


def _sets(a: argparse.Namespace) -> list[str]:
    """``--set`` and the row optimizer's flags: the config every arm starts from."""
    return [f"embedding.optimizer='{a.emb_optimizer}'", f"embedding.lr={a.emb_lr!r}", *a.set]


def _base(a: argparse.Namespace) -> list[str]:
    """The overrides every run shares."""
    return [
        *_sets(a),
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
    base = load_config(a.config, _sets(a))
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}
    return [
        f"train.dense_lr={base.train.dense_lr * a.factor ** power[dense]!r}",
        f"embedding.lr={base.embedding.lr * a.factor ** power[rows]!r}",
    ]


def arm_overrides(
    arm: str,
    a: argparse.Namespace,
    warmup: float,
    decay: str,
    scaling: str = "linear",
    clip: tuple[float, float, float, str] = (0.1, 1e-4, 1.0, "constant"),
) -> list[str]:
    """The overrides of an arm (the recipe's: ``warmup``, a share of the k*B run's steps, the
    decay and the scaling ``dense/rows`` rules; CowClip's: (r, zeta, row lr multiplier, dense
    decay))."""
    if arm == "B":
        return [f"data.batch_size={a.batch}"]
    k = a.factor * (a.big if arm == "k2B both" else 1)
    out = [f"data.batch_size={a.batch * k}"]
    steps = a.samples // (a.batch * k)
    if arm in ("kB cowclip", "k2B both"):
        r, zeta, m, clip_decay = clip
        base = load_config(a.config, _sets(a))
        out += [
            f"embedding.cowclip_ratio={r!r}",
            f"embedding.cowclip_bound={zeta!r}",
            f"embedding.lr={base.embedding.lr * m!r}",
        ]
        if a.clip_rule == "recipe":  # the recipe's lrs and schedule, the row L2 x k
            out.append(f"embedding.weight_decay={base.embedding.weight_decay * k!r}")
        else:
            out += ["train.lr_scaling='cowclip'", f"train.reference_batch={a.batch}"]
        if arm == "kB cowclip":  # CowClip's own schedule: the dense lr's warmup (and decay)
            decay = clip_decay
            if a.clip_rule == "cowclip":
                out.append("train.schedule.rows=false")
    else:
        out += _scaled(a, *_rules(scaling))
    if warmup > 0:
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


def train_once(cfg: Config, small: int) -> tuple[float, float, int]:
    """(final eval NE, AUC, train steps) of one run on the samples of batches of ``small`` (its
    folder removed after)."""
    try:
        trainer = Trainer(cfg, out=io.StringIO())
        trainer.source = SameSamples(trainer.source, small)
        m = trainer.fit()
    finally:
        shutil.rmtree(cfg.train.run_dir, ignore_errors=True)
    return float(m["eval"]["ne"]), float(m["eval"]["auc"]), int(m["train"]["steps"])


def _task(
    a: argparse.Namespace, over: list[str], seed: int, run_dir: Path
) -> tuple[float, float, int]:
    """One run of ``train_all`` (in a worker process when ``--jobs`` > 1)."""
    if a.jobs > 1:
        torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // a.jobs))
    return train_once(_cfg(a, over, seed, run_dir), a.batch)


def train_all(
    a: argparse.Namespace, tasks: list[tuple[list[str], int, Path]]
) -> list[tuple[float, float, int]]:
    """``train_once`` of each (overrides, seed, run folder), in order; ``--jobs`` of them side by
    side in fresh processes (each run is deterministic given its config, so the results do not
    depend on the order or on ``--jobs``, up to the float sums of a different thread count)."""
    if a.jobs <= 1 or len(tasks) <= 1:
        return [_task(a, *t) for t in tasks]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
        return list(pool.map(_task, *zip(*[(a, *t) for t in tasks])))


def _grid_best(
    a: argparse.Namespace, work: Path, say: Any, arm: str, grid: list[tuple[Any, ...]], over: Any
) -> tuple[tuple[Any, ...], dict[str, float]]:
    """The setting of ``grid`` with the lowest mean NE of ``arm`` on the selection seeds (a grid
    of one, e.g. one chosen by an earlier run, is taken without training)."""
    tried: dict[str, float] = {}
    if len(grid) == 1:
        return grid[0], tried
    settings: dict[str, tuple[Any, ...]] = {}
    seeds = parse_seeds(a.select_seeds, "--select-seeds")
    tasks = [(over(g), s, work / f"sel-{arm}-{i}-{s}") for i, g in enumerate(grid) for s in seeds]
    results = iter(train_all(a, tasks))
    for g in grid:
        key = f"{arm}: " + " ".join(f"{x:g}" if isinstance(x, float) else str(x) for x in g)
        nes = [next(results)[0] for _ in seeds]
        tried[key], settings[key] = statistics.fmean(nes), g
        say(f"  select {key}: NE {tried[key]:.5f}")
    return settings[min(tried, key=lambda k: tried[k])], tried


def choose(
    a: argparse.Namespace, work: Path, say: Any
) -> tuple[tuple[float, str, str], tuple[float, float, float, str], dict[str, float]]:
    """The recipe's (warmup share, decay, scaling) and CowClip's (r, zeta, row lr multiplier,
    dense decay), each the lowest mean NE on the selection seeds."""
    grid = [
        (w, d, r)
        for w in _floats(a.warmups, "--warmups")
        for d in a.decays.split(",")
        for r in a.scalings.split(",")
    ]
    recipe, tried = _grid_best(
        a, work, say, "kB recipe", grid, lambda g: arm_overrides("kB recipe", a, *g)
    )
    clips = [
        (r, z, m, d)
        for r in _floats(a.clip_ratios, "--clip-ratios", 1e30)
        for z in _floats(a.clip_bounds, "--clip-bounds", 1e30)
        for m in _floats(a.clip_row_lrs, "--clip-row-lrs", 1e30)
        for d in a.clip_decays.split(",")
    ]
    w = recipe[0]
    clip, tried_c = _grid_best(
        a, work, say, "kB cowclip", clips,
        lambda g: arm_overrides("kB cowclip", a, w, "constant", "none", g),
    )  # fmt: skip
    return recipe, clip, {**tried, **tried_c}  # type: ignore[return-value]


def run(a: argparse.Namespace, work: Path, say: Any) -> dict[str, Any]:
    """Selection, then every arm on the reported seeds; the result dict."""
    from neorec.machine import cpu_model_and_flags

    t0 = time.perf_counter()
    (warmup, decay, scaling), clip, tried = choose(a, work, say)
    select_s = time.perf_counter() - t0
    seeds = parse_seeds(a.seeds, "--seeds")
    ne: dict[str, list[float]] = {arm: [] for arm in ARMS}
    auc: dict[str, list[float]] = {arm: [] for arm in ARMS}
    steps: dict[str, int] = {}
    overs = {arm: arm_overrides(arm, a, warmup, decay, scaling, clip) for arm in ARMS}
    tasks = [(overs[arm], s, work / f"{arm}-{s}") for s in seeds for arm in ARMS]
    results = iter(train_all(a, tasks))
    for s in seeds:
        for arm in ARMS:
            v, u, steps[arm] = next(results)
            ne[arm].append(v)
            auc[arm].append(u)
        say(f"  seed {s}: " + ", ".join(f"{k} {v[-1]:.5f}" for k, v in ne.items()))
    recipe = {"warmup_share": warmup, "decay": decay, "scaling": scaling}
    cowclip = {
        "ratio": clip[0],
        "bound": clip[1],
        "row_lr_multiplier": clip[2],
        "decay": clip[3],
        "rule": a.clip_rule,
    }
    r = _summary(a, ne, steps, seeds, recipe, tried, select_s, cpu_model_and_flags()[0], auc)
    r["cowclip"] = cowclip
    return r


def _summary(
    a: argparse.Namespace,
    ne: dict[str, list[float]],
    steps: dict[str, int],
    seeds: list[int],
    recipe: dict[str, Any],
    tried: dict[str, float],
    select_s: float,
    cpu: str,
    auc: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    ref = ne["B"]
    arms = {}
    for arm in ne:
        rel = [100.0 * (x - r) / r for x, r in zip(ne[arm], ref)]
        iv = paired_difference(rel, [0.0] * len(rel)) if arm != "B" else None
        k = 1 if arm == "B" else a.factor * (a.big if arm == "k2B both" else 1)
        aucs = (auc or {}).get(arm, [])
        arms[arm] = {
            "batch": a.batch * k,
            "steps": steps.get(arm, 0),
            "ne": ne[arm],
            "ne_mean": statistics.fmean(ne[arm]),
            "auc_mean": statistics.fmean(aucs) if aucs else None,
            "ne_vs_B_pct": None if iv is None else iv.to_dict(),
        }
    main_arm = "kB cowclip" if "kB cowclip" in ne else "kB recipe"
    gaps = [(x - r) / r for x, r in zip(ne[main_arm], ref)]
    return {
        "bench": "largebatch",
        "cpu": cpu,
        "batch": a.batch,
        "factor": a.factor,
        "big": a.big,
        "samples": a.samples,
        "eval_samples": a.eval_samples,
        "seeds": seeds,
        "select_seeds": parse_seeds(a.select_seeds, "--select-seeds"),
        "recipe": recipe,
        "selection": tried,
        "select_s": round(select_s, 1),
        "arms": arms,
        "reference_ne": arms["B"]["ne_mean"],
        "reference_auc": arms["B"]["auc_mean"],
        "ne_gap": statistics.fmean(gaps),
        "target": 0.001,
        "verdict": verdict(arms["B"]["ne_mean"], arms[main_arm]["ne_vs_B_pct"], 0.1),
        "verdicts": {
            arm: verdict(arms["B"]["ne_mean"], arms[arm]["ne_vs_B_pct"], 0.1)
            for arm in ("kB recipe", "kB cowclip")
            if arm in arms
        },
        "embedding_optimizer": a.emb_optimizer,
        "embedding_lr": a.emb_lr,
    }


def verdict(ref_ne: float, iv: dict[str, Any] | None, target_pct: float) -> str:
    """``met`` when the paired interval's upper end is within ``target_pct``% of B's NE, else
    ``not met``; ``no claim`` when B does not beat the base rate (NE >= 1: nothing learned, so
    nothing is within noise of it)."""
    if not ref_ne < 1.0 or iv is None:
        return "no claim: the reference B does not learn (NE >= 1)"
    return "met" if iv["hi"] <= target_pct else "not met"


def print_table(r: dict[str, Any]) -> None:
    """The arms: batch, steps, mean NE and AUC, NE difference to B in % with its 95% interval."""
    rec, cc = r["recipe"], r.get("cowclip", {})
    print(
        f"large batch: B {r['batch']} vs {r['factor']}B and {r['factor'] * r['big']}B, "
        f"{r['samples']:,} samples each, seeds {r['seeds']} (settings chosen on seeds "
        f"{r['select_seeds']}), {r['cpu']}; recipe: {rec['scaling']} scaling, warmup "
        f"{rec['warmup_share']:g} of the steps, {rec['decay']} decay; CowClip: "
        + ", ".join(f"{k} {v}" for k, v in cc.items())
    )
    print(f"{'arm':<14}{'batch':>7}{'steps':>7}{'NE':>10}{'AUC':>9}   {'NE vs B, % [95% CI]':<28}")
    for arm, v in r["arms"].items():
        iv = v["ne_vs_B_pct"]
        rel = "-" if iv is None else f"{iv['value']:+.3f} [{iv['lo']:+.3f}, {iv['hi']:+.3f}]"
        name = arm.replace("k2B", f"{r['factor'] * r['big']}B").replace("kB", f"{r['factor']}B")
        auc = "-" if v.get("auc_mean") is None else f"{v['auc_mean']:.4f}"
        print(f"{name:<14}{v['batch']:>7}{v['steps']:>7}{v['ne_mean']:>10.5f}{auc:>9}   {rel:<28}")
    each = ", ".join(
        f"{k.replace('kB', str(r['factor']) + 'B')} {v}" for k, v in r["verdicts"].items()
    )
    print(f"ne_gap {r['ne_gap'] * 100:+.3f}%; 0.1% target (interval's upper end): {each}")


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
    for arm in ARMS:  # flags checked first
        _cfg(a, arm_overrides(arm, a, 0.1, "cosine"), 0, Path("x"))
    for flag, text in (("--clip-ratios", a.clip_ratios), ("--clip-bounds", a.clip_bounds),
                       ("--clip-row-lrs", a.clip_row_lrs)):  # fmt: skip
        _floats(text, flag, 1e30)
    if a.big < 1:
        raise ConfigError("--big must be >= 1")
    if a.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {a.jobs}")
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
