"""``neorec train``: train and evaluate a model in a run folder (one process or ``--nproc N``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

HELP = "train and evaluate a model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec train``."""
    p.add_argument("--config", help="TOML config (default: the built-in small synthetic DLRM)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable), e.g. --set train.steps=100; every key, its "
        "default and meaning: neorec config --keys",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local ranks to start (torch.distributed.run); for several machines use "
        "torchrun --nnodes ... -m neorec train",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines of the job (each runs this command with --nproc ranks); with "
        "--rdzv-endpoint: every node's launcher meets there (c10d rendezvous)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place among --nnodes (informational: the rendezvous assigns ranks)",
    )
    p.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes > 1: where the nodes' launchers meet (the same on every node)",
    )
    p.add_argument(
        "--rdzv-id",
        default="neorec",
        help="with --nnodes > 1: the job's id at the endpoint (the same on every node)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc: when a rank dies, restart the group up to K times, every rank resuming "
        "from the run's newest complete checkpoint (default 0: a lost rank ends the run)",
    )
    p.add_argument(
        "--resume",
        metavar="PATH|latest|auto",
        help="continue from a checkpoint directory, 'latest' (the latest checkpoint of the latest "
        "run, or of the run train.name names, in its own folder; an error if there is none) or "
        "'auto' (latest if any, else a new run)",
    )


def check(args: argparse.Namespace) -> None:
    """The launcher's flags, checked before PyTorch loads (``neorec.cli.main``): a wrong flag
    is one line at once, not after the seconds of an import."""
    from neorec.config import ConfigError

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    _check_nodes(args)
    if args.max_restarts and args.nproc == 1 and args.nnodes == 1:
        raise ConfigError(
            "--max-restarts restarts the ranks of a --nproc N job (N >= 2); one process: "
            "run it again with --resume latest"
        )


