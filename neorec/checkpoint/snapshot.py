"""A checkpoint's snapshot: the rows and state copied in the training pause, and their pieces.

Split from ``manager`` (which decides what to save and commits it). A block's snapshot is taken
in the pause and cut into pieces by the writer thread:

- a block in memory (``BlockSnap``): its rows (all, or the changed ones) copied to the host in the
  pause;
- a dram/ssd table behind the row cache (``TieredSnap``): in the pause, only the resident rows are
  copied from the cache; the rest are read from the store by the writer, chunk by chunk, as they
  were at the pause (``neorec.storage.tiered_rows.RowSnapshot``: copy-on-write of the rows the
  training thread writes back meanwhile).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from neorec.checkpoint.format import checksum, encode_piece
from neorec.checkpoint.tracker import LocalBlock
from neorec.config import CheckpointConfig
from neorec.storage.tiered_rows import RowSnapshot, StoreField, split_records

__all__ = ["BlockSnap", "TieredSnap", "Snapshot", "host", "clone", "snap_block", "write_pieces"]


def host(t: Any, fresh: bool = False) -> Tensor:
    """A host copy of ``t`` (device -> host staging before the background write); ``fresh``:
    ``t`` is already a new tensor (an index result), not copied again on the host. Low-precision
    rows (``DecodedRows``) decode to a new float32 tensor first."""
    if not isinstance(t, Tensor):
        t = t if fresh else t.clone()
        fresh = True
    t = t.detach()
    return t.cpu() if fresh or t.device.type != "cpu" else t.clone()


def clone(obj: Any) -> Any:
    """A deep copy with tensors detached and cloned to the host (a point-in-time snapshot)."""
    if isinstance(obj, Tensor):
        return host(obj)
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return copy.deepcopy(obj)


@dataclass
class BlockSnap:
    """Rows of a block in memory, copied in the pause."""

    block: LocalBlock
    ids: Tensor | None  # block-local rows (None = all)
    weight: Tensor
    state: dict[str, Tensor]

    def part(self, a: int, z: int) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
        """(block-local ids in [a, z) minus a, or None for all; rows; state) of rows [a, z)."""
        if self.ids is None:
            return None, self.weight[a:z], {k: v[a:z] for k, v in self.state.items()}
        sel = (self.ids >= a) & (self.ids < z)
        return self.ids[sel] - a, self.weight[sel], {k: v[sel] for k, v in self.state.items()}

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class TieredSnap:
    """Rows of a dram/ssd table (a whole table: block rows are global rows), read by ``part``."""

    block: LocalBlock
    rows: RowSnapshot
    full: bool  # every row (a baseline), else the changed ones
    keys: list[str]  # the optimizer state stored

    def part(self, a: int, z: int) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
        """As ``BlockSnap.part``, read from the cache's copy and the store."""
        ids, rec = self.rows.read(a, z)
        f = split_records(self.rows.store.fields, rec)
        state = {k: f[k].contiguous() for k in self.keys}
        return (None if self.full else ids - a), f["weight"].contiguous(), state

    def close(self) -> None:
        """Stop the copy-on-write of the table's store."""
        self.rows.close()


@dataclass
class Snapshot:
    """What one save writes: its name, step, kind and chain, the blocks' rows, the dense state."""

    name: str
    step: int
    kind: str
    chain: list[str]
    blocks: list[BlockSnap | TieredSnap]
    dense: dict[str, Any] | None
    est_bytes: float
    pause_ms: float
    meta: dict[str, Any] = field(default_factory=dict)


def snap_block(b: LocalBlock, ids: Tensor | None, keys: list[str]) -> BlockSnap | TieredSnap:
    """The pause's copy of block ``b``: rows ``ids`` (block-local, sorted; None = every row)
    and the optimizer state ``keys``."""
    w = b.weight
    if isinstance(w, StoreField):
        return TieredSnap(b, RowSnapshot(w.ebc, w.c, ids), ids is None, keys)
    if ids is None:
        return BlockSnap(b, None, host(w), {k: host(b.state[k]) for k in keys})
    on = ids.to(w.device if isinstance(w, Tensor) else w.weights.device)
    state = {k: host(b.state[k][on], fresh=True) for k in keys}
    return BlockSnap(b, ids.cpu(), host(w[on], fresh=True), state)


def write_pieces(storage: Any, cfg: CheckpointConfig, snap: Snapshot) -> list[dict[str, Any]]:
    """Encode and write the blocks' pieces of ``snap`` (``cfg.chunk_rows`` rows each, only the
    chunks with rows); their manifest entries."""
    out = []
    for s in snap.blocks:
        b = s.block
        lo = b.row_start
        while lo < b.row_end:
            hi = min(b.row_end, (lo // cfg.chunk_rows + 1) * cfg.chunk_rows)
            a, z = lo - b.row_start, hi - b.row_start
            ids, w, st = s.part(a, z)
            lo = hi
            if ids is not None and ids.numel() == 0:
                continue
            data = encode_piece(w, st, ids, z - a, cfg.bits, cfg.opt_bits, cfg.adaptive_range)
            rel = (
                f"emb/{b.table}/r{b.row_start + a}-{b.row_start + z}.c{b.col_start}-{b.col_end}.bin"
            )
            storage.write_atomic(f"{snap.name}/{rel}", data)
            out.append(
                {
                    "table": b.table,
                    "file": rel,
                    "rows": [b.row_start + a, b.row_start + z],
                    "cols": [b.col_start, b.col_end],
                    "n": int(w.shape[0]),
                    "dense": ids is None,
                    "state": sorted(st),
                    "bytes": len(data),
                    "crc32": checksum(data),
                }
            )
    return out
