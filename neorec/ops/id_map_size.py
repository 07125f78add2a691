"""The id map's sizes in pure Python (no torch): its sketch's shape and its bytes per slot.

``neorec.ops.id_map`` builds its maps with these; the planner (``neorec.sharding.tables``) prices
a dynamic table's map with ``map_bytes_per_slot`` without loading torch.
"""

from __future__ import annotations

__all__ = ["SKETCH_DEPTH", "sketch_width", "map_bytes_per_slot"]

SKETCH_DEPTH = 4
"""Rows (hash functions) of the threshold admission's count-min sketch."""


def sketch_width(capacity: int) -> int:
    """Counters per sketch row: the power of two >= 2 x capacity, within [1024, 2**22]."""
    return min(1 << 22, max(1024, 1 << (2 * capacity - 1).bit_length()))


def map_bytes_per_slot(capacity: int, admission: str = "always", eviction: str = "lru") -> float:
    """Bytes of an ``IdMap`` (compiled) and its collection's per-slot bookkeeping per slot,
    besides the row and its optimizer state. Per slot: id, last use, uses, free stack 8 each,
    live, touched and batch mark 1 each, pin 4 (= 39); the lru / ttl order (next, previous) 16;
    the hash table, 16 bytes an entry at 2-4 entries a slot (load <= 1/2); with threshold
    admission the sketch, 4 rows of int32 counters at 2-4 a slot (rows of at most 2**22). Not
    counted: the per-batch scratch, 72 bytes a slot of the largest table plus ~100 bytes an id
    of the largest batch, shared by every table of a thread."""
    cap = max(1, int(capacity))
    per = 39.0 + (16.0 if eviction != "lfu" else 0.0)
    per += 16.0 * (1 << max(4, (2 * cap - 1).bit_length())) / cap
    if admission == "threshold":
        per += SKETCH_DEPTH * 4.0 * sketch_width(cap) / cap
    return per
