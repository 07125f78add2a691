"""Predicted time and memory of embedding shards on a ``Topology`` (a simulation, not a measurement).

Model, per shard and per training step with global batch ``B`` (the same for every method that is
scored, planner or baseline):

- compute: bytes moved by the forward lookups (ids, gathered rows, pooled outputs) and by the
  backward (pooled grads, per-id grads, read/write of the touched rows and their optimizer state:
  sgd none, rowwise_adagrad 1 float per row, adam 2 floats per element). Row bytes move at the
  bandwidth of the tier the rows live in (``device`` HBM, or ``host`` DRAM over the host link);
  the rest at device bandwidth. Touched rows ``u = r (1 - exp(-h / r))`` for ``h`` uniform hits.
- communication on the owner: ids in, pooled outputs out, their gradients back in, split into
  intra-host and inter-host bytes by where the batch's samples live; data-parallel tables
  all-reduce their full gradient instead. Table-row-wise reduces partial sums inside the host
  before anything crosses hosts.
- sample side (the same on every rank): each rank sends its ids and receives pooled outputs of
  every sharded table; row-wise tables multiply the outputs, column-wise ones the ids.
- memory: weights and optimizer state (in the table's storage tier) plus id/output/grad buffers
  (always on the device).

A rank's predicted time is the sum of its shards' times plus the sample-side term; the step's
predicted embedding time is the slowest rank's. Constants come from the ``Topology`` and can be
calibrated (``neorec plan --calibrate``); checking them against measured steps is future work.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neorec.config import TableConfig
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import STORAGES, Shard, ShardingPlan, ShardingType, parse_sharding_type

__all__ = [
    "OPTIMIZERS",
    "PHASES",
    "TableSpec",
    "ShardCost",
    "RankCost",
    "PlanCost",
    "CostModel",
    "load_tables",
    "tables_from_config",
]

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")


@dataclass(kw_only=True)
class TableSpec:
    """One table as the planner sees it: shape, load, and per-table constraints."""

    name: str
    rows: int
    dim: int
    pooling_factor: float = 1.0
    """Mean ids per sample looked up in this table (summed over the features reading it)."""
    optimizer: str = ""
    """Fused optimizer of this table; empty = the planner's default."""
    allowed_types: tuple[ShardingType, ...] = ()
    """Sharding types the planner may use; empty = any."""
    ranks: tuple[int, ...] = ()
    """Pin: the table's shards may only go on these ranks; empty = any."""
    storage: str = ""
    """Force ``device`` or ``host`` storage; empty = the planner chooses."""

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.dim <= 0 or self.pooling_factor < 0:
            raise ValueError(
                f"table '{self.name}': rows, dim must be > 0 and pooling_factor >= 0, got "
                f"rows={self.rows}, dim={self.dim}, pooling_factor={self.pooling_factor}"
            )
        if self.optimizer and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table '{self.name}': optimizer must be one of {OPTIMIZERS}")
        if self.storage and self.storage not in STORAGES:
            raise ValueError(f"table '{self.name}': storage must be one of {STORAGES}")
        self.allowed_types = tuple(
            t if isinstance(t, ShardingType) else parse_sharding_type(str(t))
            for t in self.allowed_types
        )
        self.ranks = tuple(int(r) for r in self.ranks)

    @property
    def params(self) -> int:
        """Number of parameters (rows x dim)."""
        return self.rows * self.dim

    @classmethod
    def from_config(cls, t: TableConfig, **kw: Any) -> TableSpec:
        """From a ``neorec.config.TableConfig`` (pooling summed over the features reading it)."""
        pooling = t.pooling_factor * max(1, len(t.features))
        return cls(name=t.name, rows=t.rows, dim=t.dim, pooling_factor=pooling, **kw)


def tables_from_config(
    tables: Iterable[TableConfig], types: dict[str, str] | None = None, default_type: str = ""
) -> list[TableSpec]:
    """Planner tables from config tables; ``sharding.types`` / ``default_type`` become constraints."""
    out = []
    for t in tables:
        st = (types or {}).get(t.name, default_type)
        allowed = (parse_sharding_type(st),) if st else ()
        out.append(TableSpec.from_config(t, allowed_types=allowed))
    return out


def _split_list(text: str) -> list[str]:
    return [x for x in text.replace(";", " ").replace("|", " ").split() if x]


