"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018): the reference.

An item embedding (``nn.Embedding``, row 0 = padding) scaled by sqrt(d), plus learned positions,
dropout, then ``blocks`` causal self-attention blocks (pre-LayerNorm queries, residual; a
point-wise two-layer ReLU feed-forward, residual), padding positions zeroed after each block, a
final LayerNorm. Position t's output scores the next item by a dot product with the *same* item
embedding (the output layer is shared). Sequences are left-padded: the last column is the most
recent item. The fused non-pooled sequence collection replaces ``nn.Embedding`` later; this
module stays its specification.

The losses over the item table (``full_softmax_loss``, ``sampled_softmax_loss``) are the
retrieval objectives the issue names; Kang's original binary loss with one negative is not here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SASRec", "full_softmax_loss", "sampled_softmax_loss"]


class _Block(nn.Module):
    """One causal self-attention block (Kang's: LN(x) as queries, x as keys and values)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(dim, eps=1e-8)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln_ffn = nn.LayerNorm(dim, eps=1e-8)
        self.ffn = nn.Sequential(
            nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim),
            nn.Dropout(dropout),
        )  # fmt: skip

    def forward(self, x: Tensor, causal: Tensor, keep: Tensor) -> Tensor:
        """``x [B, L, D]``, ``causal [L, L]`` (True = masked), ``keep [B, L, 1]`` -> ``[B, L, D]``."""
        q = self.ln_attn(x)
        a, _ = self.attn(q, x, x, attn_mask=causal, need_weights=False)
        x = q + a
        x = self.ln_ffn(x)
        x = x + self.ffn(x)
        return x * keep


class SASRec(nn.Module):
    """Item ids ``[B, L]`` (0 = padding, left-padded) -> hidden states ``[B, L, D]``."""

    def __init__(
        self, num_items: int, dim: int, max_len: int, blocks: int = 2, heads: int = 1,
        dropout: float = 0.2,
    ) -> None:  # fmt: skip
        super().__init__()
        if num_items < 1 or dim < 1 or max_len < 1 or blocks < 1 or heads < 1 or dim % heads:
            raise ValueError(f"SASRec({num_items=}, {dim=}, {max_len=}, {blocks=}, {heads=})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"SASRec dropout {dropout} outside [0, 1)")
        self.num_items, self.dim, self.max_len = num_items, dim, max_len
        self.items = nn.Embedding(num_items + 1, dim, padding_idx=0)
        self.positions = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(dim, heads, dropout) for _ in range(blocks))
        self.ln_out = nn.LayerNorm(dim, eps=1e-8)
        causal = torch.triu(torch.ones(max_len, max_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)
        nn.init.xavier_normal_(self.items.weight[1:])
        nn.init.xavier_normal_(self.positions.weight)

    def forward(self, seq: Tensor) -> Tensor:
        """Hidden state of every position: ``[B, L, D]`` (``L <= max_len``)."""
        b, length = seq.shape
        if length > self.max_len:
            raise ValueError(f"sequences of length {length} > max_len {self.max_len}")
        keep = (seq != 0).unsqueeze(-1).to(self.items.weight.dtype)  # [B, L, 1]
        x = self.items(seq) * math.sqrt(self.dim)
        x = x + self.positions.weight[self.max_len - length :]  # the last column = last position
        x = self.drop(x) * keep
        causal = self.get_buffer("causal")[:length, :length]
        for blk in self.blocks:
            x = blk(x, causal, keep)
        out: Tensor = self.ln_out(x)
        return out

    def last(self, seq: Tensor) -> Tensor:
        """The user's state after the most recent item (the last column): ``[B, D]``."""
        return self.forward(seq)[:, -1]

    def scores(self, seq: Tensor) -> Tensor:
        """Scores of every item index for the next item: ``[B, V + 1]`` (column 0 = padding)."""
        return self.last(seq) @ self.items.weight.T


def full_softmax_loss(h: Tensor, targets: Tensor, table: Tensor) -> Tensor:
    """Cross-entropy of each target (item index >= 1) over all V items: ``h [N, D]``,
    ``targets [N]``, ``table [V + 1, D]`` (row 0 padding, never a class)."""
    logits = h @ table[1:].T  # [N, V]
    return F.cross_entropy(logits, targets - 1)


def sampled_softmax_loss(
    h: Tensor, targets: Tensor, table: Tensor, negatives: Tensor, log_q: Tensor
) -> Tensor:
    """Sampled softmax with the logQ correction: each row's target against ``negatives [S]``
    (item indices drawn with replacement from q, shared by the batch; ``log_q [V + 1]`` holds
    log q). A negative's logit has ``log(S q(item))`` subtracted, so the sum of the negatives'
    exponentials estimates the full softmax's normalizer (its expectation is exactly the sum over
    all items); the target's own logit is not corrected; a negative equal to the row's target is
    removed (accidental hit)."""
    s = len(negatives)
    pos = (h * table[targets]).sum(-1, keepdim=True)  # [N, 1]
    neg = h @ table[negatives].T - (log_q[negatives] + math.log(s))  # [N, S]
    neg = neg.masked_fill(negatives.unsqueeze(0) == targets.unsqueeze(1), float("-inf"))
    logits = torch.cat([pos, neg], 1)
    return F.cross_entropy(logits, torch.zeros(len(h), dtype=torch.long, device=h.device))
