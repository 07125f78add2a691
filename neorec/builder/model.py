"""The model a config describes: its embedding collections' shared ``CollectionSpec``, its
embedding collection (in memory, low precision, behind a row cache, dynamic), the flat DLRM, and
their distributed forms under a plan. (The towered model: ``neorec.builder.towers``.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from neorec.config import Config, ConfigError, TableConfig
from neorec.distributed.codecs import make_codec
from neorec.distributed.comm import CommStats, init_host_transport, rank_device
from neorec.distributed.dynamic_reshard import without_dynamic
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection
from neorec.distributed.model_parallel import DistributedModel
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.collection import CollectionSpec, EmbeddingCollection
from neorec.modules.dlrm import DLRM, DenseArch, attach_distill
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.types import ShardingPlan
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.dynamic import DynamicEmbeddingBagCollection
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.mixed import MixedEmbeddingBagCollection
from neorec.storage.store import StoreSettings

__all__ = [
    "collection_spec",
    "store_settings",
    "build_collection",
    "low_precision_collection",
    "build_flat_dlrm",
    "attach_student",
    "sharded_collection",
    "distributed_model",
]


def _dynamic(t: TableConfig) -> bool:
    return t.kind == "dynamic"


def collection_spec(cfg: Config) -> CollectionSpec:
    """What every embedding collection of ``cfg`` shares: ``[embedding]``'s fused optimizer,
    pooling, backend, init scale and rounding, and ``train.seed``."""
    from neorec.builder.schedule import row_l2_scale

    emb = cfg.embedding
    opt = RowOptimizer.from_config(emb)
    opt = replace(opt, weight_decay=opt.weight_decay * row_l2_scale(cfg))  # CowClip's rule
    return CollectionSpec(
        optimizer=opt, pooling=emb.pooling, backend=emb.backend,
        init_scale=emb.init_scale, seed=cfg.train.seed, rounding=emb.rounding,
    )  # fmt: skip


def store_settings(cfg: Config) -> StoreSettings:
    """Where ``cfg``'s dram / ssd tables keep their row stores (``[storage]``)."""
    st = cfg.storage
    return StoreSettings(dir=st.dir, io_threads=st.io_threads, mapped_mb=st.mapped_mb)


def low_precision_collection(
    tables: Sequence[TableConfig], spec: CollectionSpec, device: torch.device | str = "cpu"
) -> EmbeddingCollection:
    """``tables`` stored in fp16 / bf16 / fp8 (one collection when they share a precision, else
    one per precision)."""
    if len({t.precision for t in tables}) == 1:
        return EmbeddingBagCollection(tables, spec, device)
    return GroupedEmbeddingBagCollection(tables, spec, device)


def build_collection(cfg: Config, device: torch.device | str = "cpu") -> EmbeddingCollection:
    """The embedding collection a config describes: tables in memory (fp32, or low precision),
    or behind a row cache over DRAM/SSD; ``kind = "dynamic"`` tables in their own collection,
    combined with one of the other tables."""
    tables, spec, stores = cfg.embedding.tables, collection_spec(cfg), store_settings(cfg)
    if not any(_dynamic(t) for t in tables):
        return _tables_collection(tables, spec, stores, device)
    fixed = [t for t in tables if not _dynamic(t)]
    part = _tables_collection(fixed, spec, stores, device) if fixed else None
    return _dynamic_collection(tables, spec, stores, part, device)


def _tables_collection(
    tables: Sequence[TableConfig],
    spec: CollectionSpec,
    stores: StoreSettings,
    device: torch.device | str,
) -> EmbeddingCollection:
    """The collection of the fixed ``tables``."""
    if any(t.storage != "memory" for t in tables):
        return CachedEmbeddingBagCollection(tables, spec, device, stores)
    if any(t.precision not in ("", "fp32") for t in tables):
        return low_precision_collection(tables, spec, device)
    torch.manual_seed(spec.seed)  # the global generator as the flat DLRM seeds it
    return EmbeddingBagCollection(tables, spec, device)


def _dynamic_collection(
    tables: Sequence[TableConfig],
    spec: CollectionSpec,
    stores: StoreSettings,
    fixed: EmbeddingCollection | None,
    device: torch.device | str,
) -> EmbeddingCollection:
    """The ``kind = "dynamic"`` ``tables`` in a ``DynamicEmbeddingBagCollection`` (a
    ``DynamicCachedEmbeddingBagCollection`` when one is on dram / ssd), combined with ``fixed``
    (the collection of the other tables) when there are any."""
    dyn_tables = [t for t in tables if _dynamic(t)]
    dyn: EmbeddingCollection
    if any(t.storage != "memory" for t in dyn_tables):
        dyn = DynamicCachedEmbeddingBagCollection(dyn_tables, spec, device, storage=stores)
    else:
        dyn = DynamicEmbeddingBagCollection(dyn_tables, spec, device)
    if fixed is None:
        return dyn
    return MixedEmbeddingBagCollection(tables, fixed, dyn)


def build_flat_dlrm(cfg: Config, device: torch.device | str = "cpu") -> DLRM:
    """The flat DLRM of a config (its ``[towers]`` ignored): its collection, then the dense arch
    (``DLRM`` seeds it from ``train.seed``); an ExFM student's aux head and adapter
    (``[distill]``) in its dense arch."""
    ebc = build_collection(cfg, device)
    model = DLRM(cfg.model, ebc, seed=cfg.train.seed, device=device)
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
    emb, spec = cfg.embedding, collection_spec(cfg)
    dyn_tables = [t for t in emb.tables if _dynamic(t)]
    if not dyn_tables:
        return _sharded_fixed(cfg, spec, emb.tables, plan, group, stats, device)
    if torch.device(device).type != "cpu":
        raise ConfigError(
            f"dynamic tables {[t.name for t in dyn_tables]} are sharded on the CPU only, "
            f"train.device is {torch.device(device).type}; set train.device = 'cpu'"
        )
    # dram / ssd tables: each rank's stores in <storage.dir>/rank<r>
    dyn = ShardedDynamicEmbeddingBagCollection(
        dyn_tables, spec, group=group, stats=stats, storage=store_settings(cfg)
    )
    fixed_tables = [t for t in emb.tables if not _dynamic(t)]
    if not fixed_tables:
        return dyn
    fixed_plan = without_dynamic(plan, emb.tables)
    fixed = _sharded_fixed(cfg, spec, fixed_tables, fixed_plan, group, stats, device)
    return MixedEmbeddingBagCollection(emb.tables, fixed, dyn)  # type: ignore[arg-type]


def _sharded_fixed(
    cfg: Config,
    spec: CollectionSpec,
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
    device: torch.device | str,
) -> ShardedEmbeddingBagCollection:
    """``tables`` under ``plan`` with ``cfg.comm``'s codecs (forward / backward all-to-all; the
    all-reduce codec also carries data-parallel tables' row gradients)."""
    c = cfg.comm
    codecs = (
        make_codec(c.forward, c.fp8_scaling),
        make_codec(c.backward, c.fp8_scaling, c.loss_scale),
    )
    return ShardedEmbeddingBagCollection(
        tables, spec, device, plan=plan, group=group, stats=stats, codecs=codecs,
        dp_codec=make_codec(c.allreduce, c.fp8_scaling, c.loss_scale),
    )  # fmt: skip


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
