"""The parts every embedding collection is built from: the tables' initial rows, their flat
buffers, the feature maps and checks of a batch, the tables' checks and the memory they need.

``init_rows`` is the one initializer of fixed tables' rows (in memory, cached, sharded, replicated):
any row range of a table from (seed, table name, chunk), the same in every layout.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from numbers import Integral
from typing import Any

import torch
from torch import Tensor, nn

from neorec.config import ConfigError, TableConfig
from neorec.ops.lowp_rows import bytes_per_row
from neorec.ops.memory import table_empty
from neorec.ops.row_optim import state_shapes, zeros_state
from neorec.ops.tbe import TBELayout
from neorec.phases import rows_initialized
from neorec.sparse import SparseFeatureError, SparseFeatures

__all__ = [
    "INIT_CHUNK_ROWS",
    "init_rows",
    "register_table_buffers",
    "feature_maps",
    "checked_batch",
    "as_device",
    "check_tables",
    "check_memory",
    "check_tables_memory",
]

INIT_CHUNK_ROWS = 8192
"""Rows per independently seeded init chunk: any row range can be generated on its own."""


def init_rows(
    table: TableConfig,
    seed: int,
    row_start: int,
    row_end: int,
    init_scale: float = 0.0,
    out: Tensor | None = None,
) -> Tensor:
    """Initial values of rows ``[row_start, row_end)`` of a table, the same in every layout.

    Each chunk of ``INIT_CHUNK_ROWS`` rows has its own generator seeded from (seed, table name,
    chunk), so a shard, a cache fill or a checkpoint test can build any slice without the rest.
    """
    bound = init_scale or math.sqrt(1.0 / table.rows)
    if out is None:
        out = torch.empty(row_end - row_start, table.dim)
    name_key = zlib.crc32(table.name.encode())
    gen = torch.Generator(device="cpu")
    first = row_start // INIT_CHUNK_ROWS
    last = (row_end - 1) // INIT_CHUNK_ROWS if row_end > row_start else first - 1
    for c in range(first, last + 1):
        lo, hi = c * INIT_CHUNK_ROWS, min(table.rows, (c + 1) * INIT_CHUNK_ROWS)
        gen.manual_seed((seed * 1_000_003 + name_key * 7_919 + c) % (1 << 63))
        vals = torch.rand(hi - lo, table.dim, generator=gen).mul_(2 * bound).sub_(bound)
        a, b = max(lo, row_start), min(hi, row_end)
        out[a - row_start : b - row_start].copy_(vals[a - lo : b - lo])
        rows_initialized(b - a)
    return out


def register_table_buffers(
    module: nn.Module,
    layout: TBELayout,
    optimizer: str,
    device: torch.device,
    prefix: str = "",
    weights: Tensor | None = None,
) -> None:
    """Register ``{prefix}weights`` (``weights``, else uninitialized), the fused optimizer's zeroed
    state and a ``{prefix}step`` counter as buffers of ``module``, for a flat TBE ``layout``."""
    if weights is None:
        weights = table_empty(layout.total_elems, device=device)
    module.register_buffer(prefix + "weights", weights)
    for k, v in zeros_state(optimizer, layout.total_rows, layout.total_elems, device).items():
        module.register_buffer(prefix + k, v)
    module.register_buffer(prefix + "step", torch.zeros((), dtype=torch.int64))


def feature_maps(
    tables: Sequence[TableConfig], rows_of: Callable[[TableConfig], int] | None = None
) -> tuple[dict[str, int], dict[str, str]]:
    """Each feature's table rows (``rows_of(table)``, default its ``rows``) and table name: what
    ``checked_batch`` checks a batch's ids and keys against."""
    rows = rows_of or (lambda t: t.rows)
    return (
        {f: rows(t) for t in tables for f in t.features},
        {f: t.name for t in tables for f in t.features},
    )


def checked_batch(ebc: Any, sparse: SparseFeatures, ids: bool = False) -> SparseFeatures:
    """``sparse`` in ``ebc``'s feature order, refused with a ``SparseFeatureError`` unless well
    formed: lengths, finite per-id weights of the tables' dtype, and (``ebc.validate_ids`` or
    ``ids``) ids within their tables. Vectorized: a few passes over the batch, no loop per id.
    A batch marked ``checked_for = ebc`` (the training pipeline checks the host copy of a batch
    it copies to a GPU, ``neorec.train.pipeline``) is not checked again on the device (no host
    read in the step)."""
    if not isinstance(sparse, SparseFeatures):
        raise SparseFeatureError(
            f"{type(ebc).__name__} takes a SparseFeatures batch, got {type(sparse).__name__}"
        )
    sparse = sparse.reorder(ebc.feature_names)
    if getattr(sparse, "checked_for", None) is ebc and not ids:
        return sparse  # its host copy passed these checks before it was copied here
    rows = ebc._rows_by_feature if ebc.validate_ids or ids else None
    dtype = ebc.weights.dtype if ebc.weights.is_floating_point() else torch.float32
    if ebc.row_format is not None and ebc.row_format.precision != "fp32":
        dtype = torch.float32  # low-precision rows pool in fp32
    sparse.validate(rows, ebc._table_by_feature, weight_dtype=dtype)
    return sparse


