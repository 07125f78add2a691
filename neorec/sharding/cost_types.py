"""What the cost model predicts: a shard's, a rank's and a whole plan's step time and memory.

``neorec.sharding.cost_model.CostModel`` fills these in (``shard_cost``, ``evaluate``); the planner,
its report and the learned cost model read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neorec.sharding.topology import GB
from neorec.sharding.types import Shard

__all__ = ["PHASES", "ShardCost", "RankCost", "PlanCost"]

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
    ssd_bytes: float = 0.0
    """Bytes on SSD (the row store of an ``ssd``-tier shard)."""

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
    ssd_bytes: float = 0.0
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
    ssd_capacity_bytes: float = 0.0

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
            if r.ssd_bytes > self.ssd_capacity_bytes * (1 + 1e-9):
                out.append(
                    f"rank {r.rank}: ssd {r.ssd_bytes / GB:.2f} GB > "
                    f"{self.ssd_capacity_bytes / GB:.2f} GB"
                )
        return out

    @property
    def fits(self) -> bool:
        """True when every rank's memory fits."""
        return not self.overflows()
