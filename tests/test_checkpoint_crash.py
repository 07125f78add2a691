"""Campaign "checkpoint crash": SIGKILL while asynchronous checkpoint writes are in flight; every
resume is bitwise the uninterrupted run.

A fork server (this file run as a script) imports torch and loads the kernels once; the test
sends it one JSON job per process to run, and it forks a child for each:

- the reference: trains ``STEPS`` steps uninterrupted (async checkpoints every step, under its own
  root) and dumps its full state (embedding rows and optimizer state, step counter, dense
  parameters, dense optimizer state) after every step;
- ``KILLS`` writers on one root: each (but the first) resumes from the latest complete checkpoint,
  trains and checkpoints asynchronously (a policy and an interval per round), and is SIGKILLed
  while a background write is in flight: every other kill is pinned by a hook to a seeded file
  operation of the writer thread (before piece i, before dense.pt, before the manifest, before a
  retention removal: certainly mid-write), the others land a seeded 0-10 ms after ``save()``
  returned (the write is ~8 ms, training a step ~3 ms: usually mid-write, sometimes mid-file);
- a last writer resumes and trains to ``STEPS``.

After each kill: the latest complete checkpoint verifies, it is at least as new as the newest one
the writer saw committed, and every complete checkpoint seen before the kill is still there unless
retention (``keep_last`` baselines) removed it legitimately. Each resumed process first perturbs
all its state (an unrelated training step, every tensor shifted) so that whatever the restore
misses shows; its restored state must be bitwise the reference's at that step, and the final state
bitwise the reference's final state. Timing decides only where a timed kill lands, never a verdict.

Why a fork server rather than ``neorec train`` subprocesses: a fresh process pays the imports,
torch._dynamo (the dense optimizer loads it) and the kernels, 3-10 s each on a busy 2-core
machine, seven of them 20-70 s; the server pays that once and a forked child is training within
~0.1 s, so the campaign takes ~5-10 s. The children run what ``neorec train`` runs per step
(``train_step``, ``CheckpointManager.save`` / ``restore``) with one thread each, so every
process, the reference included, does the same arithmetic.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import campaign

from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint import (
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    open_storage,
    resolve_checkpoint,
    verify_checkpoint,
)
from neorec.config import CheckpointConfig, load_config
from neorec.data.synthetic import SyntheticClickData
from neorec.train.trainer import train_step

KILLS = 5
STEPS = 48
KEEP = 2
BATCH = 128
POLICIES = ("adaptive", "consecutive", "full", "one_shot")
TIMEOUT = 60.0  # seconds without a line from the server: something hangs


def _cfg() -> Any:
    return load_config(
        overrides=[
            "embedding.num_tables=2",
            "embedding.rows=3000",
            "embedding.dim=16",
            "model.bottom_mlp=[16, 16]",
            "model.top_mlp=[8, 1]",
            f"data.batch_size={BATCH}",
            "data.train_samples=128000",
            "data.eval_samples=128",
        ]
    )


def _ckpt_cfg(policy: str, fsync: bool = True) -> CheckpointConfig:
    # 32-bit rows and state: a restore is exact, so a resume can be bitwise
    return CheckpointConfig(
        policy=policy,
        bits=32,
        opt_bits=32,
        chunk_rows=1000,
        keep_last=KEEP,
        adaptive_threshold=0.5,
        fsync=fsync,
    )


# ---- the fork server and its children --------------------------------------------------------
def _say(msg: str) -> None:
    """One line to the test, in one write (the writer thread talks too)."""
    os.write(1, (msg + "\n").encode())


def _full_state(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything training depends on: model tensors (rows, row optimizer state, step counter,
    dense parameters) and the dense optimizer's state and hyperparameters."""
    out: dict[str, Any] = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            out[f"opt/{i}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["opt/param_groups"] = sd["param_groups"]
    return out


def _perturb(model: Any, opt: torch.optim.Optimizer, data: Any) -> None:
    """Move every piece of state away from anything a restore could leave untouched."""
    train_step(model, opt, data.batch("eval", 0, BATCH), 1)
    with torch.no_grad():
        for v in model.state_dict().values():
            v.add_(0.5 if v.is_floating_point() else 1000)


def _pause_writes_at(storage: Any, op: int, only: str) -> None:
    """Block the writer thread before its ``op``-th file operation from now, counting writes and
    removals (``only`` = "any") or only removals (``only`` = "remove": retention's)."""
    count = [0]
    write, remove = storage.write_atomic, storage.remove

    def hit(what: str, rel: str) -> None:
        if only not in ("any", what):
            return
        if count[0] == op:
            _say(f"paused {what} {rel}")
            time.sleep(600)  # the test kills us here
        count[0] += 1

    def write_atomic(rel: str, data: bytes) -> None:
        hit("write", rel)
        write(rel, data)

    def remove_(rel: str) -> None:
        hit("remove", rel)
        remove(rel)

    storage.write_atomic, storage.remove = write_atomic, remove_


def _child(job: dict[str, Any], say: Callable[[str], None] = _say) -> None:
    """Run one job: resume or start, train to ``until`` checkpointing, dump states; ``say``
    tells the test where it is."""
    cfg = _cfg()
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    if job["resume"]:
        _perturb(model, opt, data)
    mgr = CheckpointManager(
        _ckpt_cfg(job["policy"], job.get("fsync", True)), model, opt, job["root"]
    )
    step, seen = 0, 0
    if job["resume"]:
        step = int(mgr.restore("latest")["step"])
        torch.save(_full_state(model, opt), job["restored"])
    ref = job.get("ref_dir")
    if ref:
        torch.save(_full_state(model, opt), f"{ref}/{step}.pt")
    say(f"started {os.getpid()} {step}")
    every = job["every"]
    while step < job["until"]:
        train_step(model, opt, data.batch("train", step, BATCH), step + 1)
        step += 1
        if ref:
            torch.save(_full_state(model, opt), f"{ref}/{step}.pt")
        if step % every:
            continue
        if step == job.get("pause_step"):
            mgr.wait()  # the hook counts this step's write only
            _pause_writes_at(mgr.storage, job["pause_op"], job["pause_only"])
        mgr.save(step, {"step": step})
        # save() waited for the previous write: what it committed is on storage now
        say(f"saved {step} {_committed(mgr, seen)}")
        seen = mgr.commits
    mgr.close()
    torch.save(_full_state(model, opt), job["final"])
    say(f"done {step} {_committed(mgr, seen)}")


def _committed(mgr: Any, seen: int) -> str:
    """Name, baseline and step of the checkpoints committed since ``seen``, as compact JSON."""
    new = list(mgr.history)[len(mgr.history) - (mgr.commits - seen) :]
    return json.dumps(new, separators=(",", ":"))


def _warm_up() -> None:
    """Everything a child does once, so that the lazy loads happen here, before any fork: the
    kernels (~1.5 s), torch._dynamo (the dense optimizer imports it, ~3 s), the checkpoint I/O."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        job = dict(root=d, policy="adaptive", every=1, until=2, resume=False, final=f"{d}/f.pt")
        _child(job, say=lambda msg: None)
        _child(dict(job, resume=True, restored=f"{d}/r.pt", until=3), say=lambda msg: None)


def _server() -> None:
    torch.set_num_threads(1)  # no thread pool before fork
    _warm_up()
    _say("ready")
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _child(job)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        _say(f"reaped {status}")


# ---- the test side ---------------------------------------------------------------------------
class _Server:
    """The fork server subprocess: send jobs, read its (and its children's) lines."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._buf = b""

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()

    def line(self) -> list[str]:
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + TIMEOUT
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"no line from the fork server in {TIMEOUT} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError("the fork server exited")
            self._buf += chunk
        head, self._buf = self._buf.split(b"\n", 1)
        return head.decode().split()

    def expect(self, word: str) -> list[str]:
        got = self.line()
        assert got and got[0] == word, f"expected '{word} ...' from the fork server, got {got}"
        return got

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _complete(root: str) -> dict[str, dict[str, Any]]:
    """Manifests of the complete checkpoints under ``root`` by name (no writer is running)."""
    return {m["name"]: m for m in list_checkpoints(open_storage(root))}


def _lost(known: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> list[str]:
    """Known complete checkpoints that are gone, and not by retention: a checkpoint may go only
    when its baseline is not among the ``KEEP`` newest baselines still there."""
    baselines = [n for n, m in after.items() if m["kind"] == "baseline"]
    baselines.sort(key=lambda n: (after[n]["step"], after[n]["created"]))
    keep = set(baselines[-KEEP:])
    return sorted(n for n, m in known.items() if n not in after and m["baseline"] in keep)


def _leftovers(root: str) -> list[str]:
    """Evidence of a write cut short: checkpoint folders without a manifest, temporary files."""
    out = []
    for d in sorted(Path(root).iterdir()):
        if not (d / "manifest.json").exists():
            out.append(d.name)
        out += [str(p.relative_to(root)) for p in d.rglob("*.tmp-*")]
    return out


def _diff(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose values are not bitwise equal (tensors: dtype, shape and every bit)."""
    bad = sorted(set(got) ^ set(want))
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        else:
            same = a == b
        if not same:
            bad.append(k)
    return bad


def _load(path: Path | str) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _after_kill(root: str, known: dict[str, Any], committed: int) -> tuple[list[str], int]:
    """Problems on storage after a kill, and the step of the latest complete checkpoint (-1:
    none that verifies)."""
    problems, storage = [], open_storage(root)
    after = _complete(root)
    if lost := _lost(known, after):
        problems.append(f"complete checkpoints gone: {lost}")
    try:
        name = resolve_checkpoint(storage, "latest")
        verify_checkpoint(storage, name)
        latest = int(after[name]["step"])
    except (CheckpointError, KeyError) as e:
        return [*problems, f"latest does not verify: {type(e).__name__}: {e}"], -1
    if latest < committed:
        problems.append(f"latest is step {latest}, step {committed} had committed")
    return problems, latest


class _Rounds:
    """The reference run, the killed writers and the last one, each case recorded."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.root, self.ref = tmp, str(tmp / "ck"), tmp / "ref"
        self.ref.mkdir()
        self.camp = campaign("checkpoint crash")
        self.rng = random.Random(0)
        self.srv = _Server()
        self.latest = 0  # step of the latest complete checkpoint
        self.pending: tuple[str, list[str], str] | None = None  # the last kill, resume unjudged
        self.recorded = 0

    def record(self, name: str, outcome: str, detail: str) -> None:
        self.camp.record(name, outcome, detail)
        self.recorded += 1

    def reference(self) -> None:
        """Uninterrupted, checkpointing too (its own root; no fsync: nobody reads it, and a
        SIGKILL does not lose the page cache anyway); dumps its state after every step."""
        self.srv.expect("ready")
        self.srv.send(
            dict(root=str(self.tmp / "ref-ck"), policy="adaptive", every=1, until=STEPS,
                 resume=False, ref_dir=str(self.ref), final=str(self.ref / "final.pt"),
                 fsync=False)
        )  # fmt: skip
        self.srv.expect("started")
        while self.srv.line()[0] != "done":
            pass
        assert self.srv.expect("reaped")[1] == "0", "the reference run failed (stderr above)"

    def start(self, k: int, job: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """Start round ``k``'s child; judge the resume of the previous kill. Returns the child's
        pid and the complete checkpoints as it found them (None: it died, recorded)."""
        job = dict(job, root=self.root, until=STEPS, resume=k > 0)
        job.update(restored=str(self.tmp / f"restored-{k}.pt"), final=str(self.tmp / "final.pt"))
        self.srv.send(job)
        words = self.srv.line()
        known = _complete(self.root)  # the child has restored and not written yet
        if self.pending is None:
            assert words[0] == "started", f"round {k}: the child died ({words}, stderr above)"
            return int(words[1]), known
        name, problems, detail = self.pending
        if words[0] != "started":
            self.record(name, "crash", f"the resumed process died: {words} (stderr above)")
            return None
        if int(words[2]) != self.latest:
            problems.append(f"resumed at step {words[2]}, latest complete is {self.latest}")
        elif bad := _diff(_load(job["restored"]), _load(self.ref / f"{words[2]}.pt")):
            problems.append(f"restored state differs from the reference in {bad[:6]}")
        self.record(name, "data lost" if problems else "handled", "; ".join(problems) or detail)
        return int(words[1]), known

    def kill(self, k: int) -> bool:
        """Round ``k``: resume (k > 0), train, SIGKILL mid-write, check storage. False: stop."""
        policy, every = POLICIES[k % len(POLICIES)], 1 + k % 2
        target = min((self.latest // every + self.rng.randint(2, 4)) * every, STEPS - 6)
        assert target > self.latest, f"no room for kill {k}: latest {self.latest}"
        pinned, op, delay = k % 2 == 0, self.rng.randint(0, 9), self.rng.uniform(0.0, 0.010)
        # the pinned kill of a "full" round lands inside retention: one manifest removed, its
        # files not yet
        only, op = ("remove", 1) if policy == "full" else ("any", op)
        job: dict[str, Any] = dict(policy=policy, every=every)
        if pinned:
            job.update(pause_step=target, pause_op=op, pause_only=only)
        started = self.start(k, job)
        if started is None:
            return False
        pid, known = started
        committed, where = self.latest, ""  # newest step the writer saw committed
        name = f"kill {k} ({policy}, every {every})"
        while not where:
            words = self.srv.line()
            if words[0] == "saved":
                for m in json.loads(words[2]):  # committed before this save() returned
                    known.setdefault(m["name"], m)
                    committed = max(committed, int(m["step"]))
                if not pinned and int(words[1]) >= target:
                    time.sleep(delay)
                    where = f"{delay * 1e3:.1f} ms after save({words[1]}) returned"
            elif words[0] == "paused":
                known.update(_complete(self.root))  # writer blocked, trainer waiting: stable
                where = f"writer paused before {words[1]} {words[2]}"
            else:
                self.record(name, "crash", f"the writer died: {words} (stderr above)")
                return False
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.kill(pid, signal.SIGKILL)
        # Lines the writer printed before the kill landed (a loaded machine delays the kill):
        # what it reports committed still counts.
        words = self.srv.line()
        while words and words[0] in ("saved", "paused"):
            if words[0] == "saved":
                for m in json.loads(words[2]):
                    known.setdefault(m["name"], m)
                    committed = max(committed, int(m["step"]))
            words = self.srv.line()
        if not words or words[0] != "reaped":
            raise AssertionError(f"expected 'reaped ...' from the fork server, got {words}")
        status = int(words[1])
        if not os.WIFSIGNALED(status):
            self.record(name, "crash", f"the writer exited by itself, status {status}")
            return False
        left = _leftovers(self.root)
        problems, self.latest = _after_kill(self.root, known, committed)
        name += f": {where}"
        if self.latest < 0:  # nothing to resume from
            self.record(name, "data lost", "; ".join(problems))
            return False
        detail = f"resumed at {self.latest}; newest committed {committed}; left behind {left[:4]}"
        self.pending = (name, problems, detail)
        return True

    def finish(self) -> None:
        """The last writer resumes and trains to ``STEPS``: bitwise the reference's final state."""
        started = self.start(KILLS, dict(policy=POLICIES[KILLS % len(POLICIES)], every=1))
        if started is None:
            return
        known, words = started[1], self.srv.line()
        while words[0] == "saved":
            words = self.srv.line()
        status = self.srv.expect("reaped")[1]
        bad = lost = []
        if status == "0":
            bad = _diff(_load(self.tmp / "final.pt"), _load(self.ref / "final.pt"))
            lost = _lost(known, _complete(self.root))
        outcome = "crash" if status != "0" else "data lost" if bad or lost else "handled"
        self.record(
            f"final state at step {STEPS} after {KILLS} kills vs the uninterrupted run",
            outcome,
            f"last line {words[:2]}, exit status {status}; differing: {bad[:6]}; gone: {lost}",
        )


@pytest.mark.bitwise
def test_sigkill_during_async_writes_every_resume_bitwise(tmp_path: Path) -> None:
    rounds = _Rounds(tmp_path)
    try:
        rounds.reference()
        if all(rounds.kill(k) for k in range(KILLS)):
            rounds.finish()
    finally:
        rounds.srv.close()
    rounds.camp.check()
    assert rounds.recorded == KILLS + 1, f"only {rounds.recorded} cases recorded"


if __name__ == "__main__":
    _server()
