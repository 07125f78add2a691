"""Table buffers on transparent huge pages (neorec.ops.memory)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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


def test_switched_off_by_the_system_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from neorec.builder import apply_system
    from neorec.config import SystemConfig
    from neorec.ops import settings

    monkeypatch.setattr(settings, "HUGEPAGES", True)
    apply_system(SystemConfig(hugepages=False))
    assert not settings.HUGEPAGES
    assert not advise_huge_pages(torch.empty(16 << 20))


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
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert on.stdout.strip() == str(glibc)


def test_keep_heap_only_on_distributed_ranks_that_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    import neorec.builder.run as build_run
    from neorec.config import SystemConfig

    calls: list[int] = []
    monkeypatch.setattr(build_run, "keep_freed_heap", lambda: calls.append(1))
    build_run.apply_system(SystemConfig(keep_heap=True))  # one process: never
    build_run.apply_system(SystemConfig(keep_heap=False), distributed=True)
    assert calls == []
    build_run.apply_system(SystemConfig(keep_heap=True), distributed=True)
    assert calls == [1]
