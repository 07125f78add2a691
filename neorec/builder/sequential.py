"""The sequential path of ``neorec train``: ``[sequential]`` -> SASRec's settings and the model.

The loop (``neorec.train.sequential``) receives these plain settings and the loaded sequences.
What this path does not have yet (the DLRM trainer's checkpoints, resume, ``neorec eval`` /
export of the saved model, several ranks) is listed in docs/data.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neorec.config.sequential import SequentialConfig
from neorec.modules.sasrec import SASRec

__all__ = ["SeqSettings", "seq_settings", "make_model", "LOSSES"]

LOSSES = ("full", "sampled")


@dataclass(frozen=True)
class SeqSettings:
    """What a sequential run is: the model's shape, its training and its loss."""

    dim: int = 64
    max_len: int = 50
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.2
    lr: float = 1e-3
    batch_size: int = 128
    epochs: int = 200
    loss: str = "full"
    negatives: int = 256


def make_model(num_items: int, st: SeqSettings, seed: int) -> SASRec:
    """SASRec of ``st``'s shape, initialized from ``seed``."""
    torch.manual_seed(seed)
    return SASRec(num_items, st.dim, st.max_len, st.blocks, st.heads, st.dropout)


def seq_settings(sc: SequentialConfig) -> SeqSettings:
    """The training settings of a ``[sequential]`` section."""
    return SeqSettings(
        dim=sc.dim, max_len=sc.max_len, blocks=sc.blocks, heads=sc.heads, dropout=sc.dropout,
        lr=sc.lr, batch_size=sc.batch_size, epochs=sc.epochs, loss=sc.loss,
        negatives=sc.negatives,
    )  # fmt: skip
