"""The model a config describes: its embedding collection (in memory, low precision, behind a row
cache, dynamic), the flat or towered DLRM, and their distributed forms under a plan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from neorec.config import Config, ConfigError, TableConfig
from neorec.distributed.codecs import make_codec
from neorec.distributed.comm import CommStats, init_host_transport, rank_device
from neorec.distributed.dynamic_reshard import without_dynamic
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection
from neorec.distributed.model_parallel import DistributedModel
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.dlrm import DLRM, DenseArch, attach_distill
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.types import ShardingPlan
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.dynamic import DynamicEmbeddingBagCollection
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.mixed import MixedEmbeddingBagCollection

if TYPE_CHECKING:
    from neorec.modules.towers import TowerDLRM

__all__ = [
    "build_collection",
    "low_precision_collection",
    "build_flat_dlrm",
    "build_dlrm",
    "attach_student",
    "sharded_collection",
    "distributed_model",
]


def _dynamic(t: TableConfig) -> bool:
    return t.kind == "dynamic"


def low_precision_collection(
    cfg: Config,
    opt: RowOptimizer,
    device: torch.device | str = "cpu",
    tables: Sequence[TableConfig] | None = None,
) -> EmbeddingCollection:
    """The collection of a config whose tables (``tables``, default all) are stored in fp16 /
    bf16 / fp8 (one collection when they share a precision, else one per precision)."""
    emb = cfg.embedding
    tables = list(emb.tables if tables is None else tables)
    cls = (
        EmbeddingBagCollection
        if len({t.precision for t in tables}) == 1
        else GroupedEmbeddingBagCollection
    )
    return cls(
        tables, opt, emb.pooling, emb.backend, device, init_scale=emb.init_scale,
        seed=cfg.train.seed, rounding=emb.rounding,
    )  # fmt: skip


def build_collection(cfg: Config, device: torch.device | str = "cpu") -> EmbeddingCollection:
    """The embedding collection a config describes: tables in memory (fp32, or low precision),
    or behind a row cache over DRAM/SSD; ``kind = "dynamic"`` tables in their own collection,
    combined with one of the other tables."""
    emb = cfg.embedding
    if not any(_dynamic(t) for t in emb.tables):
        return _tables_collection(cfg, emb.tables, device)
    fixed = [t for t in emb.tables if not _dynamic(t)]
    part = _tables_collection(cfg, fixed, device) if fixed else None
    return _dynamic_collection(cfg, part, device)


def _tables_collection(
    cfg: Config, tables: Sequence[TableConfig], device: torch.device | str
) -> EmbeddingCollection:
    """``build_collection`` of the fixed ``tables`` of ``cfg``."""
    emb = cfg.embedding
    opt = RowOptimizer.from_config(emb)
    if any(t.storage != "memory" for t in tables):
        st = cfg.storage
        return CachedEmbeddingBagCollection(
            tables, opt, emb.pooling, emb.backend, device, init_scale=emb.init_scale,
            seed=cfg.train.seed, storage_dir=st.dir, io_threads=st.io_threads,
            mapped_mb=st.mapped_mb,
        )  # fmt: skip
    if any(t.precision not in ("", "fp32") for t in tables):
        return low_precision_collection(cfg, opt, device, tables)
    torch.manual_seed(cfg.train.seed)  # as DLRM does before building its collection
    return EmbeddingBagCollection(
        tables, opt, emb.pooling, emb.backend, device, init_scale=emb.init_scale,
        seed=cfg.train.seed,
    )  # fmt: skip


def _dynamic_collection(
    cfg: Config, fixed: EmbeddingCollection | None, device: torch.device | str
) -> EmbeddingCollection:
    """The ``kind = "dynamic"`` tables of ``cfg`` in a ``DynamicEmbeddingBagCollection`` (a
    ``DynamicCachedEmbeddingBagCollection`` when one is on dram / ssd), combined with ``fixed``
    (the collection of the config's other tables) when there are any."""
    emb = cfg.embedding
    dyn_tables = [t for t in emb.tables if _dynamic(t)]
    args = (dyn_tables, RowOptimizer.from_config(emb), emb.pooling, emb.backend, device)
    kw: dict[str, Any] = {"init_scale": emb.init_scale, "seed": cfg.train.seed}
    dyn: EmbeddingCollection
    if any(t.storage != "memory" for t in dyn_tables):
        st = cfg.storage
        kw.update(storage_dir=st.dir, io_threads=st.io_threads, mapped_mb=st.mapped_mb)
        dyn = DynamicCachedEmbeddingBagCollection(*args, **kw)
    else:
        dyn = DynamicEmbeddingBagCollection(*args, **kw)
    if fixed is None:
        return dyn
    return MixedEmbeddingBagCollection(emb.tables, fixed, dyn)


def build_flat_dlrm(cfg: Config, device: torch.device | str = "cpu") -> DLRM:
    """The flat DLRM of a config (its ``[towers]`` ignored); an ExFM student's aux head and
    adapter (``[distill]``) in its dense arch."""
    emb = cfg.embedding
    opt = RowOptimizer.from_config(emb)
    ebc: EmbeddingCollection | None = None
    if any(
        t.storage != "memory" or t.precision not in ("", "fp32") or _dynamic(t) for t in emb.tables
    ):
        ebc = build_collection(cfg, device)
    model = DLRM(
        cfg.model, emb.tables, opt, pooling=emb.pooling, backend=emb.backend, device=device,
        seed=cfg.train.seed, init_scale=emb.init_scale, ebc=ebc,
    )  # fmt: skip
    attach_student(cfg, model.dense_arch)
    return model


def attach_student(cfg: Config, arch: DenseArch) -> DenseArch:
    """``arch`` with the ExFM student's aux head and adapter of ``cfg.distill`` when it asks for
    them (``attach_distill``, drawn from their own generator: every model form of a config,
    flat or towered, one process or N, gets the same ones). A distributed form calls it before
    DDP wraps ``arch``, so that DDP averages their gradients too."""
    d = cfg.distill
    if d.enabled and d.aux_head:
        attach_distill(arch, True, d.adapter_size if d.adapter else 0, seed=cfg.train.seed)
    return arch


def build_dlrm(
    cfg: Config,
    device: torch.device | str = "cpu",
    groups: Sequence[Sequence[str]] | None = None,
) -> DLRM | TowerDLRM:
    """The model a config describes: a ``DLRM``, or a ``TowerDLRM`` when ``[towers]`` is on.

    Towers: ``groups`` (lists of table names, e.g. from ``neorec.build.towers.learned_groups``)
    when given, else ``towers.groups`` or the ``balanced`` / ``random`` partition of the config's
    tables; the ``learned`` partitioner needs ``groups`` (a warm-up decides them).
    """
    if not cfg.towers.enabled:
        return build_flat_dlrm(cfg, device)
    from neorec.build.towers import tower_groups
    from neorec.modules.towers import TowerDLRM

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


def sharded_collection(
    cfg: Config,
    plan: ShardingPlan,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    device: torch.device | str = "cpu",
) -> EmbeddingCollection:
    """The distributed embedding collection of ``cfg`` under ``plan``: its fixed tables in a
    ``ShardedEmbeddingBagCollection``; its dynamic tables, never placed by a plan, row-wise by
    the hash of the raw id in a ``ShardedDynamicEmbeddingBagCollection`` (dram / ssd ones behind
    each rank's row cache); both in a ``MixedEmbeddingBagCollection`` when there are both."""
    emb = cfg.embedding
    dyn_tables = [t for t in emb.tables if _dynamic(t)]
    if not dyn_tables:
        return _sharded_fixed(cfg, emb.tables, plan, group, stats, device)
    if torch.device(device).type != "cpu":
        raise ConfigError(
            f"dynamic tables {[t.name for t in dyn_tables]} are sharded on the CPU only, "
            f"train.device is {torch.device(device).type}; set train.device = 'cpu'"
        )
    st = cfg.storage  # dram / ssd tables: each rank's stores in <storage.dir>/rank<r>
    dyn = ShardedDynamicEmbeddingBagCollection(
        dyn_tables, RowOptimizer.from_config(emb), pooling=emb.pooling, backend=emb.backend,
        init_scale=emb.init_scale, seed=cfg.train.seed, group=group, stats=stats,
        storage_dir=st.dir, io_threads=st.io_threads, mapped_mb=st.mapped_mb,
    )  # fmt: skip
    fixed_tables = [t for t in emb.tables if not _dynamic(t)]
    if not fixed_tables:
        return dyn
    fixed_plan = without_dynamic(plan, emb.tables)
    fixed = _sharded_fixed(cfg, fixed_tables, fixed_plan, group, stats, device)
    return MixedEmbeddingBagCollection(emb.tables, fixed, dyn)  # type: ignore[arg-type]


def _sharded_fixed(
    cfg: Config,
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
    device: torch.device | str,
) -> ShardedEmbeddingBagCollection:
    """``tables`` under ``plan``: the config's fused optimizer, pooling, backend, initialization
    and ``cfg.comm``'s codecs (forward / backward all-to-all; the all-reduce codec also carries
    data-parallel tables' row gradients)."""
    emb, c = cfg.embedding, cfg.comm
    ebc = ShardedEmbeddingBagCollection(
        tables, plan, RowOptimizer.from_config(emb), pooling=emb.pooling, backend=emb.backend,
        seed=cfg.train.seed, init_scale=emb.init_scale, group=group, stats=stats,
        rounding=emb.rounding, device=device,
    )  # fmt: skip
    ebc.codecs = (
        make_codec(c.forward, c.fp8_scaling),
        make_codec(c.backward, c.fp8_scaling, c.loss_scale),
    )
    ebc.dp_codec = make_codec(c.allreduce, c.fp8_scaling, c.loss_scale)
    return ebc


def distributed_model(
    cfg: Config,
    plan: ShardingPlan,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> DistributedModel:
    """The DLRM of ``cfg`` under ``plan`` on this rank: the sharded collection (its collectives in
    a process group of their own, through shared memory on one host per ``comm.transport``, or in
    ``group``) and the dense part under DDP, in ``train.dense_blocks`` blocks."""
    dev = torch.device(device) if device is not None else rank_device(cfg.train.device)
    stats = CommStats()
    # Embedding collectives get their own group so their order never interleaves with DDP's.
    emb_group = dist.new_group(backend=dist.get_backend()) if dist.is_initialized() else None
    if emb_group is not None and group is None:
        init_host_transport(cfg.comm.transport, emb_group, float(cfg.train.collective_timeout_s))
    torch.manual_seed(cfg.train.seed)  # same dense init as the unsharded DLRM
    ebc = sharded_collection(
        cfg, plan, group=emb_group if group is None else group, stats=stats, device=dev
    )
    dims = {t.dim for t in cfg.embedding.tables}
    dense = attach_student(cfg, DenseArch(cfg.model, len(ebc.feature_names), dims.pop()))
    return DistributedModel(ebc, dense, stats, cfg.comm, cfg.train.dense_blocks, dev)
