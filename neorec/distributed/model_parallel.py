"""DistributedModel: a DLRM under a ShardingPlan (sharded embeddings + DDP for the dense part)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from neorec.config import Config, ConfigError
from neorec.distributed.comm import CommStats
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.dlrm import DenseArch
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.types import ShardingPlan, plan_by_type
from neorec.sparse import SparseFeatures

__all__ = ["DistributedModel", "resolve_plan", "check_same_everywhere"]


class DistributedModel(nn.Module):
    """Same forward/loss API as ``DLRM``; embeddings follow ``plan``, dense layers use DDP."""

    def __init__(
        self, cfg: Config, plan: ShardingPlan, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        emb = cfg.embedding
        opt = RowOptimizer(kind=emb.optimizer, lr=emb.lr, eps=emb.eps, weight_decay=emb.weight_decay)
        self.stats = CommStats()
        # Embedding collectives get their own group so their order never interleaves with DDP's.
        emb_group = dist.new_group(backend=dist.get_backend()) if dist.is_initialized() else None
        torch.manual_seed(cfg.train.seed)  # same dense init as the unsharded DLRM
        self.ebc = ShardedEmbeddingBagCollection(
            emb.tables,
            plan,
            opt,
            pooling=emb.pooling,
            backend=emb.backend,
            seed=cfg.train.seed,
            init_scale=emb.init_scale,
            group=emb_group if group is None else group,
            stats=self.stats,
        )
        dims = {t.dim for t in emb.tables}
        dense = DenseArch(cfg.model, len(self.ebc.feature_names), dims.pop())
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.dense_arch: nn.Module = DistributedDataParallel(dense) if world > 1 else dense

    def forward(self, dense: Tensor, sparse: SparseFeatures) -> Tensor:
        """Logits [b] for this rank's samples."""
        return self.dense_arch(dense, self.ebc(sparse))

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense optimizer (replicated, DDP-averaged)."""
        return self.dense_arch.parameters()


def resolve_plan(cfg: Config, world_size: int, ranks_per_host: int | None = None) -> ShardingPlan:
    """The plan a config asks for: a JSON file, per-table types, or the planner."""
    rph = ranks_per_host or world_size
    sh = cfg.sharding
    if sh.plan:
        path = Path(sh.plan)
        if not path.exists():
            raise ConfigError(f"sharding.plan: file not found: {path}")
        plan = ShardingPlan.load(path)
        if plan.world_size != world_size:
            raise ConfigError(
                f"sharding.plan {path} is for world_size {plan.world_size}, "
                f"but {world_size} ranks are running"
            )
        return plan
    unknown = sorted(set(sh.types) - {t.name for t in cfg.embedding.tables})
    if unknown:
        raise ConfigError(f"sharding.types names unknown table(s) {unknown}")
    if sh.default_type or sh.types:
        try:
            return plan_by_type(
                cfg.embedding.tables, world_size, rph, sh.default_type or "table_wise", sh.types
            )
        except ValueError as e:
            raise ConfigError(f"sharding: {e}") from None
    return _planned(cfg, world_size, rph)


def _planned(cfg: Config, world_size: int, rph: int) -> ShardingPlan:
    from neorec.sharding.planner import plan_for_config

    return plan_for_config(cfg, world_size, rph)


def check_same_everywhere(what: str, payload: dict) -> None:
    """Raise on every rank if ``payload`` (config, plan) differs between ranks, naming the keys."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    text = json.dumps(payload, sort_keys=True)
    gathered: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(gathered, text)
    if all(g == text for g in gathered):
        return
    base = _flatten(json.loads(gathered[0]))
    diffs = []
    for r, g in enumerate(gathered[1:], start=1):
        other = _flatten(json.loads(g))
        for k in sorted(set(base) | set(other)):
            if base.get(k) != other.get(k):
                diffs.append(f"{k}: rank 0 has {base.get(k)!r}, rank {r} has {other.get(k)!r}")
    shown = "\n  ".join(diffs[:10])
    raise ConfigError(f"ranks were started with different {what}:\n  {shown}")


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if isinstance(d, dict):
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(d, list) and d and isinstance(d[0], dict):
        out = {}
        for i, v in enumerate(d):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: d}
