"""Print the ATen CPU capabilities this CPU can run other than the default (``make test-isa``).

PyTorch picks its vectorized kernels by the highest capability the CPU has (``default``); forcing a
lower one with ``ATEN_CPU_CAPABILITY`` runs the code paths another machine would. The bitwise tests
must hold under every one of them.
"""

from __future__ import annotations

import torch


def _flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def main() -> None:
    """Capabilities (lower case) the CPU supports, the default one left out."""
    flags = _flags()
    caps = []
    if "avx2" in flags:
        caps.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        caps.append("avx512")
    default = torch.backends.cpu.get_cpu_capability().lower()
    print(" ".join(c for c in caps if c != default))


if __name__ == "__main__":
    main()
