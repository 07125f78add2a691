"""Low-precision rows on the device path (GPU backends): the working set without a host read.

``LowpRowsBackend`` decodes a batch's distinct rows into a compact fp32 table batch for its inner
kernel. On the host path that batch holds exactly each table's distinct rows (``torch.unique``
and a read of the per-table counts). On the device path (CUDA tensors, or inside
``device_checks_on_cpu``) every size is a shape instead: the tables of one dim share one compact
table of ``min(n, their rows)`` rows (n: the batch's id count), their distinct rows first (in
global row order), the rest unused; a stable sort remaps the ids, the checks are device asserts
(``assert_inputs_async``) and the updated rows, scales and states go back with masked writes
(``padded_rows.put_valid``). Each distinct row meets the same occurrences in the same order as on the host
path, and is rounded with the same random bits, so the stored bits are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from neorec.ops.lowp_format import (
    FP8_MAX,
    RowFormat,
    _bits_stochastic,
    _hash32,
    _hash32_k,
    _i32,
    _step_key,
    pow2_scale,
)
from neorec.ops.padded_rows import put_valid, segments
from neorec.ops.tbe_checks import _indices_shape, _offsets_shape, assert_inputs_async
from neorec.ops.tbe_types import TBELayout

__all__ = ["DeviceSet", "device_working_set", "device_gather_state", "device_write_back"]


@dataclass
class _Group:
    """One compact table: the distinct rows of the tables of one dim, then unused rows."""

    keys: Tensor  # [m] global row of each compact row (valid ones; any row for the rest)
    tabs: Tensor  # [m] its table
    valid: Tensor  # [m] bool: a distinct row of the batch
    eidx: Tensor  # [m, dim] its elements' positions in the layout's element order
    dim: int


@dataclass
class DeviceSet:
    """A batch's working set on the device path (see the module docstring)."""

    layout: TBELayout  # compact: one table per dim
    weights: Tensor  # fp32, ``layout``'s element order
    indices: Tensor  # the batch's ids remapped into ``layout``
    groups: list[_Group]


def _decode(fmt: RowFormat, layout: TBELayout, weights: Tensor, g: _Group) -> Tensor:
    if fmt.precision == "fp8":
        codes = weights[: layout.total_elems].view(torch.float8_e4m3fn)
        return codes[g.eidx].float() * fmt.scales(weights, layout)[g.keys].unsqueeze(1)
    return weights[g.eidx].float()


