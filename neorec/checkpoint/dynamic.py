"""Check-N-Run checkpoints of dynamic tables (``kind = "dynamic"``): pieces by raw id.

A dynamic table has no fixed rows to cut into ranges, so each checkpoint stores one piece per
table and writing rank, ``dyn/<table>.r<rank>.bin`` (manifest key ``dynamic``), in the piece
format of ``neorec.checkpoint.format`` (magic, JSON header, arrays; no pickle):

- a baseline piece holds every live id with its row, optimizer state, uses and last use;
- an increment holds the ids whose slot was touched (looked up in training or admitted) since
  its parent (``consecutive``) or its baseline (``one_shot``), plus the ids live then and gone
  now as deletions;
- every piece also holds the map's step, the threshold admission's sketch, the running counts
  and the shared default row (small).

Restore replays baseline + increments by id (the pieces of every rank that wrote one) and cuts
the result into the last save's ranks' ``TableShard`` s, each with its rank's map scalars (step,
threshold sketch, running totals); a sharded collection imports them (each rank its own ids and,
on the saved world size, its own sketch), an unsharded one their merge (every rank's sketch
summed). The slots may differ but rows, state and every later admission / eviction decision are
those of the saved run on the saved world size; on another one the threshold sketch cannot be
split by owner (``dynamic_reshard.rank_sketch``) and the resume says so in one line.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from neorec.checkpoint.format import (
    MAGIC,
    ROW_STATE,
    CheckpointCorruptError,
    CheckpointError,
    _get_rows,
    _put_rows,
    _read_arrays,
    _Writer,
    checksum,
    one_line,
    row_bytes,
)
from neorec.config import CheckpointConfig
from neorec.distributed.dynamic_reshard import TableShard, merge_table_shards, owner_of
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.errors import NeorecError
from neorec.modules.collection import EmbeddingCollection
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.storage.dynamic import DynamicEmbeddingBagCollection
from neorec.storage.dynamic_state import DynamicTableState, map_items, select_ids
from neorec.storage.mixed import MixedEmbeddingBagCollection

__all__ = [
    "dynamic_part",
    "fixed_part",
    "DynamicCheckpoints",
    "encode_dynamic_piece",
    "decode_dynamic_piece",
    "load_dynamic_shards",
    "restore_dynamic",
    "set_steps",
]


_DYNAMIC = (DynamicEmbeddingBagCollection, ShardedDynamicEmbeddingBagCollection)


def dynamic_part(ebc: EmbeddingCollection) -> Any:
    """The collection of ``ebc``'s dynamic tables (itself, its ``dynamic`` part), or None."""
    if isinstance(ebc, _DYNAMIC):
        return ebc
    if isinstance(ebc, MixedEmbeddingBagCollection):
        return ebc.dynamic
    return None


def fixed_part(ebc: EmbeddingCollection) -> Any:
    """The collection of ``ebc``'s fixed tables: itself, its ``fixed`` part, or None."""
    if isinstance(ebc, _DYNAMIC):
        return None
    if isinstance(ebc, MixedEmbeddingBagCollection):
        return ebc.fixed
    return ebc


def _counters(c: EmbeddingCollection) -> list[Tensor]:
    """The step counters a collection holds itself (its parts hold theirs)."""
    if isinstance(c, GroupedEmbeddingBagCollection):
        return [t for g in c.groups.values() for t in _counters(g)]  # type: ignore[arg-type]
    if isinstance(c, ShardedEmbeddingBagCollection):
        return [c.step, *([c.dp_step] if c.dp is not None else [])]  # (replicas count apart)
    if isinstance(c, ShardedDynamicEmbeddingBagCollection):
        return [c.default_step, *(p.step for p in c.parts)]
    return [c.step]


def set_steps(ebc: EmbeddingCollection, step: int) -> None:
    """Every part's fused-optimizer step counter (precision groups, fixed and dynamic parts)."""
    for part in (fixed_part(ebc), dynamic_part(ebc)):
        if part is not None:
            for t in _counters(part):
                t.fill_(step)


# ---- one piece --------------------------------------------------------------------------------
@dataclass
class DynamicPiece:
    """Decoded piece of one dynamic table (float32 rows and state)."""

    full: bool
    ids: Tensor
    rows: Tensor
    states: dict[str, Tensor]
    uses: Tensor
    last_use: Tensor
    deleted: Tensor
    step: int
    sketch: Tensor
    sketch_total: int
    totals: dict[str, int]
    default_row: Tensor | None
    default_states: dict[str, Tensor]


