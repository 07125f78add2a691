"""DMT towers, unsharded: tower modules and ``TowerDLRM``, the specification of SPTT training.

A tower is a set of TABLES (with every feature reading them). ``TowerDLRM`` looks up every table
in one flat collection (as ``DLRM`` does), hands each tower module its features' pooled embeddings
and interacts the towers' outputs in the usual dense part. With ``identity`` towers it is the flat
DLRM whose features are in tower order (same weights, same function, same training).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from neorec.config import ConfigError, ModelConfig, TableConfig
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.dlrm import CrossNet, DenseArch, check_dense_input
from neorec.sparse import SparseFeatures

if TYPE_CHECKING:
    from neorec.data.batch import Batch

__all__ = [
    "TowerModule",
    "TowerDLRM",
    "TowerServing",
    "TOWER_KINDS",
    "build_tower_dense",
    "feature_affinity",
    "table_affinity",
    "AFFINITY_METHODS",
]

TOWER_KINDS = ("identity", "mlp", "dot", "dcn")


def _compress(in_dim: int, out_dim: int) -> nn.Linear:
    """Linear to the tower's output, Glorot-normal as the DLRM MLPs, zero bias (a tower's output
    starts as a linear mix of its embeddings, of their scale)."""
    lin = nn.Linear(in_dim, out_dim)
    nn.init.normal_(lin.weight, 0.0, math.sqrt(2.0 / (in_dim + out_dim)))
    nn.init.zeros_(lin.bias)
    return lin


class TowerModule(nn.Module):
    """The dense module of one tower: [B, F*D] pooled embeddings -> [B, k*D] (k = out_vectors).

    Kinds:
    - ``identity``: the features themselves (k = F);
    - ``mlp``: low-rank compression ``Linear(F*D -> k*D)``, no activation: the top interaction
      takes dot products of the outputs, a bilinear form of the embeddings, as it does of flat
      embeddings; a ReLU would zero half of each vector and bias every dot product positive;
    - ``dot``: the F(F-1)/2 pairwise dots of the tower's features (as ``DotInteraction``) next to
      the features, ``Linear -> k*D``: within-tower interactions are computed exactly, locally;
    - ``dcn``: one DCNv2 cross layer (``CrossNet``) on the concatenated features, ``Linear -> k*D``.
    """

    rows: Tensor
    cols: Tensor

    def __init__(self, kind: str, num_features: int, dim: int, out_vectors: int = 1) -> None:
        super().__init__()
        if kind not in TOWER_KINDS:
            raise ConfigError(f"tower module kind must be one of {TOWER_KINDS}, got {kind!r}")
        for name, v in (("num_features", num_features), ("dim", dim), ("out_vectors", out_vectors)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"tower module {name} must be an integer >= 1, got {v!r}")
        self.kind = kind
        self.num_features = num_features
        self.dim = dim
        self.out_vectors = num_features if kind == "identity" else out_vectors
        in_dim = num_features * dim
        rows, cols = torch.tril_indices(num_features, num_features, offset=-1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.cross: CrossNet | None = None
        self.proj: nn.Linear | None = None
        if kind == "dcn":
            self.cross = CrossNet(in_dim, 1)
        if kind == "dot":
            in_dim += rows.numel()
        if kind != "identity":
            self.proj = _compress(in_dim, self.out_vectors * dim)

    @property
    def out_dim(self) -> int:
        """Columns of the output (out_vectors * dim)."""
        return self.out_vectors * self.dim

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [B, num_features*dim] -> [B, out_vectors*dim]."""
        if self.proj is None:
            return x
        if self.kind == "dot":
            t = x.view(x.shape[0], self.num_features, self.dim)
            z = torch.bmm(t, t.transpose(1, 2))[:, self.rows, self.cols]
            x = torch.cat([x, z], dim=1)
        elif self.cross is not None:
            x = self.cross(x.new_zeros(x.shape[0], 0), x.view(x.shape[0], self.num_features, -1))
        return self.proj(x)


def build_tower_dense(
    model: ModelConfig,
    features_per_tower: Sequence[int],
    dim: int,
    kind: str = "identity",
    out_vectors: int = 1,
) -> tuple[nn.ModuleList, DenseArch]:
    """The dense part of a towered model, (tower modules, dense arch), drawn from the global RNG
    in this order: the dense arch first (so its init is the flat DLRM's for the same seed, whatever
    the tower modules draw), then each tower's module. ``TowerDLRM`` calls it right after
    ``torch.manual_seed(seed)``; a distributed form does the same to start from equal weights."""
    n_out = sum(n if kind == "identity" else out_vectors for n in features_per_tower)
    arch = DenseArch(model, n_out, dim)
    mods = nn.ModuleList(TowerModule(kind, n, dim, out_vectors) for n in features_per_tower)
    return mods, arch


