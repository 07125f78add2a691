"""Low-precision embedding rows as a TBE backend: :class:`LowpRowsBackend` wraps any fp32
backend (``reference``, ``cpu``, ``cuda``) over tables stored in a ``lowp_format.RowFormat``
(fp16, bf16, fp8 with a per-row scale).

Each batch gets a working set: the distinct rows it reads are decoded to fp32 into a compact table
batch (ids remapped, in the same order), the inner kernel pools them and, in backward, sums the
gradients and applies the optimizer exactly as it would on fp32 tables, and the updated rows are
encoded back (its optimizer state stays fp32, a separate buffer). So the only difference from an
fp32 table is the rounding of the stored rows (``lowp_format``). On the device path the working
set is ``lowp_device``'s, built without a host read.

The formats' names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.lowp_device import device_gather_state, device_working_set, device_write_back
from neorec.ops.lowp_format import (
    DEFAULT_ROUNDING,
    PRECISIONS,
    ROUNDINGS,
    DecodedRows,
    RowFormat,
    bytes_per_row,
    pow2_scale,
    row_format,
    stochastic_round,
    table_key,
)
from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe_checks import TBEInputError, check_ids, check_offsets, on_device
from neorec.ops.tbe_types import Lookup, TBELayout

__all__ = [
    "PRECISIONS",
    "ROUNDINGS",
    "DEFAULT_ROUNDING",
    "RowFormat",
    "row_format",
    "bytes_per_row",
    "LowpRowsBackend",
    "stochastic_round",
    "pow2_scale",
    "DecodedRows",
    "table_key",
]


@dataclass
class _WorkingSet:
    """A batch's distinct rows as a compact fp32 table batch, ids remapped in order."""

    layout: TBELayout
    weights: Tensor
    indices: Tensor
    table_ids: list[Tensor]  # per table, the distinct original ids (sorted)
    row_starts: list[int]  # per table, where its rows start in the compact batch


