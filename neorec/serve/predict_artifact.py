"""``neorec predict --model ARTIFACT``: batch inference through a serving artifact (``neorec
export``: fp32, fp16 or int8 / int4 / int2 tables), on the data of the model it was exported from.

The data is read as ``neorec predict --model RUN`` reads it (the config saved in the artifact's
manifest, else its source model's; ``--data``, ``--set data.*``); each batch goes through the
artifact's predictor (``neorec.serve.standalone``: neorec's fused lookup for tables other than
fp32), so the probabilities are those the artifact serves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.config import Config
from neorec.errors import DataError
from neorec.phases import Phase
from neorec.serve import standalone

__all__ = ["is_artifact", "artifact_config", "predict_artifact"]


def is_artifact(path: str | Path) -> bool:
    """Whether ``path`` is a directory ``neorec export`` wrote (its manifest's format)."""
    m = Path(path) / standalone.MANIFEST
    if not m.is_file():
        return False
    try:
        return bool(json.loads(m.read_bytes()).get("format") == standalone.FORMAT)
    except (OSError, ValueError, AttributeError):
        return False  # not readable as one: the model loader names what is wrong


def artifact_config(manifest: dict[str, Any], where: str) -> Config:
    """The config the artifact's model was trained with: the manifest's, else its source
    model's (an artifact exported before the manifest carried it)."""
    from neorec.serve.model import MODEL_FILE, config_from_dict, find_model_dir, read_model_info

    if isinstance(manifest.get("config"), dict):
        return config_from_dict(manifest["config"], f"{where} (config)")
    src = Path(str(manifest.get("source", {}).get("model", "")))
    if not (src / MODEL_FILE).is_file():
        raise DataError(
            f"{where}: carries no config and its source model {src} is not here: predict reads "
            "data as the model's config says; export the model again"
        )
    src = find_model_dir(src)
    return config_from_dict(read_model_info(src)["config"], str(src / MODEL_FILE))


def predict_artifact(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """(float32 probabilities in data order, what was read) of ``args.model``, an artifact."""
    from neorec.builder import apply_threads
    from neorec.serve.artifact import load_artifact
    from neorec.serve.evaluate import eval_data, override_config

    art = load_artifact(args.model)
    cfg = artifact_config(art.manifest, str(Path(args.model) / standalone.MANIFEST))
    cfg = override_config(cfg, list(args.set))
    apply_threads(cfg.train.threads)
    data = eval_data(cfg, args.data, getattr(args, "split", "eval"))
    probs = []
    with Phase("predict", data.total, "batches") as phase:
        for batch in data.batches():
            sparse = {}
            for f in art.features:
                values, lengths, weights = batch.sparse.feature(f)
                w = weights.numpy() if weights is not None else None
                sparse[f] = (lengths.numpy(), values.numpy(), w)
            probs.append(torch.sigmoid(art.logits(batch.dense.numpy(), sparse)).numpy())
            phase.advance(1)
    if not probs:
        raise DataError(f"{data.describe}: holds no samples to predict; check --data")
    kind = art.manifest.get("quantization", "none")
    return np.concatenate(probs).astype(np.float32), f"{data.describe} through the {kind} artifact"
