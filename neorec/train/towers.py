"""The trainer's side of DMT towers: which towers (incl. the learned partition's warm-up) and
the SPTT model of a distributed run."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from neorec.config import Config

__all__ = ["resolve_tower_groups", "towered_model"]


def resolve_tower_groups(cfg: Config, source: Any, rank: int, world: int) -> list[list[str]] | None:
    """The towers of a towered config (``[towers]``): its groups, its balanced / random
    partition, or the learned partition after a warm-up of the flat model on the first train
    batches (rank 0 decides and every rank gets its answer); None for a flat config."""
    from neorec.modules.towers import learned_groups, tower_groups

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


def towered_model(cfg: Config, groups: list[list[str]]) -> Any:
    """SPTT: tower t's tables on host t (``world / towers`` consecutive ranks)."""
    from neorec.distributed.towers import DistributedTowerModel, tower_features
    from neorec.modules.towers import build_tower_dense

    feats = tower_features(cfg.embedding.tables, groups)
    dim = cfg.embedding.tables[0].dim

    def build_dense() -> tuple[nn.ModuleList, nn.Module]:
        return build_tower_dense(
            cfg.model, [len(f) for f in feats], dim, cfg.towers.module, cfg.towers.out_vectors
        )

    return DistributedTowerModel(cfg, groups, build_dense)
