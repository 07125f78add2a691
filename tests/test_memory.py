"""Table buffers on transparent huge pages (neorec.ops.memory)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from neorec.ops import memory
from neorec.ops.memory import advise_huge_pages, table_empty, table_zeros

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_buffers_have_the_asked_shape_and_values() -> None:
    z = table_zeros(3 << 20)
    assert z.shape == (3 << 20,) and z.dtype == torch.float32 and not z.any()
    e = table_empty(10, torch.int64)
    assert e.shape == (10,) and e.dtype == torch.int64


def test_small_buffers_are_left_alone() -> None:
    assert not advise_huge_pages(torch.empty(1000))


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEOREC_HUGEPAGES", "0")
    memory._madvise.cache_clear()
    try:
        assert not advise_huge_pages(torch.empty(16 << 20))
    finally:
        monkeypatch.delenv("NEOREC_HUGEPAGES")
        memory._madvise.cache_clear()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _THP.exists() or "[never]" in _THP.read_text(),
    reason="needs Linux with transparent huge pages enabled",
)
def test_large_table_is_faulted_in_as_huge_pages() -> None:
    before = _anon_huge_kb()
    t = table_zeros(64 << 20)  # 256 MiB
    assert advise_huge_pages(t)
    # The kernel may fall back to small pages under fragmentation; most of the table is huge.
    assert _anon_huge_kb() - before >= 128 * 1024, "table not backed by huge pages"
    del t


def test_keep_freed_heap_sets_glibc_thresholds_or_says_it_did_not() -> None:
    import platform
    import subprocess
    import sys

    code = "from neorec.ops.memory import keep_freed_heap; print(keep_freed_heap())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    env = {**os.environ, "NEOREC_KEEP_HEAP": "0"}
    off = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert on.stdout.strip() == str(glibc)
    assert off.stdout.strip() == "False"
