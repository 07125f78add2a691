"""A trained sequential model on disk, and its evaluation against the full item corpus.

``neorec train`` with ``[sequential]`` writes ``<run>/sequential/``: ``model.pt`` (the SASRec
state dict) and ``model.json`` (format ``neorec-sequential-model`` version 1, the
``[sequential]`` section it was trained with, the number of items). ``neorec eval --model RUN``
reads it back, rebuilds the model by the builder and ranks each user's validation and test
targets (:mod:`neorec.metrics_rank`; the protocol is docs/data.md's).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.builder.sequential import make_model, seq_settings
from neorec.config.sequential import SequentialConfig
from neorec.data.seq_batches import EvalSet, eval_set
from neorec.data.sequential import SeqData, load_sequential
from neorec.errors import DataError
from neorec.metrics_rank import rank_metrics, target_ranks
from neorec.modules.sasrec import SASRec

__all__ = ["ranks_of", "evaluate", "save_model", "load_model", "is_sequential_run", "SUBDIR"]

FORMAT, VERSION, SUBDIR = "neorec-sequential-model", 1, "sequential"


@torch.no_grad()
def ranks_of(model: SASRec, ev: EvalSet, exclude_seen: bool, batch: int = 512) -> np.ndarray:
    """0-based rank of each user's target among all items (ties pessimistic)."""
    was = model.training
    model.eval()
    out = []
    x = torch.from_numpy(ev.inputs)
    for i in range(0, len(x), batch):
        scores = model.scores(x[i : i + batch]).numpy()
        seen: Sequence[np.ndarray] = ev.seen[i : i + batch]
        out.append(target_ranks(scores, ev.targets[i : i + batch], seen, exclude_seen))
    model.train(was)
    return np.concatenate(out)


def evaluate(model: SASRec, data: SeqData, exclude_seen: bool) -> dict[str, Any]:
    """The valid and test splits' metrics (means over users, ``n`` users)."""
    if data.num_items != model.num_items:
        raise DataError(f"the data have {data.num_items} items, the model {model.num_items}")
    res: dict[str, Any] = {"exclude_seen": exclude_seen, "candidates": data.num_items}
    for split in ("valid", "test"):
        ev = eval_set(data, split, model.max_len)
        res[split] = rank_metrics(ranks_of(model, ev, exclude_seen))
    return res


def save_model(run_dir: Path, model: SASRec, sc: SequentialConfig) -> Path:
    """Write ``<run_dir>/sequential/``; its path."""
    d = Path(run_dir) / SUBDIR
    d.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), d / "model.pt")
    info = {"format": FORMAT, "version": VERSION, "num_items": model.num_items,
            "sequential": dataclasses.asdict(sc)}  # fmt: skip
    (d / "model.json").write_text(json.dumps(info, indent=1) + "\n")
    return d


def is_sequential_run(path: str | Path) -> bool:
    """Whether ``path`` (a run folder or its ``sequential/``) holds a saved sequential model."""
    p = Path(path)
    return (
        (p / SUBDIR / "model.json").is_file() or (p / "model.json").is_file() and (p.name == SUBDIR)
    )


def load_model(path: str | Path) -> tuple[SASRec, SequentialConfig]:
    """The saved model (eval mode) and the section it was trained with."""
    p = Path(path)
    d = p / SUBDIR if (p / SUBDIR).is_dir() else p
    info = json.loads((d / "model.json").read_text())
    if info.get("format") != FORMAT or info.get("version") != VERSION:
        raise DataError(f"{d}/model.json: format {info.get('format')!r} v{info.get('version')}, "
                        f"want {FORMAT} v{VERSION}")  # fmt: skip
    sc = SequentialConfig(**info["sequential"])
    model = make_model(int(info["num_items"]), seq_settings(sc), 0)
    model.load_state_dict(torch.load(d / "model.pt", weights_only=True))
    return model.eval(), sc


def eval_run(path: str, data_path: str | None, exclude_seen: bool | None) -> dict[str, Any]:
    """``neorec eval`` of a sequential run: its model on ``data_path`` (default: the data it
    trained on), seen items excluded as trained unless ``exclude_seen`` says otherwise."""
    model, sc = load_model(path)
    data = load_sequential(data_path or sc.path)
    return evaluate(model, data, sc.exclude_seen if exclude_seen is None else exclude_seen)


def metrics_line(split: str, m: dict[str, float], candidates: int, excl: bool) -> str:
    """One printed line of a split's metrics."""
    return (
        f"{split}: HR@10 {m['hr@10']:.4f} NDCG@10 {m['ndcg@10']:.4f} MRR@10 {m['mrr@10']:.4f} "
        f"HR@50 {m['hr@50']:.4f} NDCG@50 {m['ndcg@50']:.4f} ({int(m['n'])} users, {candidates} "
        f"candidates, seen items {'excluded' if excl else 'kept'})"
    )
