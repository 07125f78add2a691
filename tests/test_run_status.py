"""A run's row stores are flushed and closed at its end, also on SIGTERM (a row cache smaller
than a batch's distinct rows trains in chunks), and `neorec runs` tells how a run ended: finished,
failed with the error line, interrupted; `neorec exfm` folders too."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runs import TINY, cfg_of

from neorec.cli import main
from neorec.storage.store import SsdStore
from neorec.train import exfm
from neorec.train.runlist import describe_run
from neorec.train.runstatus import STATUS_FILE, mark_ended, mark_run, run_status
from neorec.train.trainer import Trainer, train

SSD = "[{name='a', rows=5000, dim=8, storage='ssd', cache_rows=4}, {name='b', rows=100, dim=8}]"


def test_ssd_cache_smaller_than_a_batch_trains_and_flushes_the_store(tmp_path: Path) -> None:
    """A cache of 4 rows under batches of up to 32 distinct rows (it stopped the run before,
    ``CacheCapacityError``) trains in chunks that fit; at the end of the run the row store is
    flushed (its file clean: ``SsdStore.open`` refuses an unflushed one) and its rows are the
    final table, what the all-in-memory run trains (to rounding)."""
    store = tmp_path / "store"
    sets = [f"embedding.tables={SSD}", f"storage.dir='{store}'", "train.save_model=false"]
    got = Trainer(cfg_of(tmp_path / "a", *sets))  # (no model saved: nothing else flushes)
    got.fit()
    assert got.model.ebc.stats()["spilled"] > 0
    ref = Trainer(cfg_of(tmp_path / "b", f"embedding.tables={SSD.replace('ssd', 'memory')}"))
    ref.fit()
    on_disk = SsdStore.open(store / "a.rows")  # (refused unless flushed)
    rows = on_disk.read(torch.arange(5000))[:, :8]
    on_disk.close()
    torch.testing.assert_close(rows, ref.model.ebc.table_weight("a"), rtol=1e-4, atol=1e-6)


def test_sigterm_flushes_the_row_stores(tmp_path: Path) -> None:
    """SIGTERM while training (a scheduler's stop): the run unwinds, flushes and closes its row
    store (before: killed with the store unflushed, refused by ``SsdStore.open``), and the
    process still ends by SIGTERM; train.log says where it stopped."""
    store, runs = tmp_path / "store", tmp_path / "runs"
    sets = [
        *TINY, f"embedding.tables={SSD.replace('cache_rows=4', 'cache_rows=40')}",
        f"storage.dir='{store}'", f"train.runs_dir='{runs}'",
        "train.name=t", "train.log_every=1", "train.steps=100000", "data.train_samples=3200000",
    ]  # fmt: skip
    argv = [sys.executable, "-m", "neorec", "train", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    events = runs / "t" / "events.jsonl"
    try:
        while proc.poll() is None and (
            not events.is_file() or len(events.read_text().splitlines()) < 3
        ):
            time.sleep(0.05)  # (until 3 steps were logged: the store has been written to)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    SsdStore.open(store / "a.rows").close()  # clean: flushed on the way out
    log = (runs / "t" / "train.log").read_text()
    assert "Terminated: SIGTERM" in log
    assert re.fullmatch(r"interrupted at step \d+", run_status(runs / "t") or ""), log


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
