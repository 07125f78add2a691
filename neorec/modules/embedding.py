"""EmbeddingBagCollection: many pooled embedding tables over one fused TBE call."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor, nn

from neorec.config import ConfigError, TableConfig
from neorec.modules.collection import EmbeddingCollection, UpdateHook, optimizer_state_of
from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat, bytes_per_row, table_key
from neorec.ops.memory import table_empty
from neorec.ops.row_optim import RowOptimizer, state_shapes, zeros_state
from neorec.ops.tbe import (
    Lookup,
    PoolingMode,
    TBEBackend,
    TBELayout,
    check_finite_weights,
    check_grad_output,
    get_backend,
    tbe_lookup,
)
from neorec.phases import rows_initialized, table_init_skipped
from neorec.sparse import SparseFeatureError, SparseFeatures

__all__ = [
    "EmbeddingBagCollection",
    "UpdateHook",
    "init_rows",
    "INIT_CHUNK_ROWS",
    "checked_batch",
    "feature_maps",
    "check_collection_args",
    "check_memory",
    "check_tables_memory",
]

INIT_CHUNK_ROWS = 8192
"""Rows per independently seeded init chunk: any row range can be generated on its own."""


def init_rows(
    spec: TableConfig,
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
    bound = init_scale or math.sqrt(1.0 / spec.rows)
    if out is None:
        out = torch.empty(row_end - row_start, spec.dim)
    name_key = zlib.crc32(spec.name.encode())
    gen = torch.Generator(device="cpu")
    first = row_start // INIT_CHUNK_ROWS
    last = (row_end - 1) // INIT_CHUNK_ROWS if row_end > row_start else first - 1
    for c in range(first, last + 1):
        lo, hi = c * INIT_CHUNK_ROWS, min(spec.rows, (c + 1) * INIT_CHUNK_ROWS)
        gen.manual_seed((seed * 1_000_003 + name_key * 7_919 + c) % (1 << 63))
        vals = torch.rand(hi - lo, spec.dim, generator=gen).mul_(2 * bound).sub_(bound)
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


class EmbeddingBagCollection(EmbeddingCollection):
    """Pooled lookups of every table in one TBE call; trained by a fused row optimizer.

    Weights and optimizer state are flat buffers (see ``neorec.ops.tbe``), so they are in
    ``state_dict()`` but never handed to a dense ``torch.optim`` optimizer; the embedding update
    happens inside ``loss.backward()``. The weights are float32, or packed fp16 / bf16 / fp8 rows
    when the tables' ``precision`` says so (one precision per collection; the optimizer state
    stays float32; see ``neorec.ops.lowp_rows``); ``rounding`` is how updated rows are stored.
    """

    weights: Tensor
    step: Tensor

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: RowOptimizer | None = None,
        pooling: str = "sum",
        backend: str = "auto",
        device: torch.device | str = "cpu",
        init_scale: float = 0.0,
        seed: int = 0,
        validate_ids: bool = True,
        rounding: str = "auto",
    ) -> None:
        super().__init__()
        check_collection_args(tables, optimizer, pooling, init_scale, seed, validate_ids)
        self.row_format = RowFormat(table_precision(tables))
        self.tables = list(tables)
        self.optimizer = optimizer or RowOptimizer()
        self.pooling = PoolingMode(pooling)
        self.validate_ids = validate_ids
        self.feature_names = [f for t in self.tables for f in t.features]
        feature_table = tuple(i for i, t in enumerate(self.tables) for _ in t.features)
        self.layout = TBELayout(
            rows=tuple(t.rows for t in self.tables),
            dims=tuple(t.dim for t in self.tables),
            feature_table=feature_table,
        )
        device = as_device(device)
        self.backend: TBEBackend = get_backend(backend, device)
        packed = None
        if self.row_format.precision != "fp32":
            keys = [(table_key(t.name), 0, 0, t.dim) for t in self.tables]
            self.backend = LowpRowsBackend(self.backend, self.row_format, rounding, seed, keys)
            packed = self.row_format.empty(self.layout, device)
        self.rounding = getattr(self.backend, "rounding", "nearest")
        check_memory(self.tables, self.layout, self.optimizer.kind, device)
        register_table_buffers(self, self.layout, self.optimizer.kind, device, weights=packed)
        # Zero-element tensor that puts the TBE op in the autograd graph (see tbe_lookup).
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._rows_by_feature, self._table_by_feature = feature_maps(self.tables)
        self._hooks: list[UpdateHook] = []
        self._host_step: tuple[Tensor, int, int] | None = None  # (step, its _version, value)
        self.reset_parameters(init_scale, seed)

    # ---- parameters ----------------------------------------------------------------------
    def reset_parameters(self, init_scale: float = 0.0, seed: int = 0) -> None:
        """Uniform init per table: +-init_scale, or +-sqrt(1/rows) as in the reference DLRM."""
        fmt = self.row_format
        for t, spec in enumerate(self.tables if not table_init_skipped() else []):
            if fmt.precision == "fp32":
                init_rows(
                    spec, seed, 0, spec.rows, init_scale, out=self.layout.table(self.weights, t)
                )
                continue
            for lo in range(0, spec.rows, INIT_CHUNK_ROWS):  # rounded to nearest, chunk by chunk
                hi = min(spec.rows, lo + INIT_CHUNK_ROWS)
                rows = init_rows(spec, seed, lo, hi, init_scale)
                fmt.encode(self.weights, self.layout, t, torch.arange(lo, hi), rows)
        for k in self.state_names:
            getattr(self, k).zero_()
        self.step.zero_()

    @property
    def state_names(self) -> list[str]:
        """Names of the optimizer state buffers."""
        return list(optimizer_state_of(self))

    def optimizer_state(self) -> dict[str, Tensor]:
        """The fused optimizer's state tensors (flat)."""
        return optimizer_state_of(self)

    def table_weight(self, name: str) -> Tensor:
        """One table's weights [rows, dim]: a view of the fp32 buffer, or for low-precision
        tables their fp32 values (a copy; write with ``set_table_weight``)."""
        t = self._table_index(name)
        if self.row_format.precision == "fp32":
            return self.layout.table(self.weights, t)
        return self.row_format.decode(self.weights, self.layout, t)

    def set_table_weight(self, name: str, rows: Tensor) -> None:
        """Overwrite one table's weights with fp32 ``rows`` [rows, dim] (rounded to nearest)."""
        t = self._table_index(name)
        want = (self.layout.rows[t], self.layout.dims[t])
        if tuple(rows.shape) != want:
            raise ConfigError(f"table '{name}': rows must be {list(want)}, got {list(rows.shape)}")
        self.row_format.encode(self.weights, self.layout, t, None, rows.to(self.weights.device))

    def _table_index(self, name: str) -> int:
        for i, t in enumerate(self.tables):
            if t.name == name:
                return i
        raise KeyError(f"no table '{name}' (tables: {[t.name for t in self.tables]})")

    def add_update_hook(self, hook: UpdateHook) -> None:
        """Call ``hook(layout, indices, offsets)`` after every fused update (row tracking)."""
        self._hooks.append(hook)

    @property
    def output_dim(self) -> int:
        """Columns of the pooled output."""
        return self.layout.total_dim

    def _next_step(self) -> int:
        """``self.step + 1`` from a host copy of the (device) counter: read once, and again only
        after something else wrote or replaced it (a restore, a reset, a move: the buffer or its
        version changed)."""
        seen, buf = self._host_step, self.step
        if seen is None or seen[0] is not buf or seen[1] != buf._version:
            seen = (buf, buf._version, int(buf))  # a host read: first step, or after a write
            self._host_step = seen
        return seen[2] + 1

    def stage_input_dist(self, sparse: SparseFeatures, host: SparseFeatures | None = None) -> None:
        """Check ``host``, the host copy of a later batch whose device copy is ``sparse``, and
        mark the device copy checked: its forward then reads nothing back from the device."""
        if host is not None and host.keys == self.feature_names:
            checked_batch(self, host)  # raises SparseFeatureError naming the culprit
            sparse.checked_for = self  # type: ignore[attr-defined]

    # ---- forward -------------------------------------------------------------------------
    def forward(self, sparse: SparseFeatures) -> Tensor:
        """Pooled embeddings [B, sum of dims], features in ``feature_names`` order.

        The batch is checked first (see ``checked_batch``); a zero-sample batch gives a [0, D]
        output whose backward changes nothing (no rows, no step).
        """
        sparse = checked_batch(self, sparse)
        dev = self.weights.device
        indices = sparse.values.to(dev, torch.int64)
        offsets = sparse.offsets().to(dev)
        psw = sparse.weights.to(dev) if sparse.weights is not None else None
        samples = sparse.batch_size
        lookup = Lookup(indices, offsets, psw, self.pooling)

        def update(grad_output: Tensor) -> None:
            if samples == 0:
                return
            check_grad_output(grad_output, self.layout)
            check_finite_weights(psw)
            step = self._next_step()
            self.backend.backward_update(
                self.layout,
                self.weights,
                self.optimizer_state(),
                lookup,
                grad_output,
                self.optimizer,
                step,
            )
            # Counted once the update went through: a refused batch leaves Adam's count alone.
            self.step.fill_(step)
            self._host_step = (self.step, self.step._version, step)
            for hook in self._hooks:
                hook(self.layout, indices, offsets)

        return tbe_lookup(self._anchor, self.backend, self.layout, self.weights, lookup, update)


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


