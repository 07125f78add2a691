"""Host memory for embedding tables: flat buffers backed by transparent huge pages.

Lookups and fused updates touch table rows at random. With 4 KiB pages every row of a table of
gigabytes is a TLB miss whose page walk itself misses the cache; with 2 MiB pages the whole table
is covered by the second-level TLB. On Linux with transparent huge pages in ``madvise`` mode
(the common default) nothing is backed by huge pages unless asked, so table buffers are advised
``MADV_HUGEPAGE`` *before* their first touch (the pages are faulted in as huge pages then).
``bench op`` measured the fused TBE step ~10% faster on 8 x 1M x 64 tables (docs/performance.md).

``system.hugepages = false`` (``neorec.ops.settings.HUGEPAGES``) turns this off. Elsewhere (not Linux, a GPU tensor, a buffer smaller than a
few huge pages, THP ``never``) these are plain ``torch.empty`` / ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch
from torch import Tensor

from neorec.ops import settings

__all__ = ["table_empty", "table_zeros", "advise_huge_pages", "keep_freed_heap"]

_HUGE = 1 << 21  # x86-64 / arm64 (4 KiB base pages) PMD size
_MIN_BYTES = 4 * _HUGE  # below this the gain is nil and the rounding waste is not
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: Tensor) -> bool:
    """Ask for huge pages under the 2 MiB-aligned interior of ``t``'s storage; only pages not
    yet touched are affected. Returns whether the advice was given (best effort: never raises)."""
    fn = _madvise() if settings.HUGEPAGES else None
    nbytes = t.numel() * t.element_size()
    if fn is None or t.device.type != "cpu" or nbytes < _MIN_BYTES:
        return False
    start = t.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def table_empty(
    numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Tensor:
    """An uninitialized flat table buffer (huge pages on a Linux host, see the module doc)."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def table_zeros(
    numel: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Tensor:
    """A zeroed flat table buffer (huge pages on a Linux host, see the module doc)."""
    return table_empty(numel, dtype, device).zero_()


KEEP_HEAP_BYTES = 1 << 30
"""``keep_freed_heap``'s glibc ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``."""


def keep_freed_heap(nbytes: int = KEEP_HEAP_BYTES) -> bool:
    """Keep freed buffers of up to ``nbytes`` in this process's heap for the next step.

    glibc serves an allocation above its (adaptive) mmap threshold with a fresh ``mmap`` and
    returns it to the OS when freed, and trims the heap's free top once it passes the trim
    threshold: a training step that allocates and frees buffers of megabytes (the all-to-alls'
    receive buffers, a data-parallel table's gathered rows) page-faults them in again every step.
    A 2-rank sharded step here measured 21 ms with a data-parallel table set and 4.1 ms
    table-wise that way, 9.4 and 3.4 ms with the heap kept (``docs/performance.md``). The cost:
    memory freed stays in the process (its resident size stays at its high-water mark, at most
    ``nbytes`` above what is in use). Called by distributed ranks (training, ``bench dist``);
    ``system.keep_heap = false`` skips the call. Returns whether glibc took both settings."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, nbytes)) and bool(mallopt(m_trim_threshold, nbytes))
