"""DMT's Semantic-preserving Tower Transform (SPTT) on torch.distributed.

Tower ``t`` is a set of tables and lives on host ``t``: its tables are sharded over that host's
``rph = world / towers`` ranks only, and its tower module runs there. Rank ``r = (host h, local
l)`` has a local batch of ``b`` samples. A step:

1. ids: for every tower ``t`` the rank sends its samples' bags of tower ``t``'s features to its
   *peer* on host ``t``, rank ``(t, l)`` (an all-to-all over all ranks in which each rank talks
   only to its peers: lengths, then ids and per-id weights). Rank ``(h, l)`` so receives tower
   ``h``'s bags of the ``H = world / rph`` ranks ``(*, l)``: a batch of ``H * b`` samples.
2. lookup: host ``h``'s ranks run an ordinary ``ShardedEmbeddingBagCollection`` of tower ``h``'s
   tables over the host's process group: every all-to-all of this stage stays inside the host.
3. tower module ``h`` turns each sample's pooled features [F_h * D] into [k_h * D].
4. outputs: each rank sends every source its rows back (all-to-all over peers): only the tower
   modules' outputs cross hosts. The owner concatenates the towers' outputs in tower order and
   runs the interaction and top MLP (``DenseArch`` over ``sum k_t`` vectors).

Backward runs the same exchanges in reverse. Gradients keep global-batch semantics: the pooled
gradients reaching the tower's collection are scaled by ``1 / H`` (the collection divides by its
own ``rph`` ranks). Tower modules' gradients (``tower_sync``):

- ``"world"`` (the default): every tower module is replicated on every rank inside one DDP module
  with the dense arch (``find_unused_parameters`` when the other hosts' tower modules have
  parameters: a rank computes only its host's tower), so DDP's average over the world gives
  each tower module the gradient of the global mean loss and all replicas stay identical (a
  checkpoint's dense state is the same on every rank). Tower t's gradients cross every host,
  though only host t computes them.
- ``"host"`` (the DMT paper's step): the dense arch alone is under a world-wide DDP; tower ``h``'s
  module is under a DDP over host ``h``'s ranks whose hook sums inside the host and divides by the
  world (``grad_sync.host_mean_hook``): the same global-mean gradient, and no tower gradient
  leaves its host. A rank's copies of the other hosts' tower modules are not used and not
  updated (their gradients stay None, so the dense optimizer skips them); ``sync_replicas``
  (collective) copies every tower module, and its optimizer state, from its host to every rank,
  which a checkpoint or a saved model of rank 0 needs first.

With identity tower modules the model is the flat DLRM over the features in tower order; with
parametrised ones it is the unsharded ``TowerDLRM`` (both tested, both syncs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from neorec.config import ConfigError, TableConfig
from neorec.distributed.comm import (
    Awaitable,
    Chain,
    CommStats,
    ScaleGrad,
    all_to_all,
    source_major_to_unit_major,
)
from neorec.distributed.grad_sync import host_mean_hook
from neorec.modules.dlrm import DenseArch, check_dense_input
from neorec.sparse import SparseFeatures

__all__ = ["DistributedTowerModel", "PeerExchange", "tower_features"]


def tower_features(
    tables: Sequence[TableConfig], groups: Sequence[Sequence[str]]
) -> list[list[str]]:
    """Per tower, its features: those of its tables, in the config's table order."""
    out = []
    for g in groups:
        names = set(g)
        out.append([f for t in tables if t.name in names for f in t.features])
    return out