def device_working_set(
    fmt: RowFormat, layout: TBELayout, weights: Tensor, indices: Tensor, offsets: Tensor, who: str
) -> DeviceSet:
    """Decode the distinct rows a batch reads, with device-side checks and no host read."""
    nf, n, dev = layout.num_features, indices.numel(), indices.device
    b = _offsets_shape(offsets, nf)
    _indices_shape(indices)
    bag = assert_inputs_async(layout, indices, offsets, b, who)
    meta, total, nbags = layout.meta(dev), layout.total_rows, nf * b
    inside = (bag >= 0) & (bag < nbags)
    t = meta["feature_table"][bag.clamp(0, max(nbags - 1, 0)) // max(b, 1)]
    key = torch.where(inside, meta["row_offsets"][t] + indices.long(), total)
    sorted_key, perm = torch.sort(key, stable=True)
    _, head, _ = segments(sorted_key, total)
    key_c = sorted_key.clamp(0, max(total - 1, 0))
    tab = torch.bucketize(key_c, meta["row_offsets"][1:], right=True)
    dims = sorted({layout.dims[t] for t in layout.feature_table})
    gid = [dims.index(d) if d in dims else -1 for d in layout.dims]
    grp = torch.tensor(gid, dtype=torch.int64, device=dev)[tab]
    new_sorted = torch.zeros(n, dtype=torch.int64, device=dev)
    groups, rows, blocks = [], [], []
    for g, d in enumerate(dims):
        hg = head & (grp == g)
        # each occurrence's row among the group's distinct rows (a run shares its head's)
        new_sorted = torch.where(grp == g, (torch.cumsum(hg, 0) - 1).clamp(min=0), new_sorted)
        m = min(n, sum(r for r, i in zip(layout.rows, gid) if i == g))
        order = torch.argsort((~hg).to(torch.uint8), stable=True)[:m]
        keys, tabs = key_c[order], tab[order]
        local = keys - meta["row_offsets"][tabs]
        eidx = (meta["elem_offsets"][tabs] + local * d).unsqueeze(1) + torch.arange(d, device=dev)
        grp_g = _Group(keys, tabs, torch.arange(m, device=dev) < hg.sum(), eidx, d)
        groups.append(grp_g)
        rows.append(m)
        blocks.append(_decode(fmt, layout, weights, grp_g).reshape(-1))
    new_idx = torch.empty_like(new_sorted).index_put_((perm,), new_sorted)
    compact = TBELayout(
        rows=tuple(rows),
        dims=tuple(dims),
        feature_table=tuple(gid[t] for t in layout.feature_table),
    )
    flat = torch.cat(blocks) if blocks else torch.zeros(0, device=dev)
    return DeviceSet(compact, flat.contiguous(), new_idx, groups)


def device_gather_state(layout: TBELayout, key: str, s: Tensor, ws: DeviceSet) -> Tensor:
    """The compact working set's rows of optimizer state ``key`` (fp32, per row or element)."""
    parts = [(s[g.keys] if key == "momentum1" else s[g.eidx].reshape(-1)) for g in ws.groups]
    return torch.cat(parts).contiguous() if parts else s.new_zeros(0)


def _group_bits(
    layout: TBELayout,
    g: _Group,
    step: int,
    seed: int,
    keys: Sequence[tuple[int, int, int, int]] | None,
) -> Tensor:
    """``lowp_format._element_bits`` of each compact row, with its own table's key and seed."""
    dev = g.keys.device
    kk, row0, chs = [], [], []
    for t in range(layout.num_tables):
        tkey, r0, col0, _ = keys[t] if keys is not None else (t, 0, 0, layout.dims[t])
        hseed = (seed * 1_000_003 + tkey) & 0xFFFFFFFF
        kk.append(_step_key(step, hseed))
        row0.append(r0)
        if layout.dims[t] == g.dim:
            cols = torch.arange(col0, col0 + g.dim, device=dev)
            chs.append(_hash32(cols, 0, hseed ^ 0x5BD1E995))
        else:
            chs.append(torch.zeros(g.dim, dtype=torch.int32, device=dev))
    local = g.keys - torch.tensor(layout.row_offsets[:-1], device=dev)[g.tabs]
    rows = torch.tensor(row0, dtype=torch.int64, device=dev)[g.tabs] + local
    rh = _hash32_k(rows, torch.tensor(kk, dtype=torch.int32, device=dev)[g.tabs]).unsqueeze(1)
    x = (rh ^ torch.stack(chs)[g.tabs]) * _i32(0x9E3779B1)
    return x ^ ((x >> 15) & 0x1FFFF)


def device_write_back(
    fmt: RowFormat,
    layout: TBELayout,
    weights: Tensor,
    state: dict[str, Tensor],
    ws: DeviceSet,
    st: dict[str, Tensor],
    rounding: str,
    step: int,
    seed: int,
    keys: Sequence[tuple[int, int, int, int]] | None,
) -> None:
    """Encode the updated compact rows back (as ``RowFormat.encode``) and scatter their state,
    writing only the valid rows (masked writes: no host read)."""
    codes = weights[: layout.total_elems]
    for gi, g in enumerate(ws.groups):
        if not g.keys.numel():  # (a shape: an empty batch)
            continue
        rows = ws.layout.table(ws.weights, gi).float()
        valid2 = g.valid.unsqueeze(1).expand_as(g.eidx)
        if fmt.precision == "fp8":
            sc = pow2_scale(rows)
            rows = (rows / sc.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX)
            put_valid(fmt.scales(weights, layout), g.keys, sc, g.valid)
        if rounding == "stochastic" and fmt.precision != "fp32":
            q = _bits_stochastic(rows, fmt.element_dtype, _group_bits(layout, g, step, seed, keys))
        else:
            q = rows.to(fmt.element_dtype)
        put_valid(codes, g.eidx, q.view(torch.uint8) if fmt.precision == "fp8" else q, valid2)
        lo = ws.layout.row_offsets[gi]
        for k, s in state.items():
            if k == "momentum1":
                put_valid(s, g.keys, st[k][lo : lo + g.keys.numel()], g.valid)
            else:
                put_valid(s, g.eidx, ws.layout.table(st[k], gi), valid2)