def table_precision(tables: Sequence[TableConfig]) -> str:
    """The one precision of ``tables`` (``ConfigError`` when they differ: build one collection
    per precision, e.g. with ``GroupedEmbeddingBagCollection``)."""
    precs = sorted({getattr(t, "precision", "") or "fp32" for t in tables})
    if len(precs) > 1:
        raise ConfigError(
            f"one EmbeddingBagCollection holds one precision, got {precs}; group the tables by "
            "precision (neorec.modules.GroupedEmbeddingBagCollection)"
        )
    return precs[0]


def as_device(device: object) -> torch.device:
    """``torch.device(device)``, or a ``ConfigError`` naming the bad value."""
    try:
        return torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device: {device!r} is not a device ({e})".splitlines()[0]) from None


def check_collection_args(
    tables: object,
    optimizer: object,
    pooling: object,
    init_scale: object,
    seed: object,
    validate_ids: object,
    who: str = "EmbeddingBagCollection",
) -> None:
    """Raise ``ConfigError`` naming the first bad constructor argument of collection ``who``."""
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
    if optimizer is not None and not isinstance(optimizer, RowOptimizer):
        raise ConfigError(
            f"{who}: optimizer must be a RowOptimizer (e.g. RowOptimizer(kind='adam')), "
            f"got {type(optimizer).__name__} {optimizer!r}"[:300]
        )
    if pooling not in [m.value for m in PoolingMode]:
        raise ConfigError(f"{who}: pooling must be 'sum' or 'mean', got {pooling!r}")
    scale = float(init_scale) if isinstance(init_scale, Real) else math.nan
    if isinstance(init_scale, bool) or not (math.isfinite(scale) and scale >= 0):
        raise ConfigError(
            f"{who}: init_scale must be a finite number >= 0 (0 = sqrt(1/rows)), got {init_scale!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise ConfigError(f"{who}: seed must be an integer, got {seed!r}")
    if not isinstance(validate_ids, bool):
        raise ConfigError(f"{who}: validate_ids must be True or False, got {validate_ids!r}")


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