class TowerDLRM(nn.Module):
    """The towered model, unsharded: the specification every SPTT form must equal.

    ``ebc``: the flat collection (any table order); ``tower_tables[t]``: the table names of tower t
    in the collection's table order; ``tower_features[t]``: indices into ``ebc.feature_names`` of
    those tables' features (so in ``ebc.feature_names`` order); ``towers[t]``: its ``TowerModule``;
    ``dense_arch``: ``DenseArch(model, sum of out_vectors, dim)``.
    forward = dense_arch(dense, cat_t towers[t](pooled[:, columns of tower_features[t]])).
    """

    ebc: EmbeddingCollection
    comm_stats = None
    """No collectives (a distributed model's ``CommStats``)."""

    def __init__(
        self,
        model: ModelConfig,
        ebc: EmbeddingCollection,
        tower_tables: Sequence[Sequence[str]],
        kind: str = "identity",
        out_vectors: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        tables = list(ebc.tables)
        dims = {t.dim for t in tables}
        if len(dims) != 1:
            raise ConfigError(f"towers need one embedding dim for all tables, got {sorted(dims)}")
        dim = dims.pop()
        self.ebc = ebc
        names = [t.name for t in tables]
        seen = [n for g in tower_tables for n in g]
        if sorted(seen) != sorted(names) or not all(tower_tables):
            raise ConfigError(
                f"towers must partition the tables {names} into non-empty groups, got "
                f"{[list(g) for g in tower_tables]}"
            )
        # within a tower: the collection's table order (as neorec.distributed.towers)
        self.tower_tables = [sorted(g, key=names.index) for g in tower_tables]
        feats: list[str] = list(ebc.feature_names)
        by_table = {t.name: list(t.features) for t in tables}
        self.tower_features = [
            [feats.index(f) for n in g for f in by_table[n]] for g in self.tower_tables
        ]
        self.dim = dim
        torch.manual_seed(seed)
        towers, self.dense_arch = build_tower_dense(
            model, [len(f) for f in self.tower_features], dim, kind, out_vectors
        )
        self.towers = towers.to(device)
        self.dense_arch.to(device)
        order = [i for f in self.tower_features for i in f]
        self._order: Tensor
        self.register_buffer("_order", torch.tensor(order, dtype=torch.int64), persistent=False)
        self._splits = [len(f) for f in self.tower_features]

    def tower_inputs(self, pooled: Tensor) -> list[Tensor]:
        """Each tower's slice [B, F_t*D] of the flat pooled output [B, F*D]."""
        b = pooled.shape[0]
        emb = pooled.view(b, -1, self.dim).index_select(1, self._order)
        return [x.reshape(b, -1) for x in emb.split(self._splits, dim=1)]

    def interact(self, dense: Tensor, tower_out: Sequence[Tensor]) -> Tensor:
        """Logits [B] from the dense features and the towers' outputs (the part after the
        inter-host exchange in SPTT)."""
        return self.dense_arch(dense, torch.cat(list(tower_out), dim=1))

    def forward(self, dense: Tensor, sparse: SparseFeatures) -> Tensor:
        """Logits [B] for a batch."""
        check_dense_input(dense, sparse, self.dense_arch)
        xs = self.tower_inputs(self.ebc(sparse))
        return self.interact(dense, [m(x) for m, x in zip(self.towers, xs)])

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense (torch.optim) optimizer: the dense part's, then the
        tower modules'."""
        yield from self.dense_arch.parameters()
        yield from self.towers.parameters()

    @property
    def all_tables(self) -> list[TableConfig]:
        """Every table of the model (its collection's)."""
        return list(self.ebc.tables)

    @property
    def dense_part(self) -> nn.Module:
        """The dense arch and the tower modules as one module (state-dict keys ``dense_arch.*``,
        ``towers.*``): what checkpoints and saved models store, the same as the distributed
        form's (``neorec.distributed.towers``)."""
        part = nn.Module()
        part.dense_arch = self.dense_arch
        part.towers = self.towers
        return part

    def serving_program(self, dense_arch: nn.Module | None = None) -> TowerServing:
        """Everything after the lookup as one module, ``(dense, pooled) -> logits`` (what
        ``neorec export`` writes): a copy of the tower modules and of ``dense_arch`` (default
        the model's), sharing nothing with the model."""
        arch = copy.deepcopy(self.dense_arch if dense_arch is None else dense_arch)
        towers = copy.deepcopy(self.towers)
        return TowerServing(towers, arch, self._order.clone(), self._splits, self.dim)

    def prefetch(self, sparse: SparseFeatures) -> None:
        """As ``DLRM.prefetch``: a row cache reads the next batch's misses in the background."""
        self.ebc.prefetch(sparse, defer=True)

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """As ``DLRM.stage_input_dist``: the collection checks the host copy."""
        self.ebc.stage_input_dist(sparse, host)


class TowerServing(nn.Module):
    """A towered model's dense part as one program: ``dense`` [B, num_dense] and the flat
    ``pooled`` [B, F*D] (the collection's feature order, as a flat model's) -> logits [B]; the
    same ops as ``TowerDLRM.forward`` after its lookup (``TowerDLRM.serving_program``)."""

    order: Tensor

    def __init__(
        self,
        towers: nn.ModuleList,
        dense_arch: nn.Module,
        order: Tensor,
        splits: list[int],
        dim: int,
    ) -> None:
        super().__init__()
        self.towers = towers
        self.dense_arch = dense_arch
        self.register_buffer("order", order, persistent=False)
        self.splits = list(splits)
        self.dim = dim

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """Logits [B]."""
        b = pooled.shape[0]
        emb = pooled.view(b, -1, self.dim).index_select(1, self.order)
        xs = [x.reshape(b, -1) for x in emb.split(self.splits, dim=1)]
        out = [m(x) for m, x in zip(self.towers, xs)]
        return self.dense_arch(dense, torch.cat(out, dim=1))  # type: ignore[no-any-return]


AFFINITY_METHODS = ("hstat", "corr")


def _swap(emb: Tensor, fs: Sequence[int], shift: int) -> Tensor:
    out = emb.clone()
    for f in fs:
        out[:, f] = torch.roll(emb[:, f], shift, dims=0)
    return out


@torch.no_grad()
def feature_affinity(model: nn.Module, batches: Iterable[Batch], method: str = "hstat") -> Tensor:
    """Symmetric [F, F] interaction strength of the features of a trained flat ``model`` (``DLRM``:
    ``.ebc`` + ``.dense_arch``), in ``ebc.feature_names`` order, over ``batches``.

    ``hstat``: the mixed difference of the logit when features f and g are replaced by another
    sample's (the batch rolled by half), E[(L(x_fg) - L(x_f) - L(x_g) + L(x))^2], divided by
    sqrt(S_f S_g), S_f = E[(L(x_f) - L(x))^2] (a Friedman H-statistic): zero when the model is
    additive in f and g; the division keeps features with large main effects from looking
    interactive with every other one.
    ``corr``: mean |correlation| over dims of the per-sample pooled embeddings of f and g.
    """
    if method not in AFFINITY_METHODS:
        raise ConfigError(f"affinity method must be one of {AFFINITY_METHODS}, got {method!r}")
    ebc: Any = model.ebc
    arch: Any = model.dense_arch
    nf, d = len(ebc.feature_names), arch.emb_dim
    total = torch.zeros(nf, nf, dtype=torch.float64)
    main = torch.zeros(nf, dtype=torch.float64)
    n = 0
    for b in batches:
        pooled = ebc(b.sparse).view(-1, nf, d).float()
        bs = pooled.shape[0]
        if method == "corr":
            x = pooled - pooled.mean(0, keepdim=True)
            x = x / x.norm(dim=0, keepdim=True).clamp_min(1e-12)  # [B, F, D]
            total += torch.einsum("bfd,bgd->fgd", x, x).abs().mean(2).double()
            n += 1
            continue
        shift = bs // 2

        def logit(emb: Tensor, dense: Tensor = b.dense, bs: int = bs) -> Tensor:
            return arch(dense, emb.reshape(bs, -1)).double()

        base = logit(pooled)
        single = [logit(_swap(pooled, [f], shift)) for f in range(nf)]
        for f in range(nf):
            main[f] += float((single[f] - base).pow(2).sum())
            for g in range(f + 1, nf):
                mixed = logit(_swap(pooled, [f, g], shift)) - single[f] - single[g] + base
                total[f, g] += float(mixed.pow(2).sum())
        n += bs
    if n == 0:
        raise ConfigError("feature_affinity needs at least one batch")
    a = total / n
    if method == "hstat":
        a = a + a.T
        s = (main / n).sqrt()
        a = a / (s[:, None] * s[None, :]).clamp_min(1e-30)
    else:
        a = (a + a.T) / 2
    return a.fill_diagonal_(0.0)


def table_affinity(feature_aff: Tensor, tables: Sequence[TableConfig]) -> Tensor:
    """Feature affinities summed per pair of tables (features in table order)."""
    owner = torch.tensor([i for i, t in enumerate(tables) for _ in t.features])
    onehot = torch.zeros(len(owner), len(tables), dtype=torch.float64)
    onehot[torch.arange(len(owner)), owner] = 1.0
    out = onehot.T @ feature_aff.double() @ onehot
    return out.fill_diagonal_(0.0)
