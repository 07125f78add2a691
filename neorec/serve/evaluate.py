"""Eval and batch inference of a saved model: which data, and the trainer's prediction loop.

Data: the saved config's eval split (its own source and schema, as the trainer reads it), or
``--data PATH`` in the format the model was trained on: for tabular data (Parquet / CSV, their
preprocessed directory, MovieLens) ``neorec.serve.eval_tabular``; otherwise a Criteo TSV file /
directory of them (every line, in file and line order) or a preprocessed directory (its held-out
split when it has one, else all of it, in shard order). ``--set data.KEY=VALUE`` overrides the saved data section (e.g. ``data.eval_samples``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from neorec.config import Config, ConfigError, apply_overrides
from neorec.data.batch import Batch
from neorec.errors import DataError
from neorec.metrics import binary_metrics
from neorec.phases import Phase
from neorec.serve.model import config_from_dict

__all__ = [
    "OVERRIDABLE",
    "override_config",
    "EvalData",
    "eval_data",
    "predict_batches",
    "evaluate_model",
]

OVERRIDABLE = ("data.", "train.threads", "train.bf16_dense")
"""What ``--set`` may change of a saved model's config (the model itself is fixed)."""


def override_config(cfg: Config, sets: list[str]) -> Config:
    """``cfg`` with ``--set`` overrides of its data section (and train.threads / bf16_dense)."""
    if not sets:
        return cfg
    for item in sets:
        key = str(item).split("=", 1)[0].strip()
        if not any(key.startswith(k) or key == k for k in OVERRIDABLE):
            raise ConfigError(
                f"--set {item}: a saved model's {key or 'config'} is fixed; only data.* keys, "
                "train.threads and train.bf16_dense can be overridden here"
            )
    return config_from_dict(apply_overrides(cfg.to_dict(), list(sets)), "--set")


class EvalData:
    """Eval batches of one data source, in order (and the teacher's metrics when known)."""

    def __init__(self, batches: Any, teacher: Any, describe: str, total: int | None = None) -> None:
        self._batches = batches
        self._teacher = teacher
        self.describe = describe
        self.total = total
        """Batches in one pass, when known (the progress line's ETA)."""

    def batches(self) -> Iterator[Batch]:
        """The batches (one pass)."""
        return iter(self._batches())

    def teacher(self) -> dict[str, float] | None:
        """The synthetic teacher's metrics on the same data (None for real data)."""
        return self._teacher() if self._teacher is not None else None


def eval_data(cfg: Config, data: str | None = None, split: str = "eval") -> EvalData:
    """The eval batches of ``cfg`` (``data`` None) or of the data at path ``data``; ``split``
    "train" reads the train split of synthetic or stream data instead (teacher metrics: eval
    split only)."""
    if split not in ("train", "eval"):
        raise ConfigError(f"--split must be 'train' or 'eval', got {split!r}")
    src = cfg.data.source
    if split == "train" and (data is not None or src not in ("synthetic", "stream")):
        raise ConfigError(
            "--split train reads the train split of synthetic or stream data "
            f"(data.source is '{src}'{', and --data is set' if data is not None else ''}); "
            "use --data PATH for other data"
        )
    if data is None:
        from neorec.builder import data_source

        source = data_source(cfg)
        where = {
            "synthetic": f"synthetic {split} split",
            "stream": f"stream window {cfg.data.window} {split} split",
        }.get(src, "the config's eval data")
        counter = getattr(getattr(source, "data", None), "num_batches", None)
        total = int(counter(split, cfg.data.batch_size)) if callable(counter) else None
        if split == "train":
            return EvalData(source.train_batches, None, where, total)
        return EvalData(source.eval_batches, source.reference_metrics, where, total)
    if not Path(data).exists():
        raise DataError(f"{data}: no such file or directory (--data); check the path")
    if cfg.data.source == "tabular":  # read as the model was trained: its schema, its vocabularies
        from neorec.serve.eval_tabular import tabular_batches

        return EvalData(tabular_batches(cfg, Path(data)), None, str(data))
    return EvalData(_path_batches(cfg, Path(data)), None, str(data))


