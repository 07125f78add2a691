"""Input checks of the TBE ops: offsets, ids, per-id weights, the output gradient.

Each raises a ``NeorecError`` naming the culprit (feature, table, position, sample) before
anything is read or written, so a refused batch leaves the tables as they were. All are a few
vectorized passes over the batch (a loop per feature at most, never per id).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from neorec.errors import NeorecError

if TYPE_CHECKING:
    from neorec.ops.tbe import TBELayout

__all__ = [
    "TBEInputError",
    "TBEIdError",
    "NonFiniteGradientError",
    "check_offsets",
    "check_ids",
    "check_grad_output",
    "check_per_sample_weights",
    "check_finite_weights",
]


class TBEInputError(NeorecError, ValueError):
    """A TBE op was handed malformed input (offsets, dtypes, shapes); nothing was written."""


class TBEIdError(NeorecError, IndexError):
    """An id lies outside its table; names the feature, table, position and sample."""


class NonFiniteGradientError(NeorecError, FloatingPointError):
    """The gradient reaching the embedding tables holds NaN or inf; nothing was updated."""


def check_offsets(offsets: Tensor, n_ids: int, num_features: int) -> int:
    """Raise ``TBEInputError`` unless ``offsets`` is F*B+1 non-decreasing positions within the
    ``n_ids`` ids; returns B."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise TBEInputError(
            f"offsets must be a 1-D int32/int64 tensor, got shape {tuple(offsets.shape)} "
            f"dtype {offsets.dtype}"
        )
    if num_features == 0 or offsets.numel() < 1 or (offsets.numel() - 1) % num_features:
        raise TBEInputError(
            f"offsets has {offsets.numel()} entries; expected F*B+1 for F={num_features} features"
        )
    b = (offsets.numel() - 1) // num_features
    first, last = int(offsets[0]), int(offsets[-1])
    if first < 0 or last > n_ids:
        raise TBEInputError(f"offsets span [{first}, {last}) but there are {n_ids} indices")
    down = (offsets[1:] < offsets[:-1]).nonzero()
    if down.numel():
        bag = int(down[0, 0])
        raise TBEInputError(
            f"offsets decrease at bag {bag} (feature {bag // max(b, 1)}, sample {bag % max(b, 1)})"
        )
    return b


def check_ids(layout: TBELayout, indices: Tensor, offsets: Tensor, b: int) -> None:
    """Raise ``TBEIdError`` naming the first id outside its table (per feature: min and max)."""
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TBEInputError(
            f"indices must be a 1-D int32/int64 tensor, got shape {tuple(indices.shape)} "
            f"dtype {indices.dtype}"
        )
    cuts = offsets[:: max(b, 1)].tolist() if b else [int(offsets[0])] * (layout.num_features + 1)
    for f, t in enumerate(layout.feature_table):
        ids = indices[cuts[f] : cuts[f + 1]]
        if not ids.numel():
            continue
        bad = (ids < 0) | (ids >= layout.rows[t])
        if not bool(bad.any()):
            continue
        pos = cuts[f] + int(bad.nonzero()[0, 0])
        bag = int(torch.searchsorted(offsets, torch.tensor(pos), right=True)) - 1
        raise TBEIdError(
            f"feature {f} (table {t}, rows {layout.rows[t]}): id {int(indices[pos])} at position "
            f"{pos} (sample {bag % b}) is out of range [0, {layout.rows[t]})"
        )


def check_grad_shape(grad_output: Tensor, layout: TBELayout, offsets: Tensor) -> None:
    """Raise ``TBEInputError`` unless ``grad_output`` is [B, total_dim] for ``offsets``' B."""
    b = (offsets.numel() - 1) // max(layout.num_features, 1)
    if tuple(grad_output.shape) != (b, layout.total_dim):
        raise TBEInputError(
            f"grad_output shape {tuple(grad_output.shape)}, expected {(b, layout.total_dim)}"
        )


def check_grad_output(grad_output: Tensor, layout: TBELayout) -> None:
    """Raise ``NonFiniteGradientError`` naming the first NaN/inf of the pooled output's gradient.

    One sum is the fast test (NaN or inf in, NaN or inf out); the position is looked up only then.
    """
    if grad_output.numel() == 0 or bool(torch.isfinite(grad_output.sum())):
        return
    finite = torch.isfinite(grad_output)
    if bool(finite.all()):  # the sum overflowed: the gradients are huge but finite
        return
    s, col = (int(x) for x in (~finite).nonzero()[0])
    f = int(torch.searchsorted(torch.tensor(layout.out_offsets), torch.tensor(col), right=True)) - 1
    raise NonFiniteGradientError(
        f"the gradient of the pooled embeddings is {float(grad_output[s, col])} at sample {s}, "
        f"feature {f} (table {layout.feature_table[f]}): the tables were not updated (a loss or "
        "dense inputs that are not finite?)"
    )


def check_per_sample_weights(psw: Tensor | None, indices: Tensor, weights: Tensor) -> None:
    """Raise ``TBEInputError`` unless per-id weights match the ids and the tables' dtype."""
    if psw is None:
        return
    if psw.shape != indices.shape or psw.dtype != weights.dtype:
        raise TBEInputError(
            f"per_sample_weights must be {weights.dtype} shaped like indices "
            f"{tuple(indices.shape)}, got {psw.dtype} {tuple(psw.shape)}"
        )


def check_finite_weights(psw: Tensor | None) -> None:
    """Raise ``TBEInputError`` if per-id weights hold NaN or inf (checked again at backward: the
    batch's weights are the caller's tensor, and one NaN would poison the rows it touches)."""
    if psw is None or bool(torch.isfinite(psw).all()):
        return
    pos = int((~torch.isfinite(psw)).nonzero()[0, 0])
    raise TBEInputError(
        f"per-id weight {float(psw[pos])} at position {pos} is not finite (was the batch changed "
        "after forward?); the tables were not updated"
    )
