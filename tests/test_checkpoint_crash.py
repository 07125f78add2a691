"""Crash safety: SIGKILL a checkpoint writer at random points, repeatedly; the latest complete
checkpoint always loads and verifies.

A fork server (this file run as a script) imports torch once; for each round it forks a writer
that resumes from the latest checkpoint and then trains and checkpoints (async, every step) until
the test kills it with SIGKILL. Between kills the test verifies and restores the latest checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

from neorec.checkpoint import (
    CheckpointManager,
    list_checkpoints,
    open_storage,
    resolve_checkpoint,
    verify_checkpoint,
)
from neorec.config import CheckpointConfig, load_config
from neorec.modules.dlrm import build_dlrm
from neorec.train.trainer import make_dense_optimizer, train_step

KILLS = 12


def _cfg():
    return load_config(
        overrides=[
            "embedding.num_tables=2",
            "embedding.rows=3000",
            "embedding.dim=16",
            "model.bottom_mlp=[16, 16]",
            "model.top_mlp=[8, 1]",
            "data.batch_size=128",
            "data.train_samples=128000",
            "data.eval_samples=128",
        ]
    )


def _ckpt_cfg(round_: int) -> CheckpointConfig:
    policy = ["adaptive", "consecutive", "one_shot", "full"][round_ % 4]
    bits = [32, 8, 4][round_ % 3]
    return CheckpointConfig(
        policy=policy, bits=bits, chunk_rows=1000, keep_last=2, adaptive_threshold=0.5
    )


def _writer(root: str, round_: int) -> None:
    """Resume from the latest checkpoint, then train + checkpoint every step until killed."""
    from neorec.data.synthetic import SyntheticClickData

    cfg = _cfg()
    model = build_dlrm(cfg)
    opt = make_dense_optimizer(cfg, model.dense_parameters())
    mgr = CheckpointManager(_ckpt_cfg(round_), model, opt, root)
    step = 0
    if list_checkpoints(mgr.storage):
        step = int(mgr.restore("latest")["step"])
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    print("started", flush=True)  # the kill clock starts now, not during imports and setup
    while True:
        train_step(model, opt, data.batch("train", step, 128), step + 1)
        step += 1
        mgr.save(step, {"step": step})


def _server(root: str) -> None:
    torch.set_num_threads(1)  # no thread pool before fork
    for round_, _ in enumerate(sys.stdin):
        pid = os.fork()
        if pid == 0:
            try:
                _writer(root, round_)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


def _check_latest(root: str) -> int:
    storage = open_storage(root)
    name = resolve_checkpoint(storage, "latest")
    verify_checkpoint(storage, name)
    cfg = _cfg()
    model = build_dlrm(cfg)
    opt = make_dense_optimizer(cfg, model.dense_parameters())
    extra = CheckpointManager(CheckpointConfig(async_write=False), model, opt, root).restore(name)
    assert torch.isfinite(model.ebc.weights).all()
    return int(extra["step"])


def test_sigkill_during_writes_never_breaks_latest(tmp_path):
    root = str(tmp_path / "ck")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    server = subprocess.Popen(
        [sys.executable, __file__, root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    rng = random.Random(0)
    steps = []
    try:
        assert server.stdin is not None and server.stdout is not None
        for _ in range(KILLS):
            server.stdin.write("go\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            assert server.stdout.readline().strip() == "started"
            time.sleep(rng.uniform(0.2, 2.0))
            os.kill(pid, signal.SIGKILL)
            assert server.stdout.readline().strip() == "reaped"
            if list_checkpoints(open_storage(root)):
                steps.append(_check_latest(root))
    finally:
        server.kill()
        server.wait()
    # timing on a loaded machine varies: require some progress, not a count per round
    assert len(steps) >= 3, steps
    assert steps == sorted(steps) and steps[-1] > steps[0]  # every writer resumed and progressed


if __name__ == "__main__":
    _server(sys.argv[1])
