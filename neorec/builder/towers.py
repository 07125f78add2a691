"""The towers of a config (DMT): given, or partitioned by the cost model (balanced / random; the
learned partition is decided by a warm-up in ``neorec.train.towers_warmup``); the model a config
describes, flat or towered (``build_dlrm``); and the SPTT model of a towered distributed run."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from neorec.builder.model import (
    attach_student,
    build_collection,
    build_flat_dlrm,
    sharded_collection,
)
from neorec.builder.plan import resolve_plan
from neorec.config import Config, ConfigError, TableConfig
from neorec.distributed.comm import CommStats
from neorec.distributed.towers import DistributedTowerModel, tower_features
from neorec.modules.dlrm import DLRM, DenseArch
from neorec.modules.towers import TowerDLRM, build_tower_dense
from neorec.sharding.tables import tables_from_config
from neorec.sharding.towers import partition_tables

__all__ = ["tower_groups", "build_dlrm", "towered_model"]


def tower_groups(cfg: Config) -> list[list[str]] | None:
    """The towers of a config decided by the config alone: ``towers.groups``, or the
    ``balanced`` / ``random`` partition of its tables; None for ``learned`` (a warm-up decides
    them: ``neorec.train.towers_warmup``) and for a flat config."""
    tw = cfg.towers
    if not tw.enabled:
        return None
    if tw.method == "manual":
        return [list(g) for g in tw.groups]
    if tw.method == "learned":
        return None
    specs = tables_from_config(cfg.embedding.tables)
    return partition_tables(
        specs, tw.num_towers, tw.method, tw.seed, balance=tw.balance,
        batch_size=cfg.data.batch_size,
    )  # fmt: skip


def build_dlrm(
    cfg: Config,
    device: torch.device | str = "cpu",
    groups: Sequence[Sequence[str]] | None = None,
) -> DLRM | TowerDLRM:
    """The model a config describes: a ``DLRM``, or a ``TowerDLRM`` when ``[towers]`` is on.

    Towers: ``groups`` (lists of table names, e.g. from
    ``neorec.train.towers_warmup.learned_groups``) when given, else
    ``towers.groups`` or the ``balanced`` / ``random`` partition of the config's tables; the
    ``learned`` partitioner needs ``groups`` (a warm-up decides them).
    """
    if not cfg.towers.enabled:
        return build_flat_dlrm(cfg, device)
    tg = [list(g) for g in groups] if groups is not None else tower_groups(cfg)
    if tg is None:
        raise ConfigError(
            "towers.partitioner 'learned' decides the towers after a warm-up: pass the groups "
            "of neorec.train.towers_warmup.learned_groups(cfg, batches) to build_dlrm"
        )
    model = TowerDLRM(
        cfg.model, build_collection(cfg, device), tg, kind=cfg.towers.module,
        out_vectors=cfg.towers.out_vectors, seed=cfg.train.seed, device=device,
    )  # fmt: skip
    attach_student(cfg, model.dense_arch)
    return model


def towered_model(
    cfg: Config,
    groups: Sequence[Sequence[str]],
    build_dense: Callable[[], tuple[nn.ModuleList, DenseArch]] | None = None,
    tower_sync: str = "world",
) -> DistributedTowerModel:
    """SPTT: tower t's tables on host t (``world / towers`` consecutive ranks). ``build_dense``:
    the tower modules and dense arch (default: the config's, as ``TowerDLRM`` builds them, with
    the ExFM student's aux head and adapter of ``[distill]``);
    ``tower_sync``: where the tower modules' gradients are averaged (``"world"`` | ``"host"``,
    ``DistributedTowerModel``)."""
    feats = tower_features(cfg.embedding.tables, groups)
    dim = cfg.embedding.tables[0].dim

    def config_dense() -> tuple[nn.ModuleList, DenseArch]:
        mods, arch = build_tower_dense(
            cfg.model, [len(f) for f in feats], dim, cfg.towers.module, cfg.towers.out_vectors
        )
        # the ExFM student's aux head and adapter: in the arch before DDP wraps it
        return mods, attach_student(cfg, arch)

    def build_ebc(tables: list[TableConfig], ranks: int, group: Any, stats: CommStats) -> nn.Module:
        names = {t.name for t in tables}
        sub = copy.deepcopy(cfg)  # the tower's tables and their sharding types
        sub.embedding.tables = [t for t in sub.embedding.tables if t.name in names]
        sub.sharding.types = {k: v for k, v in sub.sharding.types.items() if k in names}
        plan = resolve_plan(sub, ranks, ranks)
        return sharded_collection(sub, plan, group=group, stats=stats)

    return DistributedTowerModel(
        cfg.embedding.tables,
        groups,
        build_ebc,
        build_dense or config_dense,
        seed=cfg.train.seed,
        host_staging=cfg.train.device != "cpu",
        tower_sync=tower_sync,
    )