def _path_batches(cfg: Config, p: Path) -> Any:
    from neorec.data.loader import (
        MANIFEST,
        SampleOrder,
        ShardedReader,
        ShardSet,
        _check_tables,
        is_preprocessed,
    )

    tables, bs = cfg.embedding.tables, cfg.data.batch_size
    if not p.exists():
        raise DataError(f"{p}: no such file or directory (--data); check the path")
    if is_preprocessed(p):
        shards = ShardSet(p)
        if shards.manifest.get("layout") == "jagged":
            from neorec.serve.eval_tabular import expected_format

            raise DataError(
                f"--data {p} was preprocessed from tabular data; the model was trained on "
                f"'{cfg.data.source}' data: --data must be {expected_format(cfg)}"
            )
        held = [s for s in shards.shards if s.get("split") == "eval"]
        if held:
            shards = ShardSet(p, held)
        _check_tables(shards, tables)
        shards.check_files()
        keys = [t.features[0] for t in tables]
        reader = ShardedReader(shards, bs, keys=keys, order=SampleOrder(shuffle=False), workers=0)
        return lambda: iter(reader)
    if (p / "shards").is_dir():
        raise DataError(
            f"{p}: a preprocessed directory without {MANIFEST} (preprocessing did not finish); "
            "run `neorec data preprocess` into it again"
        )
    from neorec.data.criteo import CriteoTSVDataset, criteo_files
    from neorec.data.sources import report_skipped

    d = cfg.data
    files = criteo_files(p)
    other = [f for f in files if f.suffix.lower() in (".parquet", ".pq", ".csv")]
    if other:
        from neorec.serve.eval_tabular import expected_format

        raise DataError(
            f"--data {other[0]} is {other[0].suffix[1:]} data; the model was trained on "
            f"'{d.source}' data: --data must be {expected_format(cfg)}"
        )
    dataset = CriteoTSVDataset([str(f) for f in files], tables, bs, d.bad_lines, d.hash_categories)

    def batches() -> Iterator[Batch]:
        yield from dataset
        report_skipped("--data", dataset)

    return batches


@torch.no_grad()
def _check_finite(dense: Tensor, index: int, first: int) -> None:
    """Refuse a batch whose dense features hold NaN or inf (``first``: its first sample's index
    in the data): a ``DataError`` naming the column and the row."""
    finite = torch.isfinite(dense)
    if bool(finite.all()):
        return
    row, col = (int(i) for i in (~finite).nonzero()[0])
    raise DataError(
        f"dense column {col} of row {first + row} of the data (batch {index}, its row {row}) is "
        f"{float(dense[row, col])}: predict and eval take finite dense features"
    )


def predict_batches(
    model: Any,
    batches: Iterator[Batch],
    bf16: bool = False,
    what: str = "predict",
    total: int | None = None,
    source: str = "the data",
) -> tuple[Tensor, Tensor]:
    """(probabilities, labels) float32 over ``batches``, in order: the trainer's eval loop (the
    same per-block sigmoid), so the same model and batches give bitwise its predictions. A
    progress line (``what``; ``total`` batches when known) when it takes a while; ``source``
    names the data in errors."""
    from neorec.distributed.dense_blocks import blocks_of, per_block

    model.train(False)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    blocks = blocks_of(model)
    probs: list[Tensor] = []
    labels: list[Tensor] = []
    seen = 0
    with Phase(what, total, "batches") as phase:
        for i, batch in enumerate(batches):
            _check_finite(batch.dense, i, seen)
            seen += batch.size
            with ctx:
                logits = model(batch.dense, batch.sparse)
            p = torch.cat(per_block(torch.sigmoid, blocks, logits.float()))
            probs.append(p.detach().float().cpu())
            labels.append(batch.labels.detach().float().cpu())
            phase.advance(1)
    if not probs:
        raise DataError(f"{source}: holds no samples to {what}; check --data or the eval split")
    return torch.cat(probs), torch.cat(labels)


def evaluate_model(model: Any, cfg: Config, data: EvalData) -> dict[str, float]:
    """AUC, log loss, NE, calibration of ``model`` on ``data`` (the trainer's metrics)."""
    probs, labels = predict_batches(
        model, data.batches(), cfg.train.bf16_dense, "eval", data.total, data.describe
    )
    return binary_metrics(probs, labels)