def run(args: argparse.Namespace) -> int:
    """Train: one process, ``--nproc`` local ranks, or one rank of a torchrun job."""
    from neorec.config import load_config
    from neorec.launch.messages import EXIT_INTERRUPTED, interrupted_line, resume_command, step_of
    from neorec.launch.worker import is_worker, run_worker
    from neorec.train.resume import finished_line, locating_overrides

    if is_worker():  # one rank of a --nproc / torchrun job
        return run_worker(lambda: _train_worker(args))
    check(args)
    sets = list(args.set)
    if args.resume:  # as an override, so that --nproc passes it on to every rank
        args.set.append(f"checkpoint.resume={json.dumps(args.resume)}")
    if args.nnodes > 1:  # rank 0 chooses the run folder and tells the others (as under torchrun)
        cfg = load_config(args.config, args.set)
        if args.resume:
            print(_NNODES_RESUME, flush=True)
        return _launch(args, cfg, resume_command(args.config, sets, args.nproc), {})
    from neorec.train.runs import resolve_run

    if args.resume:  # the run to resume is found first: its own config is the base
        cfg = load_config(args.config, locating_overrides(args.set))
    else:
        cfg = load_config(args.config, args.set)  # checked once here, before any rank starts
    run = resolve_run(cfg)  # the run folder, chosen once (a new one is reserved now)
    if cfg.sequential.enabled:
        return _sequential(args, cfg, run)
    try:
        cfg, restored = _run_config(args, run, cfg.checkpoint.dir)
        done = finished_line(run, cfg) if args.resume and not run.created else None
    except BaseException:
        run.discard_if_empty()
        raise
    if done is not None:  # nothing to train: nothing is written
        run.discard_if_empty()
        print(done, flush=True)
        return 0
    resume = resume_command(args.config, sets, args.nproc, run.name if run.root else None)
    if args.nproc > 1 or args.nnodes > 1:
        code = 1
        try:
            with _config_file(cfg if restored else None) as config_file:
                code = _launch(args, run.apply(cfg), resume, run.env(), config_file)
        finally:
            if code:
                run.discard_if_empty()  # no rank got as far as writing into it
        if code in _SIGNAL_EXITS:  # stopped by a scheduler's signal, everything cleaned up above:
            sys.stdout.flush()  # gone now, not after the interpreter's teardown (seconds on a
            sys.stderr.flush()  # busy machine; the scheduler's grace period then ends in SIGKILL)
            os._exit(code)
        return code
    from neorec.train.trainer import train

    try:
        train(cfg, run=run)
    except KeyboardInterrupt as e:
        print(interrupted_line(run.apply(cfg), resume, step_of(e)), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _sequential(args: argparse.Namespace, cfg: Any, run: Any) -> int:
    """``[sequential]``: SASRec in its own loop, one process (docs/data.md)."""
    from neorec.config import ConfigError
    from neorec.train.sequential import run_sequential

    if args.nproc > 1 or args.resume:
        run.discard_if_empty()
        raise ConfigError("a [sequential] run trains in one process and cannot resume yet: "
                          "drop --nproc / --resume")  # fmt: skip
    print(f"run folder: {run.path}", flush=True)
    run_sequential(cfg, run.path, sys.stdout)
    return 0


_SIGNAL_EXITS = {128 + int(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
_NNODES_RESUME = (
    "resume: under --nnodes the ranks take the config given now (flags and --config), not the "
    "run's config.toml: pass --config RUNS/NAME/config.toml to resume with the run's own"
)


def _run_config(args: argparse.Namespace, run: Any, ckpt_dir: str) -> tuple[Any, bool]:
    """The config of this run and whether it is a resumed run's own (restored from its folder,
    with what is given now applied: ``neorec.train.resume``); prints where it came from."""
    from neorec.config import load_config
    from neorec.train.resume import restore_config

    if args.resume:
        which = args.resume.strip()
        restored = restore_config(run, which, args.config, args.set, ckpt_dir)
        if restored is not None:
            print("\n".join(restored.lines), flush=True)
            return restored.cfg, True
    cfg = load_config(args.config, args.set)
    if not args.resume:
        return cfg, False
    if not run.created and not (run.path / "config.toml").is_file():
        print(
            f"resume: {run.path} keeps no config.toml: the config is the one given now",
            flush=True,
        )
    elif run.created and args.resume.strip() != "auto":
        print(
            f"resume: {args.resume}: a new run folder {run.path}, with the config given now (no "
            f"run's config.toml to start from; its model is checked against the checkpoint's)",
            flush=True,
        )
    return cfg, False


@contextlib.contextmanager
def _config_file(cfg: Any) -> Iterator[str | None]:
    """A resumed run's config as a TOML file the launched ranks read (removed at the end)."""
    if cfg is None:
        yield None
        return
    from neorec.train.runs import dump_toml

    fd, path = tempfile.mkstemp(prefix="neorec-resume-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(dump_toml(cfg.to_dict(), "neorec train --resume: the run's config"))
        yield path
    finally:
        os.unlink(path)


def _check_nodes(args: argparse.Namespace) -> None:
    from neorec.config import ConfigError

    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if args.rdzv_endpoint and args.nnodes == 1:
        raise ConfigError("--rdzv-endpoint is for --nnodes > 1 (one node meets on localhost)")
    if args.nnodes > 1 and args.max_restarts:
        raise ConfigError(
            "--max-restarts restarts the ranks of one node; on several nodes run torchrun "
            "--max-restarts K on each (docs/running.md)"
        )


def _train_worker(args: argparse.Namespace) -> int:
    from neorec.config import load_config
    from neorec.launch.worker import attempt_overrides, train_rank

    if args.resume:
        args.set.append(f"checkpoint.resume={json.dumps(args.resume)}")
    args.set += attempt_overrides(bool(args.resume))
    return train_rank(load_config(args.config, args.set))


def _launch(
    args: argparse.Namespace,
    cfg: Any,
    resume: str,
    env: dict[str, str],
    config_file: str | None = None,
) -> int:
    """Start ``--nproc`` local ranks through PyTorch's elastic agent (what torchrun runs);
    ``env`` hands them the run folder; ``config_file``: the whole config (a resumed run's)."""
    from neorec.launch.agent import Nodes, Recovery, launch
    from neorec.launch.messages import interrupted_line
    from neorec.train.checkpoints import checkpoint_root

    rest = ["train"]
    if config_file is not None:
        rest += ["--config", config_file]
    else:
        if args.config:
            rest += ["--config", args.config]
        for s in args.set:
            rest += ["--set", s]

    def on_signal(sig: signal.Signals) -> str:
        what = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
        return interrupted_line(cfg, resume, None, what)

    if args.nnodes > 1:
        nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)
        return launch(args.nproc, rest, on_signal, env, nodes=nodes)
    recovery = Recovery(checkpoint_root(cfg), cfg.train.run_dir or None)
    return launch(args.nproc, rest, on_signal, env, args.max_restarts, recovery)
