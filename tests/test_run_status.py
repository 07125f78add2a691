"""Checks that can fail early fail early (a row cache smaller than a batch's distinct rows, before
the row store is written), and `neorec runs` tells how a run ended: finished, failed with the
error line, interrupted; `neorec exfm` folders too."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from test_runs import TINY, cfg_of

from neorec.cli import main
from neorec.storage.cache_table import CacheCapacityError
from neorec.train import exfm
from neorec.train.runlist import describe_run
from neorec.train.runstatus import STATUS_FILE, mark_ended, mark_run, run_status
from neorec.train.trainer import Trainer, train

SSD = "[{name='a', rows=5000, dim=8, storage='ssd', cache_rows=4}, {name='b', rows=100, dim=8}]"


def test_ssd_cache_smaller_than_a_batch_fails_before_the_store_is_written(
    tmp_path: Path, capsys: Any
) -> None:
    store = tmp_path / "store"
    cfg = cfg_of(tmp_path / "runs", f"embedding.tables={SSD}", f"storage.dir='{store}'")
    with pytest.raises(CacheCapacityError, match="table 'a': the first batch needs"):
        Trainer(cfg)
    assert not store.exists() or not any(store.iterdir())  # no row store was created
    runs = tmp_path / "runs"
    assert not runs.exists() or not [p for p in runs.iterdir() if p.name != "latest"]
    given = [*TINY, f"embedding.tables={SSD}", f"storage.dir='{store}'", f"train.runs_dir='{runs}'"]
    sets = [x for s in given for x in ("--set", s)]
    assert main(["train", *sets]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cache holds 4" in err
    assert not store.exists() or not any(store.iterdir())


def test_mark_run_and_run_status(tmp_path: Path) -> None:
    assert run_status(tmp_path) is None
    mark_ended(tmp_path, None)
    assert run_status(tmp_path) == "finished"
    mark_ended(tmp_path, KeyboardInterrupt())
    assert run_status(tmp_path) == "interrupted"
    mark_ended(tmp_path, ValueError("bad thing\nmore detail"))
    assert run_status(tmp_path) == "failed: bad thing"
    assert json.loads((tmp_path / STATUS_FILE).read_text())["error"] == "bad thing"
    with pytest.raises(ValueError):
        mark_run(tmp_path, "done")


def test_a_failed_run_says_failed_with_its_error_line(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="injected failure"):
        train(cfg_of(root, "train.steps=6", "system.fail_at=0:3", "train.name=broken"))
    train(cfg_of(root, "train.steps=2", "train.name=fine"))
    assert describe_run(root / "broken")["status"] == (
        "failed at step 2: injected failure on rank 0 at step 3"
    )
    assert describe_run(root / "fine")["status"] == "finished"
    capsys.readouterr()
    assert main(["runs", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "failed at step 2: injected failure" in out and "finished" in out


def test_a_resumed_run_is_no_longer_the_failure(tmp_path: Path) -> None:
    (tmp_path / "train.log").write_text(
        "step 2/6  loss 0.6\nstopped at step 2: RuntimeError: boom\n"
    )
    assert run_status(tmp_path) == "failed at step 2: boom"
    with open(tmp_path / "train.log", "a") as fh:
        fh.write("run      runs/x (resumed)\nstep 3/6  loss 0.5\n")
    assert run_status(tmp_path) is None  # (running or killed: the lock or `stopped` says)
    (tmp_path / "train.log").write_text("stopped at step 4: KeyboardInterrupt: \n")
    assert run_status(tmp_path) == "interrupted at step 4"


def _exfm_args(out: Path) -> argparse.Namespace:
    return argparse.Namespace(
        config="configs/exfm_stream.toml",
        fm_config="configs/exfm_fm.toml",
        set=[],
        fm_set=[],
        windows=1,
        out=str(out),
    )


def test_exfm_folders_are_marked_finished_or_failed(tmp_path: Path, monkeypatch: Any) -> None:
    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("the FM diverged")

    monkeypatch.setattr(exfm, "run_chain", boom)
    with pytest.raises(RuntimeError):
        exfm.run_exfm(_exfm_args(tmp_path / "bad"))
    assert describe_run(tmp_path / "bad")["status"] == "failed: the FM diverged"

    def done(*a: Any, **k: Any) -> Any:
        return {"fm_logits_ne": [None], "fm_ne": [0.9], "student_ne": [0.95]}

    monkeypatch.setattr(exfm, "run_chain", done)
    assert exfm.run_exfm(_exfm_args(tmp_path / "good")) == 0
    assert describe_run(tmp_path / "good")["status"] == "finished"
