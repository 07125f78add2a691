"""`neorec train --nproc N`: same metrics as one process; failures end every rank; mismatches."""

from __future__ import annotations

import json
import os
import shlex
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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process run both --nproc 2 comparisons read (run once: ~5 s)."""
    tmp = tmp_path_factory.mktemp("one")
    one = neorec(*sets(tmp, "one"))
    assert one.returncode == 0, one.stderr
    return json.loads((tmp / "one" / "metrics.json").read_text())["eval"]


def test_nproc2_matches_one_process(tmp_path, one_process):
    mixed = "sharding.types={t0='row_wise', t1='data_parallel', t2='column_wise'}"
    two = neorec("--nproc", "2", *sets(tmp_path, "two", mixed))
    assert two.returncode == 0, two.stderr[-3000:]
    m1 = one_process
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())["eval"]
    for k in ("auc", "logloss", "ne", "calibration"):
        assert round(m1[k], 4) == round(m2[k], 4), (k, m1[k], m2[k])


def test_nproc2_bitwise_equals_one_process_table_wise(tmp_path, one_process):
    # Table-wise shards and train.dense_blocks (default 2): the same arithmetic as one process,
    # so the metrics are equal, not just close (the default config trains chaotically enough
    # that anything less differs in the 4th decimal).
    tw = "sharding.default_type='table_wise'"
    two = neorec("--nproc", "2", *sets(tmp_path, "two", tw))
    assert two.returncode == 0, two.stderr[-3000:]
    m1 = one_process
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())["eval"]
    assert m1 == m2


def test_failing_rank_stops_every_rank(tmp_path):
    t0 = time.monotonic()
    r = neorec("--nproc", "2", *sets(tmp_path, "fail"), "--set", "system.fail_at='1:3'")
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


# ---- the launcher's pieces, in process (the processes themselves: test_faults_process.py) ------
def test_resume_command_round_trips_and_drops_old_resume():
    from neorec.cli import build_parser
    from neorec.launch.messages import resume_command

    sets_ = ["train.run_dir='/tmp/a b'", "checkpoint.resume='/x/ckpt-1'", "model.top_mlp=[8, 1]"]
    cmd = resume_command("configs/dcn_small.toml", sets_, 2)
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert (args.config, args.nproc, args.resume) == ("configs/dcn_small.toml", 2, "latest")
    assert args.set == [sets_[0], sets_[2]]
    assert "--nproc" not in resume_command(None, [], 1)


def test_step_of_reads_the_trainer_in_the_traceback():
    from neorec.launch.messages import step_of

    class Trainer:
        step = 17

        def fit(self):
            raise KeyboardInterrupt

    try:
        Trainer().fit()
    except KeyboardInterrupt as e:
        assert step_of(e) == 17
    assert step_of(KeyboardInterrupt()) is None


def test_interrupted_line_without_checkpoint(tmp_path):
    from neorec.launch.messages import interrupted_line

    cfg = load_config(overrides=[f"train.run_dir='{tmp_path}'"])
    assert interrupted_line(cfg, "cmd", 5) == (
        "neorec: interrupted at step 5 (no checkpoint to resume from)"
    )
    assert interrupted_line(None, "cmd", None) == "neorec: interrupted"


def test_failure_line_prefers_the_first_reported_error(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from neorec.launch import messages

    monkeypatch.setenv(messages.ERROR_DIR_ENV, str(tmp_path))
    fail = {
        0: SimpleNamespace(timestamp=5, exitcode=1),
        1: SimpleNamespace(timestamp=3, exitcode=-9),
    }
    # Nothing reported: the agent's first failure (a signal: exit 1).
    assert messages.failure_line(fail, str(tmp_path)) == (
        "neorec: error: rank 1 was killed by SIGKILL; the other ranks were stopped",
        1,
    )
    assert messages.write_report(1, "RuntimeError: boom", kind="defect")
    line, code = messages.failure_line(fail, str(tmp_path))
    assert line.startswith("neorec: error: rank 1 failed: RuntimeError: boom (traceback above)")
    assert code == 1
    time.sleep(0.01)
    assert messages.write_report(0, "bad plan")  # later than rank 1's: rank 1 stays the first
    assert messages.failure_line(fail, str(tmp_path))[0].startswith("neorec: error: rank 1 failed")
    (tmp_path / "rank-1.json").unlink()
    assert messages.failure_line(fail, str(tmp_path)) == ("neorec: error: rank 0: bad plan", 2)
    assert messages.peer_reported(1) and not messages.peer_reported(0)
    (tmp_path / "rank-0.json").unlink()
    fail[1].exitcode = 130  # a SIGINT sent to that worker alone
    assert messages.failure_line(fail, str(tmp_path)) == (
        "neorec: rank 1 was interrupted; the other ranks were stopped",
        130,
    )


def test_expected_parent(monkeypatch):
    from neorec.launch import worker

    monkeypatch.setenv(worker.LAUNCHER_PID_ENV, str(os.getppid()))
    assert worker._expected_parent() == os.getppid()
    monkeypatch.setenv(worker.LAUNCHER_PID_ENV, str(os.getpid()))  # alive, not the parent: stale
    assert worker._expected_parent() == os.getppid()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv(worker.LAUNCHER_PID_ENV, str(dead.pid))  # the launcher died before us
    assert worker._expected_parent() == dead.pid != os.getppid()


@pytest.mark.parametrize(
    "message, world, want",
    [
        ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv "
         "operation to complete", 2, "rank 1 did not answer a collective"),
        ("Application timeout caused pair closure", 2, "rank 1 did not answer a collective"),
        ("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4711: Connection reset by "
         "peer", 2, "rank 1 exited or lost its connection during a collective"),
        ("Connection closed by peer [127.0.0.1]:4711", 4, "another rank exited or lost"),
        ("shape mismatch", 2, None),
    ],
)  # fmt: skip
def test_peer_lost_names_the_peer(message, world, want):
    from neorec.errors import NeorecError
    from neorec.launch.messages import peer_lost

    got = peer_lost(RuntimeError(message), 0, world)
    if want is None:
        assert got is None
        return
    assert isinstance(got, NeorecError) and str(got).startswith(want), got
    assert "\n" not in str(got) and "(gloo: " in str(got)
    assert peer_lost(ValueError(message), 0, world) is None


def test_failure_line_names_a_stopped_rank(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from neorec.launch import messages

    monkeypatch.setenv(messages.ERROR_DIR_ENV, str(tmp_path))
    fail = {
        0: SimpleNamespace(timestamp=5, exitcode=2),
        1: SimpleNamespace(timestamp=5, exitcode=-15),
    }
    assert messages.write_report(0, "rank 1 did not answer a collective (gloo: x)", kind="peer")
    assert messages.failure_line(fail, str(tmp_path), [1]) == (
        "neorec: error: rank 1 was stopped (SIGSTOP?) and its peers' collectives timed out; "
        "the other ranks were stopped",
        1,
    )
    # Not stopped: a peer's report gives way to the end the agent saw of the rank it names.
    fail[1].exitcode = -9
    assert messages.failure_line(fail, str(tmp_path), [], "restarts exhausted: 1 of 1") == (
        "neorec: error: rank 1 was killed by SIGKILL; the other ranks were stopped "
        "(restarts exhausted: 1 of 1)",
        1,
    )
