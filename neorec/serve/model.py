"""The trained model on disk: ``save_model`` (any world size) and ``load_model`` (unsharded).

A model directory is a full snapshot in the checkpoint format plus the resolved config::

    model/
      model.json                 written last: format, the checkpoint's name, step, the config
                                 (JSON of the dataclasses), its own SHA-256
      ckpt-<step>-<run>-<run>/   one full fp32 baseline: manifest.json, dense.pt, emb/<table>/...

Tables are stored by global rows (``neorec.checkpoint``), so a model saved by N ranks under any
sharding plan loads into the unsharded ``DLRM``. Weights only: no fused or dense optimizer state
(a model is for eval, predict and export; resuming training is what checkpoints are for).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, get_type_hints

import torch
import torch.distributed as dist

from neorec.checkpoint.catalog import PREFIX, load_chain, parse_name
from neorec.checkpoint.dynamic import fixed_part, restore_dynamic, set_steps
from neorec.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    check_manifest_checksum,
    one_line,
    seal_manifest,
)
from neorec.checkpoint.manager import CheckpointManager
from neorec.checkpoint.restore import (
    check_model,
    dense_module,
    describe_model,
    load_dense,
    restore_embeddings,
)
from neorec.checkpoint.storage import open_storage
from neorec.checkpoint.tracker import local_blocks
from neorec.config import CheckpointConfig, Config, ConfigError
from neorec.errors import DataError

__all__ = [
    "MODEL_FILE",
    "MODEL_FORMAT",
    "MODEL_FORMAT_VERSION",
    "save_model",
    "load_model",
    "find_model_dir",
    "read_model_info",
    "config_from_dict",
]

MODEL_FILE = "model.json"
MODEL_FORMAT = "neorec.model"
MODEL_FORMAT_VERSION = 1
"""Bumped on an incompatible change of the model directory; readers refuse other versions."""
ANNOUNCE_ROWS = 10_000_000
"""Loading a model of at least this many rows says so when it starts (and when it is done)."""


# ---- config <-> JSON ---------------------------------------------------------------------------
def config_from_dict(data: dict[str, Any], where: str = "config") -> Config:
    """The ``Config`` of ``Config.to_dict()`` output (every field checked again on the way in);
    a ``ConfigError`` naming ``where`` and the key when a section or key is unknown."""
    return _build(Config, data, "", where)


def _build(cls: Any, data: Any, section: str, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: [{section or 'config'}] must be a table, got {data!r}"[:300])
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(
                f"{where}: unknown key '{k}' in [{section or 'config'}] (saved by another "
                f"neorec version?); known: {', '.join(sorted(names))}"
            )
        typ = hints[k]
        sub = f"{section}.{k}" if section else k
        kwargs[k] = _build(typ, v, sub, where) if dataclasses.is_dataclass(typ) else v
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: [{section or 'config'}]: {one_line(e)}") from None


# ---- saving ---------------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(error: str, world: int) -> None:
    """Raise rank 0's ``error`` (if any) on every rank (a collective when world > 1)."""
    if world > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = str(box[0])
    if error:
        raise CheckpointError(error)


def _check_target(out: Path) -> str:
    """'' if ``out`` can receive a model (missing or an empty directory), else why not."""
    if out.exists() and not out.is_dir():
        return f"{out}: exists and is not a directory; save the model elsewhere"
    if out.is_dir() and any(out.iterdir()):
        return (
            f"{out}: the directory is not empty; a model is saved into a new or empty "
            "directory (remove it or choose another)"
        )
    return ""


