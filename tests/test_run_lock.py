"""Run folders are locked by the run that writes them, and unfinished checkpoints of dead runs
are swept by the next run of the folder (issue 40)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from faults import campaign, run_cli
from test_runs import TINY, cfg_of

from neorec.checkpoint.format import NoCheckpointError
from neorec.train.runlock import LOCK_FILE, RunFolderError, acquire, held, release
from neorec.train.runs import resolve_run
from neorec.train.trainer import Trainer, train

CK = ["checkpoint.every_steps=2", "checkpoint.bits=32", "checkpoint.async_write=false"]


def _sets(*extra: str) -> list[str]:
    out = []
    for s in [*TINY, *extra]:
        out += ["--set", s]
    return out


class Holder:
    """A ``neorec train`` run in another process, stopped after the Trainer is built (the run
    folder chosen and, with the fix, locked) until ``finish``."""

    def __init__(self, root: Path, *sets: str) -> None:
        code = textwrap.dedent(
            f"""
            import sys
            from neorec.config import load_config
            from neorec.train.trainer import Trainer
            cfg = load_config(overrides={[*TINY, f"train.runs_dir='{root}'", *sets]!r})
            t = Trainer(cfg)
            print("ready", t.run.path, flush=True)
            sys.stdin.readline()
            t.fit()
            print("done", flush=True)
            """
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the Trainer exists (no timing)
        assert line.startswith("ready"), line + self.proc.stderr.read()[-2000:]  # type: ignore[union-attr]
        self.folder = Path(line.split(None, 1)[1].strip())

    def finish(self) -> str:
        out, err = self.proc.communicate("\n", timeout=300)
        assert self.proc.returncode == 0, err[-2000:]
        return out


def test_a_second_writer_of_a_run_folder_is_refused(tmp_path: Path) -> None:
    c = campaign("run folders")
    root = tmp_path / "runs"
    exact = tmp_path / "exact"
    h = Holder(root, f"train.run_dir='{exact}'", "train.steps=4", *CK)
    try:
        r = run_cli(["train", *_sets(f"train.runs_dir='{root}'", f"train.run_dir='{exact}'")])
        c.record(
            "second neorec train on a run_dir",
            *_refused(r, str(exact), f"pid {h.proc.pid}"),
        )
        assert not (exact / "events.jsonl").exists()  # refused before any work
        from neorec.train.runlist import describe_run

        assert describe_run(exact)["status"] == f"running (pid {h.proc.pid} on host {_host()})"
    finally:
        h.finish()
    metrics = json.loads((exact / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 4
    names = [p.name for p in (exact / "checkpoints").iterdir()]
    lineages = {n.split("-")[2] for n in names}
    c.record("one run's checkpoints", "handled" if len(lineages) == 1 else "data lost", str(names))

    # --resume latest of a named run while that run's resume is going on
    ck = [*CK, "train.name=a"]
    train(cfg_of(root, "train.steps=4", *ck))
    h = Holder(root, "train.steps=8", "checkpoint.resume='latest'", *ck)
    assert h.folder == root / "a"
    try:
        argv = [
            "train",
            "--resume",
            "latest",
            *_sets(f"train.runs_dir='{root}'", "train.steps=6", *ck),
        ]
        r = run_cli(argv)
        c.record(
            "second --resume latest of a run", *_refused(r, str(root / "a"), f"pid {h.proc.pid}")
        )
    finally:
        h.finish()
    lines = (root / "a" / "events.jsonl").read_text().splitlines()
    logged = [e["step"] for e in map(json.loads, lines) if "loss" in e]
    c.record("events of one run", "handled" if logged == [2, 4, 6, 8] else "data lost", str(logged))
    c.check()


def _host() -> str:
    import socket

    return socket.gethostname()


def _refused(r: subprocess.CompletedProcess[str], *match: str) -> tuple[str, str]:
    from faults import judge_cli

    outcome, detail = judge_cli(r, match)
    if outcome == "clear error" and r.returncode != 2:
        return "crash", f"exit {r.returncode}: {detail}"
    return outcome, detail


def test_the_lock_goes_with_the_holder(tmp_path: Path) -> None:
    """The OS drops a killed holder's lock; in one process the lock is re-entrant."""
    folder = tmp_path / "f"
    folder.mkdir()
    code = (
        "import sys; from pathlib import Path; from neorec.train.runlock import acquire; "
        f"acquire(Path({str(folder)!r})); print('locked', flush=True); sys.stdin.readline()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    with pytest.raises(RunFolderError, match=rf"{folder} is being written .*pid {p.pid}"):
        acquire(folder)
    p.send_signal(signal.SIGKILL)
    p.wait()
    acquire(folder)
    acquire(folder)  # re-entrant
    assert held(folder)
    release(folder)
    assert not held(folder) and (folder / LOCK_FILE).exists()
    from neorec.train.runlist import describe_run

    assert describe_run(folder)["status"] == "stopped"  # the lock file of a gone run


def test_a_refused_run_leaves_the_folder_unlocked(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    train(cfg_of(root, "train.steps=2", "train.name=x"))
    assert not held(root / "x")  # released at the end of the run
    with pytest.raises(NoCheckpointError):  # refused after the folder was locked
        Trainer(cfg_of(root, "train.steps=2", "train.name=x", "checkpoint.resume=latest"))
    assert not held(root / "x")
    run = resolve_run(cfg_of(root, "train.name=y"))
    assert held(run.path)
    run.discard_if_empty()  # the folder and its lock file go: nothing was written
    assert not run.path.exists() and not held(run.path)


DIE_IN_FIRST_WRITE = """
import os, sys
import neorec.checkpoint.storage as storage
real = os.replace
class _Os:
    def __getattr__(self, name):
        return getattr(os, name)
    @staticmethod
    def replace(src, dst):
        if "/ckpt-" in str(dst):
            os._exit(9)  # dies inside its first checkpoint write: the piece's temp file stays
        real(src, dst)
storage.os = _Os()
from neorec.config import load_config
from neorec.train.trainer import train
train(load_config(overrides=sys.argv[1:]))
"""


def test_unfinished_checkpoint_of_a_dead_run_is_swept(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    sets = [*TINY, f"train.run_dir='{folder}'", "train.steps=4", *CK]
    r = subprocess.run(
        [sys.executable, "-c", DIE_IN_FIRST_WRITE, *sets],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 9, r.stderr[-2000:]
    ckpts = folder / "checkpoints"
    left = [p for p in ckpts.iterdir()]
    assert len(left) == 1 and not (left[0] / "manifest.json").exists()
    tmp = [p for p in left[0].rglob("*") if ".tmp-" in p.name]
    assert tmp, list(left[0].rglob("*"))  # the unfinished folder and its temp file
    # the next run of the folder sweeps them, saying so in one line
    out = io.StringIO()
    train(cfg_of(tmp_path / "runs", *sets[len(TINY) :], "checkpoint.resume=auto"), out=out)
    lines = [ln for ln in out.getvalue().splitlines() if "removed" in ln]
    assert len(lines) == 1 and left[0].name in lines[0] and "unfinished" in lines[0], out.getvalue()
    assert not left[0].exists()
    assert all((p / "manifest.json").exists() for p in ckpts.iterdir())
