"""``neorec data preprocess``: Criteo TSV into columnar shards (its flags: ``--help``)."""

from __future__ import annotations

import argparse

HELP = "data tools: preprocess Criteo TSV into columnar shards"
ACTIONS = ("preprocess",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec data``: the action, then its own flags."""
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the action's own flags (--help)")


def passthrough(argv: list[str]) -> int | None:
    """``data preprocess ...``: its flags go to it unparsed; None for anything else."""
    if argv[:1] != ["preprocess"]:
        return None
    from neorec.data.preprocess import main

    return int(main(argv[1:]))


def run(args: argparse.Namespace) -> int:
    """Run the action."""
    return int(passthrough([args.action, *args.rest]) or 0)
