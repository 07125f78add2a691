"""GPU topologies for the cost model: presets of real GPU hosts, every constant with its source.

``neorec plan --topology-preset NAME`` plans for one of them (``a100_nvlink``, ``h100_nvlink``,
``a100_pcie``): HBM capacity and bandwidth per GPU, NVLink (or PCIe) between the GPUs of a host,
RoCE / InfiniBand NICs between hosts, PCIe to host DRAM, NVMe SSDs per host. Planning with a preset
is a SIMULATION: the constants come from vendor datasheets (the sources are named next to each),
scaled by stated efficiency assumptions to the *effective* rates the cost model uses; none of them
was measured by neorec (no GPU was available to this project).

Datasheet numbers are per GPU and per direction unless stated. The efficiencies are assumptions:

- ``GATHER_EFFICIENCY`` (0.5): the share of peak HBM bandwidth a table-batched embedding kernel
  reaches on random row gathers and updates of 128-512-byte rows (rows are short, the accesses
  scattered); it is what ``configs/paper_scale.toml`` already assumed for an A100 (1000 of 2039
  GB/s).
- ``ALL_TO_ALL_EFFICIENCY`` (0.5): the share of a link's line rate an all-to-all over many peers
  achieves (as in ``configs/paper_scale.toml``, after the ZionEX figures of the Neo paper:
  Mudigere et al., "Software-Hardware Co-design for Fast and Scalable Training of Deep Learning
  Recommendation Models", ISCA 2022).
- ``PCIE_EFFICIENCY`` (0.625): PCIe's usable share for host rows read by the GPU (UVM-like,
  128-byte TLPs; 20 of 32 GB/s on PCIe 4.0 x16, as ``configs/paper_scale.toml`` assumed).
- ``DENSE_EFFICIENCY`` (2/3): the share of the TF32 tensor-core peak the small GEMMs of tower
  modules and MLPs reach.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from neorec.errors import ConfigError
from neorec.sharding.topology import Topology

__all__ = ["GpuHost", "PRESETS", "preset_topology", "add_preset_argument", "apply_preset"]

GATHER_EFFICIENCY = 0.5
ALL_TO_ALL_EFFICIENCY = 0.5
PCIE_EFFICIENCY = 0.625
DENSE_EFFICIENCY = 2 / 3


@dataclass(frozen=True)
class GpuHost:
    """One kind of GPU host, in datasheet units (GB, GB/s per direction, TFLOP/s, us)."""

    name: str
    gpus_per_host: int
    hbm_gb: float
    hbm_bw_gbs: float
    intra_link: str
    intra_bw_gbs: float  # GPU to the GPUs of its host, per direction
    nic_bw_gbs: float  # GPU to other hosts: its NIC, per direction
    pcie_bw_gbs: float  # GPU to host DRAM, per direction
    host_dram_gb: float
    ssd_gb: float  # NVMe per host (the SSD tier)
    ssd_bw_gbs: float  # random-read share of one GPU of its host's NVMe drives
    tf32_tflops: float
    intra_latency_us: float
    inter_latency_us: float
    sources: str

    def topology(self, world_size: int, ranks_per_host: int = 0) -> Topology:
        """The cost model's Topology of ``world_size`` GPUs of this kind (effective rates)."""
        rph = ranks_per_host or min(self.gpus_per_host, world_size)
        hosts = max(1, world_size // rph)
        return Topology(
            world_size=world_size,
            ranks_per_host=rph,
            device_memory_gb=self.hbm_gb,
            device_reserve_gb=min(12.0, self.hbm_gb / 4),  # dense model, activations, allocator
            host_memory_gb=self.host_dram_gb,
            device_bw_gbs=self.hbm_bw_gbs * GATHER_EFFICIENCY,
            host_device_bw_gbs=self.pcie_bw_gbs * PCIE_EFFICIENCY,
            ssd_capacity_gb=self.ssd_gb,
            ssd_bw_gbs=self.ssd_bw_gbs,
            # The unfused / data-parallel updates: the same 1/4 of the fused rate as the
            # defaults of Topology (an assumption; torch-op passes over the distinct rows).
            unfused_bw_gbs=self.hbm_bw_gbs * GATHER_EFFICIENCY / 4,
            dp_update_bw_gbs=self.hbm_bw_gbs * GATHER_EFFICIENCY / 4,
            intra_host_bw_gbs=self.intra_bw_gbs * ALL_TO_ALL_EFFICIENCY,
            inter_host_bw_gbs=self.nic_bw_gbs * ALL_TO_ALL_EFFICIENCY,
            dense_tflops=self.tf32_tflops * DENSE_EFFICIENCY,
            collective_latency_us=self.inter_latency_us if hosts > 1 else self.intra_latency_us,
            name=(
                f"{self.name} preset: {hosts} host(s) x {rph} GPUs, {self.hbm_gb:g} GB HBM at "
                f"{self.hbm_bw_gbs:g} GB/s, {self.intra_link} (datasheet constants x stated "
                "efficiencies; a simulation, not measured)"
            ),
        )


PRESETS: dict[str, GpuHost] = {
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): HBM2e 80 GB at 2,039 GB/s; NVLink 3
    # 600 GB/s (bidirectional, 12 links: 300 GB/s each way); PCIe Gen4 64 GB/s (32 each way);
    # TF32 tensor core 156 TFLOP/s (dense). NVIDIA DGX A100 datasheet: 8 GPUs, 1 TB system
    # memory (2 TB option), 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand / 200 GbE
    # (25 GB/s per GPU each way), 15 TB internal NVMe (4x 3.84 TB U.2; ~4 GB/s random 4 KiB reads
    # per drive at ~1M IOPS, drive vendors' Gen4 datasheets: 16 GB/s per host, 2 GB/s per GPU).
    "a100_nvlink": GpuHost(
        name="a100_nvlink",
        gpus_per_host=8,
        hbm_gb=80.0,
        hbm_bw_gbs=2039.0,
        intra_link="NVLink 3 (300 GB/s each way)",
        intra_bw_gbs=300.0,
        nic_bw_gbs=25.0,
        pcie_bw_gbs=32.0,
        host_dram_gb=1024.0,
        ssd_gb=15_360.0,
        ssd_bw_gbs=2.0,
        tf32_tflops=156.0,
        # Latencies: assumptions of the order NCCL's all-to-all shows for small messages inside
        # an NVLink host (~10 us) and across a RoCE / IB fabric (~30 us, as paper_scale.toml).
        intra_latency_us=10.0,
        inter_latency_us=30.0,
        sources="NVIDIA A100 datasheet; NVIDIA DGX A100 datasheet",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): HBM3 80 GB at 3.35 TB/s; NVLink 4
    # 900 GB/s (450 each way); PCIe Gen5 128 GB/s (64 each way); TF32 tensor core 494 TFLOP/s
    # dense (989 with sparsity). NVIDIA DGX H100 datasheet: 8 GPUs, 2 TB system memory, 8x
    # ConnectX-7 400 Gb/s NDR InfiniBand / 400 GbE (50 GB/s per GPU each way), 30 TB internal
    # NVMe (8x 3.84 TB U.2: ~4 GB/s random reads each, 32 GB/s per host, 4 GB/s per GPU).
    "h100_nvlink": GpuHost(
        name="h100_nvlink",
        gpus_per_host=8,
        hbm_gb=80.0,
        hbm_bw_gbs=3350.0,
        intra_link="NVLink 4 (450 GB/s each way)",
        intra_bw_gbs=450.0,
        nic_bw_gbs=50.0,
        pcie_bw_gbs=64.0,
        host_dram_gb=2048.0,
        ssd_gb=30_720.0,
        ssd_bw_gbs=4.0,
        tf32_tflops=494.0,
        intra_latency_us=10.0,  # assumptions, as for a100_nvlink
        inter_latency_us=30.0,
        sources="NVIDIA H100 datasheet; NVIDIA DGX H100 datasheet",
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB PCIe): HBM2e 80 GB at 1,935 GB/s; PCIe
    # Gen4 64 GB/s (32 each way), which is also the path between GPUs of a host without NVLink
    # bridges (through the host's PCIe switches / root complex); TF32 156 TFLOP/s. A generic
    # 8-GPU PCIe server (an assumption): 1 TB DRAM, one 100 GbE RoCE NIC per 2 GPUs (NVIDIA
    # ConnectX-6 Dx datasheet: 100 Gb/s = 12.5 GB/s, 6.25 GB/s per GPU), no SSD tier.
    "a100_pcie": GpuHost(
        name="a100_pcie",
        gpus_per_host=8,
        hbm_gb=80.0,
        hbm_bw_gbs=1935.0,
        intra_link="PCIe Gen4 x16 (32 GB/s each way)",
        intra_bw_gbs=32.0,
        nic_bw_gbs=6.25,
        pcie_bw_gbs=32.0,
        host_dram_gb=1024.0,
        ssd_gb=0.0,
        ssd_bw_gbs=2.0,
        tf32_tflops=156.0,
        intra_latency_us=20.0,  # assumptions: PCIe peer transfers, RoCE over 100 GbE
        inter_latency_us=40.0,
        sources="NVIDIA A100 datasheet (PCIe); NVIDIA ConnectX-6 Dx datasheet; server assumed",
    ),
}
PRESETS["pcie"] = PRESETS["a100_pcie"]  # the short name


