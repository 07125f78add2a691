"""Which rank owns a raw id of a sharded dynamic table, and the tables' checkpoints across world
sizes: per-rank states (``TableShard``) merged into one ``DynamicTableState`` by raw id, from
which any world size takes the ids it owns.

Ownership (fixed, documented, independent of the seed and of the table)::

    owner(x, W) = ((mix64(x) >> 32) * W) >> 32        (unsigned 64-bit arithmetic)

``mix64`` is SplitMix64's finalizer (``neorec.ops.id_map.mix64``): the top 32 bits of the mixed
id, scaled to ``[0, W)``, so rank r owns the hash range ``[r * 2^32 / W, (r + 1) * 2^32 / W)``.
The id map's own hash table and sketch hash the id with other salts (their bits are
independent of the owner's).

Threshold admission's count-min sketch is per rank: rank r's counts the sightings of the ids r
owns. A restore on the saved world size gives each rank its own sketch (bitwise resume). On another
world size a counter cannot be split by owner, so rank r gets the sum of the sketches of the saved
ranks whose hash ranges overlap its own (``sketch_sources``): every saved rank's counts once when
the saved world is a multiple of the new one (a merge), and copies of a saved rank's counts in
each rank that takes part of its range otherwise (ids may then be admitted early, never late).

Placement in a distributed model: dynamic tables are never placed by a ``ShardingPlan``
(``without_dynamic``); ``neorec.builder.sharded_collection`` builds a config's collection (fixed
tables by the plan, dynamic tables row-wise by id hash over every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.id_map import SKETCH_DEPTH, _mix64_np
from neorec.storage.dynamic_state import DynamicTableState, select_ids

if TYPE_CHECKING:
    from neorec.config import TableConfig

__all__ = [
    "TableShard",
    "owner_of",
    "merge_table_shards",
    "as_global_state",
    "rank_state",
    "rank_sketch",
    "saved_shards",
    "sketch_sources",
    "without_dynamic",
]


def owner_of(ids: Tensor, world: int) -> Tensor:
    """The owning rank (int64, in ``[0, world)``) of each raw int64 id (see the module doc)."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world < 2**31:
        raise ConfigError(f"owner_of: world must be an integer in [1, 2^31), got {world!r}")
    u = ids.to(torch.int64).contiguous().numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        top = _mix64_np(u) >> np.uint64(32)
        own = (top * np.uint64(world)) >> np.uint64(32)
    return torch.from_numpy(own.astype(np.int64))


