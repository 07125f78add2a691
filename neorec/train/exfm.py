"""ExFM's chain on a drifting stream: the FM window by window, DAS, the students.

``neorec exfm`` (and ``neorec bench distill``, which repeats it over seeds and student setups):

1. **FM.** A larger DLRM (``--fm-config``) trains on windows 0, 1, ... in order, incrementally
   (one model and optimizer carried from window to window). After window w it is saved
   (``serve.save_model``: ``fm_w{w}``) and DAS writes its logits for the train and eval splits of
   window w + k (``neorec.serve.das.write_fm_logits``: ``k{k}/fm_w{w+k}_{split}.npy``).
2. **Student.** The small DLRM (``--config``, its ``[distill]``) trains on the same windows,
   incrementally, reading the logits of the FM of window w - k through the stream source
   (``data.fm_logits``, ``data.fm_staleness = k``); windows w < k have no FM yet and train alone.
   After each window its serving head is evaluated on the window's eval split.

The FM learns from the stream itself; ``data.vertical_bias`` / ``data.vertical_shift`` in the
student's config make its labels a vertical's (the FM / VM distribution gap).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from neorec.config import Config, ConfigError

__all__ = [
    "replace_section",
    "student_model",
    "window_cfg",
    "check_pair",
    "train_fm",
    "recalibrated_ne",
    "train_student",
    "run_chain",
]


def replace_section(cfg: Config, section: str, **kw: Any) -> Config:
    """``cfg`` with fields of one section replaced (checked again)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **kw)})


def student_model(cfg: Config) -> Any:
    """The unsharded model of ``cfg`` as the trainer builds it (dense blocks; the FM's too) and
    its dense optimizer."""
    from neorec.builder import build_dlrm, dense_optimizer
    from neorec.distributed.dense_blocks import block_dense

    model = build_dlrm(cfg)
    if cfg.train.dense_blocks > 1:
        block_dense(model.dense_arch, cfg.train.dense_blocks)
    return model, dense_optimizer(cfg.train, model.dense_parameters())


def window_cfg(cfg: Config, w: int, **data: Any) -> Config:
    """``cfg`` on window ``w`` (other data fields replaced too)."""
    return replace_section(cfg, "data", window=w, **data)


def train_fm(
    fm_cfg: Config,
    student: Config,
    windows: int,
    ks: list[int],
    work: Path,
    das_name: str = "",
    log: Any = None,
) -> list[dict[str, float]]:
    """Train the FM window by window; save it after each window whose logits someone reads
    (``work/fm_w{w}``) and write its DAS logits for window w + k (``work/k{k}``, or
    ``work/{das_name}`` for one k); per window the FM's eval metrics on the student's eval split
    of that window (fresh FM; ``recal_ne``: after the best constant shift; ``own_ne``: on the
    FM's own traffic) and the seconds its training took; ``log(line)`` as each window ends."""
    from neorec.builder import data_source
    from neorec.serve import save_model
    from neorec.serve.das import write_fm_logits
    from neorec.train.steps import evaluate, train_step

    model, opt = student_model(window_cfg(fm_cfg, 0))
    out, step = [], 0
    t_start = time.perf_counter()
    for w in range(windows):
        cfg_w = window_cfg(fm_cfg, w)
        src = data_source(cfg_w)
        t0 = time.perf_counter()
        for batch in src.train_batches():
            step += 1
            train_step(model, opt, batch, step)
        secs = time.perf_counter() - t0
        # the student's eval split (the FM's is the same samples when eval_samples agree; the
        # labels are the student's vertical's)
        ev = evaluate(model, data_source(window_cfg(student, w)).eval_batches())
        recal = recalibrated_ne(model, data_source(window_cfg(student, w)).eval_batches())
        own = ev
        if student.data.vertical_bias or student.data.vertical_shift:
            own = evaluate(model, data_source(cfg_w).eval_batches())  # on its own traffic
        row = {
            "window": w,
            "ne": ev["ne"],
            "auc": ev["auc"],
            "own_ne": own["ne"],
            "recal_ne": recal,
        }
        out.append({**row, "train_s": secs})
        if log is not None:
            log(f"  FM window {w + 1}/{windows}: eval NE {ev['ne']:.4f} ({secs:.1f} s training)"
                + _eta(t_start, w + 1, windows))  # fmt: skip
        targets = [w + k for k in ks if w + k < windows]
        if not targets:
            continue
        mdir = save_model(model, cfg_w, work / f"fm_w{w}", step=step)
        for k in ks:
            if w + k < windows:
                for split in ("train", "eval"):
                    das = work / (das_name if das_name and len(ks) == 1 else f"k{k}")
                    write_fm_logits(mdir, student, w + k, split, das, w)
        model.train(True)
    return out