class LowpRowsBackend:
    """A TBE backend over packed low-precision rows (see the module docstring)."""

    def __init__(
        self,
        inner: Any,
        fmt: RowFormat,
        rounding: str = "nearest",
        seed: int = 0,
        keys: Sequence[tuple[int, int, int, int]] | None = None,
    ) -> None:
        if rounding == "auto":
            rounding = DEFAULT_ROUNDING[fmt.precision]
        if rounding not in ROUNDINGS:
            raise ConfigError(f"embedding rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.inner = inner
        self.fmt = fmt
        self.rounding = rounding
        self.seed = seed
        self._cached: tuple[tuple[Any, ...], tuple[int, ...], Any] | None = None
        self.keys = list(keys) if keys is not None else None
        """Per table of the layout, its place in a global table (see ``RowFormat.encode``)."""
        self.name = f"{inner.name}+{fmt.precision}"

    def working_set(
        self, layout: TBELayout, weights: Tensor, indices: Tensor, offsets: Tensor
    ) -> Any:
        """Decode the distinct rows the batch reads (ids checked first: nothing is read for a
        bad batch): a ``_WorkingSet``, or on the device path a ``lowp_device.DeviceSet``."""
        if weights.numel() != self.fmt.numel(layout) or weights.dtype != self.fmt.dtype:
            raise TBEInputError(
                f"{self.fmt.precision} weights must be {self.fmt.dtype} with "
                f"{self.fmt.numel(layout)} elements, got {weights.dtype} with {weights.numel()}"
            )
        # The same tensors (held, so no new tensor can reuse their memory), unchanged since.
        key = (layout, weights, indices, offsets)
        versions = (weights._version, indices._version, offsets._version)
        c = self._cached
        if c is not None and all(x is y for x, y in zip(c[0], key)) and c[1] == versions:
            return c[2]  # this batch's forward decoded the same, unchanged rows
        if on_device(indices):  # every size a shape, device-side checks: no host read
            dws = device_working_set(self.fmt, layout, weights, indices, offsets, self.name)
            self._cached = (key, versions, dws)
            return dws
        b = check_offsets(offsets, indices.numel(), layout.num_features)
        check_ids(layout, indices, offsets, b)
        dev = indices.device
        idx = indices.to(torch.int64)
        # One sort of global row numbers (table start + id): distinct rows of every table, in
        # table order then id order, and each id's place among them.
        counts = offsets[b :: max(b, 1)] - offsets[: -1 : max(b, 1)] if b else None
        ft, ro = layout.meta(dev)["feature_table"], layout.meta(dev)["row_offsets"]
        if counts is None or idx.numel() == 0:
            tab = idx.new_zeros(0)
        else:
            tab = torch.repeat_interleave(ft, counts.to(torch.int64))
        uniq, inv = torch.unique(ro[tab] + idx, sorted=True, return_inverse=True)
        bounds = torch.searchsorted(uniq, ro).tolist()  # first distinct row of each table
        table_ids, blocks = [], []
        for t in range(layout.num_tables):
            ids = uniq[bounds[t] : bounds[t + 1]] - layout.row_offsets[t]
            table_ids.append(ids)
            blocks.append(self.fmt.decode(weights, layout, t, ids).reshape(-1))
        new_idx = inv - torch.tensor(bounds[:-1], dtype=torch.int64, device=dev)[tab]
        rows = tuple(bounds[t + 1] - bounds[t] for t in range(layout.num_tables))
        compact = TBELayout(rows=rows, dims=layout.dims, feature_table=layout.feature_table)
        flat = torch.cat(blocks) if blocks else weights.new_zeros(0, dtype=torch.float32)
        ws = _WorkingSet(compact, flat.contiguous(), new_idx, table_ids, bounds[:-1])
        self._cached = (key, versions, ws)
        return ws

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim] from the decoded rows."""
        ws = self.working_set(layout, weights, lookup.indices, lookup.offsets)
        out: Tensor = self.inner.forward(ws.layout, ws.weights, replace(lookup, indices=ws.indices))
        return out

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        lookup: Lookup,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """The inner fused update on the decoded rows and their fp32 state; rows encoded back."""
        ws = self.working_set(layout, weights, lookup.indices, lookup.offsets)
        self._cached = None  # its rows are about to change
        compact = replace(lookup, indices=ws.indices)  # ids remapped into the working set
        if not isinstance(ws, _WorkingSet):  # the device path (``lowp_device``)
            dst = {k: device_gather_state(layout, k, s, ws) for k, s in state.items()}
            self.inner.backward_update(ws.layout, ws.weights, dst, compact, grad_output, opt, step)
            device_write_back(
                self.fmt, layout, weights, state, ws, dst, self.rounding, step, self.seed,
                self.keys,
            )  # fmt: skip
            return
        st = {k: _gather(layout, k, s, ws) for k, s in state.items()}
        self.inner.backward_update(ws.layout, ws.weights, st, compact, grad_output, opt, step)
        for t, ids in enumerate(ws.table_ids):
            if not ids.numel():
                continue
            self.fmt.encode(
                weights, layout, t, ids, ws.layout.table(ws.weights, t), self.rounding, step,
                self.seed, self.keys[t] if self.keys is not None else None,
            )  # fmt: skip
            for k, s in state.items():
                _scatter(layout, k, s, ws, t, st[k])


def _gather(layout: TBELayout, key: str, s: Tensor, ws: _WorkingSet) -> Tensor:
    parts = []
    for t, ids in enumerate(ws.table_ids):
        if key == "momentum1":
            parts.append(s[layout.row_offsets[t] + ids])
        else:
            parts.append(layout.table(s, t)[ids].reshape(-1))
    return torch.cat(parts).contiguous() if parts else s.new_zeros(0)


def _scatter(layout: TBELayout, key: str, s: Tensor, ws: _WorkingSet, t: int, st: Tensor) -> None:
    ids = ws.table_ids[t]
    if key == "momentum1":
        lo = ws.row_starts[t]
        s[layout.row_offsets[t] + ids] = st[lo : lo + ids.numel()]
    else:
        layout.table(s, t)[ids] = ws.layout.table(st, t)
