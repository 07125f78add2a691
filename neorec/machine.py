"""This machine's CPU as neorec records it (run folders, learned cost models): model name and the
vector / matrix flags that matter here; and the memory it has available. Imports nothing of
neorec (any layer may use it)."""

from __future__ import annotations

import os

__all__ = ["CPU_FLAGS", "available_memory_bytes", "cpu_model_and_flags"]

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