def encode_dynamic_piece(
    st: Any, full: bool, deleted: Tensor, bits: int, opt_bits: int, adaptive: bool
) -> bytes:
    """Bytes of a piece: the ids of ``st`` (a ``DynamicTableState``, possibly a subset) and
    ``deleted`` ids; rows at ``bits``, optimizer state at ``opt_bits`` (0 = not stored)."""
    w = _Writer()
    meta: dict[str, Any] = {}
    for k, v in (("ids", st.ids), ("uses", st.uses), ("last_use", st.last_use)):
        w.add(k, v.to(torch.int64))
    w.add("deleted", deleted.to(torch.int64))
    w.add("sketch", st.sketch.to(torch.int32))
    _put_rows(w, meta, "weight", st.rows, bits, adaptive)
    stored: list[str] = []
    for k, v in st.states.items():
        if opt_bits == 0:
            continue
        if k in ROW_STATE:
            _put_rows(w, meta, k, v.reshape(-1, 1), 32 if opt_bits == 32 else 16, False)
        else:
            _put_rows(w, meta, k, v, opt_bits, False)
        stored.append(k)
    default = st.default_row is not None
    if default:  # one row: full precision
        _put_rows(w, meta, "default.weight", st.default_row.reshape(1, -1), 32, False)
        for k in stored:
            v = st.default_states[k]
            _put_rows(w, meta, f"default.{k}", v.reshape(1, -1), 32, False)
    header = {
        "kind": "dynamic",
        "full": bool(full),
        "n": int(st.ids.numel()),
        "cols": int(st.rows.shape[1]),
        "step": int(st.step),
        "sketch_total": int(st.sketch_total),
        "totals": {k: int(v) for k, v in st.totals.items()},
        "states": stored,
        "default": default,
        "meta": meta,
        "arrays": w.arrays,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *w.chunks])


def decode_dynamic_piece(data: bytes, where: str = "piece") -> DynamicPiece:
    """Inverse of ``encode_dynamic_piece``; CheckpointCorruptError on malformed bytes."""
    if data[:4] != MAGIC:
        raise CheckpointCorruptError(f"{where}: not a neorec checkpoint piece (bad magic)")
    try:
        (hlen,) = struct.unpack("<I", data[4:8])
        h = json.loads(data[8 : 8 + hlen])
        if h.get("kind") != "dynamic":
            raise ValueError("not a dynamic-table piece")
        a = _read_arrays(h, memoryview(data)[8 + hlen :])
        meta, cols = h["meta"], int(h["cols"])
        rows = _get_rows(a, meta, "weight").reshape(-1, cols)
        states = {}
        for k in h["states"]:
            v = _get_rows(a, meta, k)
            states[k] = v.reshape(-1) if k in ROW_STATE else v.reshape(-1, cols)
        d_row, d_states = None, {}
        if h["default"]:
            d_row = _get_rows(a, meta, "default.weight").reshape(-1)
            d_states = {k: _get_rows(a, meta, f"default.{k}").reshape(-1) for k in h["states"]}
            d_states = {k: (v[0] if k in ROW_STATE else v) for k, v in d_states.items()}
        n = int(h["n"])
        if a["ids"].numel() != n or rows.shape[0] != n:
            raise ValueError(f"header says {n} ids, arrays hold {a['ids'].numel()}")
        return DynamicPiece(
            bool(h["full"]), a["ids"], rows, states, a["uses"], a["last_use"], a["deleted"],
            int(h["step"]), a["sketch"], int(h["sketch_total"]),
            {k: int(v) for k, v in h["totals"].items()}, d_row, d_states,
        )  # fmt: skip
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed header or arrays: not what was written
        raise CheckpointCorruptError(
            f"{where}: malformed dynamic-table piece ({type(e).__name__}: {one_line(e)})"
        ) from None


