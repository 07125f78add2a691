"""A run with an SSD table, a DRAM table and an in-memory table, checkpointing (32-bit) every 10
steps, SIGKILLed after its second checkpoint and resumed with ``--resume latest``, ends with eval
metrics bitwise equal to an uninterrupted run: in one process; on 2 ranks resumed in 1; and on
2 ranks under ``--max-restarts`` (a rank killing itself).

The kill is deterministic: a ``sitecustomize`` holds the checkpoint writer once its second
checkpoint is committed (the run cannot go past its third), the test waits for that second
checkpoint's manifest on disk, then SIGKILLs the run's process group. On 2 ranks the fixed
dram/ssd tables train in memory shards (the distributed runtime holds no row cache for them); the
resume in one process restores their checkpoint into the row cache's stores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import run_cli

SETS = [
    "embedding.tables=[{name='s', rows=400, dim=8, storage='ssd', cache_rows=150}, "
    "{name='d', rows=300, dim=8, storage='dram', cache_rows=150}, {name='m', rows=200, dim=8}]",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=64",
    "data.train_samples=2560",  # 40 steps
    "data.eval_samples=640",
    "train.eval_every=15",
    "train.threads=1",
    "train.log_every=10",
    "train.collective_timeout_s=60",
    "sharding.default_type='table_wise'",  # 2 ranks: one process's arithmetic, bitwise
    "checkpoint.every_steps=10",
    "checkpoint.bits=32",
    "checkpoint.opt_bits=32",
]

HOLD = """import threading
from neorec.checkpoint import manager as _m

_write = _m.CheckpointManager._write


def _held(self, snap):
    _write(self, snap)
    self._held = getattr(self, "_held", 0) + 1
    if self._held == 2:  # the second checkpoint is committed: the writer holds here for good
        threading.Event().wait()


_m.CheckpointManager._write = _held
"""


def argv(run: Path, *extra: str, nproc: int = 1) -> list[str]:
    out = ["train", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    for s in [*SETS, f"train.run_dir='{run}'", f"storage.dir='{run}-store'", *extra]:
        out += ["--set", s]
    return out


def metrics(run: Path) -> dict[str, object]:
    """The eval metrics (final and periodic) and the final train loss (the mean of the last 50
    steps' losses: a step on 2 ranks reports rank 0's half of the batch)."""
    m = json.loads((run / "metrics.json").read_text())
    return {"eval": m["eval"], "evals": m["evals"], "loss": m["train"]["final_loss"]}


def evals(m: dict[str, object]) -> dict[str, object]:
    """The eval metrics of ``metrics``."""
    return {k: v for k, v in m.items() if k != "loss"}


def committed(run: Path) -> list[str]:
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if (d / "manifest.json").exists())


def killed_after_second_checkpoint(tmp: Path, run: Path, nproc: int) -> None:
    """Start the run held after its second checkpoint, wait for it on disk, SIGKILL the group."""
    site = tmp / "hold"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(HOLD)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    with open(tmp / f"{run.name}.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neorec", *argv(run, nproc=nproc)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a verdict
        while len(committed(run)) < 2:
            assert proc.poll() is None, (tmp / f"{run.name}.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "no second checkpoint"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run / "metrics.json").exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    run = tmp_path_factory.mktemp("straight") / "a"
    r = run_cli(argv(run), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (run / "events.jsonl").read_text().splitlines()]
    assert steps and max(steps) == 40
    return metrics(run)


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_after_second_checkpoint_resumes_bitwise(
    tmp_path: Path, uninterrupted: dict[str, object], nproc: int
) -> None:
    run = tmp_path / "b"
    killed_after_second_checkpoint(tmp_path, run, nproc)
    r = run_cli(["train", "--resume", "latest", "--set", f"train.run_dir='{run}'"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"resumed from step 20 ", r.stdout + r.stderr), (r.stdout + r.stderr)[-2000:]
    assert (Path(f"{run}-store") / "s.rows").exists()  # the resume trains through the row cache
    if nproc == 1:
        assert metrics(run) == uninterrupted
    assert evals(metrics(run)) == evals(uninterrupted)


def test_killed_rank_under_max_restarts_ends_bitwise(
    tmp_path: Path, uninterrupted: dict[str, object]
) -> None:
    run = tmp_path / "c"
    r = run_cli(
        [*argv(run, "system.fail_at='1:25:kill'", nproc=2), "--max-restarts", "2"], timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL; restarting the group (1 of 2)" in r.stderr
    assert evals(metrics(run)) == evals(uninterrupted)
