"""``neorec eval | predict | export``: a saved model (a run folder or its ``model/``) put to use.

``neorec/cli.py`` calls ``add_parsers(sub)``; ``main(argv)`` runs these commands alone with the
CLI's error handling (tests, ``python -m neorec.serve.commands``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

import numpy as np

from neorec.config import ConfigError
from neorec.errors import NeorecError

__all__ = ["add_parsers", "run_eval", "run_predict", "run_export", "main"]

_MODEL_HELP = "a run folder (its model/ is used) or a model directory written by save_model"
_DATA_HELP = (
    "data to read instead of the config's eval split: a Criteo TSV file or directory of them "
    "(every line, in order) or a preprocessed directory (its held-out split if it has one, else "
    "all of it)"
)


def _common(p: argparse.ArgumentParser, data_help: str = _DATA_HELP) -> None:
    p.add_argument("--model", required=True, metavar="RUN", help=_MODEL_HELP)
    p.add_argument("--data", metavar="PATH", help=data_help)
    p.add_argument(
        "--window",
        type=int,
        metavar="W",
        help="stream data (data.source = stream): read window W of the stream (the same as "
        "--set data.window=W; data.windows is raised to W + 1 if needed)",
    )
    p.add_argument(
        "--split",
        choices=["train", "eval"],
        default="eval",
        help="synthetic / stream data: which split of the config's data (default: eval)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="data.KEY=VALUE",
        help="override the saved config's data section (repeatable), e.g. --set "
        "data.eval_samples=10000; also train.threads and train.bf16_dense",
    )


def add_parsers(sub: Any) -> None:
    """Add ``eval``, ``predict`` and ``export`` to ``sub`` (argparse subparsers)."""
    e = sub.add_parser("eval", help="evaluate a saved model: AUC, log loss, NE, calibration")
    _common(e)
    e.add_argument("--json", action="store_true", help="print the metrics as one JSON line too")
    e.set_defaults(func=run_eval)

    p = sub.add_parser(
        "predict",
        help="batch inference: click probabilities (float32 .npy) of every sample, in data order",
    )
    _common(p, _DATA_HELP + "; default: the config's eval split (the trainer's eval order)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out",
        metavar="PREDS.npy",
        help="where to write the probabilities: float32 [samples], sigmoid of the model's logits "
        "(what the trainer's eval computes), in the order of the data",
    )
    where.add_argument(
        "--das",
        metavar="DIR",
        help="stream data: write the model's float32 LOGITS of --window's --split as a DAS side "
        "file DIR/fm_w{W}_{split}.npy + .json (the model is the FM of the window it was trained "
        "on), for students' data.fm_logits = DIR",
    )
    p.set_defaults(func=run_predict)

    x = sub.add_parser(
        "export", help="write a serving artifact that loads with torch + numpy only (no neorec)"
    )
    x.add_argument("--model", required=True, metavar="RUN", help=_MODEL_HELP)
    x.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) directory")
    x.add_argument(
        "--quantize",
        choices=["none", "int8", "int4"],
        default="none",
        help="table rows: none (fp32), int8 or int4 row-wise codes with per-row scale and offset",
    )
    x.set_defaults(func=run_export)


def _prepare(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model dir, config with overrides, eval data) of a command, checked before the model is
    built; then the model is loaded."""
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
    if cfg.train.threads:
        import torch

        torch.set_num_threads(cfg.train.threads)
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
    src, cfg, data = _prepare(args)
    model, _ = load_model(src)
    probs, _labels = predict_batches(model, data.batches(), cfg.train.bf16_dense)
    arr = probs.numpy().astype(np.float32, copy=False)
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
        f"wrote {arr.shape[0]:,} probabilities (float32) of {data.describe} to {dest}",
        file=out,
        flush=True,
    )
    return 0


def _write_das(args: argparse.Namespace, out: TextIO) -> int:
    """``neorec predict --das DIR``: the FM's logits of a stream window's split as a side file."""
    from neorec.data.stream import write_fm_logits
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


def run_export(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``neorec export``: the serving artifact of a saved model."""
    from neorec.serve.export import export_model

    out = out or sys.stdout
    dest = export_model(args.model, args.out, args.quantize)
    manifest = json.loads((dest / "manifest.json").read_text())
    table_bytes = sum(t["bytes"] for t in manifest["tables"])
    dense = manifest["dense"]
    print(
        f"exported to {dest}: dense part as {dense['format']} ({dense['file']}), "
        f"{len(manifest['tables'])} tables ({args.quantize}, {table_bytes / 2**20:,.2f} MiB), "
        f'loader serving.py (python -c \'import sys; sys.path.insert(0, "{dest}"); '
        f'import serving; predict = serving.load("{dest}")\')',
        file=out,
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """These commands alone, with ``neorec.cli.main``'s error handling (one line, exit 2)."""
    p = argparse.ArgumentParser(prog="neorec", description="Use a trained model.")
    add_parsers(p.add_subparsers(dest="command", required=True))
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
        return int(args.func(args))
    except NeorecError as e:
        print(f"neorec: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("neorec: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
