"""The newcomer's path (issue 54): the final eval's progress line inside ``neorec train``; PyTorch's
import announced when slow; the smaller items: MovieLens's help and split line, whole-batch sample
counts said, the step an interrupted run reached in ``neorec runs``, a resume of a finished run
that asks for changes, the Quickstart's checkpoint note."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neorec.cli import main
from neorec.config import load_config
from neorec.train.progress import whole_batches_line
from neorec.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.train_samples=256", "data.eval_samples=256", "data.batch_size=64"]
QUIET = ["train.save_model=false", "train.tensorboard=off"]


def _sets(items: list[str]) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def test_the_final_eval_inside_train_has_a_progress_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Its first line after 0 s instead of QUIET_S: no timing window.)"""
    from neorec import phases

    monkeypatch.setattr(phases, "QUIET_S", 0.0)
    monkeypatch.setattr(phases, "EVERY_S", 0.0)
    out = io.StringIO()
    train(load_config(None, [*TINY, *QUIET, f"train.runs_dir={tmp_path}"]), out=out)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("final eval: ")]
    assert lines[0].startswith("final eval: 1/4 batches (25%)")
    assert lines[-1].startswith("final eval: 4 batches in ")


def test_a_slow_torch_import_is_announced() -> None:
    code = "from neorec.cli import load_torch; load_torch(after=0.0)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert not p.stderr  # stderr is for errors only
    lines = p.stdout.splitlines()
    assert lines[0] == "neorec: loading PyTorch ..." and lines[1].startswith(
        "neorec: PyTorch loaded in "
    )


def test_movielens_help_and_split_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_movielens import ratings, write_layouts

    with pytest.raises(SystemExit):
        main(["data", "movielens", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the last 10% of each user's ratings" in text and "%%" not in text
    p = write_layouts(tmp_path, ratings(2))["ml-1m"]
    assert (
        main(
            [
                "data",
                "movielens",
                "--input",
                str(p),
                "--output",
                str(tmp_path / "o"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "eval = the last 10% of each user's ratings by time" in out
    assert "--eval-fraction" not in out  # a flag this command does not take


def test_sample_counts_that_are_not_whole_batches_are_said() -> None:
    line = whole_batches_line(load_config(None))
    assert line == (
        "data     whole batches of 512 only: train 999,936 of data.train_samples 1,000,000 "
        "(1,953 batches); eval 49,664 of data.eval_samples 50,000 (97 batches)"
    )
    assert whole_batches_line(load_config(None, TINY)) is None
    out = io.StringIO()
    train(load_config(None, [*TINY, "data.eval_samples=300", *QUIET]), out=out)
    assert "eval 256 of data.eval_samples 300 (4 batches)" in out.getvalue()


def test_runs_shows_the_step_an_interrupted_run_reached(tmp_path: Path) -> None:
    from neorec.train.runlist import describe_run

    sets = [*TINY, *QUIET, f"train.run_dir={tmp_path / 'run'}", "train.log_every=100"]
    with pytest.raises(RuntimeError, match="injected failure"):
        train(load_config(None, [*sets, "system.fail_at=0:4"]), out=io.StringIO())
    assert describe_run(tmp_path / "run")["steps"] == 3  # not the last logged step's (none)


def test_resume_of_a_finished_run_with_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [*TINY, *QUIET, f"train.runs_dir={tmp_path}", "train.name=a", "train.steps=2"]
    base += ["checkpoint.every_steps=2", "train.progress=false"]
    assert main(["train", *_sets(base)]) == 0
    capsys.readouterr()
    again = ["train", "--resume", "latest", *_sets([f"train.runs_dir={tmp_path}", "train.name=a"])]
    assert main([*again, *_sets(["embedding.dim=8", "model.bottom_mlp=[64,32,8]"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changes its model (tables, model_config)" in err[0]
    assert main([*again, *_sets(["embedding.lr=0.1"])]) == 0
    out = capsys.readouterr().out
    assert "already finished at step 2" in out and "the change of embedding.lr not applied" in out


def test_the_quickstart_says_checkpoints_are_off() -> None:
    quick = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "Checkpoints are off by" in quick and "checkpoint.every_steps=" in quick
    from neorec.config import CheckpointConfig

    assert CheckpointConfig().every_steps == 0  # (what the note says)
