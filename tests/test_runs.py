"""Run folders: one per run, `latest`, config.toml / events.jsonl / train.log / metrics.json,
`--resume latest` scoped to a run, `neorec runs`, and one folder for a 2-process run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neorec.checkpoint.format import NoCheckpointError
from neorec.cli import main
from neorec.config import ConfigError, load_config
from neorec.errors import NeorecError
from neorec.train.progress import Progress, every_of
from neorec.train.runs import RUN_DIR_ENV, RunFolder, dump_toml, resolve_run
from neorec.train.trainer import Trainer, train

TINY = [
    "embedding.num_tables=2",
    "embedding.rows=100",
    "embedding.dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[8, 1]",
    "data.batch_size=32",
    "data.train_samples=320",
    "data.eval_samples=128",
    "train.log_every=2",
    "train.progress=false",
    "train.threads=1",
]


def cfg_of(root: Path, *extra: str):
    return load_config(overrides=[*TINY, f"train.runs_dir='{root}'", *extra])


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def test_two_runs_two_folders_latest_is_newest(tmp_path):
    root = tmp_path / "runs"
    train(cfg_of(root, "train.steps=2"))
    train(cfg_of(root, "train.steps=3"))
    folders = sorted(p for p in root.iterdir() if p.name != "latest")
    assert len(folders) == 2, folders
    steps = {
        p.name: json.loads((p / "metrics.json").read_text())["train"]["steps"] for p in folders
    }
    newest = max(folders, key=lambda p: steps[p.name])
    assert (root / "latest").is_symlink() and os.readlink(root / "latest") == newest.name
    for p in folders:
        assert {"config.toml", "metrics.json", "events.jsonl", "train.log"} <= {
            f.name for f in p.iterdir()
        }
        run = json.loads((p / "metrics.json").read_text())["run"]
        assert run["name"] == p.name and run["world_size"] == 1
        for k in ("neorec_version", "torch_version", "host", "cpu", "start_utc", "end_utc"):
            assert run[k], k
        assert "git_commit" in run
        # config.toml is the config as given, with the run's name: it loads back to the same
        again = load_config(p / "config.toml")
        assert again.train.name == p.name and again.train.run_dir == ""
        assert again.to_dict()["embedding"] == cfg_of(root).to_dict()["embedding"]


def test_events_one_line_per_logged_step(tmp_path):
    root = tmp_path / "runs"
    out = io.StringIO()
    cfg = cfg_of(root, "train.steps=6", "train.eval_every=3", "train.progress=true")
    train(cfg, out=out)
    folder = root / os.readlink(root / "latest")
    ev = events(folder)
    logged = [e for e in ev if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4, 6]
    for e in logged:
        assert e["loss"] > 0 and e["lr"] == 0.05 and e["samples_per_s"] > 0
    evals = [e for e in ev if "eval_ne" in e and not e.get("final")]
    assert [e["step"] for e in evals] == [3, 6]
    for e in evals:
        assert {"eval_auc", "eval_ne", "eval_calibration"} <= set(e)
    assert ev[-1]["final"] is True and ev[-1]["step"] == 6
    # train.log holds what the terminal showed, the banner and the summary included
    log = (folder / "train.log").read_text()
    assert log == out.getvalue()
    assert "model    bottom MLP" in log and "step 6/6" in log and "eval at step 3" in log


def test_runs_command_lists_both(tmp_path, capsys):
    root = tmp_path / "runs"
    train(cfg_of(root, "train.steps=2", "train.name=first"))
    train(cfg_of(root, "train.steps=2", "train.name=second"))
    capsys.readouterr()
    assert main(["runs", "--root", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines[1:] if line.strip()]
    assert [r.split()[0] for r in rows] == ["first", "*"]  # newest last, * marks latest
    assert rows[1].split()[1] == "second" and "finished" in rows[1]
    assert "%" in rows[0]  # the teacher gap of a synthetic run
    assert main(["runs", "--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: runs root") and len(err.splitlines()) == 1


def test_resume_latest_is_the_runs_own_checkpoint(tmp_path):
    root = tmp_path / "runs"
    ck = ["checkpoint.every_steps=2", "checkpoint.bits=32", "checkpoint.async_write=false"]
    train(cfg_of(root, "train.steps=4", "train.name=a", *ck))
    train(cfg_of(root, "train.steps=2", "train.name=b", *ck))
    # --resume latest with a name: that run's checkpoint, in its own folder
    t = Trainer(cfg_of(root, "train.steps=6", "train.name=a", "checkpoint.resume=latest", *ck))
    assert t.run.path == root / "a" and t.ckpt is not None and t.ckpt.target is not None
    assert t.ckpt.target.path.startswith(str(root / "a" / "checkpoints"))
    t.fit()
    assert os.readlink(root / "latest") == "a"
    assert [e["step"] for e in events(root / "a") if "loss" in e] == [2, 4, 6]
    assert json.loads((root / "b" / "metrics.json").read_text())["train"]["steps"] == 2
    # without a name: the latest run's (a, resumed last): never b's
    t = Trainer(cfg_of(root, "train.steps=8", "checkpoint.resume=latest", *ck))
    assert t.run.path == root / "a" and t.ckpt.target.manifest["step"] == 6
    # a newer run without checkpoints: resume latest is an error, not an older run's checkpoint
    train(cfg_of(root, "train.steps=2", "train.name=c"))
    with pytest.raises(NoCheckpointError, match=str(root / "c" / "checkpoints")):
        Trainer(cfg_of(root, "train.steps=4", "checkpoint.resume=latest"))
    # and auto starts a new run in a new folder
    t = Trainer(cfg_of(root, "train.steps=4", "checkpoint.resume=auto"))
    assert t.run.path.parent == root and t.run.name not in ("a", "b", "c") and t.ckpt is None


def test_nproc2_writes_one_folder(tmp_path):
    root = tmp_path / "runs"
    argv = ["train", "--nproc", "2"]
    for s in [*TINY, "train.steps=4", f"train.runs_dir='{root}'", "train.collective_timeout_s=60"]:
        argv += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(RUN_DIR_ENV, None)
    r = subprocess.run(
        [sys.executable, "-m", "neorec", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    folders = [p for p in root.iterdir() if p.name != "latest"]
    assert len(folders) == 1, folders
    m = json.loads((folders[0] / "metrics.json").read_text())
    assert m["run"]["world_size"] == 2
    logged = [e for e in events(folders[0]) if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4]
    assert all(e["comm_bytes_per_step"] > 0 for e in logged)
    assert os.readlink(root / "latest") == folders[0].name


def test_explicit_run_dir_and_the_latest_link(tmp_path):
    root = tmp_path / "runs"
    exact = tmp_path / "exact"
    train(cfg_of(root, "train.steps=2", f"train.run_dir='{exact}'"))
    assert (exact / "metrics.json").exists() and not root.exists()  # no run folder, no link
    train(cfg_of(root, "train.steps=2"))
    with pytest.raises(ConfigError, match="is the link to the newest run folder"):
        resolve_run(cfg_of(root, f"train.run_dir='{root / 'latest'}'"))
    with pytest.raises(ConfigError, match="train.name"):
        cfg_of(root, "train.name='../x'")


def test_a_run_that_never_starts_leaves_no_folder(tmp_path):
    root = tmp_path / "runs"
    train(cfg_of(root, "train.steps=2", "train.name=good"))
    with pytest.raises(NeorecError):  # refused before any work: no such plan file
        Trainer(cfg_of(root, "train.steps=2", f"sharding.plan='{tmp_path / 'no.json'}'"))
    assert sorted(p.name for p in root.iterdir()) == ["good", "latest"]
    assert os.readlink(root / "latest") == "good"
    # a taken name gets a suffix, never the earlier run's folder
    run = resolve_run(cfg_of(root, "train.name=good"))
    assert run.path == root / "good-2" and run.created
    run.discard_if_empty()
    assert not run.path.exists()


def test_eval_schedule_and_plain_progress():
    assert every_of(0, 0.1, 1953) == 196 and every_of(50, 0.1, 1953) == 50
    assert every_of(0, 0.0, 1953) == 0 and every_of(0, 0.1, None) == 0
    out = io.StringIO()
    p = Progress(4, 2, out)
    p.begin(0)  # not a terminal: plain lines, no bar
    for step in range(1, 5):
        p.update(step, 32, __import__("torch").tensor(0.5))
    p.close()
    lines = out.getvalue().splitlines()
    assert p.bar is None and [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert "eta" in lines[0] and "eta" not in lines[1]


def test_toml_dump_round_trips_odd_values(tmp_path):
    text = dump_toml(
        {"a": {"s": 'q"\\x\n', "f": 1e-8, "i": -3, "b": True, "d": {"x y": 1}, "l": [1.5, 2.0]}}
    )
    from neorec.config import read_toml

    (tmp_path / "c.toml").write_text(text)
    assert read_toml(tmp_path / "c.toml") == {
        "a": {"s": 'q"\\x\n', "f": 1e-8, "i": -3, "b": True, "d": {"x y": 1}, "l": [1.5, 2.0]}
    }


def test_run_folder_from_launcher_env(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "r"))
    monkeypatch.setenv("NEOREC_RUNS_ROOT", str(tmp_path))
    run = resolve_run(cfg_of(tmp_path / "elsewhere"))
    assert run == RunFolder(tmp_path / "r", tmp_path) and not run.created


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_gets_a_bar_and_the_log_gets_lines():
    pytest.importorskip("tqdm")
    import torch

    from neorec.train.runs import Tee

    term, log = _Terminal(), io.StringIO()
    tee = Tee(term)
    tee.attach(log)
    p = Progress(4, 2, tee)
    p.begin(0)
    assert p.bar is not None and tee.bar is p.bar
    for step in range(1, 5):
        p.update(step, 32, torch.tensor(0.5))
        if step == 3:
            print("eval at step 3", file=tee)
    p.close()
    assert tee.bar is None
    assert log.getvalue().splitlines()[1] == "eval at step 3"  # the plain lines, in order
    assert [line.split()[1] for line in log.getvalue().splitlines() if line.startswith("step")] == [
        "2/4",
        "4/4",
    ]
    assert "4/4 [" in term.getvalue() and "step 2/4  loss" not in term.getvalue()
