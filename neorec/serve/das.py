"""DAS (ExFM's data augmentation system): a saved FM's logits over a stream window, written as
the side files ``neorec.data.stream.read_fm_logits`` reads (``data.fm_logits``)."""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.config import Config, ConfigError
from neorec.data.stream import (
    FM_FORMAT,
    FM_FORMAT_VERSION,
    DriftingClickData,
    check_split,
    fm_paths,
    logits_sha256,
    split_samples,
    stream_fingerprint,
)
from neorec.errors import DataError
from neorec.serve.model import find_model_dir, load_model, read_model_info

__all__ = ["write_fm_logits"]


def _check_fm_model(fm_cfg: Config, cfg: Config, model_dir: Path, fm_window: int) -> None:
    """The FM reads the stream's batches (same features, rows, dense) and is of ``fm_window``."""
    if fm_cfg.data.source != "stream":
        raise DataError(
            f"{model_dir}: the FM was trained on data.source = '{fm_cfg.data.source}', not on a "
            "stream window; train it with --set data.source=stream --set data.window=W"
        )
    if fm_cfg.data.window != fm_window:
        raise DataError(
            f"{model_dir}: the FM was trained on window {fm_cfg.data.window}, not fm_window "
            f"{fm_window}; pass the FM of window {fm_window}"
        )
    mine = [(t.name, t.rows, list(t.features)) for t in cfg.embedding.tables]
    theirs = [(t.name, t.rows, list(t.features)) for t in fm_cfg.embedding.tables]
    if mine != theirs or fm_cfg.model.num_dense != cfg.model.num_dense:
        raise DataError(
            f"{model_dir}: the FM's tables / dense features ({len(theirs)} tables, "
            f"{fm_cfg.model.num_dense} dense) differ from the stream's ({len(mine)} tables, "
            f"{cfg.model.num_dense} dense); FM and students must read the same stream"
        )


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path}: cannot write the FM logits ({e.strerror or e})") from None


@torch.no_grad()
def write_fm_logits(
    model_dir: str | Path,
    cfg: Config,
    window: int,
    split: str,
    out_dir: str | Path,
    fm_window: int,
) -> Path:
    """Run the saved FM ``model_dir`` (trained on window ``fm_window``) over window ``window``'s
    ``split`` of the stream ``cfg`` describes, in data order (``data.batch_size`` batches), and
    write its float32 logits to ``out_dir/fm_w{window}_{split}.npy`` plus the ``.json`` sidecar
    (written last). Returns the ``.npy`` path."""
    check_split(split)
    for name, v in (("window", window), ("fm_window", fm_window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
    if fm_window > window:
        raise ConfigError(
            f"fm_window {fm_window} is after window {window}: an FM labels the data of its own "
            "window or later ones (staleness k = window - fm_window >= 0)"
        )
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: is not a directory (the FM logits' out_dir)")
    data_cfg = dataclasses.replace(
        cfg.data, window=window, windows=max(cfg.data.windows, window + 1)
    )
    cfg = dataclasses.replace(cfg, data=data_cfg)
    bs = data_cfg.batch_size
    n = split_samples(data_cfg, split)
    if n == 0:
        raise ConfigError(
            f"window {window}'s {split} split has fewer samples than one batch of {bs}; raise "
            f"data.{'window_samples' if split == 'train' else 'eval_samples'}"
        )
    src = find_model_dir(model_dir)
    info = read_model_info(src)
    model, fm_cfg = load_model(src)
    _check_fm_model(fm_cfg, cfg, src, fm_window)
    data = DriftingClickData(data_cfg, cfg.embedding.tables, cfg.model.num_dense)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if fm_cfg.train.bf16_dense else nullcontext()
    model.train(False)
    parts = []
    for i in range(n // bs):
        b = data.batch(split, i, bs)
        with ctx:
            logits = model(b.dense, b.sparse)
        parts.append(logits.detach().float().cpu())
    arr = torch.cat(parts).numpy().astype(np.float32, copy=False)
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise DataError(
            f"{src}: the FM's logit of sample {bad} of window {window} {split} is not finite; "
            "the FM diverged, retrain it"
        )
    out.mkdir(parents=True, exist_ok=True)
    npy, side = fm_paths(out, window, split)
    meta = {
        "format": FM_FORMAT,
        "version": FM_FORMAT_VERSION,
        "window": window,
        "split": split,
        "samples": int(arr.shape[0]),
        "batch_size": bs,
        "dtype": "float32",
        "fm_window": fm_window,
        "fm_step": int(info.get("step", 0)),
        "fm_model": str(src),
        "stream": stream_fingerprint(data_cfg, cfg.embedding.tables, cfg.model.num_dense),
        "sha256": logits_sha256(arr),
    }
    side.unlink(missing_ok=True)  # a reader never pairs the new array with an old sidecar
    _atomic_write(npy, lambda fh: np.save(fh, arr, allow_pickle=False))
    text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
    _atomic_write(side, lambda fh: fh.write(text.encode()))
    return npy
