"""``neorec bench distill``: ExFM on a drifting stream, a stale FM teaching a small student.

The recipe is two configs (``configs/exfm_stream.toml``: the stream and the student;
``configs/exfm_fm.toml``: the FM on the same stream). Per seed:

1. **FM.** A larger DLRM (wider tables, DCN, more samples per window) trains on windows 0, 1, ...
   in order, incrementally (one model and optimizer carried from window to window). After window
   w it is saved (``serve.save_model``) and DAS writes its logits for the train and eval splits of
   window w + k (``neorec.serve.das.write_fm_logits``), for each staleness k.
2. **Students.** The small DLRM trains on the same windows, incrementally, reading the FM logits
   through the stream source (``data.fm_logits``, ``data.fm_staleness = k``), in four setups:
   ``alone``; ``plain`` (distillation into the serving head, ``distill.weight``); ``aux`` (the
   auxiliary head, ``distill.aux_weight``); ``aux+adapter`` (the full ExFM student). Windows
   w < k have no FM yet: every setup trains alone there (so ``alone`` is one run for every k).
   After each window the serving head is evaluated on the window's eval split (NE).

Reported: per-window eval NE (mean over seeds), the mean over the distilled windows (w >= k) with
its spread over seeds, the fresh FM's NE (the FM of window w on window w's eval split of the
student's vertical), the same after the best constant shift of its logit (``recalibrated``: the FM
at its best on a vertical that clicks differently from the traffic it learned from) and the stale
FM logits' own NE, ``gap_closed = (NE_alone - NE_full) / (NE_alone - NE_FM)`` with the
recalibrated fresh FM (``gap_closed_vs_raw_fm``: the raw one; larger when the vertical's gap
makes the raw FM worse, so not the headline), and the
student's training throughput with distillation relative to ``alone`` (``time_students``: the
setups' train steps interleaved round by round on the last window's batches, data excluded).
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

SETUPS = ("alone", "plain", "aux", "aux+adapter")
"""Student setups, in table order."""


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
    p.add_argument("--seeds", type=int, default=2, help="seeds (model init of FM and students)")
    p.add_argument("--staleness", default="1,2", help="k values, comma-separated")
    p.add_argument("--plain-weight", type=float, default=0.5, help="plain: distill.weight")
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
    cfgs: dict[str, Config], window: int, k: int, das: Path, rounds: int = 7, steps: int = 16
) -> dict[str, float]:
    """Training throughput (samples/s) of each setup on window ``window``'s batches (FM logits
    of staleness ``k``; generated before the clock starts): ``rounds`` rounds, each running
    ``steps`` steps of every setup in turn (so a slower moment of a shared machine hits them
    alike); per setup its fastest round's median step (other work on a shared machine only ever
    slows a round down)."""
    from neorec.build import data_source
    from neorec.train.steps import train_step

    state: dict[str, Any] = {}
    for name, cfg in cfgs.items():
        on = cfg.distill.enabled
        data = {"fm_logits": str(das), "fm_staleness": k} if on else {}
        batches = list(data_source(window_cfg(cfg, window, **data)).train_batches())[:steps]
        model, opt = student_model(cfg)
        state[name] = (model, opt, batches, cfg.distill if on else None, [])
    for r in range(rounds + 1):  # round 0 warms up (allocations, first-call costs)
        for model, opt, batches, distill, meds in state.values():
            times = []
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                train_step(model, opt, batch, r * len(batches) + i + 1, distill=distill)
                times.append(time.perf_counter() - t0)
            if r:
                meds.append(statistics.median(times))
    return {name: s[2][0].size / min(s[4]) for name, s in state.items()}


def _stats(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _load(a: argparse.Namespace) -> tuple[Config, Config, int, list[int]]:
    from neorec.config import load_config

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
    if a.seeds < 1 or not 0 < a.plain_weight <= 1 or a.threads < 0:
        raise ConfigError("--seeds must be >= 1, --plain-weight in (0, 1], --threads >= 0")
    student = replace_section(student, "data", windows=max(student.data.windows, windows))
    fm = replace_section(fm, "data", windows=max(fm.data.windows, windows))
    return student, fm, windows, ks


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The whole chain over the seeds; the result dict."""
    from neorec.data.stream import teacher_metrics_by_window

    student, fm_cfg, windows, ks = _load(a)
    ne: dict[str, list[list[float]]] = {}  # "k/setup" -> per seed, per window
    stale_fm: dict[int, list[list[float]]] = {k: [] for k in ks}
    fm_ne: list[list[float]] = []
    fm_recal: list[list[float]] = []
    fm_own: list[list[float]] = []
    speed: dict[str, list[float]] = {}
    fm_s = 0.0
    for seed in range(a.seeds):
        fm_seed = replace_section(fm_cfg, "train", seed=seed)
        sdir = work / f"seed{seed}"
        fm_rows = train_fm(fm_seed, replace_section(student, "train", seed=seed), windows, ks, sdir)
        fm_ne.append([r["ne"] for r in fm_rows])
        fm_recal.append([r["recal_ne"] for r in fm_rows])
        fm_own.append([r["own_ne"] for r in fm_rows])
        fm_s += sum(r["train_s"] for r in fm_rows)
        base = replace_section(student, "train", seed=seed)
        alone: tuple[list[float], list[float]] | None = None
        for k in ks:
            for setup in SETUPS:
                cfg = _student_setup(base, setup, a.plain_weight)
                if setup == "alone" and alone is not None:
                    res = alone  # no FM in the loop: the same run for every k
                else:
                    res = train_student(cfg, windows, k, sdir / f"k{k}")[1:]
                    if setup == "alone":
                        alone = res
                nes, fms = res
                ne.setdefault(f"{k}/{setup}", []).append(nes)
                if setup == "plain":
                    stale_fm[k].append(fms)
            cfgs = {s: _student_setup(base, s, a.plain_weight) for s in SETUPS}
            for s, rate in time_students(cfgs, windows - 1, k, sdir / f"k{k}").items():
                speed.setdefault(f"{k}/{s}", []).append(rate)
    teacher = [
        m["ne"]
        for m in teacher_metrics_by_window(
            student.data, student.embedding.tables, student.model.num_dense, windows
        )
    ]
    out = _summarize(a, windows, ks, ne, stale_fm, fm_ne, speed, teacher, fm_s, fm_recal)
    out["fm_own_traffic_ne"] = [
        round(statistics.fmean(s[w] for s in fm_own), 5) for w in range(windows)
    ]
    return out


