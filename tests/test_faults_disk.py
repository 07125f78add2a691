"""Fault campaign "disk full": a checkpoint root that runs out of space or turns read-only.

neorec's policy (docs/checkpoints.md, "Disk full or read-only"): a checkpoint that cannot be
written **stops the run** with one ``CheckpointError`` line (the CLI: ``neorec: error: ...``,
exit 2) naming the OS error and the newest complete checkpoint, which stays restorable; the
unfinished write has no manifest (never taken as a checkpoint) and leaves no temporary file
behind (a full disk gets its space back).

Faults are injected deterministically into ``neorec.checkpoint.storage`` (tests may run as root,
where ``chmod`` does not stop writes): from the Nth file of the run's checkpoint writes on, the
disk is full (a write stores half its bytes then raises ``ENOSPC``), the rename fails
(``ENOSPC``), or the root is read-only (``EROFS`` / ``EACCES`` at open, at creating a checkpoint
directory, or at retention's deletes). N walks every kind of file of the first checkpoint and of
an increment (pieces, dense state, manifest), with the writer in the background and inline.

Each case is judged:

- the run must end in one ``NeorecError`` line naming the OS error ("clear error"; no error is
  "silently accepted", another exception a "crash");
- the newest complete checkpoint must be the one just before the failed write, restore, and equal
  the uninterrupted run's checkpoint of that step ("data lost" otherwise); the unfinished
  directory must be reported incomplete and no temporary file may remain ("silently accepted");
- then ``--resume latest`` on the repaired disk must finish equal to the uninterrupted run,
  bitwise ("handled"; "data lost" otherwise).

A real ``chmod`` case runs when the tests do not run as root; a ``--nproc 2`` CLI case (rank 1's
disk fills, injected by a ``sitecustomize``) checks the terminal gets one line.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import campaign, judge_cli, run_cli

import neorec.checkpoint.storage as storage_mod
from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint import CheckpointManager, open_storage
from neorec.checkpoint.catalog import resolve_checkpoint, scan, verify_checkpoint
from neorec.checkpoint.storage import TMP_MARK, FsspecStorage
from neorec.config import load_config
from neorec.errors import NeorecError
from neorec.train.trainer import Trainer

CAMPAIGN = "disk full"
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
    "train.steps=8",
    "checkpoint.every_steps=2",
    "checkpoint.fsync=false",
    "checkpoint.bits=32",
    "checkpoint.policy=consecutive",
    "checkpoint.keep_last=3",
]
STRERROR = {e: os.strerror(e) for e in (errno.ENOSPC, errno.EROFS, errno.EACCES)}


def cfg_for(run: Path, *extra: str) -> Any:
    return load_config(overrides=[*BASE, f"train.run_dir='{run}'", *extra])


def root_of(run: Path) -> Path:
    return run / "checkpoints"


class Disk:
    """Faults of the checkpoint root: from the ``fail_from``-th ``write_atomic`` on (1-based),
    ``mode`` ('write': half the bytes then ENOSPC; 'replace': the rename; 'open': opening the
    temporary file; 'mkdir': creating a checkpoint directory; 'remove': retention's deletes)
    raises ``OSError(err)``. ``fail_from=0`` records the files written and injects nothing."""

    def __init__(self, mp: pytest.MonkeyPatch, root: Path, fail_from: int, mode: str, err: int):
        self.root, self.fail_from, self.mode, self.err = str(root), fail_from, mode, err
        self.calls: list[str] = []
        self.active = False
        orig_write, orig_remove = FsspecStorage.write_atomic, FsspecStorage.remove
        real_open, real_replace, real_makedirs = open, os.replace, os.makedirs
        disk = self

        def mine(p: Any) -> bool:
            return disk.active and str(p).startswith(disk.root)

        def boom(p: Any) -> OSError:
            return OSError(disk.err, os.strerror(disk.err), str(p))

        def write_atomic(st: FsspecStorage, rel: str, data: bytes) -> None:
            if str(st.root).startswith(disk.root):
                disk.calls.append(rel)
                if disk.fail_from and len(disk.calls) >= disk.fail_from:
                    disk.active = True
            orig_write(st, rel, data)

        class HalfFull:
            def __init__(self, f: Any, path: str) -> None:
                self.f, self.path = f, path

            def write(self, data: bytes) -> int:
                self.f.write(bytes(data)[: len(data) // 2])
                raise boom(self.path)

            def __getattr__(self, k: str) -> Any:
                return getattr(self.f, k)

            def __enter__(self) -> HalfFull:
                return self

            def __exit__(self, *a: Any) -> None:
                self.f.close()

        def fake_open(p: Any, *a: Any, **k: Any) -> Any:
            if mine(p) and mode == "open":
                raise boom(p)
            f = real_open(p, *a, **k)
            return HalfFull(f, str(p)) if mine(p) and mode == "write" else f

        def fake_replace(a: Any, b: Any, *r: Any, **k: Any) -> None:
            if mine(b) and mode == "replace":
                raise boom(b)
            real_replace(a, b, *r, **k)

        def fake_makedirs(p: Any, *a: Any, **k: Any) -> None:
            if mine(p) and mode == "mkdir" and not os.path.isdir(p):
                raise boom(p)
            real_makedirs(p, *a, **k)

        def remove(st: FsspecStorage, rel: str) -> None:
            if mine(st.path(rel)) and mode == "remove":
                raise boom(st.path(rel))
            orig_remove(st, rel)

        mp.setattr(FsspecStorage, "write_atomic", write_atomic)
        mp.setattr(storage_mod, "open", fake_open, raising=False)
        mp.setattr(os, "replace", fake_replace)
        mp.setattr(os, "makedirs", fake_makedirs)
        mp.setattr(FsspecStorage, "remove", remove)


def model_state(cfg: Any, root: Path, name: str) -> dict[str, torch.Tensor]:
    """Checkpoint ``name`` of ``root`` restored into a fresh model: its tensors by name."""
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    CheckpointManager(cfg.checkpoint, model, opt, str(root)).restore(name)
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state_dict()["state"].values()):
        out.update({f"o.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def by_step(root: Path) -> dict[int, str]:
    """Complete checkpoints of ``root`` by step."""
    st = open_storage(str(root), fsync=False)
    return {int(e.manifest["step"]): e.name for e in scan(st) if e.manifest}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: its metrics, checkpoints by step, and the files it writes, in
    order (the same for the background and the inline writer)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    mp = pytest.MonkeyPatch()
    disk = Disk(mp, root_of(run), 0, "write", errno.ENOSPC)
    try:
        metrics = Trainer(cfg_for(run, "checkpoint.async_write=false")).fit()
    finally:
        mp.undo()
    steps = by_step(root_of(run))
    assert sorted(steps) == [2, 4, 6, 8]
    return {"run": run, "metrics": metrics, "steps": steps, "files": disk.calls}


def plan_cases(files: list[str]) -> list[tuple[int, str]]:
    """(1-based index, what it is) of every file of the first checkpoint (a baseline) and of the
    second (an increment)."""
    ckpts = sorted({f.split("/")[0] for f in files})[:2]
    out = []
    for i, f in enumerate(files, 1):
        c, rest = f.split("/", 1)
        if c not in ckpts:
            break
        kind = "manifest" if rest == "manifest.json" else "dense" if rest == "dense.pt" else "piece"
        out.append((i, f"{'baseline' if c == ckpts[0] else 'increment'} {kind} #{i} ({rest})"))
    return out


def expected_newest(files: list[str], fail_from: int, steps: dict[int, str]) -> int | None:
    """Step of the newest checkpoint whose manifest was written before the failing file."""
    done = {f.split("/")[0] for f in files[: fail_from - 1] if f.endswith("/manifest.json")}
    names = {v.split("-")[1]: k for k, v in steps.items()}  # step digits -> step
    got = [names[n.split("-")[1]] for n in done]
    return max(got, default=None)


def judge(
    name: str, run: Path, reference: dict[str, Any], err: int, newest: int | None, fit: Any
) -> None:
    """Run ``fit``, then judge the outcome, the checkpoints left and a resume (two cases)."""
    camp = campaign(CAMPAIGN)
    cfg = cfg_for(run)
    try:
        fit()
        camp.record(name, "silently accepted", "the run finished; a checkpoint was not written")
        return
    except NeorecError as e:
        msg = str(e)
        outcome = "clear error"
        if "\n" in msg.strip() or STRERROR[err] not in msg:
            outcome, msg = "crash", f"not one line naming {STRERROR[err]!r}: {msg!r}"
    except Exception as e:  # noqa: BLE001 - a crash is what we are counting
        camp.record(name, "crash", f"{type(e).__name__}: {e}")
        return
    root = root_of(run)
    st = open_storage(str(root), fsync=False)
    steps = by_step(root)
    problems = []
    tmp = [str(p.relative_to(root)) for p in root.rglob(f"*{TMP_MARK}*")] if root.exists() else []
    if tmp:
        problems.append(f"temporary files left on the full disk: {tmp[:3]}")
    if newest is None:
        if steps:
            problems.append(f"complete checkpoints {sorted(steps)} where none was due")
    else:
        latest = resolve_checkpoint(st, None)
        if latest != steps.get(newest):
            outcome, msg = "data lost", f"newest complete is {latest}, expected step {newest}"
        else:
            verify_checkpoint(st, latest)
            want = model_state(cfg, root_of(reference["run"]), reference["steps"][newest])
            got = model_state(cfg, root, latest)
            if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
                outcome, msg = "data lost", f"step {newest} restores other weights"
            elif latest.split("-")[1] not in msg:
                outcome, msg = "crash", f"message does not name the newest complete: {msg!r}"
    incomplete = [e.name for e in scan(st) if e.status != "complete"]
    if any(s in steps for s in [2, 4, 6, 8] if newest is None or s > newest):
        problems.append(f"checkpoints past the failure taken as complete: {sorted(steps)}")
    if problems and outcome == "clear error":
        outcome, msg = "silently accepted", "; ".join(problems)
    camp.record(name, outcome, msg)
    if outcome != "clear error":
        return
    # the disk is repaired: resuming the newest complete checkpoint finishes the run, bitwise
    resume = "latest" if newest is not None else ""
    try:
        m = Trainer(cfg_for(run, f"checkpoint.resume='{resume}'")).fit()
    except Exception as e:  # noqa: BLE001
        camp.record(f"{name}, then resume", "crash", f"{type(e).__name__}: {e}")
        return
    same = m["eval"] == reference["metrics"]["eval"]
    camp.record(
        f"{name}, then resume (incomplete before: {len(incomplete)})",
        "handled" if same else "data lost",
        "" if same else f"eval {m['eval']} != {reference['metrics']['eval']}",
    )


MODES = [
    ("write", errno.ENOSPC, "disk full while writing"),
    ("replace", errno.ENOSPC, "disk full at the rename"),
    ("open", errno.EROFS, "read-only root"),
    ("open", errno.EACCES, "root not writable"),
    ("mkdir", errno.EROFS, "read-only root, new checkpoint directory"),
]


@pytest.mark.parametrize("async_write", [True, False], ids=["background", "inline"])
def test_disk_full_or_read_only_while_checkpointing(
    tmp_path: Path, reference: dict[str, Any], async_write: bool
) -> None:
    files = reference["files"]
    n = 0
    for mode, err, what in MODES:
        points = (
            plan_cases(files)
            if err != errno.EACCES and mode != "replace"
            else plan_cases(files)[::3]
        )
        if mode == "mkdir":  # the first file of each checkpoint creates its directory
            c0 = files[0].split("/")[0]
            second = next(i for i, f in enumerate(files, 1) if not f.startswith(c0))
            points = [(1, "baseline directory"), (second, "increment directory")]
        for fail_from, where in points:
            n += 1
            run = tmp_path / f"r{n}"
            newest = expected_newest(files, fail_from, reference["steps"])
            mp = pytest.MonkeyPatch()
            Disk(mp, root_of(run), fail_from, mode, err)
            cfg = cfg_for(run, f"checkpoint.async_write={str(async_write).lower()}")
            name = (
                f"{what} ({errno.errorcode[err]}) at {where}, {'async' if async_write else 'sync'}"
            )
            try:
                judge(name, run, reference, err, newest, lambda cfg=cfg, mp=mp: _fit_undo(cfg, mp))
            finally:
                mp.undo()
    campaign(CAMPAIGN).check()


def _fit_undo(cfg: Any, mp: pytest.MonkeyPatch) -> None:
    """Train with the faults, then repair the disk (whatever the outcome)."""
    try:
        Trainer(cfg).fit()
    finally:
        mp.undo()


def test_retention_on_a_read_only_root(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Full checkpoints, keep_last=2: at step 6 retention must delete step 2 and cannot. The
    checkpoint of step 6 is complete; the run stops with one line, nothing is lost."""
    run = tmp_path / "ret"
    files = reference["files"]
    first3 = sorted({f.split("/")[0] for f in files})[2]
    at = max(i for i, f in enumerate(files, 1) if f.startswith(first3))  # its manifest
    mp = pytest.MonkeyPatch()
    disk = Disk(mp, root_of(run), at, "remove", errno.EROFS)
    cfg = cfg_for(run, "checkpoint.policy=full", "checkpoint.keep_last=2")
    camp = campaign(CAMPAIGN)
    name = "read-only root at retention (EROFS), full checkpoints keep_last=2"
    try:
        Trainer(cfg).fit()
        camp.record(name, "silently accepted", "finished; retention failed unnoticed")
    except NeorecError as e:
        steps = by_step(root_of(run))
        msg = str(e)
        if sorted(steps)[:3] != [2, 4, 6]:
            camp.record(name, "data lost", f"complete checkpoints left: {sorted(steps)}")
        elif "\n" in msg or STRERROR[errno.EROFS] not in msg or steps[6].split("-")[1] not in msg:
            camp.record(name, "crash", f"not one line naming the error and step 6: {msg!r}")
        else:
            camp.record(name, "clear error", msg)
    except Exception as e:  # noqa: BLE001
        camp.record(name, "crash", f"{type(e).__name__}: {e}")
    finally:
        mp.undo()
    assert disk.calls
    camp.check()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_real_chmod_read_only(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Not as root: the root turns read-only (chmod 0555) before the third checkpoint."""
    run = tmp_path / "chmod"
    orig = CheckpointManager.save
    calls = []

    def save(self: CheckpointManager, step: int, extra: Any = None) -> float:
        calls.append(step)
        if len(calls) == 3:
            self.wait()
            os.chmod(root_of(run), stat.S_IRUSR | stat.S_IXUSR)
        return orig(self, step, extra)

    mp = pytest.MonkeyPatch()
    mp.setattr(CheckpointManager, "save", save)
    try:
        judge(
            "chmod 0555 before the third checkpoint",
            run,
            reference,
            errno.EACCES,
            4,
            lambda: _fit_undo(cfg_for(run), mp),
        )
    finally:
        mp.undo()
        if root_of(run).exists():
            os.chmod(root_of(run), 0o755)
    campaign(CAMPAIGN).check()


FILL_RANK_1 = """import errno, os
if os.environ.get("RANK") == "1":
    import neorec.checkpoint.storage as s
    orig = s.FsspecStorage.write_atomic
    def write_atomic(self, rel, data):
        if rel.startswith(os.environ["NEOREC_TEST_FULL_AT"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path(rel))
        return orig(self, rel, data)
    s.FsspecStorage.write_atomic = write_atomic
"""


def test_two_ranks_one_disk_full_is_one_line(tmp_path: Path) -> None:
    """``--nproc 2``: rank 1's disk fills at its second checkpoint: one line, exit non-zero, and
    the first checkpoint stays the newest complete."""
    from test_elastic import argv as elastic_argv

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FILL_RANK_1)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    r = run_cli(
        elastic_argv(tmp_path, "d", "train.steps=30"),
        env={"PYTHONPATH": path, "NEOREC_TEST_FULL_AT": "ckpt-0000000020"},
        timeout=300,
    )
    camp = campaign(CAMPAIGN)
    name = "--nproc 2, rank 1's disk full at its second checkpoint"
    outcome, detail = judge_cli(r, STRERROR[errno.ENOSPC])
    if outcome == "clear error":
        steps = by_step(root_of(tmp_path / "d"))
        if sorted(steps) != [10]:
            outcome, detail = "data lost", f"complete checkpoints {sorted(steps)}, expected [10]"
        elif len([ln for ln in r.stderr.splitlines() if ln.strip()]) != 1:
            outcome, detail = "crash", f"more than one line: {r.stderr[-800:]!r}"
    camp.record(name, outcome, detail)
    shutil.rmtree(site)
    camp.check()