def as_device(device: object) -> torch.device:
    """``torch.device(device)``, or a ``ConfigError`` naming the bad value."""
    try:
        return torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device: {device!r} is not a device ({e})".splitlines()[0]) from None


def check_tables(tables: object, who: str) -> None:
    """Raise ``ConfigError`` naming the first bad table of collection ``who``: not a non-empty
    list, a bad name, rows, dim or features, a name twice, a feature reading two tables."""
    if isinstance(tables, str | bytes) or not isinstance(tables, Sequence) or not tables:
        raise ConfigError(f"{who}: tables must be a non-empty list of TableConfig, got {tables!r}")
    names: set[str] = set()
    features: dict[str, str] = {}
    for i, t in enumerate(tables):
        _check_table(t, i, who)
        if t.name in names:
            raise ConfigError(f"{who}: table name '{t.name}' appears more than once")
        names.add(t.name)
        for f in t.features:
            if f in features:
                raise ConfigError(
                    f"{who}: feature '{f}' reads both table '{features[f]}' and '{t.name}'"
                )
            features[f] = t.name


def _check_table(t: object, i: int, who: str) -> None:
    name = getattr(t, "name", None)
    where = f"{who}: table {i}" + (f" '{name}'" if isinstance(name, str) else "")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: name must be a non-empty string, got {name!r}")
    for attr in ("rows", "dim"):
        v = getattr(t, attr, None)
        if isinstance(v, bool) or not isinstance(v, Integral) or v <= 0:
            raise ConfigError(f"{where}: {attr} must be an integer > 0, got {v!r}")
    feats = getattr(t, "features", None)
    if (
        isinstance(feats, str)
        or not isinstance(feats, Sequence)
        or not feats
        or not all(isinstance(f, str) and f for f in feats)
    ):
        raise ConfigError(f"{where}: features must be a non-empty list of names, got {feats!r}")
    if len(set(feats)) != len(feats):
        raise ConfigError(f"{where}: features {list(feats)} repeat a name")


def check_memory(
    tables: Sequence[TableConfig],
    layout: TBELayout,
    optimizer: str,
    device: torch.device,
    host_bytes: int = 0,
) -> None:
    """Refuse tables whose weights and optimizer state (and ``host_bytes`` more in host memory,
    e.g. row stores) cannot fit this machine (RAM + swap) before allocating them: an allocation
    that large fails late, or never returns."""
    state = state_shapes(optimizer, layout.total_rows, layout.total_elems)
    weights = (
        sum(
            r * bytes_per_row(getattr(t, "precision", "") or "fp32", d)
            for t, r, d in zip(tables, layout.rows, layout.dims)
        )
        if len(tables) == layout.num_tables
        else 4 * layout.total_elems
    )
    need = weights + 4 * sum(state.values())
    host = host_bytes + (need if device.type == "cpu" else 0)
    avail = _memory_bytes()
    if max(need, host) < 2**63 and (avail is None or host <= avail):
        return
    biggest = max(tables, key=lambda t: t.rows * t.dim)
    have = f", this machine has {avail / 2**30:,.1f} GiB" if avail else ""
    raise ConfigError(
        f"the tables need {max(need, host) / 2**30:,.1f} GiB of memory{have} (largest: "
        f"'{biggest.name}', {biggest.rows:,} rows x {biggest.dim}); lower the rows or put "
        "large tables in storage ssd"
    )


def check_tables_memory(
    tables: Sequence[TableConfig], optimizer: str, device: torch.device | str = "cpu"
) -> None:
    """``check_memory`` for a config's tables before anything is built (data readers, workers,
    the model): weights and optimizer state of the in-memory tables, plus the host memory of the
    ``dram`` / ``ssd`` tables (a 4-byte slot per row; a DRAM store holds rows and state)."""
    # A dynamic table holds ``capacity`` slot rows (+ a default row), not ``rows``.
    tables = [
        replace(t, rows=(getattr(t, "capacity", 0) or t.rows) + 1)
        if getattr(t, "kind", "fixed") == "dynamic"
        else t
        for t in tables
    ]
    resident = [t for t in tables if t.storage == "memory"]
    host = 0
    for t in tables:
        if t.storage != "memory":
            host += 4 * t.rows
        if t.storage == "dram":
            host += 4 * (
                t.rows * t.dim + sum(state_shapes(optimizer, t.rows, t.rows * t.dim).values())
            )
    layout = TBELayout(
        rows=tuple(t.rows for t in resident), dims=tuple(t.dim for t in resident), feature_table=()
    )
    check_memory(resident or list(tables), layout, optimizer, as_device(device), host)


def _memory_bytes() -> int | None:
    """RAM + swap in bytes (Linux), else None (no check)."""
    try:
        with open("/proc/meminfo") as fh:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in fh if ln.split()[1:2]}
        return 1024 * (kb["MemTotal"] + kb.get("SwapTotal", 0))
    except (OSError, KeyError, ValueError, IndexError):
        return None
