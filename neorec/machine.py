"""This machine's CPU as neorec records it (run folders, learned cost models): model name and the
vector / matrix flags that matter here; the memory it has available; and the CPUs this process
may use (affinity, cgroup CPU quota, other running processes), from which the default number of
intra-op threads is chosen (``CpuShare``). Imports nothing of neorec (any layer may use it)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CPU_FLAGS",
    "THREADS_WHY_ENV",
    "CpuShare",
    "available_memory_bytes",
    "cgroup_cpu_quota",
    "cpu_model_and_flags",
    "cpu_share",
    "default_threads",
]

CPU_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "neon",
    "asimd",
    "sve",
)
"""The flags recorded, in this order (x86 and Arm)."""


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """``(model name, the CPU_FLAGS this CPU has)`` from /proc/cpuinfo (``("", [])`` without it)."""
    model, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name", "Processor") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, [f for f in CPU_FLAGS if f in flags]


def available_memory_bytes() -> int:
    """Memory available to new work: /proc/meminfo's ``MemAvailable`` (free plus reclaimable
    cache), else the free physical pages (``os.sysconf``); 0 when neither can be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return 0


THREADS_WHY_ENV = "NEOREC_THREADS_WHY"
"""Set by the ``--nproc`` launcher next to the ``OMP_NUM_THREADS`` it chose for its workers: why."""


@dataclass(frozen=True)
class CpuShare:
    """The CPUs this process may use and how busy the host is now: what the default thread count
    is chosen from (``threads``), with the reason in words (``why``)."""

    allowed: int
    """Logical CPUs in this process's affinity mask (``os.sched_getaffinity``)."""
    cores: int
    """Physical cores among them (SMT siblings counted once, as PyTorch's default does)."""
    quota: float | None
    """The cgroup CPU quota in CPUs (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); None: none."""
    host: int
    """The host's logical CPUs (``os.cpu_count``)."""
    others: int
    """Other processes running on the host now (the fewest seen over a few reads of /proc/loadavg:
    a busy loop is in every read, a passing job in few)."""

    def usable(self) -> int:
        """Cores this process may keep busy: its cores, at most its quota (rounded down, >= 1)."""
        n = self.cores
        if self.quota is not None:
            n = min(n, math.floor(self.quota))
        return max(1, n)

    def threads(self, local_ranks: int = 1) -> int:
        """Intra-op threads per rank: the usable cores, at most the host's idle ones (a thread
        that waits for a CPU stalls every parallel op of its team), split among the ranks."""
        ranks = max(1, local_ranks)
        idle = self.host - self.others
        return max(1, min(self.usable(), max(ranks, idle)) // ranks)

    def why(self, local_ranks: int = 1) -> str:
        """The reason for ``threads`` in words (the banner's line)."""
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        parts = [
            f"{self.usable()} usable cores (affinity {self.allowed} CPUs, {self.cores} cores; "
            f"{quota})",
            f"{self.others} other processes running on the {self.host}-CPU host",
        ]
        if local_ranks > 1:
            parts.append(f"split over {local_ranks} local ranks")
        return "; ".join(parts)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _v2_limit(text: str | None) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"max 100000"``: none)."""
    if not text:
        return None
    quota, _, period = text.strip().partition(" ")
    try:
        q, p = int(quota), int(period or "100000")
    except ValueError:  # "max": no limit
        return None
    return q / p if q > 0 and p > 0 else None


def _v1_limit(folder: Path) -> float | None:
    """CPUs allowed by a cgroup v1 CFS quota (``cpu.cfs_quota_us`` -1: none)."""
    try:
        q = int((_read(folder / "cpu.cfs_quota_us") or "").strip())
        p = int((_read(folder / "cpu.cfs_period_us") or "").strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(mount: Path, rel: str) -> list[Path]:
    """``mount/rel`` and each parent folder up to ``mount`` (a limit anywhere above applies)."""
    parts = [x for x in rel.strip().split("/") if x]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The CPUs this process's cgroup (or any cgroup above it) may use per period, the smallest
    of their limits; None without a limit. ``root`` stands for ``/`` (tests give a fake tree)."""
    cgroup = _read(root / "proc/self/cgroup") or ""
    limits: list[float] = []
    for line in cgroup.splitlines():
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one unified tree
            mount = root / "sys/fs/cgroup"
            for folder in _ancestors(mount, rel):
                if (lim := _v2_limit(_read(folder / "cpu.max"))) is not None:
                    limits.append(lim)
        elif "cpu" in controllers.split(","):
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                mount = root / "sys/fs/cgroup" / name
                for folder in _ancestors(mount, rel):
                    if (lim := _v1_limit(folder)) is not None:
                        limits.append(lim)
    return min(limits) if limits else None


def _cores(cpus: set[int], root: Path) -> int:
    """Physical cores among logical ``cpus`` (sysfs topology; each CPU its own core without it)."""
    seen = set()
    for c in cpus:
        topo = root / f"sys/devices/system/cpu/cpu{c}/topology"
        pkg, core = _read(topo / "physical_package_id"), _read(topo / "core_id")
        seen.add((pkg.strip(), core.strip()) if pkg and core else ("cpu", str(c)))
    return max(1, len(seen))


def _running(root: Path) -> int | None:
    """Processes running on the host now, this one included (/proc/loadavg's ``R/T`` field)."""
    text = _read(root / "proc/loadavg")
    try:
        return int((text or "").split()[3].split("/")[0])
    except (IndexError, ValueError):
        return None


def cpu_share(
    root: Path = Path("/"),
    affinity: set[int] | None = None,
    host: int | None = None,
    reads: int = 3,
) -> CpuShare:
    """This process's ``CpuShare`` now (``root``, ``affinity``, ``host``: fakes for tests)."""
    if affinity is None:
        try:
            affinity = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            affinity = set(range(os.cpu_count() or 1))
    host = host if host is not None else (os.cpu_count() or len(affinity))
    seen: list[int] = []
    for i in range(max(1, reads)):
        if i:
            time.sleep(0.005)
        if (r := _running(root)) is not None:
            seen.append(r)
    others = max(0, min(seen) - 1) if seen else 0
    return CpuShare(len(affinity), _cores(affinity, root), cgroup_cpu_quota(root), host, others)


def default_threads(
    local_ranks: int = 1, env: Mapping[str, str] | None = None, share: CpuShare | None = None
) -> tuple[int | None, str]:
    """``(threads, why)`` when ``train.threads`` is 0: ``OMP_NUM_THREADS`` when it is set (None
    when it is not one number: PyTorch's reading of it stands), else
    ``cpu_share().threads(local_ranks)``."""
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        n = int(omp) if omp.isdigit() and int(omp) > 0 else None
        return n, env.get(THREADS_WHY_ENV) or f"OMP_NUM_THREADS={omp}"
    share = share if share is not None else cpu_share()
    return share.threads(local_ranks), share.why(local_ranks)
