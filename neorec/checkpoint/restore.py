"""Restoring: embedding pieces into local blocks, dense state, RNG state, the model description.

``describe_model`` is what a manifest records of the model; a restore compares it with the model
it loads into (``check_model``) before any tensor is changed, and lists every difference.
"""

from __future__ import annotations

import io
import random
from typing import Any, cast

import torch
from torch import nn

from neorec.checkpoint.catalog import model_differences, read_verified
from neorec.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    decode_piece,
    one_line,
)
from neorec.checkpoint.storage import FsspecStorage
from neorec.checkpoint.tracker import LocalBlock
from neorec.storage.tiered_rows import StoreField

__all__ = [
    "dense_module",
    "describe_model",
    "check_model",
    "load_dense",
    "restore_embeddings",
    "rng_state",
    "set_rng_state",
]


def dense_module(model: Any) -> nn.Module:
    """The dense part of a model (unwrapped from DDP; a towered model's: tower modules and
    dense arch): ``model.dense_part``."""
    part: nn.Module = model.dense_part
    return part


def model_tables(model: Any) -> list[Any]:
    """Every table of the model (a towered model's rank holds only its host's tower):
    ``model.all_tables``."""
    return list(model.all_tables)


def describe_model(model: nn.Module, dense_opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint must match to restore into ``model``: tables, optimizers, dense shapes."""
    ebc: Any = model.ebc
    return {
        "tables": {
            t.name: {"rows": int(t.rows), "dim": int(t.dim), "features": list(t.features)}
            for t in model_tables(model)
        },
        "pooling": str(getattr(ebc.pooling, "value", ebc.pooling)),
        "embedding_optimizer": str(ebc.optimizer.kind),
        "dense_optimizer": type(dense_opt).__name__.lower(),
        "dense": {k: list(v.shape) for k, v in dense_module(model).state_dict().items()},
    }


def check_model(name: str, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """CheckpointMismatchError listing every difference between the two descriptions."""
    diffs = model_differences(saved, current)
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {name} does not match this model: {'; '.join(diffs)} (resume with the "
            f"checkpoint's settings, or drop --resume to start a new run)"
        )


def load_dense(storage: FsspecStorage, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The verified dense state of checkpoint ``name`` (no code runs: weights_only)."""
    data = read_verified(storage, name, entry)
    where = storage.path(f"{name}/{entry['file']}")
    try:
        dense = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # unpickling error, truncated archive, ...
        raise CheckpointCorruptError(f"{where}: unreadable ({one_line(e)})") from None
    keys = {"dense", "optimizer", "emb_step", "extra"}
    if (
        not isinstance(dense, dict)
        or not keys <= set(dense)
        or not isinstance(dense["extra"], dict)
    ):
        raise CheckpointCorruptError(f"{where}: not a neorec dense state")
    return dense


def apply_dense(
    name: str, dense: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer
) -> None:
    """Load the dense weights and optimizer state; CheckpointError if they do not fit."""
    try:
        dense_module(model).load_state_dict(dense["dense"])
        opt.load_state_dict(dense["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {name}: dense state does not fit this model ({one_line(e)})"
        ) from None


def _apply(piece_meta: dict[str, Any], dec: Any, b: LocalBlock) -> None:
    """Copy the rows of a decoded piece that fall in block ``b`` (per-row state: any columns)."""
    r0, r1 = piece_meta["rows"]
    c0, c1 = piece_meta["cols"]
    g = torch.arange(r0, r1) if dec.ids is None else dec.ids + r0
    sel = (g >= b.row_start) & (g < b.row_end)
    # host -> device: the decoded rows go where the block lives (low-precision rows: their
    # packed buffer's device; dram/ssd rows: written into their store)
    w = b.weight
    dev = w.device if isinstance(w, (torch.Tensor, StoreField)) else w.weights.device
    rows = (g[sel] - b.row_start).to(dev)
    a, z = max(c0, b.col_start), min(c1, b.col_end)
    if a < z:
        b.weight[rows, a - b.col_start : z - b.col_start] = dec.weight[sel][:, a - c0 : z - c0].to(
            dev
        )
    for k, v in dec.state.items():
        if k not in b.state:
            continue
        if v.dim() == 1:
            b.state[k][rows] = v[sel].to(dev)
        elif a < z:
            b.state[k][rows, a - b.col_start : z - b.col_start] = v[sel][:, a - c0 : z - c0].to(dev)


def _overlaps(p: dict[str, Any], b: LocalBlock) -> bool:
    """Piece ``p`` holds rows of ``b``: overlapping columns, or a per-row state ``b`` needs."""
    (r0, r1), (c0, c1) = p["rows"], p["cols"]
    if p["table"] != b.table or r1 <= b.row_start or b.row_end <= r0:
        return False
    return (c0 < b.col_end and b.col_start < c1) or (
        "momentum1" in p["state"] and ("momentum1" in b.state)
    )


def _area(p: dict[str, Any], b: LocalBlock) -> int:
    r = min(p["rows"][1], b.row_end) - max(p["rows"][0], b.row_start)
    c = min(p["cols"][1], b.col_end) - max(p["cols"][0], b.col_start)
    return max(r, 0) * max(c, 0)


def restore_embeddings(
    storage: FsspecStorage, chain: list[dict[str, Any]], blocks: list[LocalBlock]
) -> int:
    """Apply baseline + increments to ``blocks``, reading only overlapping pieces; bytes read."""
    base = chain[0]
    for b in blocks:
        spec = base["tables"].get(b.table)
        if spec is None:
            raise CheckpointError(f"table '{b.table}' is not in checkpoint {base['name']}")
        if b.row_end > spec["rows"] or b.col_end > spec["dim"]:
            raise CheckpointError(
                f"table '{b.table}': checkpoint has {spec['rows']}x{spec['dim']}, "
                f"the model needs rows [{b.row_start}, {b.row_end}) cols [{b.col_start}, {b.col_end})"
            )
        for s in b.state.values():
            s.zero_()  # state the checkpoint does not store restarts from zero
    covered = [0] * len(blocks)
    nbytes = 0
    for m in chain:
        for p in m["pieces"]:
            hits = [i for i, b in enumerate(blocks) if _overlaps(p, b)]
            if not hits:
                continue
            data = read_verified(storage, m["name"], p)
            nbytes += len(data)
            dec = decode_piece(data, storage.path(f"{m['name']}/{p['file']}"))
            for i in hits:
                _apply(p, dec, blocks[i])
                if m is base:
                    covered[i] += _area(p, blocks[i])
    for b, c in zip(blocks, covered):
        if c != b.rows * (b.col_end - b.col_start):
            raise CheckpointError(
                f"table '{b.table}' rows [{b.row_start}, {b.row_end}) cols [{b.col_start}, "
                f"{b.col_end}): the baseline {base['name']} does not cover them"
            )
    return nbytes


def rng_state() -> dict[str, Any]:
    """Torch, Python and NumPy RNG states (JSON/tensor only, for ``weights_only`` loading)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``rng_state``."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
