"""``neorec eval | predict | export``: a saved model (a run folder or its ``model/``) put to use
(their flags: ``neorec.cli.eval`` / ``predict`` / ``export``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

import numpy as np

from neorec.config import ConfigError
from neorec.errors import NeorecError

__all__ = ["run_eval", "run_predict", "run_export"]


def _prepare(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model dir, config with overrides, eval data) of a command, checked before the model is
    built; then the model is loaded."""
    from neorec.builder import apply_threads
    from neorec.serve.evaluate import eval_data, override_config
    from neorec.serve.model import MODEL_FILE, config_from_dict, find_model_dir, read_model_info

    src = find_model_dir(args.model)
    cfg = config_from_dict(read_model_info(src)["config"], str(src / MODEL_FILE))
    sets = list(args.set)
    window = getattr(args, "window", None)
    if window is not None:
        if cfg.data.source != "stream":
            raise ConfigError(
                f"--window {window}: the model's data.source is '{cfg.data.source}', not "
                "'stream'; --window reads a window of stream data"
            )
        if isinstance(window, int) and window >= cfg.data.windows:
            sets.append(f"data.windows={window + 1}")
        sets.append(f"data.window={window}")
    cfg = override_config(cfg, sets)
    apply_threads(cfg.train.threads)
    return src, cfg, eval_data(cfg, args.data, getattr(args, "split", "eval"))


