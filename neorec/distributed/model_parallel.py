"""DistributedModel: a DLRM under a ShardingPlan (sharded embeddings + DDP for the dense part)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from neorec.config import Config, ConfigError
from neorec.distributed.codecs import Codec, make_codec
from neorec.distributed.comm import CommStats, coded_all_reduce, init_host_transport, rank_device
from neorec.distributed.dense_blocks import block_dense, exact_world, local_blocks
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.dlrm import DenseArch, check_dense_input
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.types import ShardingPlan, plan_by_type
from neorec.sparse import SparseFeatures

__all__ = ["DistributedModel", "sharded_ebc_from_config", "resolve_plan", "check_same_everywhere"]


def sharded_ebc_from_config(
    cfg: Config,
    plan: ShardingPlan,
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    device: torch.device | str = "cpu",
) -> ShardedEmbeddingBagCollection:
    """The sharded embedding collection of ``cfg`` under ``plan``: its tables, fused optimizer,
    pooling, backend, initialization and ``cfg.comm``'s codecs (forward / backward all-to-all; the
    all-reduce codec also carries data-parallel tables' row gradients)."""
    emb, c = cfg.embedding, cfg.comm
    ebc = ShardedEmbeddingBagCollection(
        emb.tables,
        plan,
        RowOptimizer.from_config(emb),
        pooling=emb.pooling,
        backend=emb.backend,
        seed=cfg.train.seed,
        init_scale=emb.init_scale,
        group=group,
        stats=stats,
        rounding=emb.rounding,
        device=device,
    )
    ebc.codecs = (
        make_codec(c.forward, c.fp8_scaling),
        make_codec(c.backward, c.fp8_scaling, c.loss_scale),
    )
    ebc.dp_codec = make_codec(c.allreduce, c.fp8_scaling, c.loss_scale)
    return ebc


