"""Every shell command documented in README.md and docs/*.md works as written (issue 41).

The commands are read from the fenced ``bash`` / ``sh`` / ``console`` / ``shell`` blocks (a line
starting with ``neorec``, ``make``, ``python -m neorec`` or ``torchrun``; ``$ `` prompts, ``\\``
continuations, ``;`` and ``#`` comments handled). Each one is classified in ``COMMANDS``, which
must hold exactly the commands found, so a new documented command must be classified here:

- ``RUN``: run in-process (``neorec.cli.main``) in a scratch directory, in document order, with
  small sizes appended as ``--set`` overrides (shown in the table); ``[optional]`` groups and
  ``...`` are dropped, placeholders substituted;
- ``PARSE``: too long, or needs a GPU or real data: its argv goes through the command's own
  argument parser (not run), and a ``neorec train`` command's ``--config`` / ``--set`` through the
  config checks; the reason is in the table;
- ``SKIP``: not a neorec invocation this test can make (``make``, multi-node ``torchrun``, a
  synopsis); the reason is in the table.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from neorec.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(bash|sh|console|shell)[^\n]*\n(.*?)^```", re.S | re.M)
_STARTS = ("neorec ", "make ", "python -m neorec", "torchrun ")

SMALL = [
    "--set", "data.train_samples=1024", "--set", "data.eval_samples=512",
    "--set", "train.progress=false",
]  # fmt: skip
"""A ``neorec train`` of synthetic data at small sizes (2 steps of the default batch)."""
SMALL_ROWS = [*SMALL, "--set", "embedding.rows=1000"]


@dataclass
class Spec:
    mode: str  # RUN, PARSE, SKIP
    why: str = ""
    extra: list[str] = field(default_factory=list)
    """RUN: argv appended (small sizes)."""
    subst: dict[str, str] = field(default_factory=dict)
    """RUN: token -> replacement (placeholders); ``{ckpt}`` is the latest run's newest checkpoint."""


def run(*extra: str, **subst: str) -> Spec:
    return Spec("RUN", extra=list(extra), subst=dict(subst))


def parse(why: str) -> Spec:
    return Spec("PARSE", why)


def skip(why: str) -> Spec:
    return Spec("SKIP", why)


