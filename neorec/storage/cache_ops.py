"""The row cache's per-batch bookkeeping and record copies, compiled or in torch.

``CachedEmbeddingBagCollection`` calls these once per table per batch. The compiled versions
(``neorec/ops/csrc/row_cache.c``, built into the cpu TBE kernel library) do each in one pass over
the batch or the cache; the torch versions take the same decisions (same misses, victims, slots)
and run where there is no C compiler, or with ``system.native = false`` (tests compare the two).

Measured (``neorec bench cache``, 8 tables x 100k cached rows, ~81k misses and evictions per batch):
the torch bookkeeping cost ~200 ms per batch, mostly many small index operations and sorts.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from neorec.ops import settings

__all__ = [
    "native",
    "classify",
    "select_victims",
    "evict_commit",
    "fill_commit",
    "match_sorted",
    "remap",
    "invalidate_sorted",
    "copy_rows",
    "LFU_SHIFT",
]

LFU_SHIFT = 24
"""LFU keys: use counts in the bits above, the last use's tick in the 24 bits below."""
_TICK_MASK = (1 << LFU_SHIFT) - 1
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def native() -> Any:
    """The compiled library, or None (no C compiler, or ``neorec.ops.settings.NATIVE`` off)."""
    if not settings.NATIVE:
        return None
    with _LOCK:
        if "lib" not in _STATE:
            try:
                from neorec.ops.cpu import load_kernel

                _STATE["lib"] = load_kernel()
            except RuntimeError:  # no compiler: the torch versions below
                _STATE["lib"] = None
        return _STATE["lib"]


def _p(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def classify(
    ids: Tensor,
    slot_of: Tensor,
    mark: Tensor | None = None,
    key: Tensor | None = None,
    tick: int = 0,
    lfu: bool = False,
) -> tuple[Tensor, Tensor, int, bool]:
    """Sorted distinct non-resident ``ids``; with ``mark`` also the hits.

    With ``mark`` ([capacity] bool, all False): sets ``mark`` at every distinct resident slot,
    returns those slots (any order) and the count of lookups that hit, and -- when hits + misses
    fit the capacity -- touches the hit slots' ``key`` for the policy. Returns
    ``(missing, hit_slots, lookup_hits, fits)``; with ``fits`` False nothing but ``mark`` changed.
    """
    ids = ids.contiguous()
    lib = native()
    if lib is not None:
        n = ids.numel()
        miss = torch.empty(n, dtype=torch.int64)
        hits = torch.empty(n if mark is not None else 0, dtype=torch.int64)
        tmp = torch.empty(n, dtype=torch.int64)
        counts = torch.zeros(2, dtype=torch.int64)
        cap = mark.numel() if mark is not None else 0
        r = lib.rc_classify(
            ids.data_ptr(), n, slot_of.data_ptr(), cap, _p(mark), _p(key), tick, int(lfu),
            miss.data_ptr(), hits.data_ptr(), tmp.data_ptr(), counts.data_ptr(),
        )  # fmt: skip
        n_hit, lookup_hits = int(counts[0]), int(counts[1])
        if r < 0:
            return miss[:0], hits[:n_hit], lookup_hits, False
        return miss[:r], hits[:n_hit], lookup_hits, True
    s = slot_of[ids]
    hit = s >= 0
    missing = torch.unique(ids[~hit])
    if mark is None:
        return missing, missing[:0], 0, True
    hit_slots = s[hit].to(torch.int64)
    mark[hit_slots] = True
    distinct = torch.nonzero(mark).flatten()
    lookup_hits = int(hit.sum())
    if distinct.numel() + missing.numel() > mark.numel():
        return missing, distinct, lookup_hits, False
    assert key is not None
    if lfu:
        key.index_add_(0, hit_slots, torch.full_like(hit_slots, 1 << LFU_SHIFT))
        key[distinct] = (key[distinct] >> LFU_SHIFT << LFU_SHIFT) | (tick & _TICK_MASK)
    else:
        key[hit_slots] = tick
    return missing, distinct, lookup_hits, True


def select_victims(
    key: Tensor, pins: Tensor, id_of: Tensor, keep: Tensor, need: int, chunk: int
) -> tuple[Tensor, int]:
    """The ``min(max(need, chunk), evictable)`` evictable slots (not ``keep``, unpinned, resident)
    with the smallest (key, slot), in slot order; ``(victims, evictable)``. Fewer than ``need``
    evictable: returns an empty tensor and the evictable count."""
    lib = native()
    cap = key.numel()
    if lib is not None:
        out = torch.empty(cap, dtype=torch.int64)
        tmp = torch.empty(cap, dtype=torch.int64)
        r = lib.rc_select_victims(
            key.data_ptr(), pins.data_ptr(), id_of.data_ptr(), keep.data_ptr(), cap, need, chunk,
            out.data_ptr(), tmp.data_ptr(),
        )  # fmt: skip
        if r < 0:
            return out[:0], -1 - r
        return out[:r], r
    evictable_mask = ~keep & (pins == 0) & (id_of >= 0)
    slots = torch.nonzero(evictable_mask).flatten()
    evictable = slots.numel()
    if evictable < need:
        return slots[:0], evictable
    n = min(max(need, chunk), evictable)
    order = torch.sort(key[slots], stable=True).indices[:n]  # ties: the lower slot first
    return torch.sort(slots[order]).values, evictable


def evict_commit(
    victims: Tensor, id_of: Tensor, slot_of: Tensor, dirty: Tensor, free: Tensor, n_free: int
) -> int:
    """Unmap ``victims`` (written back already) and push them on the free stack; new ``n_free``."""
    lib = native()
    if lib is not None:
        return int(
            lib.rc_evict_commit(
                victims.data_ptr(),
                victims.numel(),
                id_of.data_ptr(),
                slot_of.data_ptr(),
                dirty.data_ptr(),
                free.data_ptr(),
                n_free,
            )  # fmt: skip
        )
    n = victims.numel()
    slot_of[id_of[victims]] = -1
    id_of[victims] = -1
    dirty[victims] = False
    free[n_free : n_free + n] = victims
    return n_free + n


def fill_commit(
    slots: Tensor,
    ids: Tensor,
    slot_of: Tensor,
    id_of: Tensor,
    dirty: Tensor,
    key: Tensor,
    mark: Tensor,
    tick: int,
    lfu: bool,
) -> None:
    """Rows ``ids`` now live in ``slots``: map them, mark them used and clean, touched at ``tick``."""
    lib = native()
    if lib is not None:
        lib.rc_fill_commit(
            slots.data_ptr(), ids.data_ptr(), ids.numel(), slot_of.data_ptr(), id_of.data_ptr(),
            dirty.data_ptr(), key.data_ptr(), mark.data_ptr(), tick, int(lfu),
        )  # fmt: skip
        return
    slot_of[ids] = slots.to(torch.int32)
    id_of[slots] = ids
    dirty[slots] = False
    key[slots] = ((1 << LFU_SHIFT) | (tick & _TICK_MASK)) if lfu else tick
    mark[slots] = True


def remap(ids: Tensor, slot_of: Tensor, out: Tensor) -> None:
    """``out[i] = slot_of[ids[i]]`` (int64 ``out``; every id resident)."""
    lib = native()
    if lib is not None and out.is_contiguous():
        ids = ids.contiguous()
        lib.rc_remap(ids.data_ptr(), ids.numel(), slot_of.data_ptr(), out.data_ptr())
        return
    out.copy_(slot_of[ids])


def match_sorted(a: Tensor, b: Tensor, valid: Tensor | None = None) -> Tensor:
    """For sorted distinct ``a`` and ``b``: the position in ``b`` of each ``a`` (where ``valid``),
    else -1."""
    lib = native()
    if lib is not None:
        pos = torch.empty(a.numel(), dtype=torch.int64)
        lib.rc_match_sorted(a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), _p(valid), _p(pos))
        return pos
    if b.numel() == 0:
        return torch.full_like(a, -1)
    pos = torch.searchsorted(b, a).clamp_(max=b.numel() - 1)
    found = b[pos] == a
    if valid is not None:
        found &= valid[pos]
    return torch.where(found, pos, -1)


