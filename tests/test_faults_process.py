"""Fault campaign "processes": the launcher dies, Ctrl-C, a rank's error, from the outside.

Real ``neorec train`` processes, signalled the way a user or a scheduler does:

- SIGKILL / SIGTERM of the ``--nproc 2`` launcher while its workers train, and a SIGKILL as soon
  as the workers exist (before they can watch it): every worker must be gone within ``GONE_S``
  seconds ("handled"; workers that keep training are a "crash"), and a SIGTERM'd launcher exits
  143 with one line; a SIGTERM of one worker: the other goes, the launcher prints one line
  naming the rank and the signal;
- a SIGKILL of the launcher while its workers are held in their interpreter's start-up (a
  ``sitecustomize`` that waits): deterministic, the kernel must end them (``PR_SET_PDEATHSIG``
  set between fork and exec);
- a rank stopped (SIGSTOP) under ``--nproc 2``, and a rank killed or stopped among ranks started
  by hand (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR``): one line naming the lost rank, no
  traceback, soon after ``train.collective_timeout_s``;
- SIGINT to the process group (Ctrl-C) of a 1-process and of a ``--nproc 2`` run that has written
  checkpoints: exit 130 and one line on stderr naming the resume command (which must parse back to
  the same config), no traceback, every worker gone;
- a ``NeorecError`` raised in the workers (a plan for 4 ranks run on 2): exit 2 and one error line
  naming the rank, torchrun's report not printed;
- bad ``--nproc`` / ``--set`` of the launcher and bad ``neorec plan`` input: exit 2, one line,
  before anything starts.

Every process is started in a session of its own and killed (group and workers) in ``finally``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from faults import campaign, judge_cli, run_cli
from test_launch import TINY as LAUNCH_TINY

from neorec.cli import build_parser
from neorec.config import load_config
from neorec.sharding.fixed_plan import plan_by_type

C = campaign("processes")
GONE_S = 10.0  # a worker must be gone this long after its launcher
START_S = 120.0  # time allowed for a run to start training (2 busy cores)
TINY = [  # test_launch's tiny model, long enough that every case stops it
    *LAUNCH_TINY,
    "train.threads=1",
    "train.steps=1000000",
]


def sets(tmp: Path, name: str, *extra: str) -> list[str]:
    """``--set`` flags of the tiny long run writing into ``tmp/name``."""
    out = []
    for s in [*TINY, f"train.run_dir='{tmp / name}'", *extra]:
        out += ["--set", s]
    return out


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A ``neorec train`` process in its own session, its output in files."""

    def __init__(
        self, tmp: Path, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "neorec", "train", *argv],
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                # As a shell starts a foreground job: SIGINT at its default even when this test
                # runs in the background (where a non-interactive shell ignores it, and an
                # ignored SIGINT would be inherited: Python then never raises KeyboardInterrupt).
                preexec_fn=_default_sigint,
            )
        self.workers: list[int] = []

    def children(self) -> list[int]:
        """Pids of the launcher's ``neorec train`` children (its workers)."""
        kids: list[int] = []
        try:
            for t in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{t}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except OSError:
            return []
        return [k for k in kids if b"neorec" in _cmdline(k)]

    def step(self) -> int:
        """The last step its progress lines reported (0 before the first)."""
        steps = re.findall(r"^step (\d+)/", self.out.read_text(), re.M)
        return int(steps[-1]) if steps else 0

    def wait_training(self, step: int, workers: int = 0) -> bool:
        """Until step ``step`` is reported (and ``workers`` workers are seen); False if it ended."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if workers:
                self.workers = sorted(set(self.workers) | set(self.children()))
            if self.step() >= step and len(self.workers) >= workers:
                return True
            time.sleep(0.2)
        return False

    def finish(self, timeout: float) -> int | None:
        """Its exit code, None if it is still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr(self) -> str:
        return self.err.read_text()

    def kill(self) -> None:
        """Kill the launcher's group and every worker seen (they run in sessions of their own)."""
        for pid in [self.proc.pid, *self.workers]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        self.finish(10)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds`` (waiting no longer than needed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(running(p) for p in pids):
            return []
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def one_line(stderr: str) -> list[str]:
    """The non-empty lines of stderr (a clean failure or interruption has exactly one)."""
    return [ln for ln in stderr.splitlines() if ln.strip()]


def rank_of(pid: int) -> int:
    """The RANK in a worker's environment (-1 if unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        return int(env.get(b"RANK", b"-1"))
    except (OSError, ValueError):
        return -1


# name: (whom to signal, the signal, the step to wait for: 0 = as soon as both workers exist)
SIGNAL_CASES = {
    "SIGKILL of the launcher as its workers start": ("launcher", signal.SIGKILL, 0),
    "SIGKILL of the --nproc 2 launcher": ("launcher", signal.SIGKILL, 20),
    "SIGTERM of the --nproc 2 launcher": ("launcher", signal.SIGTERM, 20),
    "SIGTERM of worker rank 1 alone": ("rank 1", signal.SIGTERM, 20),
}


def _signal_case(name: str, run: Run, whom: str, sig: signal.Signals, step: int) -> None:
    if not run.wait_training(step, workers=2):
        C.record(name, "crash", f"never trained: {run.stderr()[-500:]}")
        return
    t0 = time.monotonic()
    target = run.proc.pid
    if whom == "rank 1":
        target = next((w for w in run.workers if rank_of(w) == 1), -1)
    if target < 0:
        C.record(name, "crash", f"no worker of rank 1 among {run.workers}")
        return
    os.kill(target, sig)
    left = gone_within(run.workers, GONE_S)
    took = time.monotonic() - t0
    if left:
        C.record(name, "crash", f"workers {left} still running {GONE_S:.0f} s later")
        return
    if sig == signal.SIGKILL:
        C.record(name, "handled", f"both workers gone after {took:.1f} s")
        return
    code = run.finish(GONE_S)
    lines = one_line(run.stderr())
    want = (143, "SIGTERM") if whom == "launcher" else (1, "rank 1 was killed by SIGTERM")
    ok = code == want[0] and len(lines) == 1 and want[1] in lines[0]
    detail = f"exit {code}, workers gone after {took:.1f} s, stderr {lines!r}"
    C.record(name, "handled" if ok else "crash", detail)


def test_signals_to_the_launcher_or_a_worker(tmp_path: Path) -> None:
    runs = {}
    try:
        for i, name in enumerate(SIGNAL_CASES):
            runs[name] = Run(tmp_path, f"sig{i}", ["--nproc", "2", *sets(tmp_path, f"sig{i}")])
        for name, (whom, sig, step) in SIGNAL_CASES.items():
            _signal_case(name, runs[name], whom, sig, step)
    finally:
        for run in runs.values():
            run.kill()
    C.check()


HOLD = """import os, signal
if "LOCAL_RANK" in os.environ:  # a worker: held here, before any neorec code can run
    signal.pause()
"""


def test_launcher_killed_while_its_workers_start_up(tmp_path: Path) -> None:
    # Deterministic, whatever the load: the workers are held in their interpreter's start-up (a
    # sitecustomize that waits forever), so nothing of neorec's own watches the launcher yet; the
    # kernel must end them when it dies (PR_SET_PDEATHSIG, set between the fork and the exec).
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOLD)
    path = os.pathsep.join(p for p in (str(hold), os.environ.get("PYTHONPATH", "")) if p)
    name = "SIGKILL of the launcher while its workers are held in their start-up"
    run = Run(tmp_path, "held", ["--nproc", "2", *sets(tmp_path, "held")], {"PYTHONPATH": path})
    try:
        if not run.wait_training(0, workers=2):
            C.record(name, "crash", f"workers never started: {run.stderr()[-500:]}")
        else:
            os.kill(run.proc.pid, signal.SIGKILL)
            left = gone_within(run.workers, GONE_S)
            if left:
                C.record(name, "crash", f"workers {left} still running {GONE_S:.0f} s later")
            else:
                C.record(name, "handled", "both workers gone")
    finally:
        run.kill()
    C.check()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PEER_TIMEOUT_S = 8  # train.collective_timeout_s of the lost-peer cases


def test_a_lost_peer_is_one_line_naming_the_rank(tmp_path: Path) -> None:
    """A rank stopped (SIGSTOP) or killed, under --nproc 2 and started by hand as a cluster
    scheduler does (RANK / WORLD_SIZE / MASTER_ADDR): the survivor and the launcher end with one
    line naming the lost rank, no traceback, soon after train.collective_timeout_s."""
    extra = (f"train.collective_timeout_s={PEER_TIMEOUT_S}", "comm.transport='gloo'")
    runs: dict[str, list[Run]] = {}
    port = _free_port()
    try:
        runs["stop"] = [Run(tmp_path, "stop", ["--nproc", "2", *sets(tmp_path, "stop", *extra)])]
        for case in ("kill", "hstop"):
            port = _free_port()
            env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            runs[case] = [
                Run(
                    tmp_path,
                    f"{case}{r}",
                    sets(tmp_path, case, *extra),
                    {**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
                )
                for r in (0, 1)
            ]
        _stopped_worker(runs["stop"][0])
        _lost_by_hand("SIGKILL of rank 1 of ranks started by hand", runs["kill"], signal.SIGKILL)
        _lost_by_hand("SIGSTOP of rank 1 of ranks started by hand", runs["hstop"], signal.SIGSTOP)
    finally:
        for rs in runs.values():
            for run in rs:
                run.workers.append(run.proc.pid)
                run.kill()
    C.check()


def _stopped_worker(run: Run) -> None:
    name = f"SIGSTOP of worker rank 1 (collective_timeout_s={PEER_TIMEOUT_S})"
    if not run.wait_training(20, workers=2):
        C.record(name, "crash", f"never trained: {run.stderr()[-500:]}")
        return
    target = next((w for w in run.workers if rank_of(w) == 1), -1)
    t0 = time.monotonic()
    os.kill(target, signal.SIGSTOP)
    code = run.finish(PEER_TIMEOUT_S + START_S)
    took = time.monotonic() - t0
    lines = one_line(run.stderr())
    left = gone_within(run.workers, GONE_S)
    detail = f"exit {code} after {took:.1f} s, left {left}, stderr {lines[-3:]!r}"[-480:]
    ok = code == 1 and len(lines) == 1 and not left
    ok = ok and lines[0].startswith("neorec: error: rank 1 was stopped")
    C.record(name, "handled" if ok else "crash", detail)


def _lost_by_hand(name: str, ranks: list[Run], sig: signal.Signals) -> None:
    first, second = ranks
    if not first.wait_training(20):
        C.record(name, "crash", f"never trained: {first.stderr()[-500:]}")
        return
    t0 = time.monotonic()
    os.kill(second.proc.pid, sig)
    code = first.finish(PEER_TIMEOUT_S + START_S)
    took = time.monotonic() - t0
    lines = one_line(first.stderr())
    detail = f"rank 0: exit {code} after {took:.1f} s, stderr {lines[-3:]!r}"[-480:]
    want = "did not answer a collective" if sig == signal.SIGSTOP else "exited or lost"
    ok = code == 2 and len(lines) == 1
    ok = ok and lines[0].startswith(f"neorec: error: rank 0: rank 1 {want}")
    C.record(name, "handled" if ok else "crash", detail)


def _check_resume(line: str, argv: list[str]) -> str:
    """'' if the resume command in ``line`` is the run's own config plus ``--resume latest``."""
    cmd = shlex.split(line.split(" with: ", 1)[1])
    if cmd[:2] != ["neorec", "train"] or cmd[-2:] != ["--resume", "latest"]:
        return f"not a resume command: {cmd}"
    args = build_parser().parse_args(cmd[1:])
    again = load_config(args.config, args.set).to_dict()
    orig = build_parser().parse_args(["train", *argv])
    if again != load_config(orig.config, orig.set).to_dict():
        return "the resume command's config differs from the run's"
    return "" if args.nproc == orig.nproc else f"--nproc {args.nproc} vs {orig.nproc}"


def test_ctrl_c_one_line_and_resume_command(tmp_path: Path) -> None:
    ckpt = "checkpoint.every_steps=20"
    cases = {
        "1 process": sets(tmp_path, "one", ckpt),
        "--nproc 2": ["--nproc", "2", *sets(tmp_path, "two", ckpt)],
    }
    for label, argv in cases.items():
        name = f"Ctrl-C (SIGINT to the group) of a {label} run with checkpoints"
        run = Run(tmp_path, label.replace(" ", "_"), argv)
        try:
            if not run.wait_training(50, workers=2 if "nproc" in label else 0):
                C.record(name, "crash", f"never trained: {run.stderr()[-500:]}")
                continue
            os.killpg(run.proc.pid, signal.SIGINT)
            code = run.finish(60)
            lines = one_line(run.stderr())
            detail = f"exit {code}, stderr {lines!r}"[:480]
            if code != 130 or len(lines) != 1 or "Traceback" in run.stderr():
                C.record(name, "crash", detail)
                continue
            m = re.match(
                r"neorec: interrupted( at step (\d+))?; resume from the checkpoint of "
                r"step (\d+) with: ",
                lines[0],
            )
            if m is None or (label == "1 process") != (m.group(2) is not None):
                C.record(name, "crash", f"unexpected line: {detail}")
                continue
            if m.group(2) is not None and int(m.group(3)) > int(m.group(2)):
                C.record(name, "crash", f"checkpoint step after the interrupted step: {detail}")
                continue
            left = gone_within(run.workers, GONE_S)
            bad = _check_resume(lines[0], argv) or (f"workers {left} still running" if left else "")
            C.record(name, "crash" if bad else "handled", bad or detail)
        finally:
            run.kill()
    C.check()


def test_ctrl_c_without_checkpoint(tmp_path: Path) -> None:
    run = Run(tmp_path, "nockpt", sets(tmp_path, "nockpt"))
    name = "Ctrl-C of a 1 process run without checkpoints"
    try:
        if not run.wait_training(20):
            C.record(name, "crash", f"never trained: {run.stderr()[-500:]}")
        else:
            os.killpg(run.proc.pid, signal.SIGINT)
            code = run.finish(60)
            lines = one_line(run.stderr())
            ok = code == 130 and len(lines) == 1
            ok = ok and re.fullmatch(
                r"neorec: interrupted at step \d+ \(no checkpoint.*\)", lines[0]
            )
            C.record(name, "handled" if ok else "crash", f"exit {code}, stderr {lines!r}")
    finally:
        run.kill()
    C.check()


def test_worker_error_is_one_line_naming_the_rank(tmp_path: Path) -> None:
    cfg = load_config(overrides=TINY)
    plan = tmp_path / "plan4.json"
    plan_by_type(cfg.embedding.tables, 4).save(plan)
    argv = ["train", "--nproc", "2", *sets(tmp_path, "plan", f"sharding.plan='{plan}'")]
    r = run_cli(argv, timeout=180)
    name = "a plan for 4 ranks run by 2 workers (NeorecError in every worker)"
    outcome, detail = judge_cli(r, ("rank ", "world_size 4"))
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    if outcome == "clear error" and (r.returncode != 2 or len(errors) != 1):
        outcome, detail = "crash", f"exit {r.returncode}, error lines {errors!r}"
    C.record(name, outcome, detail)
    C.check()


def test_launcher_and_plan_input_refused_before_start(tmp_path: Path) -> None:
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[embedding\nrows = 3\n")
    cases = [
        ("--nproc 0", ["train", "--nproc", "0"], "--nproc"),
        ("--nproc -3", ["train", "--nproc", "-3"], "--nproc"),
        (
            "--nproc 2 with a bad --set",
            ["train", "--nproc", "2", "--set", "train.steps=-1"],
            "train.steps",
        ),
        (
            "--nproc 2 with an unknown key",
            ["train", "--nproc", "2", "--set", "train.nope=1"],
            ("nope", "[train]"),
        ),
        (
            "plan: config not TOML",
            ["plan", "--world-size", "2", "--config", str(bad_toml)],
            ("bad.toml", "TOML"),
        ),
        (
            "plan: missing table file",
            ["plan", "--world-size", "2", "--tables", str(tmp_path / "none.csv")],
            "none.csv",
        ),
    ]
    for name, argv, match in cases:
        t0 = time.monotonic()
        r = run_cli(argv, timeout=60)
        outcome, detail = judge_cli(r, match)
        lines = one_line(r.stderr)
        if outcome == "clear error" and (r.returncode != 2 or len(lines) != 1):
            outcome, detail = "crash", f"exit {r.returncode}, stderr {lines!r}"
        if outcome == "clear error" and "rank" in lines[0]:
            outcome, detail = "crash", f"reached the workers: {lines[0]!r}"
        C.record(name, outcome, f"{detail} ({time.monotonic() - t0:.1f} s)")
    C.check()