def _spec_from_record(d: dict[str, Any], where: str) -> TableSpec:
    try:
        allowed: Any = d.get("allowed_types") or ()
        ranks: Any = d.get("ranks") or ()
        return TableSpec(
            name=str(d["name"]),
            rows=int(float(d["rows"])),
            dim=int(d["dim"]),
            pooling_factor=float(d.get("pooling_factor") or 1.0),
            optimizer=str(d.get("optimizer") or ""),
            allowed_types=tuple(
                parse_sharding_type(str(a))
                for a in (_split_list(allowed) if isinstance(allowed, str) else allowed)
            ),
            ranks=tuple(int(r) for r in (_split_list(ranks) if isinstance(ranks, str) else ranks)),
            storage=str(d.get("storage") or ""),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: bad table record {d}: {e}") from None


def load_tables(path: str | Path) -> list[TableSpec]:
    """Tables from CSV (header ``name,rows,dim,pooling_factor[,optimizer,allowed_types,ranks,storage]``,
    lists separated by ``;``) or JSON (a list of objects, or ``{"tables": [...]}``)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"table file not found: {p}")
    if p.suffix.lower() == ".json":
        data = json.loads(p.read_text())
        records = data["tables"] if isinstance(data, dict) else data
        return [_spec_from_record(r, f"{p}[{i}]") for i, r in enumerate(records)]
    with p.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("name") and not r["name"].startswith("#")]
    return [_spec_from_record(r, f"{p}:{i + 2}") for i, r in enumerate(rows)]


PHASES = ("fwd_comm", "fwd_compute", "bwd_comm", "bwd_compute")
"""Step phases separated by collectives; each ends when its slowest rank does."""


@dataclass(frozen=True)
class ShardCost:
    """Predicted per-step time (seconds per phase) and memory (bytes) of one shard on its rank."""

    fwd_comm_s: float
    fwd_compute_s: float
    bwd_comm_s: float
    bwd_compute_s: float
    device_bytes: float
    host_bytes: float
    inter_s: float = 0.0
    """Part of the communication time spent on inter-host links."""

    @property
    def phases(self) -> tuple[float, float, float, float]:
        """Times in ``PHASES`` order."""
        return (self.fwd_comm_s, self.fwd_compute_s, self.bwd_comm_s, self.bwd_compute_s)

    @property
    def compute_s(self) -> float:
        """Forward plus backward compute."""
        return self.fwd_compute_s + self.bwd_compute_s

    @property
    def comm_s(self) -> float:
        """Forward plus backward communication."""
        return self.fwd_comm_s + self.bwd_comm_s

    @property
    def time_s(self) -> float:
        """All phases."""
        return self.compute_s + self.comm_s


@dataclass
class RankCost:
    """Predicted load of one rank."""

    rank: int
    phases: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    """Seconds in each of ``PHASES``."""
    device_bytes: float = 0.0
    host_bytes: float = 0.0
    shards: list[tuple[str, Shard, float]] = field(default_factory=list)
    """(table, shard, predicted seconds) held by this rank."""

    @property
    def compute_s(self) -> float:
        """Forward plus backward compute of this rank's shards."""
        return self.phases[1] + self.phases[3]

    @property
    def comm_s(self) -> float:
        """Owner-side communication of this rank's shards."""
        return self.phases[0] + self.phases[2]

    @property
    def local_s(self) -> float:
        """Time of this rank's own shards (without the sample-side term)."""
        return sum(self.phases)


@dataclass
class PlanCost:
    """Predicted cost of a whole plan: per-rank loads plus the sample-side term.

    The predicted step time is the critical path: for each phase the slowest rank's time (the
    collective that ends a phase waits for it), summed over phases, plus the sample-side term.
    """

    ranks: list[RankCost]
    sample_side_s: float
    device_capacity_bytes: float
    host_capacity_bytes: float

    def rank_time(self, rank: int) -> float:
        """Predicted embedding time of ``rank`` per step if it never waited for another rank."""
        return self.ranks[rank].local_s + self.sample_side_s

    def phase_max(self) -> list[float]:
        """Slowest rank's time in each phase."""
        return [max(r.phases[p] for r in self.ranks) for p in range(len(PHASES))]

    @property
    def max_time_s(self) -> float:
        """Predicted embedding time of a step: sum over phases of the slowest rank, + sample side."""
        return sum(self.phase_max()) + self.sample_side_s

    @property
    def max_rank_s(self) -> float:
        """Slowest rank's own total (a lower bound of ``max_time_s``)."""
        return max(self.rank_time(r.rank) for r in self.ranks)

    @property
    def mean_time_s(self) -> float:
        """Mean rank time."""
        return sum(self.rank_time(r.rank) for r in self.ranks) / len(self.ranks)

    @property
    def imbalance(self) -> float:
        """Predicted step time / mean rank time (1.0 = perfectly balanced in every phase)."""
        mean = self.mean_time_s
        return self.max_time_s / mean if mean > 0 else 1.0

    def overflows(self) -> list[str]:
        """Ranks whose device or host memory is exceeded (empty when the plan fits)."""
        out = []
        for r in self.ranks:
            if r.device_bytes > self.device_capacity_bytes * (1 + 1e-9):
                out.append(
                    f"rank {r.rank}: device {r.device_bytes / GB:.2f} GB > "
                    f"{self.device_capacity_bytes / GB:.2f} GB"
                )
            if r.host_bytes > self.host_capacity_bytes * (1 + 1e-9):
                out.append(
                    f"rank {r.rank}: host {r.host_bytes / GB:.2f} GB > "
                    f"{self.host_capacity_bytes / GB:.2f} GB"
                )
        return out

    @property
    def fits(self) -> bool:
        """True when every rank's memory fits."""
        return not self.overflows()


class CostModel:
    """Time and memory of shards and plans for one topology, batch size and optimizer."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        optimizer: str = "rowwise_adagrad",
        weight_bytes: int = 4,
        id_bytes: int = 8,
        comm_bytes: int = 4,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got '{optimizer}'")
        self.topo = topology
        self.batch = batch_size
        self.optimizer = optimizer
        self.weight_bytes = weight_bytes
        self.id_bytes = id_bytes
        self.comm_bytes = comm_bytes
        w, k = topology.world_size, topology.ranks_per_host
        # Share of a rank's all-to-all bytes that go to its own host / other hosts.
        self._intra_frac = (k - 1) / w
        self._inter_frac = (w - k) / w
        self._bw = {
            "device": topology.device_bw_gbs * GB,
            "host": topology.host_device_bw_gbs * GB,
        }
        self._intra_bw = topology.intra_host_bw_gbs * GB
        self._inter_bw = topology.inter_host_bw_gbs * GB

    # ---- pieces -------------------------------------------------------------------------------
    def state_bytes(self, table: TableSpec, rows: int, cols: int) -> float:
        """Optimizer state bytes of ``rows`` x ``cols`` of ``table``."""
        opt = table.optimizer or self.optimizer
        if opt == "rowwise_adagrad":
            return rows * 4.0
        if opt == "adam":
            return rows * cols * 8.0
        return 0.0

    def _a2a_s(self, nbytes: float) -> tuple[float, float]:
        """(intra, inter) seconds of all-to-all bytes exchanged with every rank's samples."""
        return (
            nbytes * self._intra_frac / self._intra_bw,
            nbytes * self._inter_frac / self._inter_bw,
        )

    def shard_cost(
        self,
        table: TableSpec,
        sharding_type: ShardingType,
        rows: int,
        cols: int,
        storage: str = "device",
    ) -> ShardCost:
        """Per-step time and memory of a ``rows`` x ``cols`` shard of ``table`` on its rank."""
        b, w, k = self.batch, self.topo.world_size, self.topo.ranks_per_host
        e, c4 = self.weight_bytes, self.comm_bytes
        st = sharding_type
        dp = st is ShardingType.DATA_PARALLEL
        hits = (b / w if dp else b) * table.pooling_factor * (rows / table.rows)
        out_rows = b / w if dp else b  # pooled rows this shard produces
        touched = rows if dp else rows * -math.expm1(-hits / rows)
        state = self.state_bytes(table, rows, cols)
        state_touched = state * touched / rows
        # Row traffic at the storage tier; ids, pooled outputs and grads at device bandwidth.
        sto_bw, dev_bw = self._bw[storage], self._bw["device"]
        overhead = self.topo.shard_overhead_us * 1e-6 / 2
        # Forward: read ids, gather rows (storage tier), write pooled outputs.
        fwd = (
            hits * cols * e / sto_bw
            + (hits * self.id_bytes + out_rows * cols * c4) / dev_bw
            + overhead
        )
        # Backward: read pooled grads, per-id grads, read+write touched rows and their state.
        bwd = (
            2 * (touched * cols * e + state_touched) / sto_bw
            + (out_rows * cols * c4 + hits * cols * c4) / dev_bw
            + overhead
        )
        if dp:
            grad = rows * cols * c4
            ring = 2 * (w - 1) / w * grad
            bw = self._inter_bw if self.topo.num_hosts > 1 else self._intra_bw
            fwd_comm, bwd_comm = 0.0, ring / bw
            inter = bwd_comm if self.topo.num_hosts > 1 else 0.0
            buffers = hits * self.id_bytes + 2 * out_rows * cols * c4 + grad
        else:
            ids = hits * self.id_bytes + b * 4  # ids + lengths in
            out = b * cols * c4  # pooled out (forward) = grads back (backward)
            ii, ie = self._a2a_s(ids)
            if st is ShardingType.TABLE_ROW_WISE and k > 1:
                # Partial sums reduce-scattered inside the host; 1/k of them leave it.
                oi, oe = self._a2a_s(out / k)
                oi += out * (k - 1) / k / self._intra_bw
            else:
                oi, oe = self._a2a_s(out)
            fwd_comm, bwd_comm = ii + ie + oi + oe, oi + oe
            inter = ie + 2 * oe
            buffers = hits * self.id_bytes + 2 * out_rows * cols * c4
        weights = rows * cols * e + state
        dev = buffers + (weights if storage == "device" else 0.0)
        host = weights if storage == "host" else 0.0
        return ShardCost(fwd_comm, fwd, bwd_comm, bwd, dev, host, inter)

    def sample_side_s(self, table: TableSpec, sharding_type: ShardingType, n_shards: int) -> float:
        """Per-rank time of sending ids of ``table`` and receiving its pooled outputs and grads."""
        st = sharding_type
        if st is ShardingType.DATA_PARALLEL:
            return 0.0
        lb = self.batch / self.topo.world_size
        ids = lb * table.pooling_factor * self.id_bytes + lb * 4
        outs = 2 * lb * table.dim * self.comm_bytes
        if st is ShardingType.COLUMN_WISE:
            ids *= n_shards
        elif st is ShardingType.ROW_WISE:
            outs *= n_shards
            ids += lb * 4 * (n_shards - 1)  # lengths go to every row shard
        elif st is ShardingType.TABLE_ROW_WISE:
            ids += lb * 4 * (n_shards - 1)
        intra, inter = self._a2a_s(ids + outs)
        return intra + inter

    def fixed_s(self) -> float:
        """Per-step latency of the embedding collectives (same on every rank)."""
        return 6 * self.topo.collective_latency_us * 1e-6

    # ---- plans --------------------------------------------------------------------------------
    def evaluate(self, plan: ShardingPlan, tables: Iterable[TableSpec]) -> PlanCost:
        """Predicted per-rank time and memory of ``plan`` (tables looked up by name)."""
        specs = {t.name: t for t in tables}
        ranks = [RankCost(r) for r in range(plan.world_size)]
        sample = (
            self.fixed_s()
            if any(t.sharding_type is not ShardingType.DATA_PARALLEL for t in plan.tables)
            else 0.0
        )
        for tp in plan.tables:
            spec = specs.get(tp.name)
            if spec is None:
                raise KeyError(f"plan table '{tp.name}' has no spec; known: {sorted(specs)}")
            sample += self.sample_side_s(spec, tp.sharding_type, len(tp.shards))
            for s in tp.shards:
                c = self.shard_cost(spec, tp.sharding_type, s.rows, s.cols, tp.storage)
                rc = ranks[s.rank]
                for p, v in enumerate(c.phases):
                    rc.phases[p] += v
                rc.device_bytes += c.device_bytes
                rc.host_bytes += c.host_bytes
                rc.shards.append((tp.name, s, c.time_s))
        return PlanCost(
            ranks, sample, self.topo.device_capacity_bytes, self.topo.host_capacity_bytes
        )
