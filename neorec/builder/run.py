"""A run from its config: the checks before any work, process-wide system settings, the data
source, the model of this rank (flat or towered, one process or sharded) and the dense
optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from neorec.builder.model import distributed_model
from neorec.builder.plan import resolve_plan
from neorec.builder.towers import build_dlrm, tower_groups, towered_model
from neorec.config import Config, ConfigError, SystemConfig, TrainConfig, check_trainable
from neorec.data.sources import DataSource, make_source
from neorec.distributed.dense_blocks import block_dense
from neorec.distributed.dynamic_reshard import without_dynamic
from neorec.distributed.model_parallel import check_same_everywhere
from neorec.machine import default_threads
from neorec.modules.collection_parts import check_tables_memory
from neorec.ops import settings
from neorec.ops.memory import keep_freed_heap
from neorec.phases import Phase, watch_init
from neorec.sharding.plan_json import load_plan
from neorec.sharding.types import ShardingPlan

__all__ = [
    "apply_system",
    "check_run",
    "init_progress",
    "data_source",
    "dense_optimizer",
    "BuiltModel",
    "build_model",
]


def apply_system(system: SystemConfig, distributed: bool = False) -> None:
    """Set this process's ``[system]`` switches (huge pages, the native helpers) and, on a rank
    of a distributed run, keep freed heap memory when ``system.keep_heap`` says so."""
    settings.HUGEPAGES = system.hugepages
    settings.NATIVE = system.native
    if distributed and system.keep_heap:
        keep_freed_heap()  # no page faults on every step's buffers (ops.memory)


def apply_threads(threads: int, local_ranks: int = 1) -> str:
    """Set torch's intra-op threads: ``threads`` (``train.threads``), or for 0 the CPUs this
    process may use split among ``local_ranks`` (``neorec.machine.default_threads``); returns
    the banner's line saying how many and why."""
    if threads:
        n, why = threads, "train.threads"
    else:
        auto, why = default_threads(local_ranks)
        n = auto if auto is not None else torch.get_num_threads()
    torch.set_num_threads(n)
    return f"threads  {n} intra-op thread{'s' if n != 1 else ''} ({why}; train.threads sets it)"


def data_source(cfg: Config) -> DataSource:
    """The data source of ``cfg`` (cheap checks only: bad data is refused before the model)."""
    return make_source(cfg.data, cfg.embedding.tables, cfg.model.num_dense)


def dense_optimizer(t: TrainConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The torch.optim optimizer for dense parameters: torch's fused (one kernel for all
    parameters) Adagrad / Adam on CPU and CUDA; the per-parameter loop costs ~25 us a tensor, a
    third of a small model's step."""
    lr = t.dense_lr
    if t.dense_optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if t.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, fused=True)
    return torch.optim.Adam(params, lr=lr, fused=True)


def check_run(cfg: Config, world: int = 1, one_host: bool = True) -> None:
    """The checks of a run that need no data and no model, before any heavy work: the device,
    the batch over ``world`` ranks, a trainable model (``check_trainable``), what N ranks do not
    hold yet, the tables' memory on one host, and a plan file given to one process."""
    cfg.train.check_device()  # cuda without a CUDA device: refused before any work
    if cfg.data.batch_size % world:
        raise ConfigError(
            f"data.batch_size {cfg.data.batch_size} must be divisible by the {world} ranks"
        )
    check_trainable(cfg)  # one dim, the dense part's size, splits of at least one batch
    dynamic = [t.name for t in cfg.embedding.tables if t.kind == "dynamic"]
    if dynamic and world > 1 and cfg.towers.enabled:
        raise ConfigError(
            f"tables {dynamic} are dynamic: towers ([towers] count / groups) on {world} ranks do "
            "not hold dynamic tables yet; drop the towers or train in one process"
        )
    if one_host:
        check_tables_memory(cfg.embedding.tables, cfg.embedding.optimizer)
    if world == 1 and cfg.sharding.plan:
        # Read and checked although one process shards nothing: a plan for N ranks is refused
        # (it says to run --nproc N), not ignored.
        load_plan(cfg.sharding.plan, tables=cfg.embedding.tables, world_size=1)


@contextmanager
def init_progress(cfg: Config, rank: int = 0, world: int = 1) -> Iterator[Phase]:
    """A ``Phase`` over the rows the tables' initializer generates inside the block (rank 0
    shows it when ``train.progress``; the total is known in one process)."""
    fixed = sum(int(t.rows) for t in cfg.embedding.tables if t.kind != "dynamic")
    phase = Phase(
        f"initializing the tables ({fixed:,} rows)" if world == 1 else "initializing the tables",
        fixed if world == 1 else None,
        "rows",
        enabled=rank == 0 and cfg.train.progress,
    )
    with phase, watch_init(phase.advance):
        yield phase


@dataclass
class BuiltModel:
    """The model of a run on this rank, with what decided its shape."""

    model: Any
    """``DLRM`` / ``TowerDLRM`` (one process), ``DistributedModel`` / ``DistributedTowerModel``."""
    plan: ShardingPlan | None = None
    """The sharding plan of a flat distributed model (dynamic tables are never in it)."""
    tower_groups: list[list[str]] | None = None
    """The towers' tables of a towered model."""


def build_model(
    cfg: Config,
    source: DataSource,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
    ranks_per_host: int | None = None,
    groups: list[list[str]] | None = None,
) -> BuiltModel:
    """The model ``cfg`` describes on this rank of ``world``: flat or towered (``groups``: the
    towers' tables, decided by the caller; None: the config's own, ``tower_groups``; the
    ``learned`` partition's come from the trainer's warm-up, ``neorec.train.towers_warmup``), one
    process or sharded (the plan resolved here, the same on every rank or an error naming the
    difference)."""
    if groups is None:
        groups = tower_groups(cfg)
    with init_progress(cfg, rank, world):
        return _build(cfg, device, groups, rank, world, ranks_per_host)


def _build(
    cfg: Config,
    device: torch.device,
    groups: list[list[str]] | None,
    rank: int,
    world: int,
    ranks_per_host: int | None,
) -> BuiltModel:
    if world == 1:
        model = build_dlrm(cfg, device, groups=groups) if groups else build_dlrm(cfg, device)
        if cfg.train.dense_blocks > 1:
            # The dense gradient summed in the blocks' tree: what N ranks compute (bitwise).
            block_dense(model.dense_arch, cfg.train.dense_blocks)
        return BuiltModel(model, None, groups)
    check_same_everywhere("configs", cfg.to_dict())
    if groups:
        return BuiltModel(towered_model(cfg, groups), None, groups)
    plan = resolve_plan(cfg, world, ranks_per_host or world)
    # dynamic tables: row-wise by the raw id's hash over every rank, never placed by a plan
    plan = without_dynamic(plan, cfg.embedding.tables)
    check_same_everywhere("sharding plans", plan.to_dict())
    return BuiltModel(distributed_model(cfg, plan, device=device), plan, None)