class DistributedModel(nn.Module):
    """Same forward/loss API as ``DLRM``; embeddings follow ``plan``, dense layers use DDP."""

    def __init__(
        self,
        cfg: Config,
        plan: ShardingPlan,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        # ``train.device``, unless given: cuda:LOCAL_RANK on cuda.
        self.device = torch.device(device) if device is not None else rank_device(cfg.train.device)
        emb = cfg.embedding
        self.stats = CommStats()
        # Embedding collectives get their own group so their order never interleaves with DDP's.
        emb_group = dist.new_group(backend=dist.get_backend()) if dist.is_initialized() else None
        if emb_group is not None and group is None:
            # On one host, their all-to-alls through shared memory (``comm.transport``).
            init_host_transport(
                cfg.comm.transport, emb_group, float(cfg.train.collective_timeout_s)
            )
        torch.manual_seed(cfg.train.seed)  # same dense init as the unsharded DLRM
        from neorec.distributed.dynamic_reshard import has_dynamic, sharded_dynamic_from_config

        build = sharded_dynamic_from_config if has_dynamic(cfg) else sharded_ebc_from_config
        self.ebc: Any = build(
            cfg,
            plan,
            group=emb_group if group is None else group,
            stats=self.stats,
            device=self.device,
        )
        dims = {t.dim for t in emb.tables}
        dense = DenseArch(cfg.model, len(self.ebc.feature_names), dims.pop())
        world = dist.get_world_size() if dist.is_initialized() else 1
        if cfg.train.dense_blocks > 1:
            # This rank's share of the dense blocks: gradients bitwise those of one process.
            block_dense(dense, local_blocks(cfg.train.dense_blocks, world))
        dense = dense.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.dense_arch: nn.Module = (
            DistributedDataParallel(dense, device_ids=ids) if world > 1 else dense
        )
        self._setup_comm(cfg, world)

    def _setup_comm(self, cfg: Config, world: int) -> None:
        """Wire codecs from ``cfg.comm``; the dense all-reduce codec runs as a DDP comm hook."""
        c = cfg.comm
        allreduce = make_codec(c.allreduce, c.fp8_scaling, c.loss_scale)
        # fp32 on 4+ ranks that reproduce one process: the rank sums must be added in the dense
        # blocks' tree, which DDP's ring does not do (2 ranks: one addition, the same either way).
        tree = world > 2 and exact_world(cfg.train.dense_blocks, world)
        hooked = allreduce is not None or tree
        dense_bytes = sum(p.numel() * p.element_size() for p in self.dense_parameters())
        # fp32 runs DDP's own (ring) all-reduce, which reports no bytes: count the ring's share.
        self._ring_bytes = 0 if hooked else 2 * (world - 1) * dense_bytes // world
        if world > 1 and hooked:
            assert isinstance(self.dense_arch, DistributedDataParallel)
            self.dense_arch.register_comm_hook(None, self._allreduce_hook(allreduce, world))

    def _allreduce_hook(self, codec: Codec | None, world: int):  # noqa: ANN202 - DDP hook signature
        stats = self.stats

        # Unannotated on purpose: DDP compares the annotations to its own types (strings here).
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            t0, c0 = time.perf_counter(), stats.codec_s
            out = coded_all_reduce(bucket.buffer() / world, codec, None, stats)
            stats.waited("allreduce_dense", time.perf_counter() - t0 - (stats.codec_s - c0))
            fut: torch.futures.Future[Tensor] = torch.futures.Future()
            fut.set_result(out)
            return fut

        return hook

    def forward(self, dense: Tensor, sparse: SparseFeatures) -> Tensor:
        """Logits [b] for this rank's samples."""
        arch = getattr(self.dense_arch, "module", self.dense_arch)  # under DDP or not
        assert isinstance(arch, DenseArch)
        check_dense_input(dense, sparse, arch)
        if self._ring_bytes and torch.is_grad_enabled():
            self.stats.add("allreduce_dense", self._ring_bytes)
        return self.dense_arch(dense, self.ebc(sparse))

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Prepare the input distribution of a later batch from ``host``, its copy before the
        host-to-device copy (the pipelines call this before the step); a collection without
        staging prepares its input at forward."""
        stage = getattr(self.ebc, "stage_input_dist", None)
        if callable(stage):
            stage(sparse, host)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense optimizer (replicated, DDP-averaged)."""
        return self.dense_arch.parameters()


def resolve_plan(cfg: Config, world_size: int, ranks_per_host: int | None = None) -> ShardingPlan:
    """The plan a config asks for: a JSON file, per-table types, or the planner."""
    rph = ranks_per_host or world_size
    sh = cfg.sharding
    if sh.plan:
        # Checked against the model's tables and the ranks running: a table the model lacks,
        # or one it has that the plan misses, is an error naming it.
        plan = ShardingPlan.load(sh.plan, tables=cfg.embedding.tables, world_size=world_size)
        plan.check_storage(who="the distributed runtime")  # no cached tier it would ignore
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
    """The cost-model planner's plan for this machine (or the configured topology)."""
    from neorec.sharding.cost_model import tables_from_config
    from neorec.sharding.planner import PlanningError, plan_tables
    from neorec.sharding.topology import Topology

    pc = cfg.planner
    if pc.topology_file:
        topo = Topology.load(pc.topology_file).with_world(world_size, rph)
    elif pc.topology:
        topo = Topology.from_dict({**pc.topology, "world_size": world_size, "ranks_per_host": rph})
    else:
        topo = Topology.local_cpu(world_size).with_world(world_size, rph)
    tables = tables_from_config(cfg.embedding.tables, cfg.sharding.types, cfg.sharding.default_type)
    options = {"weight_bytes": pc.weight_bytes, "allow_host": pc.allow_host}
    if pc.max_cw_slices:
        options["max_cw_slices"] = pc.max_cw_slices
    try:
        result = plan_tables(
            tables,
            topo,
            pc.batch_size or cfg.data.batch_size,
            pc.optimizer or cfg.embedding.optimizer,
            **options,
        )
    except PlanningError as e:
        raise ConfigError(f"the planner found no plan: {e}") from None
    return result.plan


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
