"""A stdout whose reader has gone (``neorec plan ... | head -1``, ``neorec train ... | head``) ends
quietly: exit 0, no traceback; a training run keeps training, its lines in train.log, and notes
the closed stdout in events.jsonl. The read end is closed before the command starts, so every
write meets a broken pipe (no timing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_closed(argv: list[str]) -> tuple[int, str]:
    """Run ``python -m neorec ARGV`` with a stdout pipe nobody reads; (exit code, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-m", "neorec", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the first line
    err = p.stderr.read().decode()
    return p.wait(timeout=600), err


def test_plan_into_a_closed_pipe_exits_0_without_a_traceback() -> None:
    code, err = _run_closed(["plan", "--config", "configs/default.toml", "--world-size", "2"])
    assert (code, err) == (0, "")


def test_training_into_a_closed_pipe_trains_on_and_says_so(tmp_path: Path) -> None:
    sets = [
        "data.train_samples=2048",
        "data.eval_samples=512",
        "data.batch_size=256",
        "train.log_every=2",
        f"train.run_dir={tmp_path / 'run'}",
        "train.tensorboard=off",
    ]
    code, err = _run_closed(["train", *[a for s in sets for a in ("--set", s)]])
    assert code == 0 and "Traceback" not in err, err
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 8  # every step trained
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    notes = [e["note"] for e in events if "note" in e]
    assert len(notes) == 1 and notes[0].startswith("stdout closed at step 0")
    log = (run / "train.log").read_text()
    assert "stdout closed" in log and "metrics written to" in log


def test_distributed_training_into_a_closed_pipe_trains_on_and_says_so(tmp_path: Path) -> None:
    """``neorec train --nproc 2 ... | head``: the launcher goes on, rank 0 notes the closed pipe."""
    sets = [
        "data.train_samples=2048",
        "data.eval_samples=512",
        "data.batch_size=256",
        "train.log_every=2",
        f"train.run_dir={tmp_path / 'run'}",
        "train.tensorboard=off",
    ]
    code, err = _run_closed(["train", "--nproc", "2", *[a for s in sets for a in ("--set", s)]])
    assert code == 0 and "Traceback" not in err, err
    run = tmp_path / "run"
    assert json.loads((run / "metrics.json").read_text())["train"]["steps"] == 8
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    notes = [e["note"] for e in events if "note" in e]
    assert len(notes) == 1 and notes[0].startswith("stdout closed at step 0")
    log = (run / "train.log").read_text().splitlines()
    assert any(line.startswith("stdout closed at step 0") for line in log)  # a line of its own


def test_the_loading_note_into_a_closed_pipe_is_no_error() -> None:
    """On a loaded machine ``neorec: loading PyTorch ...`` is the first line: a reader already
    gone must not end the command there (it ended a whole ``--nproc`` job with exit 0)."""
    code = (
        "import sys; from neorec.cli import load_torch; load_torch(0.0); "
        "sys.stderr.write('went on')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=600) == 0 and err == "went on", err