def preset_topology(name: str, world_size: int, ranks_per_host: int = 0) -> Topology:
    """The Topology of preset ``name`` for ``world_size`` GPUs (``ConfigError`` if unknown)."""
    host = PRESETS.get(name)
    if host is None:
        raise ConfigError(
            f"--topology-preset {name!r} is not a GPU topology preset; known: {sorted(PRESETS)}"
        )
    return host.topology(world_size, ranks_per_host)


def add_preset_argument(parser: argparse.ArgumentParser) -> None:
    """``--topology-preset NAME`` of ``neorec plan``."""
    parser.add_argument(
        "--topology-preset",
        default=None,
        metavar="NAME",
        help=f"plan for a GPU host preset ({', '.join(sorted(PRESETS))}): datasheet constants, "
        "replacing the config's [planner.topology] (a simulation; see neorec.sharding.gpu_topology)",
    )


def apply_preset(args: argparse.Namespace, topo: Topology) -> Topology:
    """``topo``, or the preset ``--topology-preset`` names (not together with ``--topology``)."""
    name = getattr(args, "topology_preset", None)
    if not name:
        return topo
    if getattr(args, "topology", None):
        raise ConfigError("--topology-preset and --topology name two topologies: pass one")
    return preset_topology(name, args.world_size, args.ranks_per_host)
