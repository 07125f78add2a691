"""``neorec runs``: the run folders under a runs folder, one row each, newest last."""

from __future__ import annotations

import argparse

HELP = "list the runs under a runs folder (newest last)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec runs``."""
    p.add_argument("--root", default="runs", help="the runs folder (train.runs_dir; default runs)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the runs."""
    from neorec.train.runlist import run_runs_command

    return run_runs_command(args.root, args.json)
