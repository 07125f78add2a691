"""Command line: ``neorec train | plan | bench``."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

BENCHES = {
    "op": "neorec.bench.op",
    "step": "neorec.bench.step",
    "planner": "neorec.bench.planner",
    "locality": "neorec.bench.locality",
}


def _train(args: argparse.Namespace) -> int:
    from neorec.config import load_config
    from neorec.train.trainer import train

    cfg = load_config(args.config, args.set)
    train(cfg)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from neorec.sharding.commands import run_plan

    return int(run_plan(args))


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
    t.set_defaults(func=_train)

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
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neorec`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:
        return _bench(argv[1], argv[2:])
    args = build_parser().parse_args(argv)
    from neorec.config import ConfigError

    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"neorec: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
