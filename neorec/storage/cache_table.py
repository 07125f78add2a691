"""The row cache's parts: capacity, per-table bookkeeping, staged rows, and its error.

Split from ``cached.py``, which holds the collection that drives them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.errors import NeorecError
from neorec.storage.store import RowStore

__all__ = [
    "POLICIES",
    "DEFAULT_CACHE_FRACTION",
    "EVICT_CHUNK",
    "CacheCapacityError",
    "cache_capacity",
    "CacheTable",
    "StagedRows",
    "one_thread",
    "hit_rate",
    "cache_stats",
]

POLICIES = ("lru", "lfu")
DEFAULT_CACHE_FRACTION = 0.1
"""Cache size of a dram/ssd table that sets neither cache_rows nor cache_fraction."""
EVICT_CHUNK = 64
"""When the cache is full, evict at least capacity / EVICT_CHUNK rows at once: choosing victims
scans the whole cache, so doing it in chunks keeps that scan off most steps."""


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the cache bookkeeping (many small index ops) on one intra-op thread.

    Measured on a shared 2-core machine: a 10k-element index_put took 16 ms with 2 OpenMP threads
    (each parallel region waits for a core another process holds) and 0.05 ms with one.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class CacheCapacityError(NeorecError, ValueError):
    """A batch needs more distinct rows of a table than its cache holds."""


def cache_capacity(t: TableConfig) -> int:
    """Rows the cache of table ``t`` holds (all rows for storage = memory)."""
    storage = getattr(t, "storage", "memory")
    if storage == "memory":
        return t.rows
    rows = int(getattr(t, "cache_rows", 0))
    frac = float(getattr(t, "cache_fraction", 0.0))
    if rows <= 0:
        rows = math.ceil((frac or DEFAULT_CACHE_FRACTION) * t.rows)
    return max(1, min(rows, t.rows))


@dataclass
class CacheTable:
    """Cache bookkeeping of one dram/ssd table."""

    index: int
    name: str
    rows: int
    dim: int
    capacity: int
    policy: str
    store: RowStore
    slot_of: Tensor  # [rows] int32, -1 = not resident
    id_of: Tensor  # [capacity] int64, -1 = free slot
    key: Tensor  # [capacity] int64 eviction priority (smallest goes first)
    dirty: Tensor  # [capacity] bool
    pins: Tensor  # [capacity] int32: batches awaiting backward that use the slot
    free: Tensor  # [capacity] int64 stack of free slots; the first n_free are valid
    n_free: int
    counts: dict[str, int] = field(default_factory=dict)
    write_guards: list[Any] = field(default_factory=list)
    """Called with the ids of every store write before it (checkpoints' copy-on-write)."""


@dataclass
class StagedRows:
    """Rows read ahead by ``prefetch``: sorted ids, their records, and which are still valid."""

    ids: Tensor
    records: Tensor
    valid: Tensor


def hit_rate(hits: int, misses: int) -> float:
    """hits / (hits + misses), 0 when nothing was looked up."""
    return hits / (hits + misses) if hits + misses else 0.0


def cache_stats(caches: list[CacheTable]) -> dict[str, Any]:
    """Cache counters: totals, hit rates, bytes per tier, and the same per table."""
    tot: dict[str, int] = {}
    per_table: dict[str, dict[str, Any]] = {}
    tiers: dict[str, dict[str, int]] = {}
    for c in caches:
        for k, v in c.counts.items():
            tot[k] = tot.get(k, 0) + v
        moved = tiers.setdefault(c.store.tier, {"bytes_read": 0, "bytes_written": 0})
        moved["bytes_read"] += c.store.bytes_read
        moved["bytes_written"] += c.store.bytes_written
        per_table[c.name] = {
            **c.counts,
            "tier": c.store.tier,
            "capacity": c.capacity,
            "resident": c.capacity - c.n_free,
            "hit_rate": hit_rate(c.counts["hits"], c.counts["misses"]),
        }
    out: dict[str, Any] = dict(tot)
    out["hit_rate"] = hit_rate(tot.get("hits", 0), tot.get("misses", 0))
    out["lookup_hit_rate"] = hit_rate(
        tot.get("lookup_hits", 0), tot.get("lookups", 0) - tot.get("lookup_hits", 0)
    )
    for tier, nbytes in tiers.items():
        out[f"{tier}_bytes_read"] = nbytes["bytes_read"]
        out[f"{tier}_bytes_written"] = nbytes["bytes_written"]
    out["tables"] = per_table
    return out
