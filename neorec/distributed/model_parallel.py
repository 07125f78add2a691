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

from neorec.config import CommConfig, ConfigError
from neorec.distributed.codecs import Codec, make_codec
from neorec.distributed.comm import CommStats, coded_all_reduce
from neorec.distributed.dense_blocks import block_dense, exact_world, local_blocks
from neorec.modules.dlrm import DenseArch, check_dense_input
from neorec.sparse import SparseFeatures

__all__ = ["DistributedModel", "check_same_everywhere"]


class DistributedModel(nn.Module):
    """Same forward/loss API as ``DLRM``; embeddings follow ``plan``, dense layers use DDP."""

    def __init__(
        self,
        ebc: nn.Module,
        dense: DenseArch,
        stats: CommStats,
        comm: CommConfig,
        dense_blocks: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        """``ebc``: this rank's sharded collection (its collectives counted in ``stats``);
        ``dense``: the dense part, replicated under DDP; ``comm``: the wire codecs (the dense
        all-reduce's runs as a DDP comm hook); ``dense_blocks``: the dense part's blocks of the
        global batch (``neorec.distributed.dense_blocks``)."""
        super().__init__()
        self.device = torch.device(device)
        self.comm_stats = stats
        self.ebc: Any = ebc
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dense_blocks > 1:
            # This rank's share of the dense blocks: gradients bitwise those of one process.
            block_dense(dense, local_blocks(dense_blocks, world))
        dense = dense.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.dense_arch: nn.Module = (
            DistributedDataParallel(dense, device_ids=ids) if world > 1 else dense
        )
        self._setup_comm(comm, dense_blocks, world)

    def _setup_comm(self, c: CommConfig, dense_blocks: int, world: int) -> None:
        """Wire codecs from ``comm``; the dense all-reduce codec runs as a DDP comm hook."""
        allreduce = make_codec(c.allreduce, c.fp8_scaling, c.loss_scale)
        # fp32 on 4+ ranks that reproduce one process: the rank sums must be added in the dense
        # blocks' tree, which DDP's ring does not do (2 ranks: one addition, the same either way).
        tree = world > 2 and exact_world(dense_blocks, world)
        hooked = allreduce is not None or tree
        dense_bytes = sum(p.numel() * p.element_size() for p in self.dense_parameters())
        # fp32 runs DDP's own (ring) all-reduce, which reports no bytes: count the ring's share.
        self._ring_bytes = 0 if hooked else 2 * (world - 1) * dense_bytes // world
        if world > 1 and hooked:
            assert isinstance(self.dense_arch, DistributedDataParallel)
            self.dense_arch.register_comm_hook(None, self._allreduce_hook(allreduce, world))

    def _allreduce_hook(self, codec: Codec | None, world: int):  # noqa: ANN202 - DDP hook signature
        stats = self.comm_stats

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
            self.comm_stats.add("allreduce_dense", self._ring_bytes)
        return self.dense_arch(dense, self.ebc(sparse))

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Prepare the input distribution of a later batch from ``host``, its copy before the
        host-to-device copy (the pipelines call this before the step); a collection without
        staging prepares its input at forward."""
        self.ebc.stage_input_dist(sparse, host)

    def prefetch(self, sparse: SparseFeatures) -> None:
        """The collection's prefetch stage (nothing for tables in memory)."""
        self.ebc.prefetch(sparse, defer=True)

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense optimizer (replicated, DDP-averaged)."""
        return self.dense_arch.parameters()

    @property
    def dense_part(self) -> nn.Module:
        """The dense arch (unwrapped from DDP): the keys of ``DLRM.dense_part``."""
        part = self.dense_arch
        return part.module if isinstance(part, DistributedDataParallel) else part

    @property
    def all_tables(self) -> list[Any]:
        """Every table of the model (its sharded collection's)."""
        return list(self.ebc.tables)


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