def _eta(t_start: float, done: int, total: int) -> str:
    """`` (1m05s so far, eta 3m10s)`` after ``done`` of ``total`` equal units."""
    from neorec.phases import eta, fmt_duration

    spent = time.perf_counter() - t_start
    left = eta(spent, done, total)
    return f"  [{fmt_duration(spent)} so far" + (f", eta {left}]" if left else "]")


@torch.no_grad()
def recalibrated_ne(model: Any, batches: Any) -> float:
    """NE of ``model``'s logits on ``batches`` after the best constant shift of the logit (fitted
    on these labels by Newton's method): the FM at its best on a vertical whose click rate differs
    from the traffic it learned from (a stricter reference for ``gap_closed``)."""
    from neorec.metrics import binary_metrics

    model.train(False)
    logits, labels = [], []
    for b in batches:
        logits.append(model(b.dense, b.sparse).double())
        labels.append(b.labels.double())
    model.train(True)
    z, y = torch.cat(logits), torch.cat(labels)
    shift = torch.zeros((), dtype=torch.float64)
    for _ in range(30):
        p = torch.sigmoid(z + shift)
        shift = shift - (p - y).sum() / (p * (1 - p)).sum().clamp_min(1e-12)
    return binary_metrics(torch.sigmoid(z + shift), y)["ne"]


def train_student(
    cfg: Config, windows: int, k: int, das: Path | None, log: Any = None, fused_bce: bool = True
) -> tuple[Any, list[float], list[float]]:
    """One student over the windows: ``(model, per-window eval NE of the serving head, per-window
    NE of the stale FM logits it read (NaN where none))``; ``log(line)`` per window if given.
    Steps without distillation (``alone``, windows w < k) compute their BCE by the distilled
    steps' C kernel (``fused_bce``: ``neorec.train.losses.FusedBce``), so every setup has the same loss path."""
    from neorec.builder import data_source
    from neorec.data.stream import read_fm_logits
    from neorec.metrics import binary_metrics
    from neorec.train.losses import make_loss
    from neorec.train.steps import evaluate, train_step

    model, opt = student_model(cfg)
    nes, fm_nes, step = [], [], 0
    t_start = time.perf_counter()
    for w in range(windows):
        distilled = cfg.distill.enabled and w >= k
        data: dict[str, Any] = {"fm_staleness": k if distilled else 0, "fm_logits": ""}
        if distilled:
            assert das is not None
            data["fm_logits"] = str(das)
        cfg_w = window_cfg(cfg, w, **data)
        src = data_source(cfg_w)
        batches = list(src.train_batches())  # generated before the clock starts
        loss_fn = make_loss(cfg.distill if distilled else None, fused_bce)
        for batch in batches:
            step += 1
            train_step(model, opt, batch, step, loss_fn=loss_fn)
        nes.append(evaluate(model, src.eval_batches())["ne"])
        fm_ne = float("nan")
        if distilled:
            arr = read_fm_logits(cfg_w.data, cfg_w.embedding.tables, cfg_w.model.num_dense, "eval")
            assert arr is not None
            labels = torch.cat([b.labels for b in src.eval_batches()]).double()
            fm = torch.sigmoid(torch.from_numpy(arr).double())
            fm_ne = binary_metrics(fm, labels)["ne"]
        fm_nes.append(fm_ne)
        if log is not None:
            how = f"distilled from the FM of window {w - k}" if distilled else "alone"
            log(f"  student window {w + 1}/{windows} ({how}): eval NE {nes[-1]:.4f}"
                + _eta(t_start, w + 1, windows))  # fmt: skip
        model.train(True)
    return model, nes, fm_nes


