"""DLRM: bottom MLP, embedding bags, an interaction (dot or DCNv2 cross), top MLP."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from neorec.config import ModelConfig, TableConfig
from neorec.errors import ConfigError, DataError
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.exfm_heads import StudentAdapter
from neorec.sparse import SparseFeatures

__all__ = [
    "MLP",
    "DotInteraction",
    "CrossNet",
    "DenseArch",
    "StudentAdapter",
    "attach_distill",
    "emit_hidden",
    "serving_state_dict",
    "DLRM",
    "check_dense_input",
]


class MLP(nn.Sequential):
    """Linear + ReLU layers; the last layer has no activation when ``last_activation`` is False."""

    def __init__(self, in_dim: int, widths: Sequence[int], last_activation: bool = True) -> None:
        layers: list[nn.Module] = []
        for i, w in enumerate(widths):
            lin = nn.Linear(in_dim, w)
            # Init of the reference DLRM (facebookresearch/dlrm): Glorot-normal weights.
            nn.init.normal_(lin.weight, 0.0, math.sqrt(2.0 / (in_dim + w)))
            nn.init.normal_(lin.bias, 0.0, math.sqrt(1.0 / w))
            layers.append(lin)
            if i < len(widths) - 1 or last_activation:
                layers.append(nn.ReLU())
            in_dim = w
        super().__init__(*layers)
        self.out_dim = in_dim


class DotInteraction(nn.Module):
    """DLRM interaction: dense vector + pairwise dot products of [dense, embeddings]."""

    rows: Tensor
    cols: Tensor

    def __init__(self, num_features: int, dim: int, self_interaction: bool = False) -> None:
        super().__init__()
        n = num_features + 1
        offset = 0 if self_interaction else -1
        rows, cols = torch.tril_indices(n, n, offset=offset)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.out_dim = dim + rows.numel()

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """``dense`` [B, D], ``pooled`` [B, F, D] -> [B, D + pairs]."""
        t = torch.cat([dense.unsqueeze(1), pooled], dim=1)  # [B, F+1, D]
        z = self.gram(t)  # [B, F+1, F+1]
        return torch.cat([dense, z[:, self.rows, self.cols]], dim=1)

    def gram(self, t: Tensor) -> Tensor:
        """``t @ t^T`` per sample (the one GEMM; a low-precision form overrides it)."""
        return torch.bmm(t, t.transpose(1, 2))


class CrossNet(nn.Module):
    """DCNv2 cross network (as in MLPerf DLRMv2): x_{l+1} = x0 * (W_l x_l + b_l) + x_l."""

    def __init__(self, in_dim: int, layers: int, low_rank: int = 0) -> None:
        super().__init__()
        self.low_rank = low_rank
        if low_rank > 0:
            self.v = nn.ModuleList(nn.Linear(in_dim, low_rank, bias=False) for _ in range(layers))
            self.u = nn.ModuleList(nn.Linear(low_rank, in_dim) for _ in range(layers))
        else:
            self.w = nn.ModuleList(nn.Linear(in_dim, in_dim) for _ in range(layers))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.num_layers = layers
        self.out_dim = in_dim

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """``dense`` [B, D0], ``pooled`` [B, F, D] -> [B, D0 + F*D]."""
        x0 = torch.cat([dense, pooled.flatten(1)], dim=1)
        x = x0
        for i in range(self.num_layers):
            xw = self.u[i](self.v[i](x)) if self.low_rank > 0 else self.w[i](x)
            x = x0 * xw + x
        return x


class DenseArch(nn.Module):
    """Everything but the embeddings: bottom MLP, interaction, top MLP (data-parallel part).

    ExFM students (``[distill]``, ``attach_distill``) also hold ``aux_head`` (a second output
    head on the top MLP's penultimate layer) and ``adapter`` (``StudentAdapter``); the forward
    never uses them. Inside ``emit_hidden`` the forward returns ``[B, 1 + H]``: the serving logit
    (bitwise the plain forward's) then the penultimate activations, one batch-major tensor, so
    dense blocks and DDP carry it like the logits.
    """

    emit_hidden: bool = False
    aux_head: nn.Module | None
    adapter: nn.Module | None

    def __init__(self, model: ModelConfig, num_features: int, emb_dim: int) -> None:
        super().__init__()
        self.aux_head = None
        self.adapter = None
        self.bottom = MLP(model.num_dense, model.bottom_mlp)
        self.num_features = num_features
        self.emb_dim = emb_dim
        self.interaction: nn.Module
        if model.interaction == "dot":
            self.interaction = DotInteraction(num_features, emb_dim, model.dot_self)
        else:
            in_dim = self.bottom.out_dim + num_features * emb_dim
            self.interaction = CrossNet(in_dim, model.dcn_layers, model.dcn_low_rank)
        self.top = MLP(self.interaction.out_dim, model.top_mlp, last_activation=False)

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        """``dense`` [B, num_dense], ``pooled`` [B, F*D] -> logits [B]."""
        x = self.bottom(dense)  # [B, D]
        emb = pooled.view(pooled.shape[0], self.num_features, self.emb_dim)  # [B, F, D]
        z = self.interaction(x, emb.to(x.dtype))
        if not self.emit_hidden:
            return self.top(z).squeeze(1)
        *body, last = list(self.top)
        h = z
        for layer in body:
            h = layer(h)
        logit = last(h)
        return torch.cat([logit, h.to(logit.dtype)], dim=1)


def attach_distill(
    arch: DenseArch, aux_head: bool, adapter_size: int = 0, seed: int = 0
) -> DenseArch:
    """Give ``arch`` an aux head (``Linear(H, 1)`` on the top MLP's penultimate layer, H its
    width) and, ``adapter_size > 0``, a ``StudentAdapter``. They take no random numbers of
    torch's global generator (their own, from ``seed``), so the serving part's init and
    everything drawn after the model is built are those of the model without them."""
    if aux_head:
        last = list(arch.top)[-1]
        assert isinstance(last, nn.Linear)
        h = last.in_features
        g = torch.Generator().manual_seed(seed + 1)
        head = nn.Linear(h, 1)
        with torch.no_grad():  # the MLP's init (Glorot normal), from the head's own generator
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * math.sqrt(2 / (h + 1)))
            head.bias.zero_()
        arch.aux_head = head.to(last.weight.device)
    if adapter_size > 0:
        first = arch.bottom[0]
        assert isinstance(first, nn.Linear)
        arch.adapter = StudentAdapter(adapter_size, first.in_features, seed + 2).to(
            next(arch.parameters()).device
        )
    return arch


@contextmanager
def emit_hidden(arch: DenseArch) -> Iterator[DenseArch]:
    """Inside: ``arch``'s forward returns ``[B, 1 + H]`` (serving logit, penultimate layer)."""
    arch.emit_hidden = True
    try:
        yield arch
    finally:
        arch.emit_hidden = False


def serving_state_dict(arch: nn.Module) -> dict[str, Tensor]:
    """``arch``'s state without the ExFM student parts (``aux_head.*``, ``adapter.*``): what a
    plain ``DenseArch`` of the same config loads (e.g. an export of the serving program)."""
    return {
        k: v for k, v in arch.state_dict().items() if not k.startswith(("aux_head.", "adapter."))
    }


class DLRM(nn.Module):
    """The unsharded model: the specification every distributed form must equal.

    ``ebc``: its embedding collection (any kind: in memory, low precision, behind a row cache,
    dynamic); the dense arch is drawn from torch's global generator right after
    ``torch.manual_seed(seed)``, whatever the collection drew, and placed on ``device``.
    """

    ebc: EmbeddingCollection
    comm_stats = None
    """No collectives (a distributed model's ``CommStats``)."""

    def __init__(
        self,
        model: ModelConfig,
        ebc: EmbeddingCollection,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        dims = {t.dim for t in ebc.tables}
        if len(dims) != 1:
            raise ConfigError(f"DLRM needs one embedding dim for all tables, got {sorted(dims)}")
        self.ebc = ebc
        torch.manual_seed(seed)
        self.dense_arch = DenseArch(model, len(ebc.feature_names), dims.pop()).to(device)

    def forward(self, dense: Tensor, sparse: SparseFeatures) -> Tensor:
        """Logits [B] for a batch."""
        check_dense_input(dense, sparse, self.dense_arch)
        return self.dense_arch(dense, self.ebc(sparse))

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters trained by the dense (torch.optim) optimizer."""
        return self.dense_arch.parameters()

    @property
    def dense_part(self) -> nn.Module:
        """What checkpoints and saved models store of the dense side: the dense arch."""
        return self.dense_arch

    @property
    def all_tables(self) -> list[TableConfig]:
        """Every table of the model (its collection's)."""
        return list(self.ebc.tables)

    def prefetch(self, sparse: SparseFeatures) -> None:
        """Pipeline stage for the next batch, called before this step runs: a row cache over
        DRAM/SSD (``neorec.storage``) reads its missing rows in the background once this step's
        forward has made its own rows resident. No-op for in-memory tables."""
        self.ebc.prefetch(sparse, defer=True)

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Pipeline stage of a later batch from ``host``, its copy before the host-to-device
        copy: the collection checks it there (then its forward reads nothing back)."""
        self.ebc.stage_input_dist(sparse, host)


def check_dense_input(dense: object, sparse: SparseFeatures, arch: DenseArch) -> None:
    """Raise ``DataError`` unless ``dense`` is [B, num_dense] of the bottom MLP's dtype and B
    is the sparse batch's size (checked before anything runs, so nothing is updated)."""
    first = arch.bottom[0]
    assert isinstance(first, nn.Linear)
    want = first.weight.dtype
    if not isinstance(dense, Tensor) or dense.dim() != 2:
        shape = tuple(dense.shape) if isinstance(dense, Tensor) else type(dense).__name__
        raise DataError(f"dense features must be a 2-D tensor [batch, num_dense], got {shape}")
    b = sparse.batch_size if isinstance(sparse, SparseFeatures) else dense.shape[0]
    if dense.dtype != want or tuple(dense.shape) != (b, first.in_features):
        raise DataError(
            f"dense features must be {want} [{b}, {first.in_features}] (batch of the sparse "
            f"features x model.num_dense), got {dense.dtype} {list(dense.shape)}"
        )
