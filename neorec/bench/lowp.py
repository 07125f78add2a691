"""``neorec bench lowp``: eval quality of LoKA precision modes vs fp32 over several seeds.

Each (seed, variant) pair trains the config from scratch (model seed = ``train.seed``, seeds
``--seed-base`` .. ``--seed-base + --seeds - 1``; synthetic data is the same for all, labels from
the synthetic teacher) and evaluates. Variants are ``--modes`` (``lowp.mode`` of the dense sites;
``autocast``: plain ``torch.autocast(bfloat16)`` of the dense part, ``train.bf16_dense``), or with
``--emb`` the stored precision of the embedding tables and its rounding
(``fp32,fp16:nearest,bf16:stochastic,fp8:nearest``), with the tables' memory.

The table gives the reference's (the first variant's) absolute eval NE and AUC with 95%
intervals, and per variant its NE relative to the reference paired by seed with a 95% interval
(``docs/benchmarks.md``), the paired AUC difference, and a verdict: a change is called "within
noise" only when the reference beats the base rate (NE < 1); a model that learned nothing says
nothing about precision.

``auto`` runs one pinned plan on every seed (``lowp.plan``): ``--plan FILE``, or the plan ``auto``
chooses on ``--plan-seed`` (a seed that is not reported) after its probe steps; ``--save-plan``
writes it, for the speed run (``neorec bench step --lowp ... --plan FILE``) to run the same sites.
``--movielens`` trains the MovieLens-100K recipe instead (``neorec bench movielens``'s task and
its chosen settings, ``configs/movielens.toml``; ML-100K fetched once, as that benchmark does).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neorec.bench.lowp_runs import movielens_task, summarize
from neorec.config import Config, load_config
from neorec.errors import ConfigError
from neorec.lowp.plan_file import load_plan, low_sites, save_plan

__all__ = ["main"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench lowp", description=__doc__)
    p.add_argument("--config", default=None, help="TOML config (default: the built-in default)")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--modes", default="off,auto", help="lowp modes, comma-separated")
    p.add_argument(
        "--emb",
        default="",
        help="instead of modes: embedding precisions[:rounding], e.g. fp32,fp16:nearest,fp8",
    )
    p.add_argument("--seeds", type=int, default=3, help="model seeds (at least 2 for intervals)")
    p.add_argument(
        "--seed-base", type=int, default=0, help="first model seed (seeds nobody tuned on)"
    )
    p.add_argument("--threads", type=int, default=0, help="train.threads (0 = all cores)")
    p.add_argument("--plan", default="", help="the auto arm's pinned plan (a JSON file)")
    p.add_argument(
        "--plan-seed", type=int, default=0, help="without --plan: the seed auto's plan is chosen on"
    )
    p.add_argument("--save-plan", default="", help="write the auto arm's plan to this file")
    p.add_argument(
        "--movielens",
        action="store_true",
        help="the MovieLens-100K recipe (configs/movielens.toml unless --config)",
    )
    p.add_argument("--input", default="", help="--movielens: an ML-100K folder (default: fetch)")
    return p.parse_args(argv)


def _variants(a: argparse.Namespace) -> dict[str, list[str]]:
    """Label -> config overrides of each variant."""
    if not a.emb:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        return {
            m: ["train.bf16_dense=true"] if m == "autocast" else [f"lowp.mode={m!r}"] for m in modes
        }
    out = {}
    for spec in (x.strip() for x in a.emb.split(",")):
        if not spec:
            continue
        prec, _, rounding = spec.partition(":")
        out[spec] = [f"embedding.precision={prec!r}", f"embedding.rounding={rounding or 'auto'!r}"]
    return out


def _check(a: argparse.Namespace, variants: dict[str, list[str]]) -> list[int]:
    """The reported seeds; every flag checked before any training."""
    seeds = list(range(a.seed_base, a.seed_base + a.seeds))
    if a.seeds < 1:
        raise ConfigError(f"bench lowp --seeds {a.seeds}: at least 1")
    if "auto" in variants and not a.plan and a.plan_seed in seeds:
        raise ConfigError(
            f"bench lowp --plan-seed {a.plan_seed} is a reported seed ({seeds[0]}-{seeds[-1]}): "
            "the plan must be chosen on a seed that is not reported"
        )
    if a.plan:
        load_plan(a.plan)
    if (a.plan or a.save_plan) and "auto" not in variants:
        raise ConfigError("bench lowp --plan / --save-plan: only the auto arm runs a plan")
    return seeds


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    from neorec.train.trainer import Trainer

    variants = _variants(a)
    seeds = _check(a, variants)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        make = _maker(a, Path(tmp))
        for sets in variants.values():
            make(seeds[0], sets, "check")  # every variant's config checked before any training
        plan, source = _plan(a, make, Path(tmp)) if "auto" in variants else ({}, "")
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in variants}
        for seed in seeds:
            for mode, sets in variants.items():
                extra = [f"lowp.plan='{Path(tmp) / 'plan.json'}'"] if mode == "auto" else []
                cfg = make(seed, [*sets, *extra], f"{mode}-{seed}")
                m = Trainer(cfg).fit()
                lp = m.get("lowp") or {}
                runs[mode].append(
                    {
                        "seed": seed,
                        "ne": m["eval"]["ne"],
                        "auc": m["eval"]["auc"],
                        "train_s": m["train"]["seconds"],
                        "low_precision_sites": lp.get("low_precision_sites", 0),
                        "fallbacks": lp.get("fallbacks", 0),
                        "plan": lp.get("plan", {}),
                        "table_mb": _table_bytes(cfg) / 2**20,
                    }
                )
    result = summarize(runs, variants)
    result.update(
        bench="lowp",
        config=a.config,
        movielens=a.movielens,
        sets=a.set,
        seeds=seeds,
        seconds=round(time.perf_counter() - t0, 1),
    )
    if plan:
        result["plan"] = {
            "sites": plan,
            "low_precision": low_sites(plan),
            "source": source,
            "same_in_every_run": all(r["plan"] == plan for r in runs["auto"]),
        }
    _print(result)
    print(json.dumps(result))
    return 0


def _maker(a: argparse.Namespace, tmp: Path) -> Callable[[int, list[str], str], Config]:
    """``make(seed, sets, name)``: a run's config (the synthetic config or MovieLens's)."""
    common = ["train.progress=false", f"train.threads={a.threads}"]
    if not a.movielens:

        def make(seed: int, sets: list[str], name: str) -> Config:
            return load_config(
                a.config,
                [*a.set, f"train.seed={seed}", *sets, f"train.run_dir='{tmp / name}'", *common],
            )

        return make
    return movielens_task(a, tmp, common)


def _plan(
    a: argparse.Namespace, make: Callable[[int, list[str], str], Config], tmp: Path
) -> tuple[dict[str, str], str]:
    """The auto arm's plan, written to ``tmp/plan.json`` (and ``--save-plan``); where it came
    from."""
    from neorec.train.trainer import Trainer

    if a.plan:
        plan, source = load_plan(a.plan), f"pinned: {a.plan}"
    else:
        probe = make(a.plan_seed, ["lowp.mode='auto'"], "plan").lowp.probe_steps
        cfg = make(a.plan_seed, ["lowp.mode='auto'", f"train.steps={probe}"], "plan")
        plan = dict(Trainer(cfg).fit()["lowp"]["plan"])
        source = f"chosen by auto on seed {a.plan_seed} after {probe} probed steps"
    save_plan(tmp / "plan.json", plan, source=source)
    if a.save_plan:
        save_plan(a.save_plan, plan, source=source, config=a.config, movielens=a.movielens)
    return plan, source


def _iv(d: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    if d["lo"] is None or d["hi"] is None:
        return f"{scale * d['value']:{fmt}} (one seed)"
    return f"{scale * d['value']:{fmt}} [{scale * d['lo']:{fmt}}, {scale * d['hi']:{fmt}}]"


def _print(r: dict[str, Any]) -> None:
    ref = r["reference"]
    print(
        f"reference {ref['variant']}: NE {_iv(ref['ne'], '.5f')}, AUC {_iv(ref['auc'], '.4f')}"
        f"{'' if ref['learns'] else '  (NE >= 1: it learned nothing)'}"
    )
    if "plan" in r:
        p = r["plan"]
        print(f"auto's plan ({p['source']}): {len(p['low_precision'])} low-precision sites "
              f"{', '.join(p['low_precision']) or '(none)'}")  # fmt: skip
    w = max(10, *(len(m) + 2 for m in r["modes"]))
    print(f"{'variant':<{w}}{'NE mean':>10}{'NE vs ref (95%)':>30}{'AUC diff':>24}"
          f"{'train s':>9}{'sites':>7}{'table MB':>10}  verdict")  # fmt: skip
    for mode, row in r["modes"].items():
        cell, auc = _iv(row["rel_vs_base"], "+.3f", 100) + "%", _iv(row["auc_diff"], "+.4f")
        print(f"{mode:<{w}}{row['ne_mean']:>10.5f}{cell:>30}{auc:>24}{row['train_s_mean']:>9.1f}"
              f"{row['low_precision_sites']:>7}{row['table_mb']:>10.2f}  {row['verdict']}")  # fmt: skip


def _table_bytes(cfg: Any) -> int:
    """Bytes of the stored embedding rows (without optimizer state)."""
    from neorec.ops.lowp_rows import bytes_per_row

    return sum(t.rows * bytes_per_row(t.precision or "fp32", t.dim) for t in cfg.embedding.tables)
