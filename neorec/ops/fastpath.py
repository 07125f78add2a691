"""How often each fast path ran in this process: the C TBE kernel, the Triton kernels, the ExFM
loss kernel. Each has a fallback that computes the same numbers, so a test comparing a fast path
with its specification asserts here that the fast path, and not the fallback, is what it measured.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["RAN", "ran"]

RAN: Counter[str] = Counter()
"""Calls per fast path: ``cpu.forward``, ``cpu.backward``, ``triton.forward``,
``triton.backward``, ``exfm_losses.forward``, ``exfm_losses.backward``."""


def ran(name: str) -> None:
    """Count one call of fast path ``name`` (a dict increment: nothing on the hot path)."""
    RAN[name] += 1