class PeerExchange(torch.autograd.Function):
    """An all-to-all of float rows with fixed splits; backward sends the gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        send: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: Any,
        stats: CommStats | None,
    ) -> Tensor:
        ctx.meta = (send.shape, send_splits, recv_splits, group, stats)
        return all_to_all(
            send.reshape(-1), send_splits, recv_splits, group, stats, "tower_fwd"
        ).wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        shape, send_splits, recv_splits, group, stats = ctx.meta
        back = all_to_all(grad.contiguous(), recv_splits, send_splits, group, stats, "tower_bwd")
        return back.wait().view(shape), None, None, None, None


class _TowerDense(nn.Module):
    """Every tower module (replicated) and the dense arch, as one module for DDP. Its state-dict
    keys (``towers.*``, ``dense_arch.*``) are those of the unsharded ``TowerDLRM``'s dense part."""

    def __init__(self, towers: nn.ModuleList, dense_arch: nn.Module, owner: Any) -> None:
        super().__init__()
        self.dense_arch = dense_arch  # first: parameters in TowerDLRM.dense_parameters() order
        self.towers = towers
        self._owner = [owner]  # not a submodule

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Logits [b] from this rank's dense features and its host's tower batch [H*b, F_h*D]."""
        m = self._owner[0]
        run_tower, run_arch = m._runners or (self.towers[m.host], self.dense_arch)
        out = run_tower(pooled)  # [H*b, k_h*D]
        got = PeerExchange.apply(out, m.out_send, m.out_recv, m.xgroup, m.comm_stats)
        b = dense.shape[0]
        parts = torch.split(got, [n for n in m.out_recv if n])  # tower order = host order
        cat = torch.cat([p.view(b, -1) for p in parts], dim=1)
        return run_arch(dense, cat)  # type: ignore[no-any-return]


class DistributedTowerModel(nn.Module):
    """A towered DLRM under SPTT: same forward / loss API as ``DLRM``.

    ``tables``: every table, in the config's order; ``groups``: the towers' tables, one list per
    tower; the world must be ``len(groups)`` hosts of equal size (``world / towers`` ranks each,
    consecutive global ranks). ``build_ebc(tables, ranks, group, stats)`` builds this host's
    tower collection: ``tables`` (the tower's), sharded over the host's ``ranks`` ranks and
    process ``group``, counting its collectives in ``stats``. ``build_dense`` returns ``(towers:
    nn.ModuleList, dense_arch)`` exactly as the unsharded ``TowerDLRM`` builds them. Both are
    called after ``torch.manual_seed(seed)``, collection first, so that the distributed and the
    unsharded model start from the same weights. ``host_staging``: the ids exchange staged on
    the host goes over a gloo group of its own (the tables live on a GPU). ``tower_sync``:
    ``"world"`` or ``"host"``, where the tower modules' gradients are averaged (module doc).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        groups: Sequence[Sequence[str]],
        build_ebc: Callable[[list[TableConfig], int, Any, CommStats], Any],
        build_dense: Callable[[], tuple[Any, DenseArch]],
        seed: int = 0,
        host_staging: bool = False,
        tower_sync: str = "world",
    ) -> None:
        super().__init__()
        if tower_sync not in ("world", "host"):
            raise ConfigError(f"tower_sync must be 'world' or 'host', got {tower_sync!r}")
        self.tower_sync = tower_sync
        world, rank = dist.get_world_size(), dist.get_rank()
        towers = len(groups)
        if towers < 1 or world % towers:
            raise ConfigError(
                f"towers: {towers} towers need a world size that is a multiple of it (one host "
                f"of world / towers ranks per tower), got {world} ranks"
            )
        self.rph = world // towers
        self.hosts = towers
        self.host, self.local = divmod(rank, self.rph)
        self.comm_stats = CommStats(ranks_per_host=self.rph)
        self.groups = [list(g) for g in groups]
        self.all_tables = list(tables)
        big = max(t.rows for t in self.all_tables) >= 2**31
        self._id_dtype = torch.int64 if big else torch.int32
        self.features = tower_features(self.all_tables, self.groups)
        # Every rank creates every group, in the same order (torch.distributed's rule).
        host_groups = [
            dist.new_group(ranks=list(range(h * self.rph, (h + 1) * self.rph)))
            for h in range(towers)
        ]
        self.xgroup = dist.new_group()  # the peer exchanges, apart from DDP's collectives
        # the ids exchange staged on the host (``stage_input_dist``): over gloo (a twin of
        # ``xgroup`` when the tables live on a GPU)
        self._host_xgroup = dist.new_group(backend="gloo") if host_staging else self.xgroup
        # staged batches: (batch, its ids exchange in flight, or its tower batch once received)
        self._staged: list[tuple[SparseFeatures, Chain[SparseFeatures] | SparseFeatures]] = []
        mine = set(self.groups[self.host])
        torch.manual_seed(seed)  # same dense init as the unsharded TowerDLRM
        self.ebc = build_ebc(
            [t for t in self.all_tables if t.name in mine],
            self.rph,
            host_groups[self.host],
            self.comm_stats,
        )
        tower_mods, dense_arch = build_dense()
        if len(tower_mods) != towers:
            raise ValueError(f"build_dense made {len(tower_mods)} towers for {towers} groups")
        dims = {t.dim for t in self.all_tables}
        self.dim = dims.pop()
        outs = [int(m.out_vectors) * self.dim for m in tower_mods]
        self.arch = dense_arch
        peers = [j % self.rph == self.local for j in range(world)]
        self._out_k = outs
        self.out_send: list[int] = []  # set per batch size in forward
        self.out_recv: list[int] = []
        self._peers = peers
        part = _TowerDense(tower_mods, dense_arch, self)
        # DDP wrappers kept out of the module tree (in lists), so that the state-dict keys stay
        # TowerDLRM's; under "host", (tower h's runner, the dense arch's runner)
        self._runners: tuple[nn.Module, nn.Module] | None = None
        self._ddps: list[DistributedDataParallel | None]
        if tower_sync == "world":
            # the other hosts' tower modules are not run here: DDP must look for unused
            # parameters exactly when they have some (else it warns every run that none were)
            unused = any(
                p.requires_grad
                for t, mod in enumerate(tower_mods)
                if t != self.host
                for p in mod.parameters()
            )
            # An ExFM student's aux head and adapter are used after the forward, in the loss:
            # DDP's search for unused parameters (from the forward's output) would count them
            # unused, then see their gradients; a static graph learns the unused ones from the
            # first backward instead (the same parameters are used every step).
            outside = any(getattr(dense_arch, k, None) is not None for k in ("aux_head", "adapter"))
            self.dense_arch: nn.Module = DistributedDataParallel(
                part,
                find_unused_parameters=unused and not outside,
                static_graph=unused and outside,
            )
            self._ddps = [self.dense_arch, None]
        else:
            self.dense_arch = part
            # every rank builds every host's sync group, in the same order
            sync_groups = [
                dist.new_group(ranks=list(range(h * self.rph, (h + 1) * self.rph)))
                for h in range(towers)
            ]
            arch_ddp = DistributedDataParallel(dense_arch)
            mine_mod = tower_mods[self.host]
            run_tower: nn.Module = mine_mod
            tower_ddp = None
            if any(p.requires_grad for p in mine_mod.parameters()):
                tower_ddp = DistributedDataParallel(mine_mod, process_group=sync_groups[self.host])
                tower_ddp.register_comm_hook(
                    None, host_mean_hook(sync_groups[self.host], world, self.comm_stats)
                )
                run_tower = tower_ddp
            self._ddps = [arch_ddp, tower_ddp]
            self._runners = (run_tower, arch_ddp)

    @property
    def world_ddp(self) -> DistributedDataParallel:
        """The DDP whose all-reduce spans the world (``"world"``: every tower module and the
        dense arch; ``"host"``: the dense arch): a comm hook may be registered on it."""
        ddp = self._ddps[0]
        assert ddp is not None
        return ddp

    @property
    def tower_ddp(self) -> DistributedDataParallel | None:
        """``"host"``: the DDP of this host's tower module over the host's ranks (None under
        ``"world"`` or for a tower module without parameters)."""
        return self._ddps[1]

    # ---- forward ---------------------------------------------------------------------------
    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Start the ids exchange of a later ``forward(dense, sparse)`` from the host copy
        ``host`` (the pipelines call this before the step): its lengths all-to-all (over gloo)
        starts now; the lookup of the step that runs meanwhile starts its ids all-to-all
        (``advance``), and the end of that step's forward receives them and stages the tower
        collection's own input distribution from the tower batch. Nothing depends on weights,
        so staging changes no number; the step reads nothing back from the device."""
        if host is None:
            host = sparse if sparse.values.device.type == "cpu" else sparse.to("cpu")
        self._staged.append((sparse, self._exchange_ids(host, self._host_xgroup)))

    def forward(self, dense: Tensor, sparse: SparseFeatures) -> Tensor:
        """Logits [b] for this rank's samples."""
        check_dense_input(dense, sparse, self.arch)
        b = sparse.batch_size
        staged = [i for i, (s, _) in enumerate(self._staged) if s is sparse]
        if staged:
            got = self._staged.pop(staged[0])[1]
            batch = got.wait() if isinstance(got, Chain) else got
        else:  # not staged: exchanged now (a host read of the lengths received)
            batch = self._exchange_ids(sparse, self.xgroup).wait()
        pooled = self.ebc(batch)  # [H*b, F_h*D]: host-local all-to-alls only
        for _, pending in self._staged:  # the next batch's lengths had the lookup's time
            if isinstance(pending, Chain):
                pending.advance()
        pooled = ScaleGrad.apply(pooled, 1.0 / self.hosts)
        k_h = self._out_k[self.host]
        self.out_send = [b * k_h if p else 0 for p in self._peers]
        self.out_recv = [
            b * self._out_k[j // self.rph] if p else 0 for j, p in enumerate(self._peers)
        ]
        out = self.dense_arch(dense, pooled)
        self._receive_staged()
        return out  # type: ignore[no-any-return]

    def _receive_staged(self) -> None:
        """The staged batches' ids (their exchange had this step's forward to arrive): the
        tower batches, each staged in the tower collection."""
        for i, (s, pending) in enumerate(self._staged):
            if isinstance(pending, Chain):
                tower = pending.wait()
                self.ebc.stage_input_dist(tower, tower)
                self._staged[i] = (s, tower)

    def _exchange_ids(self, sparse: SparseFeatures, group: Any) -> Chain[SparseFeatures]:
        """This host's tower batch: its features' bags of every peer's samples, peers in host
        order (``H * b`` samples), exchanged over ``group``: the lengths' all-to-all starts now,
        the ids' at ``advance()``, the batch is built at ``wait()``."""
        b = sparse.batch_size
        mine = self.features[self.host]
        subs = [sparse.select(f) for f in self.features]
        world = len(self._peers)
        send_len = torch.cat([s.lengths.to(torch.int32) for s in subs])
        len_send = [
            len(self.features[j // self.rph]) * b if p else 0 for j, p in enumerate(self._peers)
        ]
        len_recv = [len(mine) * b if p else 0 for p in self._peers]
        got_len = all_to_all(send_len, len_send, len_recv, group, self.comm_stats, "tower_lengths")

        def ids_phase() -> Awaitable[SparseFeatures]:
            recv_len = got_len.wait().to(torch.int64)
            per_src = torch.split(recv_len, [n for n in len_recv if n])
            val_send = [0] * world
            val_recv = [0] * world
            peers = [j for j in range(world) if self._peers[j]]
            for t, j in enumerate(peers):
                val_send[j] = subs[t].values.numel()
                val_recv[j] = int(per_src[t].sum())
            # ids travel as int32 when every table fits (lossless, half the bytes), as in
            # input_dist
            values = torch.cat([s.values.to(self._id_dtype) for s in subs])
            got_val = all_to_all(values, val_send, val_recv, group, self.comm_stats, "tower_ids")
            weights = None
            if sparse.weights is not None:
                w = torch.cat([s.weights for s in subs if s.weights is not None])
                weights = all_to_all(w, val_send, val_recv, group, self.comm_stats, "tower_ids")

            def finish() -> SparseFeatures:
                blocks = recv_len.view(self.hosts, len(mine), b)
                idx, offsets, wts = source_major_to_unit_major(
                    blocks,
                    got_val.wait().to(torch.int64),
                    weights.wait() if weights is not None else None,
                )
                lengths = offsets[1:] - offsets[:-1]
                return SparseFeatures(mine, idx, lengths, wts)

            return Awaitable(finish)

        return Chain(ids_phase)

    def prefetch(self, sparse: SparseFeatures) -> None:
        """Nothing: a tower's sharded tables live in memory (no row cache to fill)."""

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense optimizer: every tower module and the dense arch."""
        return self.dense_arch.parameters()

    @property
    def dense_part(self) -> nn.Module:
        """Tower modules and dense arch (checkpoints: the keys of ``TowerDLRM.dense_part``).
        Under ``tower_sync="host"`` the other hosts' tower modules are current only after
        ``sync_replicas``."""
        part: nn.Module = getattr(self.dense_arch, "module", self.dense_arch)
        return part

    @torch.no_grad()
    def sync_replicas(self, opt: torch.optim.Optimizer | None = None) -> None:
        """Collective (every rank): copy tower t's module, and its state in the dense optimizer
        ``opt``, from host t's first rank to every rank. Nothing to do under ``"world"``."""
        if self.tower_sync == "world":
            return
        towers: Any = self.dense_part.towers
        for t, mod in enumerate(towers):
            src = t * self.rph
            for p in [*mod.parameters(), *mod.buffers()]:
                dist.broadcast(p.data, src=src)
            if opt is None:
                continue
            for p in mod.parameters():
                box: list[Any] = [
                    {k: v.cpu() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                    if self.host == t and p in opt.state
                    else None
                ]
                dist.broadcast_object_list(box, src=src)
                if box[0] is not None and self.host != t:
                    opt.state[p] = {
                        k: v.to(p.device) if torch.is_tensor(v) else v for k, v in box[0].items()
                    }