@dataclass
class TableShard:
    """One rank's part of a sharded dynamic table: the ids it owned in a world of ``world``."""

    rank: int
    world: int
    state: DynamicTableState

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for ``torch.save``."""
        return {"rank": self.rank, "world": self.world, "state": self.state.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableShard:
        """Inverse of ``to_dict``; a dict that is not one refused (``ConfigError``)."""
        try:
            return cls(int(d["rank"]), int(d["world"]), DynamicTableState.from_dict(d["state"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"TableShard.from_dict: not a saved table shard ({type(e).__name__}: {e}); "
                "want the dict of TableShard.to_dict()"
            ) from None


def _fold_sketch(sk: Tensor, width: int) -> Tensor:
    """A [depth, w] count-min sketch folded by sums to ``width`` (a power of two <= w)."""
    depth, w = sk.shape
    return sk.to(torch.int64).view(depth, w // width, width).sum(1)


def _sum_sketches(states: Sequence[DynamicTableState]) -> tuple[Tensor, int]:
    """The sketches of ``states`` summed (folded to the narrowest width; int32, saturating) and
    their sightings counts summed: the sketch of the union of their (disjoint) id streams."""
    sks = [s.sketch.reshape(SKETCH_DEPTH, -1) for s in states]
    width = min(int(sk.shape[1]) for sk in sks)
    out = torch.zeros(SKETCH_DEPTH, width, dtype=torch.int64)
    for sk in sks:
        out += _fold_sketch(sk, width)
    return out.clamp(max=2**31 - 1).to(torch.int32), sum(int(s.sketch_total) for s in states)


_SPAN = 1 << 32


def _hash_range(rank: int, world: int) -> tuple[int, int]:
    """The top-32-bit hash values ``[lo, hi)`` that ``rank`` of ``world`` owns."""
    return -(-rank * _SPAN // world), -(-(rank + 1) * _SPAN // world)


def sketch_sources(rank: int, world: int, saved_world: int) -> list[int]:
    """The ranks of a ``saved_world``-rank checkpoint whose hash ranges overlap the range of
    ``rank`` of ``world``: whose sketches hold the sightings of ids ``rank`` owns (``[rank]``
    on the saved world size)."""
    lo, hi = _hash_range(rank, world)
    return [
        q
        for q in range(saved_world)
        if _hash_range(q, saved_world)[0] < hi and lo < _hash_range(q, saved_world)[1]
    ]


def rank_sketch(
    shards: Sequence[TableShard], rank: int, world: int
) -> tuple[Tensor, int, dict[str, int]]:
    """(sketch, sightings count, running totals) of ``rank`` of ``world`` restored from every
    saved rank's ``shards`` (one whole checkpoint, as ``merge_table_shards`` checks): on the saved
    world size the rank's own; otherwise the sum of the ``sketch_sources`` ranks' sketches, and
    the totals summed over every saved rank on rank 0 (zeros elsewhere: their sum is kept)."""
    by_rank = {s.rank: s.state for s in shards}
    saved = shards[0].world
    if saved == world:
        own = by_rank[rank]
        return own.sketch.reshape(SKETCH_DEPTH, -1), int(own.sketch_total), dict(own.totals)
    sketch, total = _sum_sketches([by_rank[q] for q in sketch_sources(rank, world, saved)])
    totals: dict[str, int] = {}
    for q in range(saved):
        for k, v in by_rank[q].totals.items():
            totals[k] = totals.get(k, 0) + int(v)
    return sketch, total, totals if rank == 0 else {k: 0 for k in totals}


def merge_table_shards(shards: Sequence[TableShard], where: str = "table") -> DynamicTableState:
    """The whole table of a sharded checkpoint: every rank's ids (ascending), rows, optimizer
    state and bookkeeping; map step and default row of the (identical) ranks; the running totals
    and the threshold sketches summed (folded to the narrowest width: counts only grow), which is
    the sketch one process restores (``rank_sketch`` of rank 0 of world 1).

    Refuses (``ConfigError``, one line naming ``where``) a set that is not one whole checkpoint:
    ranks missing or repeated, another world, different steps, dims or optimizer states, an id in
    two ranks' shards or on a rank that does not own it.
    """
    shards = list(shards)
    if not shards or not all(isinstance(s, TableShard) for s in shards):
        got = sorted({type(s).__name__ for s in shards}) if shards else "nothing"
        raise ConfigError(f"{where}: want the TableShard of every rank, got {got}")
    world = shards[0].world
    worlds = sorted({s.world for s in shards})
    if len(worlds) > 1:
        raise ConfigError(f"{where}: shards of different world sizes {worlds}; use one checkpoint")
    ranks = sorted(s.rank for s in shards)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ConfigError(
            f"{where}: a checkpoint of {world} ranks needs ranks 0..{world - 1} once each; "
            f"missing {missing}, repeated {repeated}, out of range "
            f"{sorted(r for r in set(ranks) if not 0 <= r < world)}"
        )
    shards.sort(key=lambda s: s.rank)
    sts = [s.state for s in shards]
    steps = sorted({int(s.step) for s in sts})
    if len(steps) > 1:
        raise ConfigError(
            f"{where}: the ranks' shards are at different steps {steps}; they are not one "
            "checkpoint (restore every rank's shard of the same save)"
        )
    dims = sorted({s.dim for s in sts})
    names = sorted({tuple(sorted(s.states)) for s in sts})
    if len(dims) > 1 or len(names) > 1:
        raise ConfigError(
            f"{where}: the ranks' shards disagree on dim {dims} or optimizer state {names}"
        )
    for s in shards:
        own = owner_of(s.state.ids, world)
        bad = s.state.ids[own != s.rank]
        if bad.numel():
            raise ConfigError(
                f"{where}: rank {s.rank}'s shard holds id {int(bad[0])}, which rank "
                f"{int(owner_of(bad[:1], world)[0])} of {world} owns; the shard is not that rank's"
            )
    ids = torch.cat([s.ids for s in sts])
    order = torch.argsort(ids, stable=True)
    ids = ids[order]
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        dup = int(ids[1:][ids[1:] == ids[:-1]][0])
        raise ConfigError(f"{where}: id {dup} is in two ranks' shards")
    sketch, sketch_total = _sum_sketches(sts)
    totals: dict[str, int] = {}
    for st in sts:
        for k, v in st.totals.items():
            totals[k] = totals.get(k, 0) + int(v)
    return DynamicTableState(
        ids=ids,
        rows=torch.cat([s.rows for s in sts])[order],
        states={k: torch.cat([s.states[k] for s in sts])[order] for k in sts[0].states},
        uses=torch.cat([s.uses for s in sts])[order],
        last_use=torch.cat([s.last_use for s in sts])[order],
        step=steps[0],
        sketch=sketch,
        sketch_total=sketch_total,
        totals=totals,
        default_row=sts[0].default_row,
        default_states=dict(sts[0].default_states),
    )


def as_global_state(
    source: DynamicTableState | TableShard | Sequence[TableShard], where: str = "table"
) -> DynamicTableState:
    """The whole table from an unsharded export, or from every rank's ``TableShard``."""
    if isinstance(source, DynamicTableState):
        return source
    if isinstance(source, TableShard):
        return merge_table_shards([source], where)
    if isinstance(source, (str, bytes, dict)) or not isinstance(source, Sequence):
        raise ConfigError(
            f"{where}: want a DynamicTableState or the TableShard of every rank, got "
            f"{type(source).__name__}"
        )
    return merge_table_shards(source, where)


