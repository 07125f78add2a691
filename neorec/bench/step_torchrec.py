"""The peer of ``neorec bench step --compare torchrec``: the config's DLRM built in TorchRec.

TorchRec's ``DLRM`` (dot interaction) or ``DLRM_DCN`` (low-rank DCNv2 cross layers) over a
``FusedEmbeddingBagCollection``: FBGEMM's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``)
with its optimizer fused into the backward (row-wise Adagrad -> ``EXACT_ROWWISE_ADAGRAD``). The
dense part has the same layer widths and interaction as ours (same flops) and the same dense
optimizer; the step is TorchRec's usual loop: forward, BCE, zero_grad, backward, step (the
forward under bf16 autocast when ours runs a low-precision mode). TorchRec
is imported here only (the ``[bench]`` extra; see ``docs/performance.md`` for its install).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from neorec.builder import dense_optimizer
from neorec.data.batch import Batch
from neorec.errors import ConfigError

__all__ = ["TorchRecPeer", "PEER_NAME", "check_peer_config", "torchrec_dlrm"]

PEER_NAME = "TorchRec 1.x DLRM + FusedEmbeddingBagCollection (FBGEMM CPU TBE)"


def _torchrec() -> Any:
    try:
        import torchrec  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            "bench step --compare torchrec: torchrec is not installed; install it as "
            "docs/performance.md says (the [bench] extra's peer)"
        ) from e
    return torchrec


def _optimizer(kind: str) -> type:
    """TorchRec's optimizer class that FBGEMM fuses as ``kind`` (our row optimizer's name)."""
    from torchrec.optim import RowWiseAdagrad

    by_kind: dict[str, type] = {
        "rowwise_adagrad": RowWiseAdagrad,
        "sgd": torch.optim.SGD,
        "adam": torch.optim.Adam,
    }
    return by_kind[kind]


def check_peer_config(cfg: Any) -> None:
    """One line (``ConfigError``) for a config TorchRec's DLRM cannot express (no torchrec
    import: the parent of the rounds checks before any process starts)."""
    emb, m = cfg.embedding, cfg.model
    if any(t.precision != "fp32" for t in emb.tables):
        raise ConfigError("bench step --compare torchrec: fp32 tables only (embedding.precision)")
    if cfg.towers.enabled:
        raise ConfigError("bench step --compare torchrec: [towers] has no TorchRec DLRM form")
    dims = sorted({t.dim for t in emb.tables})
    if dims != [m.bottom_mlp[-1]]:
        raise ConfigError(
            f"bench step --compare torchrec: TorchRec's DLRM needs every table's dim equal to the "
            f"bottom MLP's last width (dims {dims}, model.bottom_mlp[-1] {m.bottom_mlp[-1]})"
        )
    if m.interaction == "dot" and m.dot_self:
        raise ConfigError("bench step --compare torchrec: model.dot_self has no TorchRec form")
    if m.interaction != "dot" and m.dcn_low_rank <= 0:
        raise ConfigError(
            "bench step --compare torchrec: TorchRec's DLRM_DCN is low-rank; set model.dcn_low_rank"
        )


def torchrec_dlrm(cfg: Any) -> torch.nn.Module:
    """The config's DLRM in TorchRec (CPU), embeddings trained by FBGEMM's fused optimizer."""
    check_peer_config(cfg)
    _torchrec()
    from torchrec.models.dlrm import DLRM, DLRM_DCN
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    emb, m = cfg.embedding, cfg.model
    tables = [
        EmbeddingBagConfig(
            name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features)
        )
        for t in emb.tables
    ]
    kwargs: dict[str, Any] = {"lr": emb.lr}
    if emb.optimizer != "sgd":
        kwargs["eps"] = emb.eps
    torch.manual_seed(cfg.train.seed)
    ebc = FusedEmbeddingBagCollection(
        tables, optimizer_type=_optimizer(emb.optimizer), optimizer_kwargs=kwargs
    )
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=m.num_dense,
        dense_arch_layer_sizes=list(m.bottom_mlp),
        over_arch_layer_sizes=list(m.top_mlp),
    )
    if m.interaction == "dot":
        return DLRM(**common)
    return DLRM_DCN(**common, dcn_num_layers=m.dcn_layers, dcn_low_rank_dim=m.dcn_low_rank)


def to_kjt(batch: Batch, feature_names: list[str]) -> Any:
    """The batch's sparse features as TorchRec's ``KeyedJaggedTensor`` (features in table order)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    sp = batch.sparse.reorder(feature_names)
    return KeyedJaggedTensor(keys=list(sp.keys), values=sp.values, lengths=sp.lengths)


class TorchRecPeer:
    """TorchRec's training step on our batches (each converted once, before any timing)."""

    def __init__(self, cfg: Any, bf16: bool = False) -> None:
        self.model = torchrec_dlrm(cfg)
        self.bf16 = bf16  # forward under torch.autocast(bfloat16): FBGEMM's TBE stays fp32
        self.names = [f for t in cfg.embedding.tables for f in t.features]
        dense = [p for n, p in self.model.named_parameters() if "embedding_bag" not in n]
        self.opt = dense_optimizer(cfg.train, dense)
        self.dense_params = sum(p.numel() for p in dense)
        self._kjt: dict[int, Any] = {}
        self.times: list[float] = []

    def step(self, i: int, batch: Batch, timed: bool) -> None:
        """One training step on ``batch`` (timed after the warm-up)."""
        kjt = self._kjt.get(id(batch))
        if kjt is None:
            kjt = self._kjt[id(batch)] = to_kjt(batch, self.names)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(batch.dense, kjt).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if timed:
            self.times.append(time.perf_counter() - t0)

    def result(self) -> dict:
        """Median and mean ms per step."""
        return {
            "ms": 1000 * statistics.median(self.times),
            "ms_mean": 1000 * statistics.mean(self.times),
            "backend": "fbgemm",
            "table_mb": 0.0,
            "bf16_autocast": self.bf16,
        }