BENCH = "a full-size benchmark (minutes); `neorec bench NAME --help` is run"
CKPT = ["--set", "checkpoint.every_steps=2"]  # 500 in the docs: a 4-step run writes none
COMMANDS: dict[str, Spec] = {
    # ---- README / running.md: install
    "make run": skip("installs the venv and trains the default 1M-sample run (minutes)"),
    "make test": skip("runs this test suite (and ruff, mypy)"),
    "make test-shm": skip("runs the distributed tests again over shared memory (minutes)"),
    # ---- runs, checkpoints, resume (checkpoints.md, running.md)
    "neorec train --set checkpoint.every_steps=500 ...": run(*SMALL_ROWS, *CKPT),
    "neorec train --resume latest ...": run(*SMALL_ROWS, *CKPT),
    "neorec train --resume auto ...": run(*SMALL_ROWS, *CKPT),
    "neorec train --resume runs/X/checkpoints/<ckpt> ...": run(
        *SMALL_ROWS, *CKPT, **{"runs/X/checkpoints/<ckpt>": "{ckpt}"}
    ),
    "neorec ckpt ls runs/latest/checkpoints": run(),
    "neorec ckpt inspect runs/latest/checkpoints --verify": run(),
    "neorec runs": run(),
    "neorec config --keys train.": run(),
    "neorec report latest": run(),
    "neorec eval --model runs/latest [--data PATH]": run(),
    "neorec predict --model runs/latest --out preds.npy": run(),
    "neorec predict --model runs/latest [--data PATH] --out p.npy": run(),
    "neorec export --model runs/latest --out serving/ --quantize int8": run(),
    "neorec export --model runs/latest --out serving/ [--quantize none|fp16|int8|int4|int2]": run(
        **{"serving/": "serving2/"}
    ),
    "neorec serve serving/ --port 8000": parse("serves until stopped (tests/test_serve_http.py)"),
    "neorec serve serving/ --port 8000 --no-batching": parse(
        "serves until stopped (tests/test_serve_http.py)"
    ),
    "neorec export --model runs/latest --out serving-int4/ --quantize int4": run(),
    "neorec train [--config FILE.toml] [--set section.key=value ...]": skip("a synopsis"),
    # ---- training variants
    "neorec train --set lowp.mode=auto": run(*SMALL_ROWS),
    "neorec train --set embedding.precision=fp8": run(*SMALL_ROWS),
    "neorec train --config configs/default.toml --set \"embedding.tables=[{name='users', "
    "rows=100000, dim=16, kind='dynamic', capacity=5000, admission='threshold', "
    "admit_threshold=2}, {name='items', rows=10000, dim=16}]\" --set "
    "data.train_samples=200000": run(*SMALL),
    "neorec train --nproc 2 --set sharding.default_type=row_wise": run(*SMALL_ROWS),
    "neorec train --nproc 8 --set train.device='cuda'": parse("needs 8 GPUs"),
    "neorec train --nproc 4 --set towers.count=2 --set towers.module=dot": parse(
        "4 processes on this 2-core machine (tests/test_sptt.py trains towers)"
    ),
    "neorec train --nproc 4 --max-restarts 3 --set checkpoint.every_steps=500": parse(
        "4 processes (tests/test_elastic.py runs restarts)"
    ),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 -m neorec train "
    "--config ...": skip("two machines"),
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d "
    "--rdzv-endpoint HOST0:29500 --rdzv-id JOB -m neorec train --config ... "
    "--set train.name=JOB": skip("two machines"),
    # ---- data (data.md, running.md): a tiny Criteo file in criteo_raw/
    "neorec data preprocess --input criteo_raw/ --output criteo_pre/": run(),
    "neorec data example-parquet --output data/parquet_example": run(
        "--train", "400", "--eval", "100"
    ),
    "neorec train --config configs/parquet_example.toml": parse(
        "trains 2 epochs (test_schema_tabular trains it)"
    ),
    "neorec eval --model runs/latest --data data/parquet_example/part-1.parquet": parse(
        "needs the Parquet-trained run (tests/test_eval_own_data.py evaluates one so)"
    ),
    "neorec data preprocess --config configs/parquet_example.toml --input data/parquet_example "
    "--output data/parquet_example_pre": run(),
    "neorec train --config configs/criteo_kaggle.toml --set data.path=criteo_pre/": parse(
        "builds the Criteo Kaggle model's 540M parameters (~2 min)"
    ),
    # ---- planner (planner.md, autoshard.md, running.md)
    "neorec plan --config configs/paper_scale.toml --world-size 128 --ranks-per-host 8": run(),
    "neorec plan --config configs/default.toml --world-size 2 --out plan.json --show-plan": run(),
    "neorec train --nproc 2 --set sharding.plan=plan.json": run(*SMALL),
    "neorec plan --tables T.csv --world-size 8 --batch-size 65536 --json": run(),
    "neorec plan --config configs/paper_scale.toml --world-size 128 "
    "--topology-preset h100_nvlink": run(),
    "neorec plan --config configs/paper_scale.toml --world-size 128 --ranks-per-host 8 "
    "--towers 16": run(),
    "neorec plan --config configs/default.toml --world-size 2 --topology topo.json": run(),
    "neorec plan --calibrate --topology topo.json --world-size 2 --budget-s 420": parse(
        "measures this machine for 7 min"
    ),
    "neorec plan --calibrate --topology topo.json --world-size 2 --budget-s 300": parse(
        "measures this machine for 5 min"
    ),
    "neorec plan --tables T.csv --world-size 2 --batch-size 4096 --topology topo.json "
    "--tune 8": parse("measures 8 plans on gloo ranks (minutes)"),
    "neorec plan --tables T.csv --world-size 2 --topology topo.json --tune 8": parse(
        "measures 8 plans on gloo ranks (minutes)"
    ),
    # ---- ExFM
    "neorec exfm --out runs/exfm": parse("the 7-window recipe (~27 min)"),
    # ---- running.md "Resuming a run" (last: they make run r the latest); steps 400 / 800 -> 4 / 8
    "neorec train --set checkpoint.every_steps=100 --set train.steps=400 --set train.name=r": run(
        *SMALL_ROWS, *CKPT, "--set", "train.steps=4"
    ),
    "neorec train --resume latest": run(),  # run r is finished: one line, exit 0
    "neorec train --resume latest --set train.steps=800": run("--set", "train.steps=8"),
    # ---- benchmarks
    "neorec bench op|step|dist|planner|costcheck|locality|cache|ckpt|data|lowp|dmt|dynamic|"
    "distill --help": Spec("HELP"),
    "neorec bench costcheck --repeats 3 --random-plans 10 --topology topo.json": parse(BENCH),
    "neorec bench costcheck --topology topo.json --cost-model learned --world-size 4 --batch 3072 "
    "--random-batch 3072 --random-plans 10 --random-seed 7777 --repeats 3 --passes 10 "
    "--iters 100": parse(BENCH),
    "neorec bench planner --measure --measure-tasks 8 --repeats 6 --measure-batch 4096 "
    "--seed-base 100 --seeds 4 --topology topo.json": parse(BENCH),
    "neorec bench dist --nproc 2 --embedding-only --tables 8 --rows 100000 --dim 64 --batch 4096 "
    "--pooling 10 --alpha 1.05 --types table_wise,row_wise,data_parallel --transport shm,gloo "
    "--keep-heap on,off --rounds 5 --iters 20": parse(BENCH),
    "neorec bench dist --nproc 2 --types mixed,table_wise --codecs "
    "fp32,fp16/bf16/bf16,fp8_e4m3/fp8_e5m2/fp8_e4m3,int8 --pipelines "
    "sequential,overlapped": parse(BENCH),
    "neorec bench serve --configs default,dlrm_benchmark --quantize none,int8,int4": parse(BENCH),
    "neorec bench op --alpha 0 --repeats 5": parse(BENCH),
    "neorec bench op --alpha 1.05 --repeats 5": parse(BENCH),
    "neorec bench distill --windows 5 --seeds 5 --seed-base 100": parse(BENCH),
    "neorec bench cache --skip-hit --warmup 40 --iters 20 --model dlrm": parse(BENCH),
    "neorec bench cache --skip-hit --warmup 40 --iters 20": parse(BENCH),
    "neorec bench op --device cuda --tables 8 --rows 1000000 --dim 64 --batch 2048 --pooling 100 "
    "--alpha 1.05": parse("needs a GPU"),
    "neorec bench op --device cuda --backend cuda --tables 8 --rows 1000000 --dim 64 --batch 2048 "
    "--pooling 100 --alpha 1.05": parse("needs a GPU"),
    "neorec bench step --device cuda --alpha 1.05": parse("needs a GPU"),
}