def check_pair(student: Config, fm: Config, config: str, fm_config: str) -> None:
    """The FM and the student read the same stream (``ConfigError`` naming what differs)."""
    from neorec.data.stream import stream_fingerprint

    for name, c in ((config, student), (fm_config, fm)):
        if c.data.source != "stream":
            raise ConfigError(f"{name}: data.source must be 'stream', got '{c.data.source}'")
    own = replace_section(student, "data", vertical_bias=0.0, vertical_shift=0.0)
    if fm.data.vertical_bias or fm.data.vertical_shift:
        raise ConfigError(
            f"{fm_config}: the FM learns from the stream itself; data.vertical_bias / "
            "data.vertical_shift describe the student's vertical (set them in the student config)"
        )

    def _fingerprint(c: Config) -> str:
        return stream_fingerprint(c.data, c.embedding.tables, c.model.num_dense)

    if _fingerprint(own) != _fingerprint(fm):
        raise ConfigError(
            f"{config} and {fm_config} describe different streams (seed, drift, churn, batch "
            "size or tables differ); the FM and the student must read the same stream"
        )
    if student.data.eval_samples != fm.data.eval_samples:
        raise ConfigError(
            f"data.eval_samples differ ({student.data.eval_samples} vs {fm.data.eval_samples}); "
            "the FM and the student are compared on the same eval samples"
        )


def run_chain(
    student: Config, fm: Config, windows: int, out: Path, log: Any = print
) -> dict[str, Any]:
    """The chain of the module docstring into ``out`` (new or empty): FM models ``fm_w{w}``,
    DAS files ``das/``, the student ``student/`` (a saved model: eval / predict / export read
    it). Returns the per-window metrics."""
    from neorec.serve import save_model

    k = student.data.fm_staleness
    if student.distill.enabled and not 0 <= k < windows:
        raise ConfigError(f"data.fm_staleness {k} must be below the {windows} windows")
    t0 = time.perf_counter()
    log(f"FM: {windows} windows, DAS logits for staleness k = {k} -> {out / 'das'}")
    fm_rows = train_fm(fm, student, windows, [k], out, das_name="das", log=log)
    log("student:")
    model, nes, fm_nes = train_student(student, windows, k, out / "das", log=log)
    save_model(model, window_cfg(student, windows - 1), out / "student")
    result = {
        "windows": windows,
        "staleness": k,
        "distill": dataclasses.asdict(student.distill),
        "fm_ne": [round(r["ne"], 5) for r in fm_rows],
        "fm_logits_ne": [None if x != x else round(x, 5) for x in fm_nes],
        "student_ne": [round(x, 5) for x in nes],
        "student_mean_ne": round(statistics.fmean(nes[k:]), 5) if nes[k:] else None,
        "out": str(out),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return result


def run_exfm(args: argparse.Namespace) -> int:
    """``neorec exfm``: check everything, run the chain, print a table and a JSON line."""
    from neorec.config import load_config

    student = load_config(args.config, args.set)
    fm = load_config(args.fm_config, args.fm_set)
    check_pair(student, fm, args.config, args.fm_config)
    windows = args.windows or student.data.windows
    if windows < 1 or windows > student.data.windows or windows > fm.data.windows:
        raise ConfigError(
            f"--windows {windows} must be in [1, data.windows] ({student.data.windows} in "
            f"{args.config}, {fm.data.windows} in {args.fm_config})"
        )
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: not an empty folder; give a new or empty one")
    out.mkdir(parents=True, exist_ok=True)
    from neorec.train.runstatus import mark_ended

    try:
        r = run_chain(student, fm, windows, out)
    except BaseException as e:  # `neorec runs` says how it ended: failed / interrupted
        mark_ended(out, e)
        raise
    mark_ended(out, None)
    print(f"{'window':>8}{'FM NE':>10}{'FM logits NE':>14}{'student NE':>12}")
    for w in range(windows):
        fl = r["fm_logits_ne"][w]
        fls = "-" if fl is None else f"{fl:.4f}"
        print(f"{w:>8}{r['fm_ne'][w]:>10.4f}{fls:>14}{r['student_ne'][w]:>12.4f}")
    print(json.dumps(r, sort_keys=True))
    return 0
