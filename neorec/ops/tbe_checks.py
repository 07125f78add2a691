"""Input checks of the TBE ops: offsets, ids, per-id weights, the output gradient.

Each raises a ``NeorecError`` naming the culprit (feature, table, position, sample) before
anything is read or written, so a refused batch leaves the tables as they were. All are a few
vectorized passes over the batch (a loop per feature at most, never per id).

On a GPU those value checks would read the device back to the host (a sync per call), so the
backends meant for GPUs (cuda, triton) check CUDA tensors on the device instead: the shapes and
dtypes on the host as above (no read), the values with ``torch._assert_async`` (``assert_inputs_async``,
and ``check_grad_output`` / ``check_finite_weights`` for CUDA tensors). A failed device assert
is a CUDA error raised at the next synchronizing call; as after any device-side assert, the CUDA
context is then unusable and the work queued after it does not run. It cannot name the position
(that would take the host read it avoids), and torch may show CUDA's generic assert error rather
than the message given here (which CPU tensors do raise). ``device_checks_on_cpu`` makes CPU tensors
take the device path too, so a CPU machine tests it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from neorec.errors import NeorecError

if TYPE_CHECKING:
    from neorec.ops.tbe_types import TBELayout

__all__ = [
    "TBEInputError",
    "TBEIdError",
    "NonFiniteGradientError",
    "check_offsets",
    "check_ids",
    "check_grad_output",
    "check_per_sample_weights",
    "check_finite_weights",
    "check_shapes",
    "assert_inputs_async",
    "bag_of_ids",
    "on_device",
    "device_checks_on_cpu",
]

_FORCED = [False]  # inside device_checks_on_cpu


@contextlib.contextmanager
def device_checks_on_cpu() -> Iterator[None]:
    """Within: CPU tensors are checked as CUDA ones are (``on_device`` is true): device asserts,
    no host read. For tests of the GPU path on a CPU machine; ``_assert_async`` on a CPU tensor
    raises ``RuntimeError`` with the assert's message at once."""
    old, _FORCED[0] = _FORCED[0], True
    try:
        yield
    finally:
        _FORCED[0] = old


def on_device(t: Tensor) -> bool:
    """Whether the value checks of ``t`` stay on its device: a CUDA (non-CPU) tensor, where a
    host read is a sync, or any tensor inside ``device_checks_on_cpu``."""
    return t.device.type != "cpu" or _FORCED[0]


class TBEInputError(NeorecError, ValueError):
    """A TBE op was handed malformed input (offsets, dtypes, shapes); nothing was written."""


class TBEIdError(NeorecError, IndexError):
    """An id lies outside its table; names the feature, table, position and sample."""


class NonFiniteGradientError(NeorecError, FloatingPointError):
    """The gradient reaching the embedding tables holds NaN or inf; nothing was updated."""


def _offsets_shape(offsets: Tensor, num_features: int) -> int:
    """Raise ``TBEInputError`` unless ``offsets`` is a 1-D int tensor of F*B+1 entries; B."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise TBEInputError(
            f"offsets must be a 1-D int32/int64 tensor, got shape {tuple(offsets.shape)} "
            f"dtype {offsets.dtype}"
        )
    if num_features == 0 or offsets.numel() < 1 or (offsets.numel() - 1) % num_features:
        raise TBEInputError(
            f"offsets has {offsets.numel()} entries; expected F*B+1 for F={num_features} features"
        )
    return (offsets.numel() - 1) // num_features


def check_offsets(offsets: Tensor, n_ids: int, num_features: int) -> int:
    """Raise ``TBEInputError`` unless ``offsets`` is F*B+1 non-decreasing positions within the
    ``n_ids`` ids; returns B."""
    b = _offsets_shape(offsets, num_features)
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
    _indices_shape(indices)
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


def _indices_shape(indices: Tensor) -> None:
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TBEInputError(
            f"indices must be a 1-D int32/int64 tensor, got shape {tuple(indices.shape)} "
            f"dtype {indices.dtype}"
        )


def check_shapes(
    layout: TBELayout,
    weights: Tensor,
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
) -> int:
    """The host half of the input checks: shapes and dtypes only (no value is read); B."""
    if weights.numel() != layout.total_elems:
        raise TBEInputError(
            f"weights has {weights.numel()} elements, expected {layout.total_elems}"
        )
    b = _offsets_shape(offsets, layout.num_features)
    _indices_shape(indices)
    check_per_sample_weights(per_sample_weights, indices, weights)
    return b


def bag_of_ids(offsets: Tensor, n_ids: int) -> Tensor:
    """For each of the ``n_ids`` ids, its bag in ``offsets`` (0 .. F*B-1), -1 before
    ``offsets[0]`` and F*B from ``offsets[-1]`` on: int64 [n_ids], with no host read (the output
    size is ``n_ids``, a shape). ``offsets`` must be valid (see ``assert_inputs_async``)."""
    off = offsets.long()
    lengths = torch.cat([off[:1], off[1:] - off[:-1], n_ids - off[-1:]])
    bags = torch.arange(-1, off.numel(), device=off.device)
    return torch.repeat_interleave(bags, lengths, output_size=n_ids)


def assert_inputs_async(
    layout: TBELayout, indices: Tensor, offsets: Tensor, b: int, who: str
) -> Tensor:
    """The value checks of ``check_offsets`` and ``check_ids`` as device asserts (no host read);
    returns ``bag_of_ids(offsets, indices.numel())``. Shapes must have passed ``check_shapes``."""
    n = indices.numel()
    off = offsets.long()
    ok = (off[0] >= 0) & (off[-1] <= n) & (off[1:] >= off[:-1]).all()
    torch._assert_async(
        ok,
        f"{who} TBE backend: offsets are not F*B+1 non-decreasing positions within the {n} "
        "indices (checked on the device: see check_offsets for the first bad bag)",
    )
    bag = bag_of_ids(off, n)
    nbags = layout.num_features * b
    if n and nbags:
        meta = layout.meta(indices.device)
        rows = meta["rows"][meta["feature_table"]][bag.clamp(0, nbags - 1) // b]
        ids = indices.long()
        inside = (bag >= 0) & (bag < nbags)
        torch._assert_async(
            (((ids >= 0) & (ids < rows)) | ~inside).all(),
            f"{who} TBE backend: an id is out of range of its table (checked on the device: "
            "see check_ids for the feature, table and position)",
        )
    return bag


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
    ``on_device``: one device assert instead (no host read; no position named).
    """
    if grad_output.numel() and on_device(grad_output):
        torch._assert_async(
            torch.isfinite(grad_output).all(),
            "the gradient of the pooled embeddings holds NaN or inf (checked on the device): "
            "the tables were not updated (a loss or dense inputs that are not finite?)",
        )
        return
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
    batch's weights are the caller's tensor, and one NaN would poison the rows it touches).
    ``on_device``: one device assert instead."""
    if psw is not None and psw.numel() and on_device(psw):
        torch._assert_async(
            torch.isfinite(psw).all(),
            "a per-id weight is not finite (checked on the device; was the batch changed after "
            "forward?); the tables were not updated",
        )
        return
    if psw is None or bool(torch.isfinite(psw).all()):
        return
    pos = int((~torch.isfinite(psw)).nonzero()[0, 0])
    raise TBEInputError(
        f"per-id weight {float(psw[pos])} at position {pos} is not finite (was the batch changed "
        "after forward?); the tables were not updated"
    )