def _summarize(
    a: argparse.Namespace,
    windows: int,
    ks: list[int],
    ne: dict[str, list[list[float]]],
    stale_fm: dict[int, list[list[float]]],
    fm_ne: list[list[float]],
    speed: dict[str, list[float]],
    teacher: list[float],
    fm_s: float,
    fm_recal: list[list[float]] | None = None,
) -> dict[str, Any]:
    per_window_fm = [statistics.fmean(s[w] for s in fm_ne) for w in range(windows)]
    out: dict[str, Any] = {
        "bench": "distill",
        "windows": windows,
        "seeds": a.seeds,
        "staleness": ks,
        "teacher_ne": [round(x, 5) for x in teacher],
        "fm_ne": [round(x, 5) for x in per_window_fm],
        "fm_train_s": round(fm_s, 2),
        "per_k": {},
    }
    for k in ks:
        ws = list(range(k, windows))  # the distilled windows
        fm_mean = [statistics.fmean(s[w] for w in ws) for s in fm_ne]
        row: dict[str, Any] = {
            "windows": ws,
            "fm_fresh_ne": _round(_stats(fm_mean)),
            "fm_stale_ne": _round(
                _stats([statistics.fmean(s[w] for w in ws) for s in stale_fm[k]])
            ),
        }
        means: dict[str, list[float]] = {}
        for setup in SETUPS:
            runs = ne[f"{k}/{setup}"]
            means[setup] = [statistics.fmean(r[w] for w in ws) for r in runs]
            row[setup] = {
                "ne_per_window": [
                    round(statistics.fmean(r[w] for r in runs), 5) for w in range(windows)
                ],
                "ne": _round(_stats(means[setup])),
                "samples_per_s": round(statistics.fmean(speed[f"{k}/{setup}"]), 1),
            }
        rc = [statistics.fmean(s[w] for w in ws) for s in fm_recal] if fm_recal else fm_mean
        row["fm_recalibrated_ne"] = _round(_stats(rc))
        for key, ref in (("gap_closed", rc), ("gap_closed_vs_raw_fm", fm_mean)):
            gaps = [
                (al - full) / (al - f) if al != f else float("nan")
                for al, full, f in zip(means["alone"], means["aux+adapter"], ref)
            ]
            row[key] = _round(_stats(gaps))
        base_speed = row["alone"]["samples_per_s"]
        for setup in SETUPS[1:]:
            row[setup]["throughput_vs_alone"] = round(row[setup]["samples_per_s"] / base_speed, 3)
        row["full_better_than_plain"] = row["aux+adapter"]["ne"][0] < row["plain"]["ne"][0]
        out["per_k"][str(k)] = row
    return out


def _round(ms: tuple[float, float]) -> list[float]:
    return [round(ms[0], 5), round(ms[1], 5)]


def _print(r: dict[str, Any]) -> None:
    w = r["windows"]
    print(f"ExFM on a drifting stream: {w} windows, {r['seeds']} seed(s); eval NE of the serving")
    print("head per window (mean over seeds); mean over the distilled windows w >= k +- spread")
    head = "".join(f"{'w' + str(i):>8}" for i in range(w))
    print(f"{'':<18}{head}{'mean':>10}{'+-':>8}{'samples/s':>11}{'vs alone':>9}")
    print(f"{'teacher (Bayes)':<18}" + "".join(f"{x:8.4f}" for x in r["teacher_ne"]))
    print(f"{'FM (fresh)':<18}" + "".join(f"{x:8.4f}" for x in r["fm_ne"]))
    for k, row in r["per_k"].items():
        print(f"-- staleness k = {k}")
        print(f"{'FM logits (stale)':<18}{'':>{8 * int(k)}}" + " " * 8 * (w - int(k)), end="")
        print(f"{row['fm_stale_ne'][0]:10.4f}{row['fm_stale_ne'][1]:8.4f}")
        for setup in SETUPS:
            s = row[setup]
            vs = s.get("throughput_vs_alone", 1.0)
            print(
                f"{setup:<18}"
                + "".join(f"{x:8.4f}" for x in s["ne_per_window"])
                + f"{s['ne'][0]:10.4f}{s['ne'][1]:8.4f}{s['samples_per_s']:11,.0f}{vs:9.2f}"
            )
        g, gr = row["gap_closed"], row["gap_closed_vs_raw_fm"]
        print(
            f"gap_closed (aux+adapter vs alone, of the gap to the fresh FM recalibrated to this "
            f"vertical, {row['fm_recalibrated_ne'][0]:.4f}): {g[0]:.3f} +- {g[1]:.3f}; to the raw "
            f"FM ({row['fm_fresh_ne'][0]:.4f}): {gr[0]:.3f} +- {gr[1]:.3f}"
        )
        print(f"aux+adapter better than plain: {row['full_better_than_plain']}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    a = parse(argv)
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
    _print(result)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
