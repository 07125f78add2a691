"""Which rank owns a raw id of a sharded dynamic table, and the tables' checkpoints across world
sizes: per-rank states (``TableShard``) merged into one ``DynamicTableState`` by raw id, from
which any world size takes the ids it owns.

Ownership (fixed, documented, independent of the seed and of the table)::

    owner(x, W) = ((mix64(x) >> 32) * W) >> 32        (unsigned 64-bit arithmetic)

``mix64`` is SplitMix64's finalizer (``neorec.ops.id_map.mix64``): the top 32 bits of the mixed
id, scaled to ``[0, W)``, so rank r owns the hash range ``[r * 2^32 / W, (r + 1) * 2^32 / W)``.
The id map's own hash table and sketch hash the id with other salts (their bits are
independent of the owner's).

Placement in a distributed model: dynamic tables are never placed by a ``ShardingPlan``
(``without_dynamic``); ``sharded_dynamic_from_config`` builds a config's collection (fixed tables
by the plan, dynamic tables row-wise by id hash over every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.id_map import _mix64_np
from neorec.storage.dynamic_state import DynamicTableState, select_ids

if TYPE_CHECKING:
    from neorec.config import TableConfig

__all__ = [
    "TableShard",
    "owner_of",
    "merge_table_shards",
    "as_global_state",
    "rank_state",
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


def merge_table_shards(shards: Sequence[TableShard], where: str = "table") -> DynamicTableState:
    """The whole table of a sharded checkpoint: every rank's ids (ascending), rows, optimizer
    state and bookkeeping; map step and default row of the (identical) ranks; the running totals
    and the threshold sketches summed (folded to the narrowest width: counts only grow).

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
    width = min(int(s.sketch.shape[-1]) for s in sts)
    sketch = torch.zeros(sts[0].sketch.shape[0], width, dtype=torch.int64)
    for st in sts:
        sketch += _fold_sketch(st.sketch.reshape(sketch.shape[0], -1), width)
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
        sketch=sketch.clamp(max=2**31 - 1).to(torch.int32),
        sketch_total=sum(int(s.sketch_total) for s in sts),
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


def rank_state(
    state: DynamicTableState, rank: int, world: int, capacity: int, where: str = "table"
) -> DynamicTableState:
    """The part of the whole ``state`` that ``rank`` of ``world`` owns (per-rank ``capacity``
    slots); the running totals go to rank 0 (their sum over ranks is kept). Refuses, on every
    rank alike, a state of which some rank would own more ids than ``capacity``."""
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
    part.totals = dict(state.totals) if rank == 0 else {k: 0 for k in state.totals}
    return part


# ---- a distributed model's collection with dynamic tables ----------------------------------------
def without_dynamic(plan: Any, tables: Sequence[TableConfig]) -> Any:
    """``plan`` without the dynamic tables of ``tables``: they are never placed by a plan (row-wise
    by the hash of the raw id over every rank, ``ShardedDynamicEmbeddingBagCollection``)."""
    dyn = {t.name for t in tables if getattr(t, "kind", "fixed") == "dynamic"}
    return replace(plan, tables=[tp for tp in plan.tables if tp.name not in dyn])
