"""Command line: ``neorec train | runs | report | eval | predict | export | exfm | plan | bench |
data | ckpt``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from typing import Any

from neorec.errors import NeorecError
from neorec.launch import (
    EXIT_INTERRUPTED,
    interrupted_line,
    is_worker,
    launch,
    resume_command,
    run_worker,
    step_of,
)

__all__ = ["main"]

BENCHES = {
    "op": "neorec.bench.op",
    "step": "neorec.bench.step",
    "planner": "neorec.bench.planner",
    "locality": "neorec.bench.locality",
    "dist": "neorec.bench.dist",
    "costcheck": "neorec.bench.costcheck",
    "cache": "neorec.bench.cache",
    "ckpt": "neorec.bench.ckpt",
    "data": "neorec.bench.data",
    "lowp": "neorec.bench.lowp",
    "dmt": "neorec.bench.dmt",
    "dynamic": "neorec.bench.dynamic",
    "distill": "neorec.bench.distill",
}


def _train(args: argparse.Namespace) -> int:
    from neorec.config import ConfigError, load_config

    if is_worker():  # one rank of a --nproc / torchrun job
        return run_worker(lambda: _train_worker(args))
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    sets = list(args.set)
    if args.resume:  # as an override, so that --nproc passes it on to every rank
        args.set.append(f"checkpoint.resume={json.dumps(args.resume)}")
    cfg = load_config(args.config, args.set)  # checked once here, before any rank starts
    from neorec.train.runs import resolve_run

    run = resolve_run(cfg)  # the run folder, chosen once (a new one is reserved now)
    resume = resume_command(args.config, sets, args.nproc, run.name if run.root else None)
    if args.nproc > 1:
        code = 1
        try:
            code = _launch(args, run.apply(cfg), resume, run.env())
        finally:
            if code:
                run.discard_if_empty()  # no rank got as far as writing into it
        return code
    from neorec.train.trainer import train

    try:
        train(cfg, run=run)
    except KeyboardInterrupt as e:
        print(interrupted_line(run.apply(cfg), resume, step_of(e)), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _train_worker(args: argparse.Namespace) -> int:
    from neorec.config import load_config

    if args.resume:
        args.set.append(f"checkpoint.resume={json.dumps(args.resume)}")
    cfg = load_config(args.config, args.set)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _train_distributed(cfg)
    from neorec.train.trainer import train

    train(cfg)
    return 0


def _launch(args: argparse.Namespace, cfg: Any, resume: str, env: dict[str, str]) -> int:
    """Start ``--nproc`` local ranks through PyTorch's elastic agent (what torchrun runs);
    ``env`` hands them the run folder."""
    rest = ["train"]
    if args.config:
        rest += ["--config", args.config]
    for s in args.set:
        rest += ["--set", s]

    def on_signal(sig: signal.Signals) -> str:
        what = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
        return interrupted_line(cfg, resume, None, what)

    return launch(args.nproc, rest, on_signal, env)


def _train_distributed(cfg: Any) -> int:
    """One rank of a torchrun-launched job: gloo on CPU, NCCL on GPU.

    The process group is destroyed only after a clean run: after a failure the process exits
    right away, once its error has been handed on (so that a peer whose collective breaks first
    can tell it was not the cause).
    """
    import torch.distributed as dist

    from neorec.distributed.comm import close_host_transports
    from neorec.launch import init_rank_group
    from neorec.train.trainer import train

    init_rank_group(cfg.train.device, cfg.train.collective_timeout_s)  # nccl on cuda, else gloo
    train(cfg)
    close_host_transports()
    dist.destroy_process_group()
    return 0


def _runs(args: argparse.Namespace) -> int:
    from neorec.train.runlist import run_runs_command

    return run_runs_command(args.root, args.json)


def _plan(args: argparse.Namespace) -> int:
    from neorec.sharding.commands import run_plan

    return int(run_plan(args))


def _ckpt(args: argparse.Namespace) -> int:
    from neorec.checkpoint.inspect import run_ckpt_command

    return run_ckpt_command(args.action, args.path, args.verify)


def _bench(name: str, argv: list[str]) -> int:
    module = importlib.import_module(BENCHES[name])
    return int(module.main(argv))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="neorec", description="Train DLRMs at scale.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train and evaluate a model")
    t.add_argument("--config", help="TOML config (default: the built-in small synthetic DLRM)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set train.steps=100",
    )
    t.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local ranks to start (torch.distributed.run); for several machines use "
        "torchrun --nnodes ... -m neorec train",
    )
    t.add_argument(
        "--resume",
        metavar="PATH|latest|auto",
        help="continue from a checkpoint directory, 'latest' (the latest checkpoint of the latest "
        "run, or of the run train.name names, in its own folder; an error if there is none) or "
        "'auto' (latest if any, else a new run)",
    )
    t.set_defaults(func=_train)

    rs = sub.add_parser("runs", help="list the runs under a runs folder (newest last)")
    rs.add_argument("--root", default="runs", help="the runs folder (train.runs_dir; default runs)")
    rs.add_argument("--json", action="store_true", help="print the rows as JSON")
    rs.set_defaults(func=_runs)

    ck = sub.add_parser("ckpt", help="list or inspect Check-N-Run checkpoints")
    ck.add_argument("action", choices=["ls", "inspect"])
    ck.add_argument("path", help="checkpoint root (ls) or a checkpoint / 'ROOT' for its latest")
    ck.add_argument("--verify", action="store_true", help="inspect: read and checksum every file")
    ck.set_defaults(func=_ckpt)

    from neorec.serve.commands import add_parsers  # eval, predict, export

    add_parsers(sub)
    from neorec.train.report import add_parser as add_report  # neorec report RUN

    add_report(sub)
    from neorec.train.exfm import add_parser as add_exfm  # neorec exfm (the ExFM chain)

    add_exfm(sub)

    pl = sub.add_parser("plan", help="plan how tables are sharded over ranks")
    try:
        from neorec.sharding.commands import add_plan_arguments

        add_plan_arguments(pl)
    except ImportError:  # pragma: no cover - planner not installed in this tree
        pass
    pl.set_defaults(func=_plan)

    b = sub.add_parser("bench", help="benchmarks (print a table and a JSON line)")
    b.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")

    d = sub.add_parser("data", help="data tools: preprocess Criteo TSV into columnar shards")
    d.add_argument("action", choices=["preprocess"])
    d.add_argument("rest", nargs=argparse.REMAINDER, help="the action's own flags (--help)")
    d.set_defaults(func=lambda a: _data(a.action, a.rest))
    return p


def _data(action: str, argv: list[str]) -> int:
    from neorec.data.preprocess import main as preprocess_main

    return int(preprocess_main(argv))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neorec`` command.

    A ``NeorecError`` (bad input, config, data, plan, checkpoint) is printed as one line and exits
    with its code (2); Ctrl-C prints one line and exits 130 (a rank of a distributed run stays
    quiet: its launcher prints); anything else is a defect and keeps its traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:
            return _bench(argv[1], argv[2:])
        if argv[:2] == ["data", "preprocess"]:  # its flags (--input ...) go to it unparsed
            return _data(argv[1], argv[2:])
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except NeorecError as e:
        print(f"neorec: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if not is_worker():
            print("neorec: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
