"""``neorec bench distill``: ExFM on a drifting stream, a stale FM teaching a small student.

The recipe is two configs (``configs/exfm_stream.toml``: the stream and the student;
``configs/exfm_fm.toml``: the FM on the same stream). Per seed and vertical (``vertical_bias``,
the student's click logit above the stream's; 0 = no FM / VM gap):

1. **FM.** A larger DLRM (wider tables, DCN, more samples per window) trains on windows 0, 1, ...
   in order, incrementally. After window w it is saved and DAS writes its logits for the train and
   eval splits of window w + k, for each staleness k (``neorec.train.exfm.train_fm``).
2. **Students.** The small DLRM trains on the same windows, incrementally, reading the FM logits
   of window w - k, in four setups: ``alone``; ``plain`` (distillation into the serving head,
   ``distill.weight``); ``aux`` (the auxiliary head); ``aux+adapter`` (the full ExFM student).
   Windows w < k have no FM yet and train alone. Every setup's loss runs the same fused C kernel
   (``alone`` too: ``make_loss(fused_bce=True)``). After each window the serving head's NE on
   the window's eval split.

A seed s sets the models' initialization and the stream: ``data.seed`` is the config's plus s
(the FM and the student read that stream), so every seed trains and is evaluated on its own data.

Tuning (the same budget for every setup): ``train.dense_lr`` over ``--lrs`` for each setup
(``alone`` included), per vertical and k, on the development seeds ``0 .. --dev-seeds - 1`` and
their streams; the lr with the lowest mean NE over the distilled windows (w >= k) is the one run
on the reported seeds ``--seed-base .. --seed-base + --seeds - 1``, whose streams the tuning never
saw (``stream_seeds`` in the JSON).

Reported per vertical and k, paired by seed with 95% t intervals (``neorec.bench.stats``): each
setup's NE and its difference to ``alone``; ``gap_closed = (NE_alone - NE_full) / (NE_alone -
NE_ref)`` of the full student against the stale FM logits it learns from, the fresh FM, and the
fresh FM recalibrated on the eval labels (its best constant shift), each stated as meeting the
target (``GAP_TARGET``) only where its interval's lower end clears it; the stale FM's NE minus
alone's. Throughput of each setup relative to ``alone``: their train steps on the last window's
batches (data excluded) interleaved round by round in a rotated order, the ratio's geometric mean
over rounds with its interval (``stats.paired_ratio``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from neorec.bench.distill_stats import SETUPS, print_table, summarize
from neorec.bench.stats import rotated
from neorec.config import Config, ConfigError
from neorec.train.exfm import (
    check_pair,
    replace_section,
    student_model,
    train_fm,
    train_student,
    window_cfg,
)

__all__ = ["main", "SETUPS"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(
        prog="neorec bench distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/exfm_stream.toml", help="stream + student")
    p.add_argument("--fm-config", default="configs/exfm_fm.toml", help="the FM (same stream)")
    p.add_argument("--windows", type=int, default=0, help="windows (0 = data.windows)")
    p.add_argument("--seeds", type=int, default=5, help="reported seeds (model init)")
    p.add_argument("--seed-base", type=int, default=100, help="first reported seed")
    p.add_argument("--dev-seeds", type=int, default=2, help="lr chosen on seeds 0 .. N-1")
    p.add_argument("--lrs", default="0.001,0.003,0.01", help="train.dense_lr grid, every setup")
    p.add_argument("--biases", default="0,0.3", help="data.vertical_bias values (verticals)")
    p.add_argument("--staleness", default="1,2", help="k values, comma-separated")
    p.add_argument("--plain-weight", type=float, default=0.5, help="plain: distill.weight")
    p.add_argument("--rounds", type=int, default=10, help="timing rounds (after one warm-up)")
    p.add_argument("--steps", type=int, default=16, help="train steps per setup and round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--work", default="", help="keep FM models and DAS files here (default: temp)")
    p.add_argument("--set", action="append", default=[], help="student override section.key=v")
    p.add_argument("--fm-set", action="append", default=[], help="FM override section.key=v")
    return p.parse_args(argv)


def _student_setup(cfg: Config, setup: str, plain_weight: float) -> Config:
    """The student config of a setup (the recipe's [distill] gives aux_weight, adapter size, T)."""
    d = cfg.distill
    aux_w = d.aux_weight if d.aux_head and d.aux_weight > 0 else 1.0
    common = dict(temperature=d.temperature, adapter_size=d.adapter_size)
    if setup == "alone":
        kw: dict[str, Any] = dict(enabled=False, aux_head=False, adapter=False, weight=0.0)
        kw["aux_weight"] = 0.0
    elif setup == "plain":
        kw = dict(enabled=True, aux_head=False, aux_weight=0.0, adapter=False, weight=plain_weight)
    elif setup == "aux":
        kw = dict(enabled=True, aux_head=True, aux_weight=aux_w, adapter=False, weight=0.0)
    else:
        kw = dict(enabled=True, aux_head=True, aux_weight=aux_w, adapter=True, weight=0.0)
    return replace_section(cfg, "distill", **common, **kw)


def time_students(
    cfgs: dict[str, Config], window: int, k: int, das: Path, rounds: int = 10, steps: int = 16
) -> dict[str, list[float]]:
    """Training throughput (samples/s) of each setup on window ``window``'s batches (FM logits
    of staleness ``k``; generated before the clock starts), per round: each of ``rounds`` rounds
    (after a warm-up round) runs ``steps`` steps of every setup, in an order rotated by the round
    (``stats.rotated``), so a slower moment of a shared machine hits them alike; a setup's rate in
    a round is from its median step. Every setup's loss takes the fused C kernel."""
    from neorec.builder import data_source
    from neorec.train.losses import make_loss
    from neorec.train.steps import train_step

    state: dict[str, Any] = {}
    for name, cfg in cfgs.items():
        on = cfg.distill.enabled
        data = {"fm_logits": str(das), "fm_staleness": k} if on else {}
        batches = list(data_source(window_cfg(cfg, window, **data)).train_batches())[:steps]
        model, opt = student_model(cfg)
        state[name] = (model, opt, batches, make_loss(cfg.distill if on else None, fused_bce=True))
    rates: dict[str, list[float]] = {name: [] for name in cfgs}
    for r in range(rounds + 1):  # round 0 warms up (allocations, first-call costs)
        for name in rotated(list(cfgs), r):
            model, opt, batches, loss_fn = state[name]
            times = []
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                train_step(model, opt, batch, r * len(batches) + i + 1, loss_fn=loss_fn)
                times.append(time.perf_counter() - t0)
            if r:
                rates[name].append(batches[0].size / statistics.median(times))
    return rates


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes numbers like 0.001,0.003, got {text!r}") from None
    if not vals or len(set(vals)) != len(vals):
        raise ConfigError(f"{flag} needs distinct values, got {text!r}")
    return vals


def _load(a: argparse.Namespace) -> tuple[Config, Config, int, list[int]]:
    from neorec.config import load_config

    for flag, v, lo in (
        ("--seeds", a.seeds, 1),
        ("--dev-seeds", a.dev_seeds, 1),
        ("--rounds", a.rounds, 2),
        ("--steps", a.steps, 1),
        ("--threads", a.threads, 0),
    ):
        if v < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {v}")
    if not 0 < a.plain_weight <= 1:
        raise ConfigError(f"--plain-weight must be in (0, 1], got {a.plain_weight}")
    if a.seed_base < a.dev_seeds:
        raise ConfigError(
            f"--seed-base {a.seed_base} overlaps the development seeds 0..{a.dev_seeds - 1}: "
            "report on seeds nobody tuned on"
        )
    if any(x <= 0 for x in _floats(a.lrs, "--lrs")):
        raise ConfigError(f"--lrs must be > 0, got {a.lrs!r}")
    _floats(a.biases, "--biases")
    student = load_config(a.config, a.set)
    fm = load_config(a.fm_config, a.fm_set)
    check_pair(student, fm, a.config, a.fm_config)
    windows = a.windows or student.data.windows
    try:
        ks = sorted({int(x) for x in a.staleness.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--staleness takes integers like 1,2, got {a.staleness!r}") from None
    if not ks or ks[0] < 1 or ks[-1] >= windows:
        raise ConfigError(f"--staleness values must be in [1, {windows - 1}], got {a.staleness}")
    student = replace_section(student, "data", windows=max(student.data.windows, windows))
    fm = replace_section(fm, "data", windows=max(fm.data.windows, windows))
    return student, fm, windows, ks


Runs = dict[str, list[list[float]]]
"""``"{bias}/{k}/{setup}/{lr}"`` (students' eval NE) or the FM's NE (``"{bias}/fresh"``,
``"{bias}/recal"``, ``"{bias}/{k}/stale"``) -> per seed, per window (numbers as ``{:g}``)."""


def _one_seed(
    a: argparse.Namespace,
    student: Config,
    fm_cfg: Config,
    seed: int,
    windows: int,
    lrs_of: Any,
    work: Path,
    runs: Runs,
) -> dict[tuple[float, int], Path]:
    """FM, DAS and students of one seed, for every vertical, k, setup and the lrs ``lrs_of(bias,
    k, setup)`` gives; appends to ``runs``. Returns the DAS directory of each (bias, k)."""
    ks = _ks(a)
    das: dict[tuple[float, int], Path] = {}
    for bias in _floats(a.biases, "--biases"):
        b = f"{bias:g}"
        base = replace_section(seeded(student, seed), "data", vertical_bias=bias)
        sdir = work / f"seed{seed}" / f"bias{b}"
        fm_seed = seeded(fm_cfg, seed)
        fm_rows = train_fm(fm_seed, base, windows, ks, sdir)
        runs.setdefault(f"{b}/fresh", []).append([r["ne"] for r in fm_rows])
        runs.setdefault(f"{b}/recal", []).append([r["recal_ne"] for r in fm_rows])
        alone: dict[float, list[float]] = {}  # no FM in the loop: one run per lr for every k
        for k in ks:
            das[(bias, k)] = sdir / f"k{k}"
            for setup in SETUPS:
                lrs = lrs_of(b, k, setup)
                for lr in lrs:
                    cfg = replace_section(
                        _student_setup(base, setup, a.plain_weight), "train", dense_lr=lr
                    )
                    if setup == "alone" and lr in alone:
                        nes = alone[lr]
                    else:
                        _, nes, fms = train_student(cfg, windows, k, das[(bias, k)])
                        if setup == "alone":
                            alone[lr] = nes
                        if setup == "plain" and lr == lrs[0]:  # the FM logits every setup reads
                            runs.setdefault(f"{b}/{k}/stale", []).append(fms)
                    runs.setdefault(f"{b}/{k}/{setup}/{lr:g}", []).append(nes)
    return das


def seeded(cfg: Config, seed: int) -> Config:
    """``cfg`` for seed ``seed``: its initialization (``train.seed``) and its stream
    (``data.seed`` = the config's + ``seed``)."""
    out = replace_section(cfg, "train", seed=seed)
    return replace_section(out, "data", seed=cfg.data.seed + seed)


def _ks(a: argparse.Namespace) -> list[int]:
    return sorted({int(x) for x in a.staleness.split(",") if x.strip()})


def _choose(runs: Runs, biases: list[str], ks: list[int], lrs: list[float]) -> dict[str, float]:
    """Per ``"{bias}/{k}/{setup}"`` the lr of the lowest mean NE over the distilled windows
    (w >= k) and the development seeds."""
    out = {}
    for bias in biases:
        for k in ks:
            for setup in SETUPS:

                def score(lr: float, bias: str = bias, k: int = k, setup: str = setup) -> float:
                    seeds = runs[f"{bias}/{k}/{setup}/{lr:g}"]
                    return statistics.fmean(statistics.fmean(s[k:]) for s in seeds)

                out[f"{bias}/{k}/{setup}"] = min(lrs, key=score)
    return out


def _teacher_ne(student: Config, bias: float, seeds: list[int], windows: int) -> list[float]:
    """The teacher's eval NE per window of the vertical ``bias``, the mean over the streams of
    ``seeds``."""
    from neorec.data.stream import teacher_metrics_by_window

    per_seed = []
    for s in seeds:
        cfg = replace_section(seeded(student, s), "data", vertical_bias=bias)
        by_window = teacher_metrics_by_window(
            cfg.data, cfg.embedding.tables, cfg.model.num_dense, windows
        )
        per_seed.append([m["ne"] for m in by_window])
    return [statistics.fmean(w) for w in zip(*per_seed, strict=True)]


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tuning on the development seeds, the chosen lrs on the reported seeds; the result dict."""
    from neorec.machine import cpu_model_and_flags

    student, fm_cfg, windows, ks = _load(a)
    lrs = _floats(a.lrs, "--lrs")
    biases = [f"{b:g}" for b in _floats(a.biases, "--biases")]
    t0 = time.perf_counter()
    dev: Runs = {}
    for seed in range(a.dev_seeds):
        _one_seed(a, student, fm_cfg, seed, windows, lambda b, k, s: lrs, work / "dev", dev)
    chosen = _choose(dev, biases, ks, lrs)
    tune_s = time.perf_counter() - t0
    rep: Runs = {}
    seeds = list(range(a.seed_base, a.seed_base + a.seeds))
    speed: dict[str, dict[str, list[float]]] = {}
    for i, seed in enumerate(seeds):
        das = _one_seed(
            a,
            student,
            fm_cfg,
            seed,
            windows,
            lambda b, k, s: [chosen[f"{b}/{k}/{s}"]],
            work / "rep",
            rep,
        )
        if i == 0:  # throughput: the setups side by side on the first reported seed's DAS files
            bias = _floats(a.biases, "--biases")[-1]
            base = replace_section(seeded(student, seed), "data", vertical_bias=bias)
            for k in ks:
                cfgs = {s: _student_setup(base, s, a.plain_weight) for s in SETUPS}
                speed[str(k)] = time_students(
                    cfgs, windows - 1, k, das[(bias, k)], a.rounds, a.steps
                )
    teacher = {b: _teacher_ne(student, float(b), seeds, windows) for b in biases}
    out = summarize(rep, dev, chosen, speed, teacher, biases, ks, lrs, windows)
    out.update(
        seeds=seeds,
        dev_seeds=list(range(a.dev_seeds)),
        stream_seeds={
            "dev": [student.data.seed + s for s in range(a.dev_seeds)],
            "reported": [student.data.seed + s for s in seeds],
        },
        cpu=cpu_model_and_flags()[0],
        window_samples=student.data.window_samples,
        fm_window_samples=fm_cfg.data.window_samples,
        plain_weight=a.plain_weight,
        timing={"rounds": a.rounds, "steps": a.steps, "window": windows - 1, "seed": seeds[0]},
        tune_s=round(tune_s, 1),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
    _load(a)  # every flag and config checked before any training
    if a.threads:
        torch.set_num_threads(a.threads)
    keep = bool(a.work)
    work = Path(a.work) if keep else Path(tempfile.mkdtemp(prefix="neorec-distill-"))
    if keep and work.exists() and any(work.iterdir()):
        raise ConfigError(f"--work {work}: not empty; give a new or empty directory")
    t0 = time.perf_counter()
    try:
        result = run(a, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
