"""`neorec train --nproc N`: same metrics as one process; failures end every rank; mismatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from dist_util import run_ranks

from neorec.config import ConfigError, load_config
from neorec.distributed.model_parallel import check_same_everywhere

TINY = [
    "embedding.num_tables=3",
    "embedding.rows=300",
    "embedding.dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=64",
    "data.train_samples=1920",
    "data.eval_samples=640",
    "train.log_every=10",
    "train.collective_timeout_s=60",
]


def neorec(*args: str, env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "neorec", "train", *args]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def sets(tmp, name, *extra):
    out = []
    for s in [*TINY, f"train.run_dir='{tmp / name}'", *extra]:
        out += ["--set", s]
    return out


def test_nproc2_matches_one_process(tmp_path):
    one = neorec(*sets(tmp_path, "one"))
    assert one.returncode == 0, one.stderr
    mixed = "sharding.types={t0='row_wise', t1='data_parallel', t2='column_wise'}"
    two = neorec("--nproc", "2", *sets(tmp_path, "two", mixed))
    assert two.returncode == 0, two.stderr[-3000:]
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())["eval"]
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())["eval"]
    for k in ("auc", "logloss", "ne", "calibration"):
        assert round(m1[k], 4) == round(m2[k], 4), (k, m1[k], m2[k])


def test_nproc2_bitwise_equals_one_process_table_wise(tmp_path):
    # Table-wise shards and train.dense_blocks (default 2): the same arithmetic as one process,
    # so the metrics are equal, not just close (the default config trains chaotically enough
    # that anything less differs in the 4th decimal).
    tw = "sharding.default_type='table_wise'"
    one = neorec(*sets(tmp_path, "one"))
    assert one.returncode == 0, one.stderr
    two = neorec("--nproc", "2", *sets(tmp_path, "two", tw))
    assert two.returncode == 0, two.stderr[-3000:]
    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())["eval"]
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())["eval"]
    assert m1 == m2


def test_failing_rank_stops_every_rank(tmp_path):
    t0 = time.monotonic()
    r = neorec("--nproc", "2", *sets(tmp_path, "fail"), env={"NEOREC_FAIL_AT": "1:3"})
    assert r.returncode != 0
    assert "injected failure on rank 1 at step 3" in r.stderr + r.stdout
    assert time.monotonic() - t0 < 120
    assert not (tmp_path / "fail" / "metrics.json").exists()


def _mismatch(rank: int, world: int) -> None:
    cfg = load_config(overrides=[f"embedding.lr={0.05 if rank == 0 else 0.1}"])
    with pytest.raises(ConfigError, match=r"embedding.lr: rank 0 has 0.05, rank 1 has 0.1"):
        check_same_everywhere("configs", cfg.to_dict())


def test_different_configs_detected():
    run_ranks(_mismatch, 2)