def save_model(model: Any, cfg: Config, out_dir: str | Path, step: int | None = None) -> Path:
    """Save ``model`` (the unsharded ``DLRM`` / ``TowerDLRM`` or a distributed form; collective:
    every rank calls it) and the resolved ``cfg`` into ``out_dir`` (new or empty). Returns
    ``out_dir``. A towered model under ``tower_sync="host"`` first copies every tower module
    from its host to every rank (``sync_replicas``).

    The tables go by global rows in fp32 (``ebc.step`` or ``step`` as the checkpoint's step), the
    dense weights in ``dense.pt``, and ``model.json`` last (rank 0): a directory without it is an
    unfinished save, never a model.
    """
    out = Path(out_dir)
    ebc: Any = getattr(model, "ebc", None)
    if ebc is None or not hasattr(model, "dense_arch"):
        raise CheckpointError(
            f"save_model takes a DLRM or DistributedModel, got {type(model).__name__}"
        )
    rank, world = _world()
    _agree(_check_target(out) if rank == 0 else "", world)
    sync = getattr(model, "sync_replicas", None)
    if sync is not None:  # towers synced inside their host: rank 0 gets every tower's module
        sync()
    if step is None:
        step = ebc.fused_steps()
    ck = CheckpointConfig(
        policy="full", bits=32, opt_bits=0, keep_last=1, async_write=False, fsync=True
    )
    # A placeholder for the manager's dense-optimizer slot: a model holds no optimizer state.
    placeholder = torch.optim.SGD(dense_module(model).parameters(), lr=0.0)
    manager = CheckpointManager(ck, model, placeholder, str(out))
    manager.extra_description = {
        "model_config": cfg.describe_model()["model_config"],
        "dense_optimizer": cfg.train.dense_optimizer,
    }
    error = ""
    try:
        manager.save(int(step), {"model": True})  # rank 0 hears of every rank's write error
        manager.close()
    except CheckpointError as e:
        error = f"saving the model to {out}: {e}"
    if rank == 0 and not error:
        try:
            info = {
                "format": MODEL_FORMAT,
                "format_version": MODEL_FORMAT_VERSION,
                "checkpoint": manager.last_committed,
                "step": int(step),
                "world_size": world,
                "created": time.time(),
                "torch": torch.__version__,
                "config": cfg.to_dict(),
            }
            manager.storage.write_atomic(MODEL_FILE, seal_manifest(info))
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = f"{out / MODEL_FILE}: cannot write ({type(e).__name__}: {one_line(e)})"
    _agree(error, world)
    return out


