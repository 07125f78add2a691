"""Config section ``[sequential]``: a sequential recommender (SASRec) on leave-one-out sequences.

When ``enabled`` is true, ``neorec train`` trains this model on the sequences at ``path``
(``neorec data movielens --sequential``) instead of a DLRM, and evaluates it against the full item
corpus (docs/data.md, "Sequential MovieLens"); the DLRM sections are then not used. When false the
other fields are not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.config.checks import check_fields, rule
from neorec.errors import ConfigError

__all__ = ["SequentialConfig"]


@dataclass(kw_only=True)
class SequentialConfig:
    """SASRec: its data, its shape, its training and its evaluation."""

    enabled: bool = False
    """Train the sequential model of this section (not a DLRM)."""
    path: str = ""
    """The folder ``neorec data movielens --sequential`` wrote."""
    model: str = field(default="sasrec", metadata=rule(choices=("sasrec",)))
    """The model: ``sasrec`` (Kang & McAuley 2018)."""
    dim: int = field(default=64, metadata=rule(1, 4096))
    """Item and position embedding dim (and the blocks' width)."""
    max_len: int = field(default=50, metadata=rule(1, 4096))
    """The most recent interactions a sequence keeps."""
    blocks: int = field(default=2, metadata=rule(1, 64))
    """Causal self-attention blocks."""
    heads: int = field(default=1, metadata=rule(1, 64))
    """Attention heads (must divide ``dim``)."""
    dropout: float = field(default=0.2, metadata=rule(0, 0.99))
    """Dropout on the embeddings, the attention weights and the feed-forward layers."""
    lr: float = field(default=1e-3, metadata=rule(gt=0, hi=10))
    """Adam's learning rate (every parameter, the item table included)."""
    batch_size: int = field(default=128, metadata=rule(1, 1 << 20))
    """Users per step."""
    epochs: int = field(default=40, metadata=rule(1, 100_000))
    """Passes over the users' train sequences."""
    loss: str = field(default="full", metadata=rule(choices=("full", "sampled")))
    """``full``: softmax over every item; ``sampled``: ``negatives`` items per step from the
    train popularity, logQ-corrected."""
    negatives: int = field(default=256, metadata=rule(1, 1 << 20))
    """Sampled softmax: negatives per step (shared by the batch)."""
    exclude_seen: bool = False
    """Evaluation: remove the user's history from the candidates (the target stays)."""

    def __post_init__(self) -> None:
        check_fields(self, "sequential")
        if self.dim % self.heads:
            raise ConfigError(
                f"sequential.heads {self.heads} must divide sequential.dim {self.dim}"
            )
        if self.enabled and not self.path:
            raise ConfigError(
                "sequential.enabled needs sequential.path: the folder `neorec data movielens "
                "--sequential --input DIR --output OUT` wrote"
            )