# ---- saving -----------------------------------------------------------------------------------
class DynamicCheckpoints:
    """The dynamic tables' side of a ``CheckpointManager``: what changed since the prefix, the
    pieces of a save, the estimate of their bytes."""

    def __init__(self, dyn: Any, rank: int = 0) -> None:
        self.dyn = dyn
        self.rank = rank
        self.names = [t.name for t in dyn.tables]
        self.prev: dict[str, Tensor] = {}
        self.touched: dict[str, Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """The prefix ends now: live ids as they are, nothing touched since."""
        for t in self.names:
            self.dyn.take_touched(t)
            self.prev[t] = map_items(self.dyn.id_map(t))["ids"]
            self.touched[t] = torch.zeros(self.dyn.id_map(t).capacity, dtype=torch.bool)

    def collect(self) -> None:
        """Fold the collection's touched slots into the since-prefix marks."""
        for t in self.names:
            self.touched[t] |= self.dyn.take_touched(t)

    def _row_bytes(self, dim: int, bits: int, opt_bits: int) -> float:
        names = self.dyn.state_names if opt_bits else []
        elems = sum(k != "momentum1" for k in names)
        return row_bytes(dim, bits, elems, len(names) - elems, opt_bits) + 24  # id, uses, last

    def est_bytes(self, full: bool, bits: int, opt_bits: int) -> float:
        """Estimated bytes of the next piece set (every live id when ``full``)."""
        total = 0.0
        for i, t in enumerate(self.names):
            m = self.dyn.id_map(t)
            n = m.occupancy if full else int(self.touched[t].sum())
            total += n * self._row_bytes(self.dyn.tables[i].dim, bits, opt_bits)
        return total

    def base_bytes(self, bits: int, opt_bits: int) -> float:
        """Bytes of a full piece set at capacity."""
        return sum(
            self.dyn.id_map(t).capacity * self._row_bytes(self.dyn.tables[i].dim, bits, opt_bits)
            for i, t in enumerate(self.names)
        )

    def snapshot(self, full: bool) -> list[tuple[str, Any, bool, Tensor]]:
        """(table, state, full, deleted) per table: everything, or the ids changed since the
        prefix and the ids gone since (copies; the training pause)."""
        out = []
        for t in self.names:
            st = self.dyn.export_table(t)
            if full:
                out.append((t, st, True, torch.zeros(0, dtype=torch.int64)))
                continue
            items = map_items(self.dyn.id_map(t))
            changed = self.touched[t][items["slots"]] | ~torch.isin(st.ids, self.prev[t])
            deleted = self.prev[t][~torch.isin(self.prev[t], st.ids)]
            out.append((t, select_ids(st, changed), False, deleted))
        return out

    def advance(self, restart: bool) -> None:
        """After a save: a new prefix starts when ``restart`` (baseline, or consecutive)."""
        if restart:
            for t in self.names:
                self.prev[t] = map_items(self.dyn.id_map(t))["ids"]
                self.touched[t].zero_()

    def pieces(
        self,
        name: str,
        snap: list[tuple[str, Any, bool, Tensor]],
        storage: Any,
        cfg: CheckpointConfig,
    ) -> list[dict[str, Any]]:
        """Write the snapshot's pieces of checkpoint ``name``; their manifest entries."""
        out = []
        adaptive = bool(cfg.adaptive_range)
        for t, st, full, deleted in snap:
            data = encode_dynamic_piece(st, full, deleted, cfg.bits, cfg.opt_bits, adaptive)
            rel = f"dyn/{t}.r{self.rank}.bin"
            storage.write_atomic(f"{name}/{rel}", data)
            out.append(
                {
                    "table": t,
                    "file": rel,
                    "rank": self.rank,
                    "full": full,
                    "n": int(st.ids.numel()),
                    "deleted": int(deleted.numel()),
                    "bytes": len(data),
                    "crc32": checksum(data),
                }
            )
        return out


# ---- restoring --------------------------------------------------------------------------------
def load_dynamic_shards(
    storage: Any, chain: list[dict[str, Any]], tables: list[str]
) -> dict[str, list[TableShard]]:
    """``{table: [TableShard of each rank of the last save]}`` of the checkpoint whose chain is
    ``chain``: the baseline's ids, then each increment's deletions and changed ids in order (every
    rank's pieces), cut by owner among the last save's ranks, each with its own map scalars."""
    from neorec.checkpoint.catalog import read_verified

    acc: dict[str, DynamicTableState] = {}
    scal: dict[str, tuple[int, list[tuple[int, DynamicPiece]]]] = {}  # the last save's pieces
    for ci, m in enumerate(chain):
        entries = m.get("dynamic") or []
        if m is chain[0]:
            missing = [t for t in tables if t not in {e["table"] for e in entries}]
            if missing:
                raise CheckpointError(
                    f"checkpoint {m['name']} has no pieces of the dynamic tables {missing} "
                    "(saved before they were dynamic?); resume with the checkpoint's tables"
                )
        for e in entries:
            t = e["table"]
            if t not in tables:
                continue
            where = storage.path(f"{m['name']}/{e['file']}")
            p = decode_dynamic_piece(read_verified(storage, m["name"], e), where)
            rank = int(e.get("rank", 0))
            if t not in scal or ci > scal[t][0]:
                scal[t] = (ci, [])
            if ci == scal[t][0]:
                scal[t][1].append((rank, p))  # map scalars: the last save's ranks'
            got = DynamicTableState(
                p.ids, p.rows, dict(p.states), p.uses, p.last_use, p.step, p.sketch,
                p.sketch_total, p.totals, p.default_row, dict(p.default_states),
            )  # fmt: skip
            old = acc.get(t)
            if old is None:
                acc[t] = got
                continue
            gone = torch.isin(old.ids, torch.cat([p.deleted, p.ids]))
            keep = ~gone
            acc[t] = DynamicTableState(
                torch.cat([old.ids[keep], p.ids]),
                torch.cat([old.rows[keep], p.rows]),
                {k: torch.cat([v[keep], p.states[k]]) for k, v in old.states.items()
                 if k in p.states},
                torch.cat([old.uses[keep], p.uses]),
                torch.cat([old.last_use[keep], p.last_use]),
                p.step,
            )  # fmt: skip
    out = {}
    for t in tables:
        ci, pieces = scal[t]
        pieces.sort(key=lambda rp: rp[0])
        ranks = [r for r, _ in pieces]
        world = len(pieces)
        if ranks != list(range(world)):
            raise CheckpointCorruptError(
                f"checkpoint {chain[ci]['name']}: table '{t}' has pieces of ranks {ranks}, want "
                f"0..{world - 1} once each (a piece missing from its manifest)"
            )
        st = acc[t]
        order = torch.argsort(st.ids)
        st = DynamicTableState(
            st.ids[order], st.rows[order], {k: v[order] for k, v in st.states.items()},
            st.uses[order], st.last_use[order], st.step,
        )  # fmt: skip
        own = owner_of(st.ids, world)
        out[t] = [
            TableShard(r, world, _with_scalars(select_ids(st, own == r), p)) for r, p in pieces
        ]
    return out


def _with_scalars(st: DynamicTableState, p: DynamicPiece) -> DynamicTableState:
    """``st`` (one rank's ids) with the map scalars of that rank's piece ``p``."""
    st.step, st.sketch, st.sketch_total = p.step, p.sketch, p.sketch_total
    st.totals, st.default_row, st.default_states = p.totals, p.default_row, p.default_states
    return st


def _fill_states(dyn: Any, i: int, st: Any) -> Any:
    """``st`` of table ``i`` with zero optimizer state where the checkpoint stored none
    (``opt_bits = 0``)."""
    dim = int(dyn.tables[i].dim)
    n = st.ids.numel()
    if st.rows.numel() == 0:
        st.rows = torch.zeros(0, dim)
    for k in dyn.state_names:
        if k not in st.states or st.states[k].shape[0] != n:
            st.states[k] = torch.zeros(n) if k == "momentum1" else torch.zeros(n, dim)
        if st.default_row is not None and k not in st.default_states:
            st.default_states[k] = torch.zeros(()) if k == "momentum1" else torch.zeros(dim)
    st.states = {k: st.states[k] for k in dyn.state_names}
    return st


def restore_dynamic(storage: Any, chain: list[dict[str, Any]], ebc: Any) -> list[Any]:
    """Read and check the dynamic tables' states of ``chain`` for ``ebc`` (nothing changes yet);
    returns the callables that import them (call after every other check passed). A sharded
    collection imports every saved rank's shard (each rank takes its ids and its sketch), an
    unsharded one their merge."""
    dyn = dynamic_part(ebc)
    if dyn is None:
        return []
    names = [t.name for t in dyn.tables]
    shards = load_dynamic_shards(storage, chain, names)
    sharded = isinstance(dyn, ShardedDynamicEmbeddingBagCollection)
    todo: list[Callable[[], Any]] = []
    for i, t in enumerate(names):
        for s in shards[t]:
            _fill_states(dyn, i, s.state)
        try:  # the collection's own check (a sharded one: of the ids its rank owns)
            src: Any = shards[t] if sharded else merge_table_shards(shards[t], f"table '{t}'")
            dyn.check_import_table(t, src)
        except NeorecError as e:  # capacity / dim / optimizer
            raise CheckpointError(f"checkpoint {chain[-1]['name']}: {one_line(e)}") from None
        todo.append(partial(dyn.import_table, t, src))
    note = resume_note(dyn, shards, chain[-1])
    if note and (dyn.rank if sharded else 0) == 0:
        todo.append(partial(print, note, file=sys.stderr, flush=True))
    return todo


def resume_note(dyn: Any, shards: dict[str, list[TableShard]], last: dict[str, Any]) -> str:
    """The line a training resume prints when it is not bitwise for the dynamic tables: threshold
    admission restored on another world size than the saved one (``""`` otherwise, and for a
    checkpoint without optimizer state, such as a saved model: no training resumes from it)."""
    world = int(getattr(dyn, "world", 1))
    saved = {t: s[0].world for t, s in shards.items()}
    tables = [t.name for t in dyn.tables if t.admission == "threshold" and saved[t.name] != world]
    if not tables or not last.get("opt_bits"):
        return ""
    was = saved[tables[0]]
    how = (
        "every saved sighting counted once"
        if was % world == 0
        else "a saved rank's sightings counted on each rank that takes part of its ids"
    )
    return (
        f"note: dynamic tables {tables} (admission = 'threshold') were saved by {was} rank(s) and "
        f"resume on {world}: each rank's admission sketch is the sum of the saved ranks' sketches "
        f"over its id-hash range ({how}; none lost, so no id is admitted late), and admissions "
        f"may differ from an uninterrupted run: the resume is bitwise on {was} rank(s) only"
    )