# ---- loading --------------------------------------------------------------------------------------
def find_model_dir(path: str | Path) -> Path:
    """The model directory ``path`` names: a model directory itself, or a run folder holding
    ``model/``. A ``CheckpointError`` when there is none, saying what is there instead."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{p}: no such model or run directory; pass a run folder (with model/) or a model "
            "directory"
        )
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory; --model takes a run folder or a model dir")
    if not (p / MODEL_FILE).exists() and (p / "model").is_dir():
        p = p / "model"
    if (p / MODEL_FILE).exists():
        return p
    if any(parse_name(c.name) for c in p.iterdir() if c.is_dir()):
        raise CheckpointError(
            f"{p}: no {MODEL_FILE} (the save did not finish, or this is a checkpoint root: "
            "resume checkpoints with neorec train --resume)"
        )
    raise CheckpointError(
        f"{p}: no saved model (neither {MODEL_FILE} nor model/{MODEL_FILE}); a run saves one "
        "when it finishes"
    )


def read_model_info(model_dir: Path) -> dict[str, Any]:
    """The verified ``model.json`` of a model directory."""
    f = model_dir / MODEL_FILE
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror or e})") from None
    try:
        info = json.loads(raw)
    except ValueError as e:
        raise CheckpointCorruptError(f"{f}: unreadable ({one_line(e)})") from None
    if not isinstance(info, dict) or info.get("format") != MODEL_FORMAT:
        raise CheckpointCorruptError(f"{f}: not a {MODEL_FORMAT} file")
    version = info.get("format_version")
    if version != MODEL_FORMAT_VERSION:
        raise CheckpointError(
            f"{f}: format_version {version!r}, this neorec reads {MODEL_FORMAT_VERSION}; use the "
            "neorec that saved it"
        )
    check_manifest_checksum(info, str(f))
    name = info.get("checkpoint")
    if not isinstance(name, str) or not name.startswith(PREFIX) or "/" in name:
        raise CheckpointCorruptError(f"{f}: names no checkpoint ({name!r})")
    if not isinstance(info.get("config"), dict):
        raise CheckpointCorruptError(f"{f}: no config")
    return info


def _serving_config(cfg: Config) -> Config:
    """``cfg`` with every table in memory (a model is loaded unsharded, without row stores), and
    the TBE backend chosen anew when the saved one was ``cuda`` and there is no GPU here."""
    d = cfg.to_dict()
    if d["embedding"]["backend"] == "cuda" and not torch.cuda.is_available():
        d["embedding"]["backend"] = "auto"
    for t in d["embedding"]["tables"]:
        if t["storage"] != "memory":
            t.update(storage="memory", cache_rows=0, cache_fraction=0.0)
    return config_from_dict(d)


def load_model(path: str | Path, dense_blocks: bool = True) -> tuple[Any, Config]:
    """``(model, cfg)``: the unsharded ``DLRM`` of a saved model (a run folder or the model dir)
    and its config, in eval mode. With ``dense_blocks`` the dense part runs in the config's
    ``train.dense_blocks`` blocks, as the trainer's eval does (bitwise its predictions).

    Everything is checked before the model is built (model.json, the checkpoint's manifest and
    its model description); a missing, unfinished or corrupt directory is a ``CheckpointError``.
    """
    from neorec.builder import build_dlrm
    from neorec.modules.collection_parts import check_tables_memory
    from neorec.phases import Phase, no_table_init

    model_dir = find_model_dir(path)
    info = read_model_info(model_dir)
    cfg = config_from_dict(info["config"], str(model_dir / MODEL_FILE))
    storage = open_storage(str(model_dir), fsync=False)
    name = info["checkpoint"]
    chain = load_chain(storage, name)
    saved = dict(chain[-1]["model"])
    check_model(storage.path(name), saved, cfg.describe_model())  # model.json vs manifest
    dense = load_dense(storage, name, chain[-1]["dense"])
    build = _serving_config(cfg)
    check_tables_memory(build.embedding.tables, build.embedding.optimizer)
    with no_table_init():  # every row is read from the model below: no random init first
        model = build_dlrm(build)
    current = describe_model(model, torch.optim.SGD(model.dense_parameters(), lr=0.0))
    current["dense_optimizer"] = saved.get("dense_optimizer")
    check_model(storage.path(name), saved, current)
    rows = sum(int(t.rows) for t in cfg.embedding.tables)
    with Phase(f"loading the model's tables ({rows:,} rows)") as phase:
        if rows >= ANNOUNCE_ROWS:
            phase.announce()
        dynamic = restore_dynamic(storage, chain, model.ebc)  # the id maps, by raw id
        fixed = fixed_part(model.ebc)
        restore_embeddings(storage, chain, local_blocks(fixed) if fixed is not None else [])
        for apply in dynamic:
            apply()
        phase.done = rows
    try:
        dense_module(model).load_state_dict(dense["dense"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"{storage.path(name)}: the dense weights do not fit the model ({one_line(e)})"
        ) from None
    _set_step(model.ebc, int(dense["emb_step"]))
    if dense_blocks and cfg.train.dense_blocks > 1:
        from neorec.distributed.dense_blocks import block_dense

        block_dense(model.dense_arch, cfg.train.dense_blocks)
    model.train(False)
    return model, cfg


def _set_step(ebc: Any, step: int) -> None:
    """The fused optimizer's step counter(s) of a collection (one, one per precision group, or
    one per fixed / dynamic part)."""
    set_steps(ebc, step)


def check_out_path(path: str | Path, what: str) -> Path:
    """``path`` as an output file whose directory exists (``DataError`` otherwise)."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{p}: is a directory; {what} is a file path")
    if not p.parent.is_dir():
        raise DataError(f"{p.parent}: no such directory (for {what} {p}); create it first")
    return p
