"""The towers of a run (DMT), decided before its model is built: the config's own (given,
balanced, random: ``neorec.builder.towers.tower_groups``), or ``learned`` after a warm-up of the flat
model (``train_step`` on the first train batches, then the features' interaction clustered).
The trainer passes them to ``neorec.builder.build_model``."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from neorec.builder import build_flat_dlrm, tower_groups
from neorec.config import Config, ConfigError
from neorec.data.batch import Batch
from neorec.data.sources import DataSource
from neorec.modules.towers import feature_affinity, table_affinity
from neorec.sharding.tables import tables_from_config
from neorec.sharding.towers import partition_tables
from neorec.train.steps import train_step

__all__ = ["learned_groups", "resolve_tower_groups"]


def learned_groups(
    cfg: Config,
    batches: Iterable[Batch],
    measure: Iterable[Batch] | None = None,
    method: str = "hstat",
) -> list[list[str]]:
    """Towers by the ``learned`` partitioner: train the flat model of ``cfg`` for
    ``towers.warmup_steps`` steps on ``batches`` (``train_step``: its dense optimizer and fused
    embedding optimizer, mean BCE), measure the features' interaction (``feature_affinity`` on
    ``measure``, default the last 4 warm-up batches), sum it per table pair, and cluster the
    tables into ``towers.count`` towers under ``towers.balance`` (``neorec.sharding.towers``).
    Deterministic for the config and batches. A ``ConfigError`` when ``batches`` ends before the
    warm-up."""
    tw = cfg.towers
    if not tw.enabled:
        raise ConfigError("learned_groups needs towers: set towers.count > 0")
    # the warm-up model keeps its rows in memory: a dram / ssd table's store files stay the run's
    warm = copy.deepcopy(cfg)
    for t in warm.embedding.tables:
        t.storage = "memory"
    model = build_flat_dlrm(warm)
    opt = _warmup_optimizer(cfg.train.dense_optimizer, cfg.train.dense_lr, model)
    recent: list[Batch] = []
    steps = 0
    for b in batches:
        if steps == tw.warmup_steps:
            break
        train_step(model, opt, b, steps + 1)
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


def _warmup_optimizer(kind: str, lr: float, model: Any) -> torch.optim.Optimizer:
    """The warm-up's dense optimizer (torch's per-parameter loop)."""
    params = list(model.dense_parameters())
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    return torch.optim.Adam(params, lr=lr)


def resolve_tower_groups(
    cfg: Config, source: DataSource, rank: int = 0, world: int = 1
) -> list[list[str]] | None:
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
