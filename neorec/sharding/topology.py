"""The machine the planner plans for: ranks, memory per rank and the bandwidths between them.

Every constant the cost model uses lives here, in human units (GB, GB/s, microseconds), so a
topology can be written by hand, loaded from JSON/TOML, or measured on this machine by
``neorec plan --calibrate`` (``neorec.measure.calibrate``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Topology", "GB"]

GB = 1e9


@dataclass(kw_only=True)
class Topology:
    """Ranks, per-rank memory and bandwidths (all per rank unless stated)."""

    world_size: int
    """Number of ranks (GPUs, or processes on CPU)."""
    ranks_per_host: int = 0
    """Ranks per host; 0 = all on one host."""
    device_memory_gb: float = 80.0
    """Fast memory of one rank (HBM on GPU; the rank's share of DRAM on CPU)."""
    device_reserve_gb: float = 8.0
    """Device memory kept for the dense model, activations and the allocator (not for tables)."""
    host_memory_gb: float = 0.0
    """Host DRAM per host usable for embedding rows read over the host link (UVM-like); 0 = none."""
    device_bw_gbs: float = 1000.0
    """Effective device-memory bandwidth of random row gathers and updates."""
    host_device_bw_gbs: float = 25.0
    """Effective bandwidth of rows in host memory read/updated by the device (PCIe, UVM); also
    what cache misses of a ``dram``-tier table move at (records between host DRAM and the cache)."""
    ssd_capacity_gb: float = 0.0
    """SSD per host usable for the row stores of ``ssd``-tier tables (rows on SSD behind a row
    cache in device memory, MTrainS-style); 0 = no SSD tier."""
    ssd_bw_gbs: float = 3.0
    """Effective bandwidth of one rank's share of its host's SSDs for cache-miss record reads and
    dirty write-backs (random 4 KiB-page I/O; lower than the drives' sequential rating). Misses of
    an ``ssd`` table move at min(this, ``host_device_bw_gbs``)."""
    unfused_bw_gbs: float = 250.0
    """Effective bandwidth (same byte accounting as ``device_bw_gbs``) of the unfused row update:
    per-row gradients summed by the kernel and handed back, then the optimizer on the distinct
    rows with torch ops. The runtime takes it, under row-wise Adagrad, for column-wise slices
    (full-row mean(g^2) needs the other slices' sums first; the other shards of their ranks keep
    the fused update). Default: an assumption (~1/4 of
    ``device_bw_gbs``: torch-op passes over the distinct rows after the kernel); measured by
    calibrate (~1/5 of the fused step on this CPU, one thread)."""
    dp_update_bw_gbs: float = 250.0
    """Effective bandwidth (same byte accounting as ``device_bw_gbs``) of a data-parallel table's
    backward on one rank: the kernel's per-row sums of the rank's ids, then, after every rank's
    (id, row sum) pairs are all-gathered, the kernel's fused update over those pairs (added per
    row in rank order), with the torch glue between. Default: an assumption; measured by
    calibrate."""
    row_split_bw_gbs: float = 100.0
    """Throughput (id bytes per second) of splitting a rank's ids by row range for row-wise and
    table-row-wise tables before they are sent (bucketize, count per bag, stable sort). Default:
    an assumption; measured by calibrate."""
    intra_host_bw_gbs: float = 150.0
    """All-to-all bandwidth of one rank to the ranks of its own host (NVLink, shared memory)."""
    inter_host_bw_gbs: float = 12.5
    """All-to-all bandwidth of one rank to other hosts (its share of the NIC)."""
    dense_tflops: float = 100.0
    """Effective dense math rate (TFLOP/s) of one rank's small GEMMs; the cost model prices DMT
    tower modules with it (``neorec.sharding.towers_cost``). Default: an assumption for A100-class
    GPUs (TF32 tensor cores peak at 156 TFLOP/s; ~2/3 of it for these GEMMs); not calibrated."""
    shard_overhead_us: float = 5.0
    """Fixed time per shard per step (bookkeeping, kernel work that does not scale with bytes)."""
    collective_latency_us: float = 30.0
    """Latency of one collective; a step runs ~6 for embeddings (fwd/bwd ids, lengths, outputs)."""
    step_overhead_us: float = 0.0
    """Fixed host time of one embedding step that no shard accounts for (the sharded module's
    Python and dispatch: reordering, splitting, concatenating); calibrated on CPU, 0 = ignored."""
    name: str = ""
    """Free-form label (preset name, ``calibrated on <host>``)."""
    learned_cost: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A learned correction of the cost model fitted on placements measured on one machine
    (``neorec plan --calibrate``; ``neorec.sharding.learned_cost``): its parameters, the machine
    it was fitted on and its held-out error; empty = none (the analytical model alone)."""

    def __post_init__(self) -> None:
        if self.ranks_per_host <= 0:
            self.ranks_per_host = self.world_size
        problems = []
        if self.world_size <= 0:
            problems.append(f"world_size must be > 0, got {self.world_size}")
        elif self.world_size % self.ranks_per_host:
            problems.append(
                f"ranks_per_host ({self.ranks_per_host}) must divide world_size ({self.world_size})"
            )
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("_gbs", "_tflops")) and v <= 0:
                problems.append(f"{f.name} must be > 0, got {v}")
            if f.name.endswith(("_gb", "_us")) and v < 0:
                problems.append(f"{f.name} must be >= 0, got {v}")
        if not isinstance(self.learned_cost, dict):
            problems.append(
                f"learned_cost must be an object, got {type(self.learned_cost).__name__}"
            )
        if self.device_reserve_gb >= self.device_memory_gb:
            problems.append(
                f"device_reserve_gb ({self.device_reserve_gb}) must be < device_memory_gb "
                f"({self.device_memory_gb})"
            )
        if problems:
            raise ValueError("invalid topology: " + "; ".join(problems))

    # ---- derived ------------------------------------------------------------------------------
    @property
    def num_hosts(self) -> int:
        """Number of hosts."""
        return self.world_size // self.ranks_per_host

    @property
    def device_capacity_bytes(self) -> float:
        """Bytes of one rank's device memory available to embedding shards."""
        return (self.device_memory_gb - self.device_reserve_gb) * GB

    @property
    def host_capacity_bytes(self) -> float:
        """Bytes of host memory available to one rank's host-stored shards (its host's share)."""
        return self.host_memory_gb * GB / self.ranks_per_host

    @property
    def ssd_capacity_bytes(self) -> float:
        """Bytes of SSD available to one rank's ssd-tier shards (its host's share)."""
        return self.ssd_capacity_gb * GB / self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """Host index of ``rank``."""
        return rank // self.ranks_per_host

    def with_world(self, world_size: int, ranks_per_host: int | None = None) -> Topology:
        """Same machine constants for another world size / ranks per host."""
        rph = ranks_per_host or min(self.ranks_per_host, world_size)
        return dataclasses.replace(self, world_size=world_size, ranks_per_host=rph)

    # ---- presets ------------------------------------------------------------------------------
    @classmethod
    def gpu_cluster(
        cls,
        hosts: int,
        gpus_per_host: int = 8,
        hbm_gb: float = 80.0,
        host_dram_gb: float = 1536.0,
        ssd_gb: float = 0.0,
    ) -> Topology:
        """A100/H100-class cluster: HBM per GPU, NVLink inside a host, one NIC per GPU across;
        optionally ``ssd_gb`` of NVMe per host for the SSD tier."""
        return cls(
            world_size=hosts * gpus_per_host,
            ranks_per_host=gpus_per_host,
            device_memory_gb=hbm_gb,
            device_reserve_gb=min(12.0, hbm_gb / 4),
            host_memory_gb=host_dram_gb,
            ssd_capacity_gb=ssd_gb,
            name=f"gpu_cluster {hosts}x{gpus_per_host}, {hbm_gb:g} GB HBM (preset, not measured)",
        )

    @classmethod
    def local_cpu(cls, world_size: int, memory_gb: float = 16.0) -> Topology:
        """Ranks as processes on this CPU host (gloo); rough constants, refine with calibrate."""
        return cls(
            world_size=world_size,
            ranks_per_host=world_size,
            device_memory_gb=memory_gb / world_size,
            device_reserve_gb=min(1.0, memory_gb / world_size / 4),
            host_memory_gb=0.0,
            device_bw_gbs=2.0,
            host_device_bw_gbs=1.0,
            unfused_bw_gbs=0.2,
            dp_update_bw_gbs=0.3,
            row_split_bw_gbs=0.1,
            intra_host_bw_gbs=1.0,
            inter_host_bw_gbs=1.0,
            dense_tflops=0.05,
            shard_overhead_us=20.0,
            collective_latency_us=200.0,
            name=f"local_cpu x{world_size} (preset, not measured)",
        )

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        """Topology from a dict; unknown keys are an error naming the known ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown topology key(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    def to_json(self) -> str:
        """JSON text."""
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        """Write as JSON."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a JSON topology file (``ConfigError``, one line, when missing or not JSON)."""
        from neorec.errors import ConfigError

        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(
                f"topology {str(path)!r}: cannot read it ({e.strerror or e}); write one with "
                "neorec plan --calibrate --topology PATH --world-size N"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"topology {str(path)!r}: not JSON ({e})") from None
        return cls.from_dict(raw)