def run_eval(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``neorec eval``: the saved model's metrics on its eval data (or ``--data``)."""
    from neorec.serve.evaluate import evaluate_model
    from neorec.serve.model import load_model, read_model_info

    out = out or sys.stdout
    src, cfg, data = _prepare(args)
    model, _ = load_model(src)
    m = evaluate_model(model, cfg, data)
    step = read_model_info(src)["step"]
    lines = [
        f"model {src} (step {step}); data: {data.describe}, {m['samples']:,} samples",
        f"{'':10}{'auc':>8}{'logloss':>10}{'ne':>8}{'calib':>8}",
        f"{'eval':10}{m['auc']:8.4f}{m['logloss']:10.4f}{m['ne']:8.4f}{m['calibration']:8.3f}",
    ]
    te = data.teacher()
    if te:
        lines.append(
            f"{'teacher':10}{te['auc']:8.4f}{te['logloss']:10.4f}{te['ne']:8.4f}"
            f"{te.get('calibration', 1.0):8.3f}"
        )
        lines.append(f"eval NE is {100 * (m['ne'] / te['ne'] - 1):+.2f}% vs the teacher")
    if getattr(args, "json", False):
        lines.append(json.dumps({"eval": m, "teacher": te}, sort_keys=True, default=float))
    print("\n".join(lines), file=out, flush=True)
    return 0


def run_predict(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``neorec predict``: float32 probabilities of every sample, in data order, to ``--out``."""
    from neorec.serve.evaluate import predict_batches
    from neorec.serve.model import check_out_path, load_model

    out = out or sys.stdout
    if getattr(args, "das", None):
        return _write_das(args, out)
    dest = check_out_path(args.out, "--out")
    from neorec.serve.predict_artifact import is_artifact, predict_artifact

    if is_artifact(args.model):  # a serving artifact: its tables as exported
        arr, describe = predict_artifact(args)
    else:
        src, cfg, data = _prepare(args)
        model, _ = load_model(src)
        probs, _labels = predict_batches(
            model, data.batches(), cfg.train.bf16_dense, "predict", data.total, data.describe
        )
        arr, describe = probs.numpy().astype(np.float32, copy=False), data.describe
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)
        os.replace(tmp, dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        from neorec.errors import DataError

        raise DataError(f"{dest}: cannot write the predictions ({e.strerror or e})") from None
    print(
        f"wrote {arr.shape[0]:,} probabilities (float32) of {describe} to {dest}",
        file=out,
        flush=True,
    )
    return 0


def _write_das(args: argparse.Namespace, out: TextIO) -> int:
    """``neorec predict --das DIR``: the FM's logits of a stream window's split as a side file."""
    from neorec.serve.das import write_fm_logits
    from neorec.serve.model import MODEL_FILE, config_from_dict, find_model_dir, read_model_info

    if args.data:
        raise ConfigError("--das writes the logits of stream data; drop --data")
    src = find_model_dir(args.model)
    saved = config_from_dict(read_model_info(src)["config"], str(src / MODEL_FILE))
    _, cfg, _ = _prepare(args)
    npy = write_fm_logits(src, cfg, cfg.data.window, args.split, args.das, saved.data.window)
    meta = json.loads(npy.with_suffix(".json").read_text())
    print(
        f"wrote {meta['samples']:,} FM logits (float32; FM of window {meta['fm_window']}, step "
        f"{meta['fm_step']}) of stream window {meta['window']} {meta['split']} split to {npy}",
        file=out,
        flush=True,
    )
    return 0


def _export_phase(model: str) -> Any:
    """The export's progress: announced (and timed when done) for a model of at least
    ``ANNOUNCE_ROWS`` rows; quiet for a small one."""
    from neorec.phases import Phase
    from neorec.serve.model import ANNOUNCE_ROWS, MODEL_FILE, find_model_dir, read_model_info

    try:
        src = find_model_dir(model)
        tables = read_model_info(src)["config"].get("embedding", {}).get("tables", [])
    except NeorecError:  # export_model says what is wrong, in its order
        return Phase("export", enabled=False)
    rows = sum(int(t.get("rows", 0)) for t in tables if isinstance(t, dict))
    phase = Phase(f"exporting {src / MODEL_FILE}", total=rows, unit="rows")
    if rows >= ANNOUNCE_ROWS:
        phase.announce()
    return phase


def run_export(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``neorec export``: the serving artifact of a saved model."""
    from neorec.serve.export import export_model
    from neorec.serve.lowrank import DEFAULT_ITERS, parse_low_rank

    out = out or sys.stdout
    rank = parse_low_rank(getattr(args, "low_rank", None), "--low-rank")
    iters = parse_low_rank(getattr(args, "low_rank_iters", None), "--low-rank-iters")
    if iters is not None and rank is None:
        raise ConfigError("--low-rank-iters: only with --low-rank R")
    iters = DEFAULT_ITERS if iters is None else iters
    with _export_phase(args.model) as phase:
        dest = export_model(
            args.model, args.out, args.quantize, phase.advance, low_rank=rank, low_rank_iters=iters
        )
    manifest = json.loads((dest / "manifest.json").read_text())
    table_bytes = sum(t["bytes"] for t in manifest["tables"])
    dense = manifest["dense"]
    if rank is not None:
        print(_low_rank_line(manifest, rank, iters), file=out, flush=True)
    kind = args.quantize if rank is None else f"low rank {rank}"
    print(
        f"exported to {dest}: dense part as {dense['format']} ({dense['file']}), "
        f"{len(manifest['tables'])} tables ({kind}, {table_bytes / 2**20:,.2f} MiB), "
        f'loader serving.py (python -c \'import sys; sys.path.insert(0, "{dest}"); '
        f'import serving; predict = serving.load("{dest}")\')',
        file=out,
        flush=True,
    )
    return 0


def _low_rank_line(manifest: dict[str, Any], rank: int, iters: int) -> str:
    """What ``--low-rank`` did: the factored tables' errors, the tables kept as they are."""
    tables = manifest["tables"]
    done = [t for t in tables if t["quantization"] == "lowrank"]
    kept = [t["name"] for t in tables if t["quantization"] != "lowrank"]
    line = f"low rank {rank} ({iters} ALS iterations): {len(done)} tables factored"
    if done:
        worst = max(done, key=lambda t: t["relative_error"])
        line += (
            f" (relative Frobenius error up to {worst['relative_error']:.4f}, table "
            f"'{worst['name']}')"
        )
    if kept:
        line += f"; kept as they are (dim <= {rank}): {', '.join(kept)}"
    return line
