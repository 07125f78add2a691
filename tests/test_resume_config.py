"""`neorec train --resume` keeps the run: its own config.toml, with only what is given now applied
(printed key by key); a finished run is not trained again; `neorec runs` keeps the first start."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from neorec.cli import build_parser, main
from neorec.config import ConfigError, load_config
from neorec.train import runs as runs_module
from neorec.train.runlist import format_runs, list_runs
from neorec.train.runs import dump_toml
from neorec.train.trainer import Trainer

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
    "checkpoint.every_steps=2",
    "checkpoint.bits=32",
    "checkpoint.async_write=false",
]
FILES = ("config.toml", "metrics.json", "events.jsonl", "train.log")


def sets(*items: str) -> list[str]:
    out: list[str] = []
    for s in items:
        out += ["--set", s]
    return out


def first_run(root: Path, *extra: str) -> Path:
    """A finished 4-step run ``a`` under ``root`` (checkpoints at steps 2 and 4)."""
    argv = ["train", *sets(*TINY, f"train.runs_dir='{root}'", "train.name=a", "train.steps=4")]
    assert main([*argv, *sets(*extra)]) == 0
    return root / "a"


def metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def logged_steps(run: Path) -> list[int]:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if "loss" in e]


def resume_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("resume: ")]


def test_resume_without_flags_continues_the_interrupted_run_as_it_was(tmp_path, capsys):
    root = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="injected failure"):  # stops before step 3
        first_run(root, "system.fail_at='0:3'")
    capsys.readouterr()
    # Only the run's folder (and the fault injection switched off): nothing of TINY again.
    argv = ["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'", "system.fail_at=''")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert resume_lines(out) == [
        f"resume: run a with its own config ({root / 'a' / 'config.toml'}), 1 change:",
        "resume: system.fail_at '0:3' -> '' (from --set)",
    ]
    m = metrics(root / "a")
    assert m["train"]["steps"] == 4 and m["train"]["resumed_at_step"] == 2  # not 1,953 steps
    assert (
        m["config"]["embedding"]["tables"][0]["rows"] == 100
        and m["config"]["data"]["train_samples"] == 320
    )
    assert logged_steps(root / "a") == [2, 4]


def test_set_overrides_are_printed_and_kept_for_the_next_resume(tmp_path, capsys):
    root = tmp_path / "runs"
    first_run(root)
    capsys.readouterr()
    base = ["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'")]
    assert main([*base, *sets("train.steps=6", "train.seed=0")]) == 0
    out = capsys.readouterr().out
    assert resume_lines(out)[1:] == ["resume: train.steps 4 -> 6 (from --set)"]  # seed: unchanged
    assert "resume: run a with its own config" in out and ", 1 change:" in out
    assert metrics(root / "a")["train"]["steps"] == 6 and logged_steps(root / "a") == [2, 4, 6]
    saved = load_config(root / "a" / "config.toml")
    assert saved.train.steps == 6 and saved.checkpoint.resume == ""  # re-runnable as a new run
    # the next resume starts from 6: the override stays with the run
    assert main([*base, *sets("train.steps=8")]) == 0
    assert "resume: train.steps 6 -> 8 (from --set)" in capsys.readouterr().out
    assert metrics(root / "a")["train"]["steps"] == 8


def test_config_with_resume_applies_its_keys_and_set_wins(tmp_path, capsys):
    root = tmp_path / "runs"
    a = tmp_path / "a.toml"
    a.write_text(
        "[embedding]\nnum_tables = 2\nrows = 100\ndim = 8\n"
        "[model]\nbottom_mlp = [16, 8]\ntop_mlp = [8, 1]\n"
        "[data]\nbatch_size = 32\ntrain_samples = 320\neval_samples = 128\n"
        "[train]\nsteps = 4\nlog_every = 2\nprogress = false\nthreads = 1\nname = 'a'\n"
        f"runs_dir = '{root}'\n"
        "[checkpoint]\nevery_steps = 2\nbits = 32\nasync_write = false\n"
    )
    assert main(["train", "--config", str(a)]) == 0
    capsys.readouterr()
    # The command Ctrl-C prints (the original --config and flags again): nothing changes.
    assert main(["train", "--config", str(a), "--resume", "latest", *sets("train.steps=6")]) == 0
    out = capsys.readouterr().out
    assert resume_lines(out)[1:] == ["resume: train.steps 4 -> 6 (from --set)"]
    # Another file: only the keys it names apply (the tables stay the run's), printed as such;
    # a --set of the same key wins.
    b = tmp_path / "b.toml"
    b.write_text(f"[train]\nsteps = 8\nlog_every = 4\nruns_dir = '{root}'\nname = 'a'\n")
    assert (
        main(["train", "--config", str(b), "--resume", "latest", *sets("train.log_every=1")]) == 0
    )
    out = capsys.readouterr().out
    assert resume_lines(out)[1:] == [
        f"resume: train.steps 6 -> 8 (from --config {b})",
        "resume: train.log_every 2 -> 1 (from --set)",
    ]
    m = metrics(root / "a")
    assert m["train"]["steps"] == 8 and m["config"]["embedding"]["rows"] == 100


def test_a_resume_that_breaks_the_model_is_refused_and_changes_nothing(tmp_path, capsys):
    root = tmp_path / "runs"
    run = first_run(root)
    before = {f: (run / f).read_bytes() for f in FILES}
    capsys.readouterr()
    base = ["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'", "train.steps=6")]
    assert main([*base, *sets("embedding.dim=16", "model.bottom_mlp=[16, 16]")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match this model" in err[0] and "dim" in err[0], err
    assert main([*base, *sets("train.stpes=9")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'steps'" in err[0], err
    assert {f: (run / f).read_bytes() for f in FILES} == before


def test_resuming_a_finished_run_says_so_and_writes_nothing(tmp_path, capsys):
    root = tmp_path / "runs"
    run = first_run(root)
    before = {f: (run / f).read_bytes() for f in FILES}
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    capsys.readouterr()
    assert main(["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'")]) == 0
    out = capsys.readouterr().out
    said = [ln for ln in out.splitlines() if not ln.startswith("resume: ")]
    assert len(said) == 1 and "run a is already finished at step 4" in said[0], out
    assert "trained steps" not in out and "(M > 4)" in said[0]
    assert {f: (run / f).read_bytes() for f in FILES} == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ckpts
    assert os.readlink(root / "latest") == "a"
    # the command it names trains further
    cmd = shlex.split(said[0].split("to train further: ", 1)[1].split(" (M >")[0])
    assert cmd[:2] == ["neorec", "train"]
    assert main([*cmd[1:-1], cmd[-1].replace("=M", "=6")]) == 0
    assert metrics(run)["train"]["steps"] == 6


def test_a_checkpoint_past_train_steps_is_refused(tmp_path):
    root = tmp_path / "runs"
    first_run(root)
    over = [*TINY, f"train.runs_dir='{root}'", "train.name=a", "checkpoint.resume=latest"]
    with pytest.raises(ConfigError, match="is at step 4, past this run's 3 steps"):
        Trainer(load_config(overrides=[*over, "train.steps=3"]))


def test_runs_keeps_the_first_start_and_shows_the_last_resume(tmp_path, monkeypatch, capsys):
    times = iter(f"2030-01-0{d}T00:00:00Z" for d in range(1, 10))
    monkeypatch.setattr(runs_module, "utc_now", lambda: next(times))
    root = tmp_path / "runs"
    first_run(root)
    assert main(["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'")]) == 0  # done
    base = ["train", "--resume", "latest", *sets(f"train.runs_dir='{root}'")]
    assert main([*base, *sets("train.steps=6")]) == 0
    (row,) = list_runs(root)
    assert row["start_utc"] == "2030-01-01T00:00:00Z"
    assert row["resumed_utc"] == "2030-01-02T00:00:00Z"
    assert metrics(root / "a")["run"]["start_utc"] == "2030-01-01T00:00:00Z"
    table = format_runs([row])
    assert "2030-01-01 00:00" in table and "resumed 2030-01-02 00:00" in table


def test_nproc_ranks_get_the_restored_config(tmp_path, monkeypatch, capsys):
    """The launcher hands its ranks the resumed run's whole config (what an elastic restart
    starts again, with its own checkpoint.resume appended)."""
    import neorec.launch.agent as agent

    root = tmp_path / "runs"
    first_run(root)
    seen: dict = {}

    def fake_launch(nproc, rest, on_signal, env, max_restarts=0, recovery=None, **kw):
        args = build_parser().parse_args(rest)
        seen["cfg"] = load_config(args.config, [*args.set, "checkpoint.resume='/x/ckpt-1'"])
        seen["rest"], seen["env"] = rest, env
        return 0

    monkeypatch.setattr(agent, "launch", fake_launch)
    argv = ["train", "--nproc", "2", "--resume", "latest"]
    assert main([*argv, *sets(f"train.runs_dir='{root}'", "train.steps=6")]) == 0
    cfg = seen["cfg"]
    assert cfg.train.steps == 6 and cfg.embedding.rows == 100 and cfg.train.name == "a"
    assert cfg.checkpoint.resume == "/x/ckpt-1"
    assert seen["rest"][:2] == ["train", "--config"] and not Path(seen["rest"][2]).exists()
    assert seen["env"]["NEOREC_RUN_DIR"] == str(root / "a")


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_a_config_round_trips_through_the_file_the_ranks_read(tmp_path, name):
    cfg = load_config(CONFIGS / name, ["train.steps=3"])
    (tmp_path / "c.toml").write_text(dump_toml(cfg.to_dict()))
    assert load_config(tmp_path / "c.toml") == cfg
