"""The towers of a config (DMT): given, partitioned by the cost model (balanced / random), or
learned after a warm-up of the flat model; the model a config describes, flat or towered
(``build_dlrm``); and the SPTT model of a towered distributed run."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from neorec.build.model import (
    attach_student,
    build_collection,
    build_flat_dlrm,
    sharded_collection,
)
from neorec.build.plan import resolve_plan
from neorec.config import Config, ConfigError, TableConfig
from neorec.data.batch import Batch
from neorec.distributed.comm import CommStats
from neorec.distributed.towers import DistributedTowerModel, tower_features
from neorec.modules.dlrm import DLRM, DenseArch
from neorec.modules.towers import TowerDLRM, build_tower_dense, feature_affinity, table_affinity
from neorec.sharding.tables import tables_from_config
from neorec.sharding.towers import partition_tables

__all__ = ["tower_groups", "build_dlrm", "learned_groups", "resolve_tower_groups", "towered_model"]


def tower_groups(cfg: Config) -> list[list[str]] | None:
    """The towers of a config decided by the config alone: ``towers.groups``, or the
    ``balanced`` / ``random`` partition of its tables; None for ``learned`` (see
    ``learned_groups``) and for a flat config."""
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

    Towers: ``groups`` (lists of table names, e.g. from ``learned_groups``) when given, else
    ``towers.groups`` or the ``balanced`` / ``random`` partition of the config's tables; the
    ``learned`` partitioner needs ``groups`` (a warm-up decides them).
    """
    if not cfg.towers.enabled:
        return build_flat_dlrm(cfg, device)
    tg = [list(g) for g in groups] if groups is not None else tower_groups(cfg)
    if tg is None:
        raise ConfigError(
            "towers.partitioner 'learned' decides the towers after a warm-up: pass the groups "
            "of neorec.build.towers.learned_groups(cfg, batches) to build_dlrm"
        )
    model = TowerDLRM(
        cfg.model, build_collection(cfg, device), tg, kind=cfg.towers.module,
        out_vectors=cfg.towers.out_vectors, seed=cfg.train.seed, device=device,
    )  # fmt: skip
    attach_student(cfg, model.dense_arch)
    return model


def learned_groups(
    cfg: Config,
    batches: Iterable[Batch],
    measure: Iterable[Batch] | None = None,
    method: str = "hstat",
) -> list[list[str]]:
    """Towers by the ``learned`` partitioner: train the flat model of ``cfg`` for
    ``towers.warmup_steps`` steps on ``batches`` (its dense optimizer and fused embedding
    optimizer, mean BCE), measure the features' interaction (``feature_affinity`` on ``measure``,
    default the last 4 warm-up batches), sum it per table pair, and cluster the tables into
    ``towers.count`` towers under ``towers.balance`` (``neorec.sharding.towers``). Deterministic
    for the config and batches. A ``ConfigError`` when ``batches`` ends before the warm-up."""
    tw = cfg.towers
    if not tw.enabled:
        raise ConfigError("learned_groups needs towers: set towers.count > 0")
    # the warm-up model keeps its rows in memory: a dram / ssd table's store files stay the run's
    warm = copy.deepcopy(cfg)
    for t in warm.embedding.tables:
        t.storage = "memory"
    model = build_flat_dlrm(warm)
    params = list(model.dense_parameters())
    lr, kind = cfg.train.dense_lr, cfg.train.dense_optimizer
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(params, lr=lr)
        if kind == "sgd"
        else torch.optim.Adagrad(params, lr=lr)
        if kind == "adagrad"
        else torch.optim.Adam(params, lr=lr)
    )
    recent: list[Batch] = []
    steps = 0
    for b in batches:
        if steps == tw.warmup_steps:
            break
        loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        recent = (recent + [b])[-4:]
        steps += 1
    if steps < tw.warmup_steps:
        raise ConfigError(
            f"towers.warmup_steps is {tw.warmup_steps:,} but the data gave {steps:,} batches; "
            "lower towers.warmup_steps or use more data"
        )
    aff = table_affinity(
        feature_affinity(model, recent if measure is None else measure, method),
        cfg.embedding.tables,
    )
    specs = tables_from_config(cfg.embedding.tables)
    return partition_tables(
        specs, tw.num_towers, "learned", tw.seed, affinity=aff.numpy(), balance=tw.balance,
        batch_size=cfg.data.batch_size,
    )  # fmt: skip


def resolve_tower_groups(cfg: Config, source: Any, rank: int, world: int) -> list[list[str]] | None:
    """The towers of a towered config (``[towers]``): its groups, its balanced / random
    partition, or the learned partition after a warm-up of the flat model on the first train
    batches (rank 0 decides and every rank gets its answer); None for a flat config."""
    if not cfg.towers.enabled:
        return None
    groups = tower_groups(cfg)
    if groups is None:  # learned
        box: list[Any] = [None]
        if rank == 0:
            box[0] = learned_groups(cfg, source.train_batches(0))
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        groups = box[0]
    return groups


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
