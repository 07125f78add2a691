"""`neorec train --nproc N --max-restarts K`: a lost rank restarts the group from the run's newest
checkpoint, and the run ends equal to an uninterrupted one, bitwise.

The kill is deterministic: ``system.fail_at='1:25:kill'`` makes rank 1 SIGKILL itself before
step 25 (in the first attempt only); checkpoints every 10 steps (32-bit: exact). Whether the
checkpoint of step 20 is complete when the kill lands (it is written in the background) does not
matter: the restart takes the newest complete one (20, 10, or none: the start), and the end is
the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from faults import run_cli
from test_launch import TINY

EXACT = [
    *TINY,
    "train.threads=1",
    "sharding.default_type='table_wise'",
    "checkpoint.every_steps=10",
    "checkpoint.bits=32",
    "checkpoint.opt_bits=32",
]


def argv(tmp: Path, name: str, *extra: str, transport: str = "gloo") -> list[str]:
    out = ["train", "--nproc", "2"]
    for s in [*EXACT, f"comm.transport='{transport}'", f"train.run_dir='{tmp / name}'", *extra]:
        out += ["--set", s]
    return out


def lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


def model_state(run: Path) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """The saved model's table files (by table) and dense tensors."""
    (ckpt,) = [p for p in (run / "model").iterdir() if p.is_dir()]
    tables = {str(p.relative_to(ckpt / "emb")): p.read_bytes() for p in (ckpt / "emb").rglob("*.*")}
    dense = torch.load(ckpt / "dense.pt", weights_only=False)
    flat = {}

    def walk(prefix: str, v: object) -> None:
        if isinstance(v, torch.Tensor):
            flat[prefix] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)

    walk("", dense)
    return tables, flat


@pytest.fixture(scope="module", params=["gloo", "auto"])
def transport(request: pytest.FixtureRequest) -> str:
    """The embedding group's transport: gloo, or (auto) shared memory between ranks of a host."""
    return str(request.param)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Path:
    tmp = tmp_path_factory.mktemp("straight")
    r = run_cli(argv(tmp, "a", transport=transport), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp / "a"


def test_killed_rank_restarts_from_the_checkpoint_and_equals_uninterrupted(
    tmp_path: Path, uninterrupted: Path, transport: str
) -> None:
    kill = argv(tmp_path, "b", "system.fail_at='1:25:kill'", transport=transport)
    r = run_cli([*kill, "--max-restarts", "2"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = lines(r.stderr)
    m = re.fullmatch(
        r"neorec: rank 1 was killed by SIGKILL; restarting the group \(1 of 2\) from "
        r"(the checkpoint of step (10|20)|its start \(no checkpoint of this run yet\))",
        line,
    )
    assert m, line
    a = json.loads((uninterrupted / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert a["eval"] == b["eval"] and a["evals"] == b["evals"]
    assert a["train"]["final_loss"] == b["train"]["final_loss"]
    ta, da = model_state(uninterrupted)
    tb, db = model_state(tmp_path / "b")
    assert ta.keys() == tb.keys() and all(ta[k] == tb[k] for k in ta), "tables differ"
    assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da), "dense differs"
    events = [json.loads(x) for x in (tmp_path / "b" / "events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if "restart" in e]
    assert len(restarts) == 1 and restarts[0]["cause"] == "rank 1 was killed by SIGKILL"
    step = int(m.group(2) or 0)
    assert restarts[0]["step"] == step and restarts[0]["restart"] == 1
    assert [e["step"] for e in events] == sorted(e["step"] for e in events)


KILL_RANK_1 = """import os, signal
if os.environ.get("RANK") == "1" and "LOCAL_RANK" in os.environ:  # every attempt's rank 1
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_restarts_exhausted_is_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KILL_RANK_1)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    r = run_cli([*argv(tmp_path, "x"), "--max-restarts", "1"], env={"PYTHONPATH": path})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines(r.stderr) == [
        "neorec: rank 1 was killed by SIGKILL; restarting the group (1 of 1) from its start "
        "(no checkpoint of this run yet)",
        "neorec: error: rank 1 was killed by SIGKILL; the other ranks were stopped "
        "(restarts exhausted: 1 of 1)",
    ]


def test_an_error_in_the_input_is_not_restarted(tmp_path: Path) -> None:
    from neorec.config import load_config
    from neorec.sharding.fixed_plan import plan_by_type

    plan = tmp_path / "plan4.json"
    plan_by_type(load_config(overrides=TINY).embedding.tables, 4).save(plan)
    r = run_cli([*argv(tmp_path, "p", f"sharding.plan='{plan}'"), "--max-restarts", "2"])
    (line,) = lines(r.stderr)
    assert r.returncode == 2 and line.startswith("neorec: error: rank "), r.stderr[-2000:]
    assert "world_size 4" in line and line.endswith("(not restarted: the same error would recur)")


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--nproc", "2", "--max-restarts", "-1"], "--max-restarts must be at least 0, got -1"),
        (["--max-restarts", "1"], "--max-restarts restarts the ranks of a --nproc N job"),
    ],
)
def test_bad_max_restarts_refused(extra: list[str], match: str) -> None:
    r = run_cli(["train", *extra], timeout=60)
    (line,) = lines(r.stderr)
    assert r.returncode == 2 and line.startswith(f"neorec: error: {match}"), r.stderr


# ---- several nodes: two launchers on this machine, one rank each ------------------------------
def test_two_nodes_on_localhost_equal_one_node(
    tmp_path: Path, uninterrupted: Path, transport: str
) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = argv(tmp_path, "nodes", transport=transport)[
        3:
    ]  # the --set flags (the same run folder on both nodes)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "neorec", "train", "--nnodes", "2", "--node-rank", str(n)]
            + ["--nproc", "1", "--rdzv-endpoint", f"localhost:{port}", *base],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    a = json.loads((uninterrupted / "metrics.json").read_text())
    b = json.loads((tmp_path / "nodes" / "metrics.json").read_text())
    assert a["eval"] == b["eval"] and a["train"]["final_loss"] == b["train"]["final_loss"]
    ta, da = model_state(uninterrupted)
    tb, db = model_state(tmp_path / "nodes")
    assert ta == tb and da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--nnodes", "0"], "--nnodes must be at least 1, got 0"),
        (["--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank must be in [0, 2), got 2"),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint is for --nnodes > 1"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "1"],
            "--max-restarts restarts the ranks of one node",
        ),
    ],
)
def test_bad_node_flags_refused(extra: list[str], match: str) -> None:
    r = run_cli(["train", *extra], timeout=60)
    (line,) = lines(r.stderr)
    assert r.returncode == 2 and line.startswith(f"neorec: error: {match}"), r.stderr


@pytest.mark.parametrize(
    "extra",
    [["--nproc", "0"], ["--max-restarts", "1"], ["--nnodes", "2"], ["--node-rank", "3"]],
)
def test_launcher_flags_refused_before_pytorch_loads(extra: list[str]) -> None:
    """A wrong launcher flag is one line at once: PyTorch (seconds on a loaded machine) is never
    imported for it."""
    import subprocess
    import sys

    code = (
        "import sys; from neorec.cli import main; c = main(['train', *sys.argv[1:]]); "
        "sys.stderr.write(f'exit {c} torch {\"torch\" in sys.modules}')"
    )
    r = subprocess.run([sys.executable, "-c", code, *extra], capture_output=True, text=True)
    *errs, last = r.stderr.strip().splitlines()
    assert len(errs) == 1 and errs[0].startswith("neorec: error: --"), r.stderr
    assert last.endswith("exit 2 torch False"), r.stderr
