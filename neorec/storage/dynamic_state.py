"""The state of a dynamic table by raw id (``DynamicTableState``): what ``export_table`` gives and
``import_table`` takes, so a table restores into any slot numbering, capacity or world size (a
sharded rank imports the ids it owns).

Slot numbers are not part of the state: the id map breaks ties between victims by raw id, so a map
rebuilt from (ids, uses, last use, step, sketch) takes the same admission and eviction decisions
as the original, and rows and optimizer state travel with their ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.id_map import _I32_MAX, SKETCH_DEPTH, IdMap

__all__ = [
    "DynamicTableState",
    "export_table_state",
    "import_table_state",
    "select_ids",
    "check_table_state",
    "map_items",
    "load_map_items",
]


@dataclass
class DynamicTableState:
    """One dynamic table by raw id (all tensors on the CPU)."""

    ids: Tensor
    """int64 [n]: live raw ids, ascending."""
    rows: Tensor
    """float32 [n, dim]: their rows."""
    states: dict[str, Tensor]
    """Optimizer state per id, first dim n (``momentum1`` [n], ``exp_avg`` / ``exp_avg_sq``
    [n, dim]; names as the collection's ``state_names``)."""
    uses: Tensor
    """int64 [n]: uses since admission (the LFU key)."""
    last_use: Tensor
    """int64 [n]: the map step of the last use (the LRU / TTL key)."""
    step: int
    """The map's step counter (one per training batch)."""
    sketch: Tensor = field(default_factory=lambda: torch.zeros(4, 1, dtype=torch.int32))
    """int32 [depth, width]: the threshold admission's count-min sketch (zeros otherwise)."""
    sketch_total: int = 0
    """Sightings counted by the sketch since it last halved."""
    totals: dict[str, int] = field(default_factory=dict)
    """Running counts: admitted, evicted, unadmitted, lookups."""
    default_row: Tensor | None = None
    """float32 [dim]: the shared row of unadmitted ids (``unadmitted = "default_row"``)."""
    default_states: dict[str, Tensor] = field(default_factory=dict)
    """The default row's optimizer state (one row of each of ``states``)."""

    @property
    def dim(self) -> int:
        """Columns of a row."""
        return int(self.rows.shape[1])

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (tensors, ints, dicts) for ``torch.save``."""
        return {
            "ids": self.ids,
            "rows": self.rows,
            "states": dict(self.states),
            "uses": self.uses,
            "last_use": self.last_use,
            "step": int(self.step),
            "sketch": self.sketch,
            "sketch_total": int(self.sketch_total),
            "totals": dict(self.totals),
            "default_row": self.default_row,
            "default_states": dict(self.default_states),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DynamicTableState:
        """Inverse of ``to_dict``."""
        return cls(**d)


def select_ids(state: DynamicTableState, keep: Tensor) -> DynamicTableState:
    """The part of ``state`` whose ids ``keep`` (bool [n]) selects: e.g. the ids one rank owns.
    Map step, sketch, totals and the default row are kept whole."""
    return DynamicTableState(
        ids=state.ids[keep],
        rows=state.rows[keep],
        states={k: v[keep] for k, v in state.states.items()},
        uses=state.uses[keep],
        last_use=state.last_use[keep],
        step=state.step,
        sketch=state.sketch,
        sketch_total=state.sketch_total,
        totals=dict(state.totals),
        default_row=state.default_row,
        default_states=dict(state.default_states),
    )


def map_items(m: IdMap) -> dict[str, Any]:
    """The map by raw id: ``ids`` (live, ascending), their ``slots``, ``uses`` (hits),
    ``last_use``, plus ``step``, ``sketch`` [depth, width], ``sketch_total``, ``totals``.
    Slot numbers are informative only: ``load_map_items`` of the rest rebuilds a map that takes
    the same decisions (ties between victims go by raw id, never by slot)."""
    slots, ids = m.live_items()
    order = torch.argsort(ids, stable=True)
    slots, ids = slots[order], ids[order]
    return {
        "ids": ids.clone(),
        "slots": slots,
        "uses": m.hits[slots].clone(),
        "last_use": m.last[slots].clone(),
        "step": int(m.steps),
        "sketch": m.sketch.view(SKETCH_DEPTH, m.width).clone(),
        "sketch_total": int(m.sk_total),
        "totals": dict(m.totals),
    }


def load_map_items(
    m: IdMap,
    ids: Tensor,
    uses: Tensor,
    last_use: Tensor,
    step: int,
    sketch: Tensor | None = None,
    sketch_total: int = 0,
    totals: dict[str, int] | None = None,
) -> Tensor:
    """Replace the whole map by live ``ids`` (ascending, distinct, at most ``capacity``) with
    their ``uses`` / ``last_use``, the step counter ``step`` and the threshold admission's
    ``sketch`` [depth, any power-of-two width] (folded by sums or tiled to this map's width:
    counts can only grow, so an id is never admitted late). Ids take slots ``0 .. n-1`` in
    order; returns those slots."""
    ids = ids.to(torch.int64).flatten()
    n = ids.numel()
    if n > m.capacity:
        raise ConfigError(
            f"load_map_items: {n} live ids do not fit in capacity {m.capacity}; "
            "import into a table with capacity >= the number of ids"
        )
    if n > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError("load_map_items: ids must be distinct and ascending")
    for what, t in (("uses", uses), ("last_use", last_use)):
        if tuple(t.shape) != (n,):
            raise ConfigError(f"load_map_items: {what} has shape {tuple(t.shape)}, want ({n},)")
    cap = m.capacity
    m.id_of.zero_()
    m.live.zero_()
    m.last.zero_()
    m.hits.zero_()
    m.id_of[:n] = ids
    m.live[:n] = 1
    m.hits[:n] = uses.to(torch.int64)
    m.last[:n] = last_use.to(torch.int64)
    m.free.zero_()
    m.free[: cap - n] = torch.arange(cap - 1, n - 1, -1, dtype=torch.int64)
    m.n_free = cap - n
    m.steps = int(step)
    m.sketch.zero_()
    m.sk_total = 0
    if sketch is not None and m.admission == "threshold" and sketch.numel():
        sk = sketch.to(torch.int64).reshape(SKETCH_DEPTH, -1)
        w = sk.shape[1]
        if w & (w - 1):
            raise ConfigError(f"load_map_items: sketch width {w} is not a power of two")
        if w > m.width:  # fold: counter j gets every counter whose low bits are j
            sk = sk.view(SKETCH_DEPTH, w // m.width, m.width).sum(1)
        elif w < m.width:  # tile: counter j reads counter j mod w
            sk = sk.repeat(1, m.width // w)
        m.sketch.copy_(sk.clamp(max=_I32_MAX).to(torch.int32).flatten())
        m.sk_total = int(sketch_total)
    if totals is not None:
        m.totals = {k: int(totals.get(k, 0)) for k in m.totals}
    m._rebuild()
    return torch.arange(n, dtype=torch.int64)


def export_table_state(ebc: Any, i: int) -> DynamicTableState:
    """Table ``i`` of a ``DynamicEmbeddingBagCollection`` by raw id (copies on the CPU; a
    collection behind a row cache flushes it first)."""
    m = ebc.id_maps[i]
    items = map_items(m)
    rows, states = ebc._read_slots(i, items["slots"])
    default_row, default_states = None, {}
    if ebc.default_rows[i]:
        d, ds = ebc._read_slots(i, torch.tensor([ebc.capacities[i]]))
        default_row, default_states = d[0], {k: v[0] for k, v in ds.items()}
    return DynamicTableState(
        ids=items["ids"],
        rows=rows,
        states=states,
        uses=items["uses"],
        last_use=items["last_use"],
        step=items["step"],
        sketch=items["sketch"],
        sketch_total=items["sketch_total"],
        totals=items["totals"],
        default_row=default_row,
        default_states=default_states,
    )


def check_table_state(ebc: Any, i: int, s: DynamicTableState) -> None:
    """``ConfigError`` (one line) when ``s`` cannot be imported into table ``i`` of ``ebc``:
    more ids than the capacity, another dim or optimizer, unsorted ids, shapes."""
    spec = ebc.tables[i]
    where = f"import_table '{spec.name}'"
    cap, dim = ebc.capacities[i], spec.dim
    if not isinstance(s, DynamicTableState):
        raise ConfigError(f"{where}: want a DynamicTableState, got {type(s).__name__}")
    if s.ids.dtype != torch.int64 or s.ids.dim() != 1:
        raise ConfigError(f"{where}: ids must be int64 [n], got {s.ids.dtype} {list(s.ids.shape)}")
    n = s.ids.numel()
    if n > cap:
        raise ConfigError(
            f"{where}: {n} live ids exceed the table's capacity {cap}; raise capacity to >= {n}"
        )
    if s.rows.dim() != 2 or s.rows.shape[1] != dim:
        raise ConfigError(
            f"{where}: rows have shape {list(s.rows.shape)}, the table's dim is {dim}; "
            "import into a table of the same dim"
        )
    if s.rows.shape[0] != n:
        raise ConfigError(f"{where}: {s.rows.shape[0]} rows for {n} ids")
    if sorted(s.states) != sorted(ebc.state_names):
        raise ConfigError(
            f"{where}: optimizer state {sorted(s.states)} does not match the collection's "
            f"{sorted(ebc.state_names)} (another optimizer?)"
        )
    for k, v in s.states.items():
        want = [n] if k == "momentum1" else [n, dim]
        if list(v.shape) != want:
            raise ConfigError(f"{where}: state '{k}' has shape {list(v.shape)}, want {want}")
    if ebc.default_rows[i] and s.default_row is not None and s.default_row.numel() != dim:
        raise ConfigError(f"{where}: default row has {s.default_row.numel()} values, dim {dim}")


def import_table_state(ebc: Any, i: int, s: DynamicTableState) -> None:
    """Replace table ``i``'s map, rows and optimizer state by ``s`` (see ``DynamicTableState``);
    slots not in ``s`` are zeroed. Refuses (``ConfigError``) a state that does not fit."""
    check_table_state(ebc, i, s)
    m = ebc.id_maps[i]
    live = torch.sort(m.live_items()[0]).values
    slots = load_map_items(
        m, s.ids, s.uses, s.last_use, s.step, s.sketch, s.sketch_total, s.totals or None
    )
    ebc._clear_slots(i, live)
    ebc._write_slots(i, slots, s.rows, s.states)
    if ebc.default_rows[i] and s.default_row is not None:
        one = {k: v.reshape(1, -1 if v.dim() else 1) for k, v in s.default_states.items()}
        one = {k: v.flatten() if k == "momentum1" else v for k, v in one.items()}
        ebc._write_slots(i, torch.tensor([ebc.capacities[i]]), s.default_row.reshape(1, -1), one)
    ebc._pins[i].zero_()
