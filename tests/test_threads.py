"""The default thread budget: the cores a process may use (affinity, cgroup v1/v2 quota), at most
the host's idle ones, split among local ranks; read from faked /proc and /sys trees (no timing)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from neorec.builder import apply_threads
from neorec.launch.agent import worker_threads_env
from neorec.machine import THREADS_WHY_ENV, CpuShare, cgroup_cpu_quota, cpu_share, default_threads


def _tree(
    root: Path,
    cgroup: str = "0::/\n",
    files: dict[str, str] | None = None,
    running: int = 1,
    cores: dict[int, int] | None = None,
) -> Path:
    """A fake ``/``: /proc/self/cgroup, /proc/loadavg (``running`` R of R/T), cgroup files, and
    each CPU's core id (``cores``: cpu -> core; one package)."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/loadavg").write_text(f"0.50 0.40 0.30 {running}/300 12345\n")
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for cpu, core in (cores or {}).items():
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True, exist_ok=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_cgroup_v2_quota_is_read_and_the_smallest_limit_above_wins(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods/pod1/cpu.max": "250000 100000\n",
            "sys/fs/cgroup/kubepods/cpu.max": "800000 100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 2.5


def test_cgroup_v2_max_and_missing_files_mean_no_quota(tmp_path: Path) -> None:
    assert (
        cgroup_cpu_quota(_tree(tmp_path / "a", files={"sys/fs/cgroup/cpu.max": "max 100000"}))
        is None
    )
    assert cgroup_cpu_quota(_tree(tmp_path / "b")) is None


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(root) == 1.5
    unlimited = _tree(
        tmp_path / "u",
        "2:cpu,cpuacct:/\n",
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_quota(unlimited) is None


def test_a_pod_limited_to_two_cpus_on_a_64_core_host_gets_two_threads(tmp_path: Path) -> None:
    root = _tree(tmp_path, files={"sys/fs/cgroup/cpu.max": "200000 100000\n"}, running=5)
    share = cpu_share(root, affinity=set(range(64)), host=64)
    assert (share.usable(), share.threads(), share.others) == (2, 2, 4)
    assert "cgroup quota 2 CPUs" in share.why()


def test_affinity_counts_smt_siblings_once(tmp_path: Path) -> None:
    root = _tree(tmp_path, cores={0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2})
    share = cpu_share(root, affinity={0, 1, 2, 3}, host=6)
    assert (share.allowed, share.cores, share.threads()) == (4, 2, 2)


def test_busy_processes_on_a_small_host_leave_one_thread(tmp_path: Path) -> None:
    # 2 CPUs, two busy loops beside this process: 3 running (this one counts itself).
    loaded = cpu_share(_tree(tmp_path / "l", running=3), affinity={0, 1}, host=2)
    assert (loaded.others, loaded.threads()) == (2, 1)
    quiet = cpu_share(_tree(tmp_path / "q", running=1), affinity={0, 1}, host=2)
    assert quiet.threads() == 2
    # A 64-CPU host with 60 other jobs running: the 4 idle cores.
    assert CpuShare(64, 64, None, 64, 60).threads() == 4


def test_local_ranks_split_the_budget() -> None:
    share = CpuShare(allowed=8, cores=8, quota=None, host=8, others=0)
    assert [share.threads(n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]
    assert "split over 4 local ranks" in share.why(4)


def test_omp_num_threads_wins_over_the_budget() -> None:
    share = CpuShare(8, 8, None, 8, 0)
    assert default_threads(1, {"OMP_NUM_THREADS": "3"}, share) == (3, "OMP_NUM_THREADS=3")
    assert default_threads(1, {"OMP_NUM_THREADS": "4,2"}, share) == (None, "OMP_NUM_THREADS=4,2")
    n, why = default_threads(2, {}, share)
    assert n == 4 and "8 usable cores" in why


def test_the_launcher_sets_its_workers_threads_and_why() -> None:
    env = worker_threads_env(2, {})
    assert int(env["OMP_NUM_THREADS"]) >= 1 and "split over 2 local ranks" in env[THREADS_WHY_ENV]
    assert worker_threads_env(2, {"OMP_NUM_THREADS": "1"}) == {}
    n, why = default_threads(2, {"OMP_NUM_THREADS": "1", THREADS_WHY_ENV: "because"})
    assert (n, why) == (1, "because")


def test_apply_threads_sets_torch_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    old = torch.get_num_threads()
    try:
        line = apply_threads(3)
        assert torch.get_num_threads() == 3 and line.startswith("threads  3 intra-op threads")
        assert "(train.threads;" in line
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        line = apply_threads(0)
        assert "OMP_NUM_THREADS=1" in line
    finally:
        torch.set_num_threads(old)


def test_the_banner_prints_the_thread_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from neorec.config import load_config
    from neorec.train.trainer import train

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config(
        None,
        [
            "data.train_samples=256",
            "data.eval_samples=128",
            "data.batch_size=64",
            f"train.runs_dir={tmp_path}",
            "train.save_model=false",
            "train.tensorboard=off",
        ],
    )
    out = io.StringIO()
    old = torch.get_num_threads()
    try:
        train(cfg, out=out)
    finally:
        torch.set_num_threads(old)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("threads  ")]
    assert lines == ["threads  1 intra-op thread (OMP_NUM_THREADS=1; train.threads sets it)"]