def invalidate_sorted(written: Tensor, staged: Tensor, valid: Tensor) -> None:
    """``valid[j] = False`` for each ``staged[j]`` in ``written`` (both sorted, distinct)."""
    lib = native()
    if lib is not None:
        lib.rc_invalidate_sorted(
            written.data_ptr(), written.numel(), staged.data_ptr(), staged.numel(),
            valid.data_ptr(),
        )  # fmt: skip
        return
    valid &= ~torch.isin(staged, written)


def copy_rows(
    src: Tensor,
    src_idx: Tensor | None,
    dst: Tensor,
    dst_idx: Tensor | None,
    threads: int = 1,
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for row-major 2-D (or 1-D) float32 tensors of equal
    row width; a ``None`` index means ``i``, a negative index skips the row. Either side may be a
    column block of a wider row-major tensor (rows strided)."""
    n = (src_idx if src_idx is not None else dst_idx if dst_idx is not None else src).shape[0]
    width = src.shape[1] if src.dim() == 2 else 1
    dwidth = dst.shape[1] if dst.dim() == 2 else 1
    if width != dwidth:
        raise ValueError(f"copy_rows: row widths differ ({width} vs {dwidth})")
    if n == 0:
        return
    lib = native()
    if lib is not None:
        for t in (src, dst):
            if t.dtype != torch.float32 or (t.dim() == 2 and t.stride(1) != 1):
                raise ValueError("copy_rows: float32 tensors with contiguous rows expected")
        lib.rc_copy_rows(
            src.data_ptr(), src.stride(0) * 4, _p(src_idx), dst.data_ptr(), dst.stride(0) * 4,
            _p(dst_idx), n, width * 4, threads,
        )  # fmt: skip
        return
    s = src if src.dim() == 2 else src.unsqueeze(1)
    d = dst if dst.dim() == 2 else dst.unsqueeze(1)
    keep = None
    if src_idx is not None and dst_idx is not None:
        keep = (src_idx >= 0) & (dst_idx >= 0)
    elif src_idx is not None:
        keep = src_idx >= 0
    elif dst_idx is not None:
        keep = dst_idx >= 0
    rows = torch.arange(n)
    si = src_idx if src_idx is not None else rows
    di = dst_idx if dst_idx is not None else rows
    if keep is not None and not bool(keep.all()):
        si, di = si[keep], di[keep]
    d[di] = s[si]