def saved_shards(
    source: DynamicTableState | TableShard | Sequence[TableShard],
) -> list[TableShard] | None:
    """The saved ranks' shards of an import's ``source`` (None for an unsharded export)."""
    if isinstance(source, DynamicTableState):
        return None
    return [source] if isinstance(source, TableShard) else list(source)


def rank_state(
    state: DynamicTableState,
    rank: int,
    world: int,
    capacity: int,
    where: str = "table",
    shards: Sequence[TableShard] | None = None,
) -> DynamicTableState:
    """The part of the whole ``state`` that ``rank`` of ``world`` owns (per-rank ``capacity``
    slots). Sketch, sightings count and running totals: ``rank_sketch`` of the saved ranks'
    ``shards`` (``state`` merged from them); without them (an unsharded export) the whole sketch,
    and the totals on rank 0 (their sum over ranks is kept). Refuses, on every rank alike, a
    state of which some rank would own more ids than ``capacity``."""
    own = owner_of(state.ids, world)
    counts = torch.bincount(own, minlength=world)
    worst = int(torch.argmax(counts))
    if int(counts[worst]) > capacity:
        raise ConfigError(
            f"{where}: rank {worst} of {world} would own {int(counts[worst])} of the "
            f"{state.ids.numel()} ids, more than its {capacity} slots (ceil(capacity / world)); "
            "raise the table's capacity or restore on more ranks"
        )
    part = select_ids(state, own == rank)
    if shards:
        part.sketch, part.sketch_total, part.totals = rank_sketch(shards, rank, world)
    else:
        part.totals = dict(state.totals) if rank == 0 else {k: 0 for k in state.totals}
    return part


# ---- a distributed model's collection with dynamic tables ----------------------------------------
def without_dynamic(plan: Any, tables: Sequence[TableConfig]) -> Any:
    """``plan`` without the dynamic tables of ``tables``: they are never placed by a plan (row-wise
    by the hash of the raw id over every rank, ``ShardedDynamicEmbeddingBagCollection``)."""
    dyn = {t.name for t in tables if getattr(t, "kind", "fixed") == "dynamic"}
    return replace(plan, tables=[tp for tp in plan.tables if tp.name not in dyn])
