"""Fault campaigns on checkpoints: damage, resume into another model, retention across runs.

- "checkpoint corruption": a chain of four checkpoints (baseline at step 2, increments at 4, 6,
  8), each case a fresh copy damaged one way: truncated or bit-flipped pieces, dense state and
  manifests; deleted manifests, pieces, baseline, intermediates; edited manifest fields (step,
  rows, lineage); empty, garbage, old-format and renamed manifests. Each is tried three ways:
  resume (``Trainer(...).fit()`` with ``checkpoint.resume=latest``), ``ckpt inspect --verify`` and
  ``ckpt ls`` (which must list the damaged checkpoint marked, or for damage inside a piece, which
  ls does not read, still list). A failed resume must delete nothing ("data lost" otherwise).
  The one specified non-error: a deleted newest manifest makes that checkpoint an unfinished
  write, so resume takes the one before and says so ("handled").
- "resume mismatch": resuming with other rows, dim, tables, table names, optimizers, pooling, MLP
  shapes or interaction is one error listing every difference (several at once: all of them);
  the model the restore was aimed at is left unchanged.
- "retention": the issue's repros (a deleted baseline then ``--resume latest``; a new run in a
  root holding an older run's later checkpoints) and ``--resume latest`` / ``auto`` on an empty
  root: right outcome, and nothing of another lineage deleted.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from faults import campaign, judge_cli, run_cli

from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint import CheckpointManager, list_checkpoints, open_storage
from neorec.checkpoint.format import seal_manifest
from neorec.checkpoint.inspect import format_inspect, format_ls
from neorec.config import load_config
from neorec.errors import NeorecError
from neorec.train.trainer import Trainer

BASE = [
    "embedding.num_tables=2",
    "embedding.rows=200",
    "embedding.dim=4",
    "model.bottom_mlp=[8, 4]",
    "model.top_mlp=[8, 1]",
    "data.batch_size=32",
    "data.train_samples=640",
    "data.eval_samples=64",
    "train.progress=false",
    "train.threads=1",
    "checkpoint.fsync=false",
    "checkpoint.bits=32",
    "checkpoint.policy=consecutive",
    "checkpoint.keep_last=3",
]


def cfg_for(run: Path, *extra: str):
    """A tiny config writing to ``run`` (checkpoints under run/checkpoints)."""
    return load_config(overrides=[*BASE, f"train.run_dir='{run}'", *extra])


def files(root: Path) -> set[str]:
    """Every file under ``root`` (relative), to tell whether anything vanished."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def ckpts(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, by step."""
    return sorted(p for p in root.iterdir() if p.name.startswith("ckpt-"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A run dir whose root holds baseline 2 and increments 4, 6, 8 of one run."""
    run = tmp_path_factory.mktemp("pristine")
    Trainer(cfg_for(run, "train.steps=8", "checkpoint.every_steps=2")).fit()
    assert [p.name[5:15] for p in ckpts(run / "checkpoints")] == [f"{s:010d}" for s in (2, 4, 6, 8)]
    return run


def _copy(pristine: Path, dst: Path) -> Path:
    shutil.copytree(pristine, dst)
    return dst / "checkpoints"


# ---- damage ---------------------------------------------------------------------------------
def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(rng: random.Random):
    def go(p: Path) -> None:
        data = bytearray(p.read_bytes())
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        p.write_bytes(bytes(data))

    return go


def _edit(path: tuple[str, ...], value):
    def go(p: Path) -> None:
        m = json.loads(p.read_text())
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
        p.write_text(json.dumps(m, indent=1))

    return go


def _piece(ck: Path) -> Path:
    return sorted((ck / "emb").rglob("*.bin"))[0]


def _old_format(p: Path) -> None:
    m = json.loads(p.read_text())
    m.pop("checksum")
    m["format_version"] = 1
    p.write_text(json.dumps(m))


def _rename_copy(ck: Path) -> None:
    shutil.copytree(ck, ck.parent / (ck.name[:-8] + "0badc0de"))


RNG = random.Random(0)
# (case, which checkpoint: index in the chain, target, damage, what the errors must mention)
DAMAGE = [
    ("truncate piece of latest", 3, "piece", _truncate, "truncated"),
    ("truncate piece of baseline", 0, "piece", _truncate, "truncated"),
    ("truncate dense.pt of latest", 3, "dense", _truncate, "dense.pt"),
    ("truncate manifest of latest", 3, "manifest", _truncate, "manifest"),
    ("truncate manifest of baseline", 0, "manifest", _truncate, "manifest"),
    *[(f"flip bit {i} in piece of increment", 1, "piece", _flip(RNG), "r0-200") for i in range(3)],
    *[(f"flip bit {i} in dense.pt", 3, "dense", _flip(RNG), "dense.pt") for i in range(2)],
    *[(f"flip bit {i} in manifest", 3, "manifest", _flip(RNG), "manifest") for i in range(4)],
    ("delete piece of latest", 3, "piece", Path.unlink, "missing"),
    ("delete piece of baseline", 0, "piece", Path.unlink, "missing"),
    ("delete dense.pt of latest", 3, "dense", Path.unlink, "missing"),
    ("delete baseline", 0, "dir", shutil.rmtree, "gone"),
    ("delete intermediate", 2, "dir", shutil.rmtree, "gone"),
    ("delete manifest of intermediate", 1, "manifest", Path.unlink, "no manifest"),
    ("edit step of latest", 3, "manifest", _edit(("step",), 80), "checksum mismatch"),
    ("edit rows of latest", 3, "manifest", _edit(("tables", "t0", "rows"), 999), "checksum"),
    ("edit lineage of latest", 3, "manifest", _edit(("lineage",), "00000000"), "checksum"),
    ("edit step of baseline", 0, "manifest", _edit(("step",), 0), "checksum mismatch"),
    ("empty manifest", 3, "manifest", lambda p: p.write_bytes(b""), "empty manifest"),
    ("garbage manifest", 3, "manifest", lambda p: p.write_bytes(b"\x00{]garbage"), "unreadable"),
    ("manifest is a list", 3, "manifest", lambda p: p.write_text("[]"), "not a"),
    ("old-format manifest", 3, "manifest", _old_format, "format_version 1"),
    ("renamed copy of latest", 3, "dir", _rename_copy, "renamed or copied"),
]


def _target(ck: Path, what: str) -> Path:
    return {
        "piece": lambda: _piece(ck),
        "dense": lambda: ck / "dense.pt",
        "manifest": lambda: ck / "manifest.json",
        "dir": lambda: ck,
    }[what]()


@pytest.mark.parametrize("case,index,what,damage,match", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_checkpoint_corruption(tmp_path, pristine, case, index, what, damage, match):
    c = campaign("checkpoint corruption")
    root = _copy(pristine, tmp_path / "run")
    damaged = ckpts(root)[index]
    damage(_target(damaged, what))
    before = files(root)
    resume = cfg_for(tmp_path / "run", "train.steps=12", "checkpoint.every_steps=2")
    resume.checkpoint.resume = "latest"
    c.expect_error(f"{case}: resume latest", lambda: Trainer(resume).fit(), match)
    lost = before - files(root)
    if lost:
        c.record(f"{case}: resume", "data lost", f"vanished: {sorted(lost)[:3]}")
    c.expect_error(f"{case}: inspect --verify", lambda: format_inspect(str(root), True), match)
    try:
        text = format_ls(str(root))
    except NeorecError as e:
        c.record(f"{case}: ls", "crash", f"ls refused a damaged root: {e}")
    else:
        shown = damaged.name if what != "dir" else damaged.name[:-8] + "0badc0de"  # the copy
        line = next((ln for ln in text.splitlines() if shown in ln), "")
        marked = any(w in line for w in ("CORRUPT", "BROKEN", "unfinished"))
        if what == "piece" or what == "dense":  # ls reads manifests, not pieces
            marked = bool(line)
        if what == "dir" and not damaged.exists():  # gone: its dependants are marked
            marked = "BROKEN" in text
        c.record(f"{case}: ls", "handled" if marked else "silently accepted", line or text[-200:])
    c.check()


def test_deleted_newest_manifest_is_an_unfinished_write(tmp_path, pristine):
    """Without its manifest the newest is an unfinished write: resume takes step 6, says so."""
    c = campaign("checkpoint corruption")
    root = _copy(pristine, tmp_path / "run")
    newest = ckpts(root)[-1]
    (newest / "manifest.json").unlink()
    kept = {f for f in files(root) if not f.startswith(newest.name)}
    out = tmp_path / "out.txt"
    resume = cfg_for(tmp_path / "run", "train.steps=10", "checkpoint.every_steps=2")
    resume.checkpoint.resume = "latest"
    with out.open("w") as fh:
        r = Trainer(resume, out=fh).fit()
    said = out.read_text()
    ok = r["train"]["resumed_at_step"] == 6 and "ignored unfinished" in said and newest.name in said
    c.record("delete newest manifest: resume", "handled" if ok else "silently accepted", said[:300])
    if kept - files(root):
        c.record("delete newest manifest: resume", "data lost", str(sorted(kept - files(root))))
    ls = format_ls(str(root))
    c.record(
        "delete newest manifest: ls",
        "handled" if "unfinished" in ls or newest.name not in ls else "silently accepted",
        ls[-300:],
    )
    c.check()


def test_checkpoint_cli_errors_are_one_line(tmp_path, pristine):
    """The CLI paths: one line, exit 2, for a damaged resume, a damaged inspect, a missing ls."""
    c = campaign("checkpoint corruption")
    root = _copy(pristine, tmp_path / "run")
    _flip(random.Random(1))(_piece(ckpts(root)[1]))
    (ckpts(root)[3] / "manifest.json").write_text("{")
    before = files(root)
    argv = [
        "train",
        *[a for o in BASE for a in ("--set", o)],
        "--set",
        f"train.run_dir='{tmp_path / 'run'}'",
        "--set",
        "train.steps=12",
        "--resume",
        "latest",
    ]
    for name, args, match in [
        ("cli resume latest, garbage newest manifest", argv, "unreadable manifest"),
        ("cli inspect --verify", ["ckpt", "inspect", str(ckpts(root)[2]), "--verify"], "r0-200"),
        ("cli ls missing root", ["ckpt", "ls", str(tmp_path / "nope")], "no such"),
    ]:
        r = run_cli(args)
        outcome, detail = judge_cli(r, match)
        if outcome == "clear error" and r.returncode != 2:
            outcome, detail = "crash", f"exit {r.returncode}: {detail}"
        c.record(name, outcome, detail)
    if before - files(root):
        c.record("cli: files", "data lost", str(sorted(before - files(root))[:3]))
    c.check()


# ---- resume mismatch ------------------------------------------------------------------------
TABLES_UV = 'embedding.tables=[{name="u0", rows=200, dim=4}, {name="u1", rows=200, dim=4}]'
MISMATCH = [
    ("rows", ["embedding.rows=150"], ("table t0 rows 200 != 150", "table t1 rows 200 != 150")),
    (
        "dim",
        ["embedding.dim=8", "model.bottom_mlp=[8, 8]"],
        ("table t0 dim 4 != 8", "model.bottom_mlp [8, 4] != [8, 8]"),
    ),
    ("num_tables", ["embedding.num_tables=3"], ("tables only in this model: t2",)),
    ("table names", [TABLES_UV], ("only in the checkpoint: t0, t1", "only in this model: u0")),
    ("embedding.optimizer adam", ["embedding.optimizer=adam"], ("rowwise_adagrad != adam",)),
    ("embedding.optimizer sgd", ["embedding.optimizer=sgd"], ("rowwise_adagrad != sgd",)),
    ("dense_optimizer sgd", ["train.dense_optimizer=sgd"], ("dense_optimizer adagrad != sgd",)),
    ("dense_optimizer adam", ["train.dense_optimizer=adam"], ("adagrad != adam",)),
    ("pooling", ["embedding.pooling=mean"], ("embedding.pooling sum != mean",)),
    ("top_mlp", ["model.top_mlp=[16, 1]"], ("model.top_mlp [8, 1] != [16, 1]",)),
    ("bottom_mlp", ["model.bottom_mlp=[16, 4]"], ("model.bottom_mlp [8, 4] != [16, 4]",)),
    ("interaction", ["model.interaction=dcn"], ("model.interaction dot != dcn",)),
    (
        "several at once",
        ["embedding.rows=150", "embedding.optimizer=adam", "train.dense_optimizer=sgd"],
        ("rows 200 != 150", "embedding.optimizer rowwise_adagrad != adam", "adagrad != sgd"),
    ),
]


@pytest.mark.parametrize("case,over,match", MISMATCH, ids=[m[0] for m in MISMATCH])
def test_resume_mismatch(tmp_path, pristine, case, over, match):
    c = campaign("resume mismatch")
    root = _copy(pristine, tmp_path / "run")
    before = files(root)
    cfg = cfg_for(tmp_path / "run", "train.steps=12", "checkpoint.every_steps=2", *over)
    cfg.checkpoint.resume = "latest"
    c.expect_error(f"{case}: trainer", lambda: Trainer(cfg).fit(), ("does not match", *match))
    # The manager API on a built model: same error, and the model is left as it was.
    cfg.checkpoint.resume = ""
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    was = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = CheckpointManager(cfg.checkpoint, model, opt, str(root))
    # (the API has no config: the dense part is compared by parameter shapes)
    api = [m for m in match if not m.startswith("model.")] or ["dense"]
    c.expect_error(f"{case}: manager", lambda: mgr.restore("latest"), ("does not match", *api))
    now = model.state_dict()
    if any(not torch.equal(was[k], now[k]) for k in was):
        c.record(f"{case}: manager", "data lost", "a refused restore changed the model")
    if before - files(root):
        c.record(f"{case}: files", "data lost", str(sorted(before - files(root))[:3]))
    c.check()


def test_resume_with_other_learning_rate_is_allowed(tmp_path, pristine):
    """Hyperparameters that are not the model's shape (learning rates) may change on resume."""
    c = campaign("resume mismatch")
    _copy(pristine, tmp_path / "run")
    cfg = cfg_for(tmp_path / "run", "train.steps=10", "embedding.lr=0.01", "train.dense_lr=0.002")
    cfg.checkpoint.resume = "latest"
    r = Trainer(cfg).fit()
    ok = r["train"]["resumed_at_step"] == 8
    c.record("other learning rates", "handled" if ok else "crash", str(r["train"]))
    c.check()


# ---- retention ------------------------------------------------------------------------------
def test_deleted_baseline_then_resume_latest(tmp_path):
    """Issue repro 1: baseline of a consecutive chain deleted, then --resume latest."""
    c = campaign("retention")
    run = tmp_path / "run"
    common = ["checkpoint.every_steps=2", "checkpoint.keep_last=3"]
    Trainer(cfg_for(run, "train.steps=10", *common)).fit()
    root = run / "checkpoints"
    shutil.rmtree(ckpts(root)[0])  # the baseline at step 2
    before = files(root)
    for mode in ("latest", "auto"):
        cfg = cfg_for(run, "train.steps=9", *common)
        cfg.checkpoint.resume = mode
        c.expect_error(
            f"deleted baseline: resume {mode}", lambda cfg=cfg: Trainer(cfg).fit(), "gone"
        )
        if before - files(root):
            c.record(f"deleted baseline: resume {mode}", "data lost", "files vanished")
    # A new run in the same root (no --resume) writes its own lineage and deletes nothing else.
    Trainer(cfg_for(run, "train.steps=6", *common, "checkpoint.keep_last=1")).fit()
    lost = before - files(root)
    c.record("deleted baseline: new run", "data lost" if lost else "handled", str(sorted(lost)[:3]))
    c.check()


def test_new_run_never_deletes_an_older_runs_checkpoints(tmp_path):
    """Issue repro 2: an older run's later steps in the root, then a new shorter run."""
    c = campaign("retention")
    run = tmp_path / "run"
    full = ["checkpoint.policy=full", "checkpoint.keep_last=2"]
    Trainer(cfg_for(run, "train.steps=18", "checkpoint.every_steps=6", *full)).fit()
    root = run / "checkpoints"
    old = files(root)
    old_lineage = {m["lineage"] for m in list_checkpoints(open_storage(str(root)))}
    out = tmp_path / "new.txt"
    with out.open("w") as fh:
        Trainer(cfg_for(run, "train.steps=9", "checkpoint.every_steps=2", *full), out=fh).fit()
    ms = list_checkpoints(open_storage(str(root)))
    new = [m for m in ms if m["lineage"] not in old_lineage]
    lost = old - files(root)
    c.record("new run: older run's files", "data lost" if lost else "handled", str(sorted(lost)))
    steps = sorted(m["step"] for m in new)
    ok = steps == [6, 8]
    c.record("new run: keeps its own last 2", "handled" if ok else "data lost", str(steps))
    said = out.read_text()
    c.record(
        "new run: says the root holds earlier runs",
        "handled" if "already holds" in said else "silently accepted",
        said[:200],
    )
    cfg = cfg_for(run, "train.steps=12", "checkpoint.every_steps=2", *full)
    cfg.checkpoint.resume = "latest"
    r = Trainer(cfg).fit()
    after = list_checkpoints(open_storage(str(root)))
    ok = r["train"]["resumed_at_step"] == 8 and after[-1]["lineage"] == new[0]["lineage"]
    c.record("resume latest = newest written", "handled" if ok else "silently accepted", str(r))
    if old - files(root):
        c.record("resume latest: older run's files", "data lost", str(old - files(root)))
    c.check()


def test_nothing_to_resume(tmp_path):
    c = campaign("retention")
    cfg = cfg_for(tmp_path / "run", "train.steps=2")
    cfg.checkpoint.resume = "latest"
    c.expect_error("resume latest, empty root", lambda: Trainer(cfg).fit(), "no checkpoint under")
    cfg.checkpoint.resume = str(tmp_path / "elsewhere" / "ckpt-0000000002-aa-bb")
    c.expect_error("resume a missing path", lambda: Trainer(cfg).fit(), "no such checkpoint")
    cfg.checkpoint.resume = "auto"
    out = tmp_path / "auto.txt"
    with out.open("w") as fh:
        r = Trainer(cfg, out=fh).fit()
    ok = r["train"]["resumed_at_step"] == 0 and "starting a new run" in out.read_text()
    c.record("resume auto, empty root", "handled" if ok else "silently accepted", out.read_text())
    c.check()


def test_forged_manifest_with_valid_checksum_is_a_mismatch(tmp_path, pristine):
    """An edit that keeps the checksum valid (a forged manifest) still meets the model check."""
    c = campaign("checkpoint corruption")
    root = _copy(pristine, tmp_path / "run")
    p = ckpts(root)[-1] / "manifest.json"
    m = json.loads(p.read_text())
    m["model"]["tables"]["t0"]["rows"] = 999
    p.write_bytes(seal_manifest(m))
    cfg = cfg_for(tmp_path / "run", "train.steps=12")
    cfg.checkpoint.resume = "latest"
    c.expect_error("forged model rows", lambda: Trainer(cfg).fit(), "rows 999 != 200")
    c.check()