def _commands(text: str) -> list[str]:
    """The commands of a document's shell blocks, in order (see the module docstring)."""
    out = []
    for block in _FENCE.finditer(text):
        lines = block.group(2).splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip().removeprefix("$ ")
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            line = re.split(r"\s#\s|\s#$", line)[0]  # a trailing comment (never in a command)
            for cmd in line.split("; "):
                cmd = " ".join(cmd.split())
                if cmd.startswith(_STARTS):
                    out.append(cmd)
    return out


def documented() -> dict[str, list[str]]:
    """Command -> the documents that show it (first-seen order: README, then docs/ sorted)."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for cmd in _commands(doc.read_text()):
            found.setdefault(cmd, [])
            if doc.name not in found[cmd]:
                found[cmd].append(doc.name)
    return found


def test_every_documented_command_is_classified() -> None:
    found = documented()
    new = [c for c in found if c not in COMMANDS]
    gone = [c for c in COMMANDS if c not in found]
    assert not new, f"documented commands this test does not classify (add them): {new}"
    assert not gone, f"classified commands no document shows any more (drop them): {gone}"
    for cmd, spec in COMMANDS.items():
        assert spec.mode in ("RUN", "HELP") or spec.why, cmd


def test_parse_only_refuses_what_argparse_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check PARSE commands get: the README's old calibrate command (no --world-size) fails,
    a benchmark's unknown flag fails, a bad --set key fails; nothing is run."""
    with pytest.raises(SystemExit):
        _check_parse("neorec plan --calibrate --topology topo.json --budget-s 300", monkeypatch)
    with pytest.raises(SystemExit):
        _check_parse("neorec bench op --alphaa 0", monkeypatch)
    from neorec.config import ConfigError

    with pytest.raises(ConfigError, match="no_such"):
        _check_parse("neorec train --nproc 8 --set train.no_such=1", monkeypatch)
    # parse_known_args, then bench dist's parser for the rest: parsed, not run
    _check_parse("neorec bench costcheck --repeats 3 --topology topo.json", monkeypatch)


def test_the_extraction() -> None:
    text = (
        "```bash\n$ neorec train --set a=1 \\\n    --set b=2   # comment\nmake x; neorec runs\n"
        "pip install y\n```\n```toml\nneorec = 1\n```\n"
    )
    assert _commands(text) == ["neorec train --set a=1 --set b=2", "make x", "neorec runs"]


# ---- running ------------------------------------------------------------------------------
class _Parsed(Exception):
    pass


