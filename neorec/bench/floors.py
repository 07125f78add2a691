"""This machine's floors, measured in the benchmark's own run (``docs/performance.md``).

- memory bandwidth: a STREAM-style triad ``a = b + s * c`` over fp32 arrays far larger than the
  last-level cache (12 bytes moved per element: two reads and one write, STREAM's count), each
  at least 512 MB (a virtual machine may report less L3 than its host has). On these VMs the rate
  changes between allocations and processes (one process's three fresh 512 MB allocations: 44,
  75 and 43 GB/s, each steady over its repeats; other processes 40-77 GB/s), so the triad runs
  over ``ALLOCATIONS`` fresh allocations and keeps the best;
- copy bandwidth: ``a.copy_(b)`` over the same arrays (8 bytes per element), the memcpy a
  shared-memory collective does;
- GEMM peak per dtype: a large square ``torch.matmul`` in fp32 and bf16 (2 n^3 flops).

Each is the best of a few repeats, all of torch's threads: a floor is the fastest this machine
was seen to move bytes or do flops, so a phase's time over its floor is at least about 1.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import torch

from neorec.measure.calibrate_micro import _best_of

__all__ = ["Floors", "measure_floors", "llc_bytes"]

GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_ARRAY_MB = 512.0
"""Smallest triad / copy array: larger than any host's cache a virtual machine may hide."""
ALLOCATIONS = 3
"""Fresh allocations the triad and copy are measured over (the best is kept)."""


@dataclass(frozen=True)
class Floors:
    """Measured rates: bytes/s of triad and copy, flops/s of a large GEMM per dtype."""

    triad_gbs: float
    copy_gbs: float
    gemm_gflops: dict[str, float] = field(default_factory=dict)
    array_mb: float = 0.0
    gemm_n: int = 0
    threads: int = 1

    def bytes_ms(self, nbytes: float) -> float:
        """Milliseconds to move ``nbytes`` at the triad bandwidth."""
        return 1000 * nbytes / (self.triad_gbs * 1e9)

    def copy_ms(self, nbytes: float) -> float:
        """Milliseconds to copy ``nbytes`` (read once, written once) at the copy bandwidth."""
        return 1000 * 2 * nbytes / (self.copy_gbs * 1e9)

    def flops_ms(self, flops: float, dtype: str = "fp32") -> float:
        """Milliseconds for ``flops`` at the GEMM peak of ``dtype`` (fp16 / fp8: bf16's)."""
        peak = self.gemm_gflops.get(dtype) or self.gemm_gflops["bf16"]
        return 1000 * flops / (peak * 1e9)

    def to_dict(self) -> dict:
        """JSON form."""
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def llc_bytes() -> int:
    """The largest cache's size in bytes (sysfs), 32 MiB when unknown."""
    best = 0
    for i in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{i}/size") as f:
                s = f.read().strip()
        except OSError:
            break
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1], 1)
        best = max(best, int(s.rstrip("KMG")) * mult)
    return best or 32 * 2**20


def _stream_s(n: int, reps: int, allocations: int = ALLOCATIONS) -> tuple[float, float]:
    """Best seconds of a triad and of a copy over fp32 arrays of ``n`` elements, over
    ``allocations`` fresh sets of arrays."""
    best = [float("inf"), float("inf")]
    for _ in range(allocations):
        t = _stream_once(n, reps)  # (its arrays are freed before the next are made)
        best = [min(best[0], t[0]), min(best[1], t[1])]
    return best[0], best[1]


def _stream_once(n: int, reps: int) -> tuple[float, float]:
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    triad = _best_of(lambda: torch.add(b, c, alpha=3.0, out=a), reps)
    return triad, _best_of(lambda: a.copy_(b), reps)


def measure_floors(array_mb: float = 0.0, gemm_n: int = 2048, reps: int = 5) -> Floors:
    """Measure the floors; ``array_mb`` per array (0: 4x the last-level cache, >= 512 MB)."""
    mb = array_mb or max(MIN_ARRAY_MB, 4 * llc_bytes() / 2**20)
    n = int(mb * 2**20) // 4
    triad, copy = _stream_s(n, reps)
    gemm = {}
    for name, dt in GEMM_DTYPES.items():
        x = torch.randn(gemm_n, gemm_n).to(dt)
        y = torch.randn(gemm_n, gemm_n).to(dt)
        s = _best_of(functools.partial(torch.matmul, x, y), reps)
        gemm[name] = 2 * gemm_n**3 / s / 1e9
    return Floors(
        triad_gbs=12 * n / triad / 1e9,
        copy_gbs=8 * n / copy / 1e9,
        gemm_gflops=gemm,
        array_mb=mb,
        gemm_n=gemm_n,
        threads=torch.get_num_threads(),
    )
