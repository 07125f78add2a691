"""The local parts of a sharded dynamic collection (``ShardedDynamicEmbeddingBagCollection``): one
unsharded dynamic collection per init bound, of ``ceil(capacity / W)`` slots a table, in memory,
or with its slot rows in a DRAM / SSD store behind the row cache
(``DynamicCachedEmbeddingBagCollection``) when one of its tables has ``storage = "dram" | "ssd"``;
and the check that every rank was built alike.

Each rank's stores are its own: the SSD store files of rank r go to ``<storage_dir>/rank<r>/``
(``<table>.rows``), so the ranks of one host never share a file; the cache settings of a table
(``cache_rows`` / ``cache_fraction`` / ``cache_policy``) count the rank's slots.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from neorec.config import TableConfig
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec
from neorec.ops.tbe import PoolingMode
from neorec.storage.cache_table import cache_stats
from neorec.storage.dynamic import DynamicEmbeddingBagCollection, table_capacity
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.store import StoreError, StoreSettings

__all__ = ["check_same_everywhere", "rank_store_dir", "build_parts", "parts_stats"]


def check_same_everywhere(
    who: str, tables: Sequence[TableConfig], spec: CollectionSpec, group: dist.ProcessGroup | None
) -> None:
    """One-line ``ConfigError`` on every rank of ``group`` when its ranks were built with other
    dynamic tables, or another optimizer, pooling, seed or init scale in ``spec`` (a collective;
    nothing without a process group)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return
    desc = [
        (t.name, t.dim, tuple(t.features), table_capacity(t), t.admission, t.admit_threshold,
         t.admit_probability, t.eviction, t.ttl_steps, t.unadmitted)
        for t in tables
    ]  # fmt: skip
    pooling = PoolingMode(spec.pooling).value
    mine = repr((desc, spec.optimizer, pooling, int(spec.seed), float(spec.init_scale)))
    got: list[str] = [""] * world
    dist.all_gather_object(got, mine, group=group)
    for r, g in enumerate(got):
        if g != got[0]:
            raise ConfigError(
                f"{who}: rank {r} was built with other dynamic tables, "
                f"optimizer, pooling or seed than rank 0 (crc32 {zlib.crc32(g.encode()):08x} "
                f"vs {zlib.crc32(got[0].encode()):08x}); build every rank from one config"
            )


def rank_store_dir(storage_dir: str | Path, rank: int) -> Path:
    """The folder of rank ``rank``'s SSD row stores: ``<storage_dir>/rank<rank>``."""
    return Path(storage_dir) / f"rank{rank}"


def _store_dir(tables: Sequence[TableConfig], storage_dir: str | Path, rank: int) -> str:
    """Rank ``rank``'s store folder, created when a table is on ssd (``""``: none needed); one
    line naming the table or the folder when it cannot be."""
    ssd = [t.name for t in tables if t.storage == "ssd"]
    if not ssd:
        return str(rank_store_dir(storage_dir, rank)) if storage_dir else ""
    if not str(storage_dir):
        raise ConfigError(
            f"dynamic tables {ssd} have storage 'ssd' but no storage directory (storage.dir)"
        )
    where = rank_store_dir(storage_dir, rank)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(
            f"rank {rank}'s row store folder {where} cannot be created ({e.strerror or e}); "
            f"point storage.dir at a writable directory (dynamic tables {ssd} are on ssd)"
        ) from None
    return str(where)


def build_parts(
    tables: Sequence[TableConfig],
    capacities: Sequence[int],
    bounds: Sequence[float],
    spec: CollectionSpec,
    native: bool | None,
    rank: int,
    storage: StoreSettings | None = None,
) -> list[DynamicEmbeddingBagCollection]:
    """This rank's parts: ``tables`` with their per-rank ``capacities``, unadmitted ids dropped
    (the sharded module holds the default rows), grouped by init ``bounds`` so each id's initial
    row is the unsharded one (``spec``'s init scale replaced by the bound; sum pooling, on the
    CPU); a group with a dram / ssd table behind a row cache (its memory tables in the cache's
    fast tier), its stores in ``rank_store_dir(storage.dir, rank)``."""
    storage = storage or StoreSettings()
    groups: dict[float, list[TableConfig]] = {}
    for t, c, bd in zip(tables, capacities, bounds):
        groups.setdefault(bd, []).append(replace(t, capacity=c, unadmitted="zeros"))
    root = ""
    if any(t.storage != "memory" for t in tables):
        root = _store_dir(tables, storage.dir, rank)
    mine = replace(storage, dir=root)
    parts: list[DynamicEmbeddingBagCollection] = []
    for bd, ts in groups.items():
        part_spec = replace(spec, pooling="sum", init_scale=bd)
        if any(t.storage != "memory" for t in ts):
            parts.append(DynamicCachedEmbeddingBagCollection(ts, part_spec, "cpu", native, mine))
        else:
            parts.append(DynamicEmbeddingBagCollection(ts, part_spec, "cpu", native))
    return parts


def parts_stats(parts: Sequence[DynamicEmbeddingBagCollection]) -> dict[str, Any]:
    """Per table, this rank's map counters (``DynamicEmbeddingBagCollection.stats``) and, on
    dram / ssd, its cache's under ``cache``; the row caches' totals over every part at the top
    level (hits, misses, hit rates, bytes per tier; none when every table is in memory)."""
    out: dict[str, Any] = {}
    caches = []
    for p in parts:
        s = p.stats()
        out.update({t.name: s[t.name] for t in p.tables})
        if isinstance(p, DynamicCachedEmbeddingBagCollection):
            caches += p.cache_tables()
    if caches:
        totals = cache_stats(caches)
        totals.pop("tables")
        out.update(totals)
    return out