def _argv(cmd: str, spec: Spec, here: Path) -> list[str]:
    """The argv of a RUN command: ``neorec`` dropped, ``[...]`` and ``...`` dropped, placeholders
    substituted, the spec's extra flags appended."""
    toks = shlex.split(cmd)
    assert toks[0] == "neorec", cmd
    out, depth = [], 0
    for t in toks[1:]:
        if t.startswith("["):
            depth += 1
        if depth == 0 and t != "...":
            if t in spec.subst:
                t = spec.subst[t]
                if t == "{ckpt}":
                    ckpts = sorted((here / "runs" / "latest" / "checkpoints").glob("ckpt-*"))
                    assert ckpts, f"{cmd}: the latest run has no checkpoint"
                    t = str(ckpts[-1])
            out.append(t)
        if t.endswith("]"):
            depth -= 1
    return [*out, *spec.extra]


def _parse_only(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """``argv`` through the command's own parser (``neorec`` or a benchmark's), not run."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        raise _Parsed(original(self, *a, **kw))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        try:
            rc = main(argv)
        except _Parsed as p:
            ns = p.args[0]
            assert isinstance(ns, argparse.Namespace)
            return ns
    raise AssertionError(f"neorec {argv}: exit {rc} before its arguments were parsed")


def _check_parse(cmd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = shlex.split(cmd)[1:]
    ns = _parse_only(argv, monkeypatch)
    if argv[0] == "train":  # the config and every --set go through the config's checks
        from neorec.config import load_config

        load_config(ns.config if ns.config and ns.config != "..." else None, ns.set)


def _criteo_raw(d: Path) -> None:
    d.mkdir()
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(70):
        dense = [str(int(x)) if x >= 0 else "" for x in rng.integers(-2, 50, 13)]
        cats = [f"{int(x):08x}" for x in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]) + "\n")
    (d / "day_0.tsv").write_text("".join(lines))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch directory with the repository's configs, a small T.csv, topo.json and
    criteo_raw/: the files the documents' commands name."""
    from neorec.sharding.topology import Topology

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "T.csv").write_text(
        "name,rows,dim,pooling_factor\n"
        + "".join(f"t{i},{20000 * (i + 1)},{16 * (1 + i % 2)},{2 + i}\n" for i in range(6))
    )
    Topology(world_size=2).save(tmp_path / "topo.json")
    _criteo_raw(tmp_path / "criteo_raw")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path


def test_documented_commands_work(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """RUN commands in the order the table lists them (each may use what earlier ones wrote);
    PARSE commands through their parsers; HELP: each alternative's ``--help``."""
    found = documented()
    failed = []
    for cmd, spec in COMMANDS.items():
        if cmd not in found or spec.mode == "SKIP":
            continue
        where = ", ".join(found[cmd])
        try:
            if spec.mode == "PARSE":
                _check_parse(cmd, monkeypatch)
            elif spec.mode == "HELP":
                head, _, tail = cmd.partition(" --help")
                *prefix, names = shlex.split(head)
                for name in names.split("|"):
                    with pytest.raises(SystemExit) as e:
                        main([*prefix[1:], name, "--help", *shlex.split(tail)])
                    assert e.value.code == 0, name
            else:
                argv = _argv(cmd, spec, workdir)
                rc = main(argv)
                assert rc == 0, f"exit {rc}"
        except BaseException as e:  # noqa: BLE001 - every failure is reported together
            if isinstance(e, KeyboardInterrupt):
                raise
            out = capsys.readouterr()
            last = " | ".join((out.out + out.err).strip().splitlines()[-3:])
            failed.append(f"{cmd}  ({where}): {type(e).__name__}: {e}; {last}")
        capsys.readouterr()
    assert not failed, "documented commands that fail:\n" + "\n".join(failed)
    assert (workdir / "serving" / "serving.py").is_file()
    assert (workdir / "criteo_pre" / "manifest.json").is_file()


def test_the_quickstart_shell_step_runs_as_written(tmp_path: Path) -> None:
    """The README Quickstart's activation line, run as written by a POSIX shell in a folder whose
    ``.venv`` is this test's virtualenv: ``neorec`` is on PATH afterwards, in a fresh shell."""
    import os
    import subprocess
    import sys

    quick = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = _FENCE.search(quick)
    assert block is not None, "the Quickstart has no shell block"
    lines = [x.split(" #")[0].strip() for x in block.group(2).splitlines()]
    step = [x for x in lines if x.startswith(". ") or x.startswith("source ")]
    assert step == [". .venv/bin/activate"], step
    if sys.prefix == sys.base_prefix or not (Path(sys.prefix) / "bin" / "activate").is_file():
        pytest.skip("the tests do not run in a virtualenv")
    (tmp_path / ".venv").symlink_to(sys.prefix)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PATH"] = "/usr/bin:/bin"  # a fresh shell: no virtualenv on PATH
    script = f"{step[0]} && command -v neorec && neorec --help"
    out = subprocess.run(
        ["sh", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].endswith("/bin/neorec")
    assert "usage: neorec" in out.stdout
